"""``ccft serve``: an OpenAI-compatible HTTP server for the base and its decoders on one shared prefill.

    ccft serve --decoder math=runs/math --decoder code=runs/code --port 8000
    ccft serve replay --url http://127.0.0.1:8000 --trace react.jsonl --out replay.json

The first form loads the base (``--model``: an embedded name or an HF folder), registers each
``--decoder NAME=PATH`` on a ``SharedPrefillEngine``, wraps it in a ``Scheduler`` (PrefillShare
unless ``--no-share``; a prefix K/V store of ``--block-tokens`` blocks unless ``--block-tokens 0``;
``--kv-budget-mb`` caps live KV + store; ``--max-prefix-tokens N|budget`` allocates the prefix arena whole at
start) and serves ``ccft.serving.app.create_app`` with uvicorn.
The second replays a workload trace (``ccft.serving.workloads``) or a JSONL file of requests
against a running server and prints TTFT / latency quantiles. Heavy imports happen only when run.

``ccft serve --replicas N ...`` deploys N engine replicas (each built as above) on Ray Serve with
ccft's session-affinity router (``ccft.serving.ray_serve``; docs/deploy.md, "Scale-out with Ray
Serve"); the routes are the same.
"""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over the shared-prefill engine "
        "(`ccft serve trace` writes a multi-agent workload, `ccft serve replay` "
        "replays it against a server)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="base model: embedded name or HF folder (default: ccft.DEFAULT_BASE)"
    )
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the decoder folder PATH as model NAME (repeatable); 'base' is always served",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--no-share",
        action="store_true",
        help="per-model baseline: every decoder prefills its own prompt (no shared prefill)",
    )
    p.add_argument(
        "--no-auto-shared-prefix",
        action="store_true",
        help="a request without shared_prefix_tokens takes its whole prompt as its context (default: the "
        "longest whole-block prefix it shares with another request or live context, found from the "
        "prompts' block hashes as vLLM's prefix caching does)",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help="cap on live KV + prefix store (MiB); default: no cap",
    )
    p.add_argument(
        "--max-prefix-tokens",
        default="0",
        metavar="N|budget",
        help="allocate the prefix arena (the K/V of live contexts) whole at start, N token slots; it never "
        "grows, and a context that does not fit waits for live ones to end (one larger than the arena "
        "fails, 500). 'budget': the slots --kv-budget-mb holds (budget / KV bytes per token), the most the "
        "budget ever admits. 0: start at 1024 slots and double when full",
    )
    p.add_argument("--max-batch", type=int, default=16, help="active rows per engine lane")
    p.add_argument(
        "--max-tail-tokens",
        type=int,
        default=4096,
        help="per request: its own prompt tokens after the shared context + max_tokens",
    )
    p.add_argument(
        "--block-tokens", type=int, default=16, help="prefix store block size in tokens (0: no prefix store)"
    )
    p.add_argument(
        "--prefix-pool",
        default=None,
        metavar="redis://HOST:PORT[/DB] | ray",
        help="a prefix K/V pool under the prefix store, shared by every replica: a local miss is fetched "
        "from it before prefilling, a prefill publishes its blocks (the `pool` extra for redis; ray: with "
        "--replicas N; docs/deploy.md)",
    )
    p.add_argument(
        "--prefix-pool-timeout-ms",
        type=float,
        default=500.0,
        help="a pool answer slower than this is a failure: the request prefills locally and the pool is "
        "skipped for 5 s",
    )
    p.add_argument(
        "--prefix-pool-mb",
        type=float,
        default=1024.0,
        help="--prefix-pool ray: MiB of blocks the pool's directory keeps (least recently used evicted)",
    )
    p.add_argument(
        "--prefix-spill-dir",
        default=None,
        metavar="DIR",
        help="spill prefix store blocks evicted from memory to files in DIR (the `ccft precompute` shard "
        "format) and read them back before prefilling or asking the pool; one folder per server (with "
        "--replicas N each replica takes DIR/replica-<i>; docs/serving.md)",
    )
    p.add_argument(
        "--prefix-spill-mb",
        type=float,
        default=4096.0,
        help="--prefix-spill-dir: MiB of block files kept (per replica; least recently used deleted)",
    )
    p.add_argument(
        "--max-queue", type=int, default=4096, help="queued requests beyond which the server answers 503"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt accepted")
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="chunked prefill: per-step token budget shared by decode rows and prefill pieces "
        "(default: whole prefills between steps; docs/serving.md)",
    )
    p.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "mlfq"],
        help="scheduling policy: first come first served, or a multi-level feedback queue (docs/serving.md)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="rows decoded per step: with --policy mlfq the best ones run and the others pause (their "
        "KV kept), which is what lets short requests pass long ones; with fcfs, a cap on admitted "
        "requests (default: no cap)",
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens of a chat request without one"
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=4.0,
        help="longest request body (MiB); longer ones get 413 before they are read (0: no limit)",
    )
    p.add_argument(
        "--allow-reload",
        action="store_true",
        help='serve POST /v1/models/{model}/reload {"path": FOLDER}: a LoRA decoder takes new weights in '
        "place (off: 404)",
    )
    p.add_argument(
        "--malloc",
        default="trim",
        help="allocator policy against RSS growth (glibc; docs/serving.md, Allocator): trim = glibc's "
        "thresholds and malloc_trim every 10 s; mmap-64k = the mmap threshold fixed at 64 KiB (slower "
        "prefill); glibc = neither. With --replicas each Ray Serve replica applies it in its own process",
    )
    p.add_argument(
        "--no-tune-malloc",
        dest="malloc",
        action="store_const",
        const="glibc",
        default=argparse.SUPPRESS,  # the default is --malloc's
        help="the same as --malloc glibc",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_ray_options(p)
    p.set_defaults(func=run)
    sp = p.add_subparsers(dest="serve_command", required=False, metavar="[trace | replay]")
    t = sp.add_parser(
        "trace",
        help="write a ReAct / Reflexion multi-agent workload trace (JSONL)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--kind", default="react", choices=["react", "reflexion"])
    t.add_argument("--out", required=True, help="the JSONL file to write")
    t.add_argument(
        "--model",
        default=None,
        help="base model whose tokenizer makes the token ids (default: the embedded one)",
    )
    t.add_argument(
        "--agents",
        nargs="+",
        default=["planner", "math", "code", "tools"],
        help="agent names (= the model names requests use; remap at replay with --model-map)",
    )
    t.add_argument("--sessions", type=int, default=4)
    t.add_argument("--turns", type=int, default=3)
    t.add_argument("--shared-tokens", type=int, default=512)
    t.add_argument("--unique-tokens", type=int, default=32)
    t.add_argument("--growth-tokens", type=int, default=64)
    t.add_argument("--max-new-tokens", type=int, default=32)
    t.add_argument(
        "--rate", type=float, default=1.0, help="Poisson session arrivals per second (0: all at t=0)"
    )
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=run_trace)
    r = sp.add_parser(
        "replay",
        help="replay a workload trace (JSONL) against a running server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    r.add_argument(
        "--trace", required=True, help="a ccft trace (workloads.Trace.save) or JSONL of request dicts"
    )
    r.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival offsets (0: no waiting)")
    r.add_argument("--no-stream", action="store_true", help="plain JSON responses (no TTFT)")
    r.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout (s)")
    r.add_argument("--ignore-eos", action="store_true", help="every request decodes max_tokens tokens")
    r.add_argument("--out", default=None, help="write the summary and per-request records (JSON) here")
    r.add_argument(
        "--model-map",
        action="append",
        default=[],
        metavar="AGENT=MODEL",
        help="send AGENT's requests to the served model MODEL (repeat; `*=base` maps every other agent)",
    )
    r.set_defaults(func=run_replay)


def add_ray_options(p) -> None:
    """``ccft serve --replicas N``: scale-out on Ray Serve (``ccft.serving.ray_serve``; docs/deploy.md)."""
    g = p.add_argument_group("scale-out on Ray Serve (the `ray` extra)")
    g.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="N >= 1: serve N engine replicas behind Ray Serve with session-affinity routing "
        "(0: one engine in this process, no Ray)",
    )
    g.add_argument(
        "--router",
        default="session",
        choices=["session", "prefix", "least-loaded", "round-robin"],
        help="how requests are placed on replicas (ccft.serving.router); prefix: where the prompt's "
        "prefix blocks were placed (blocks of --block-tokens), sessions kept home as with session",
    )
    g.add_argument("--max-load-ratio", type=float, default=2.0, help="session/prefix router: overload ratio")
    g.add_argument(
        "--min-load-gap", type=int, default=4, help="session/prefix router: overload gap (requests)"
    )
    g.add_argument(
        "--router-keys",
        type=int,
        default=16384,
        help="prefix router: chain keys (prompt blocks) remembered per replica",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster (e.g. 'auto'); default: start a local Ray instance",
    )
    g.add_argument(
        "--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)"
    )
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per engine replica")
    g.add_argument(
        "--max-ongoing-requests", type=int, default=256, help="requests one replica takes at a time"
    )
    g.add_argument(
        "--retries", type=int, default=2, help="re-sends of a request whose replica died before answering"
    )


def _decoders(specs: list[str]) -> dict[str, str]:
    from ccft.core.errors import ConfigError

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--decoder {spec!r}: use NAME=PATH (e.g. --decoder math=runs/math)")
        if name in out or name == "base":
            raise ConfigError(f"--decoder {spec!r}: the name {name!r} is already used; pick another")
        out[name] = path
    return out


ARENA_FROM_BUDGET = "budget"  #: ``--max-prefix-tokens budget``


def prefix_arena_tokens(args, kv_bytes_per_token: int | None) -> int | None:
    """The prefix arena's size in token slots from ``--max-prefix-tokens`` (the one rule: ``build_scheduler``,
    so the single engine and every Ray replica): None for 0 (the default: it starts at 1024 slots and doubles
    when full); N for N ≥ 1; for ``budget``, the slots ``--kv-budget-mb`` holds, budget bytes //
    ``kv_bytes_per_token``, as vLLM sizes its KV blocks up front from its memory share. The scheduler keeps
    live KV (contexts + reserved tails) + prefix store within the budget, so live contexts never need more.
    With ``kv_bytes_per_token`` None only the value is checked (before a model is loaded).

    Raises:
        ConfigError: a value that is not an integer ≥ 0 or ``budget``; ``budget`` without ``--kv-budget-mb``
            or with one that holds no token.
    """
    from ccft.core.errors import ConfigError

    value = getattr(args, "max_prefix_tokens", None)
    value = "0" if value is None else str(value).strip()
    if value == ARENA_FROM_BUDGET:
        mb = getattr(args, "kv_budget_mb", None)
        if mb is None:
            raise ConfigError(
                "--max-prefix-tokens budget sizes the prefix arena from --kv-budget-mb; give --kv-budget-mb, "
                "or a number of token slots (--max-prefix-tokens N)"
            )
        if kv_bytes_per_token is None:
            return None
        tokens = int(mb * 2**20) // int(kv_bytes_per_token)
        if tokens < 1:
            raise ConfigError(
                f"--max-prefix-tokens budget: --kv-budget-mb {mb:g} holds no token of this model's KV "
                f"({kv_bytes_per_token} bytes per token); raise --kv-budget-mb"
            )
        return tokens
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ConfigError(
            f"--max-prefix-tokens {value!r}: use a whole number of token slots (N ≥ 1: the prefix arena is "
            f"allocated whole at start; 0: it grows as needed) or {ARENA_FROM_BUDGET!r} (the slots "
            "--kv-budget-mb holds)"
        )
    return tokens or None


def check_prefix_pool(args) -> str | None:
    """Check ``--prefix-pool`` and its options before anything loads; returns the backend name (or None).

    Raises:
        ConfigError: a bad value (``ccft.serving.prefix_pool.check_pool_spec``), a pool without a prefix
            store (``--block-tokens 0``), ``ray`` without ``--replicas N``, or ``--prefix-pool-mb`` ≤ 0.
    """
    from ccft.core.errors import ConfigError
    from ccft.serving.prefix_pool import check_pool_spec

    spec = getattr(args, "prefix_pool", None)
    kind = check_pool_spec(spec, getattr(args, "prefix_pool_timeout_ms", 500.0) / 1000)
    if kind is None:
        return None
    if not args.block_tokens:
        raise ConfigError(
            f"--prefix-pool {spec} sits under the prefix store, which --block-tokens 0 turns off; "
            "give --block-tokens N (N ≥ 1) or drop --prefix-pool"
        )
    if kind == "ray" and not getattr(args, "replicas", 0):
        raise ConfigError(
            "--prefix-pool ray shares blocks between the replicas of one Ray cluster; add --replicas N, "
            "or use --prefix-pool redis://HOST:PORT"
        )
    if kind == "ray" and not getattr(args, "prefix_pool_mb", 1.0) > 0:
        raise ConfigError(f"--prefix-pool-mb {args.prefix_pool_mb:g}: use a positive size in MiB")
    return kind


def check_prefix_spill(args) -> str | None:
    """Check ``--prefix-spill-dir`` and ``--prefix-spill-mb`` before anything loads (nothing is created);
    returns the folder (or None).

    Raises:
        ConfigError: a spill without a prefix store (``--block-tokens 0``), ``--prefix-spill-mb`` ≤ 0, or a
            folder that is a file, lies under a file or under a folder this user cannot write.
    """
    from ccft.core.errors import ConfigError
    from ccft.core.io import check_output_folder

    folder = getattr(args, "prefix_spill_dir", None)
    if not folder:
        return None
    if not args.block_tokens:
        raise ConfigError(
            f"--prefix-spill-dir {folder} holds blocks the prefix store evicts, and --block-tokens 0 turns "
            "the store off; give --block-tokens N (N ≥ 1) or drop --prefix-spill-dir"
        )
    mb = getattr(args, "prefix_spill_mb", 4096.0)
    if not mb > 0:
        raise ConfigError(
            f"--prefix-spill-mb {mb:g}: use a positive size in MiB (the block files kept in "
            "--prefix-spill-dir), or drop --prefix-spill-dir"
        )
    check_output_folder(folder, "--prefix-spill-dir")
    return folder


def build_scheduler(args):
    """(scheduler, tokenizer) from ``ccft serve`` arguments."""
    import torch

    import ccft
    from ccft.inference.engine import kv_bytes_per_token
    from ccft.serving.scheduler import Scheduler

    prefix_arena_tokens(args, None)  # a bad value fails before the model is loaded
    check_prefix_pool(args)  # so does a bad --prefix-pool
    check_prefix_spill(args)  # and a bad --prefix-spill-dir
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    decoders = _decoders(args.decoder)
    base = ccft.load_base(args.model or ccft.DEFAULT_BASE, dtype=args.dtype, device=device)
    engine = ccft.SharedPrefillEngine(
        base,
        decoders=decoders,
        max_batch=args.max_batch,
        max_tail_tokens=args.max_tail_tokens,
        max_prefix_tokens=prefix_arena_tokens(args, kv_bytes_per_token(base)),
    )
    store = None
    if args.block_tokens:
        from ccft.serving.prefix_store import PrefixKVStore

        pool = None
        if getattr(args, "prefix_pool", None):
            from ccft.serving.prefix_pool import pool_from_spec

            pool = pool_from_spec(
                args.prefix_pool,
                timeout_s=args.prefix_pool_timeout_ms / 1000,
                capacity_bytes=int(args.prefix_pool_mb * 2**20),
                device=device,
                background=True,  # a prefill does not wait for the pool to take its blocks
            )
        spill = None
        if getattr(args, "prefix_spill_dir", None):
            from ccft.serving.prefix_spill import DiskSpill

            new = DiskSpill.claim if getattr(args, "replicas", 0) else DiskSpill
            spill = new(args.prefix_spill_dir, int(args.prefix_spill_mb * 2**20), device=device)
        store = PrefixKVStore(
            block_tokens=args.block_tokens, budget_bytes=None, pool=pool, spill=spill
        )  # the scheduler's budget covers it
    budget = None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20)
    scheduler = Scheduler(
        engine,
        share=not args.no_share,
        store=store,
        kv_budget_bytes=budget,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        policy=args.policy,
        max_running=getattr(args, "max_running", None),
        auto_shared_prefix=not getattr(args, "no_auto_shared_prefix", False),
    )
    return scheduler, base.tokenizer


def run(args) -> int:
    if getattr(args, "replicas", 0):
        return run_ray(args)
    import uvicorn

    from ccft.serving.app import create_app
    from ccft.serving.malloc import apply_malloc_policy

    apply_malloc_policy(args.malloc)  # checks it first; against RSS growth (docs/serving.md, "Allocator")
    scheduler, tokenizer = build_scheduler(args)
    max_body = int(args.max_body_mb * 2**20) if args.max_body_mb else None
    app = create_app(
        scheduler,
        tokenizer,
        default_max_tokens=args.default_max_tokens,
        max_body_bytes=max_body,
        allow_reload=args.allow_reload,
    )
    names = ", ".join(scheduler.engine.decoders)
    arena = scheduler.engine.arena
    fixed = (
        f", prefix arena of {arena.capacity} token slots ({arena.nbytes / 2**20:.1f} MiB) allocated"
        if arena.max_tokens is not None
        else ""
    )
    print(
        f"ccft serve: models {names} on http://{args.host}:{args.port} "
        f"({'shared prefill' if scheduler.share else 'no sharing'}, "
        f"{'prefix store' if scheduler.store is not None else 'no prefix store'}{fixed}"
        f"{f', prefix pool {args.prefix_pool}' if getattr(args, 'prefix_pool', None) else ''}"
        f"{f', prefix spill {args.prefix_spill_dir}' if getattr(args, 'prefix_spill_dir', None) else ''})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def router_options(args) -> dict:
    """The options of the ``--router`` policy from ``ccft serve --replicas`` arguments.

    Returns:
        keyword arguments of ``ccft.serving.router.make_router(args.router, ...)``.
    Raises:
        ConfigError: ``--router prefix`` with ``--block-tokens 0`` (no prefix store to route to).
    """
    from ccft.core.errors import ConfigError

    if args.router not in ("session", "prefix"):
        return {}
    options = {"max_load_ratio": args.max_load_ratio, "min_load_gap": args.min_load_gap}
    if args.router == "prefix":
        if not args.block_tokens:
            raise ConfigError(
                "--router prefix places requests where their prompt's prefix blocks are cached, and "
                "--block-tokens 0 turns the prefix store off; give --block-tokens N (N >= 1) or use "
                "--router session"
            )
        options.update(block_tokens=args.block_tokens, max_keys_per_worker=args.router_keys)
    return options


def build_replica_scheduler(args):
    """``build_scheduler(args)`` in a Ray Serve replica's own process, after ``--malloc`` is applied there
    (an allocator policy is per process: the driver's does not reach its replicas). The ``trim`` policy's
    thread lives as long as the replica's process."""
    from ccft.serving.malloc import apply_malloc_policy

    apply_malloc_policy(args.malloc)  # before the model loads, as in ccft serve without --replicas
    return build_scheduler(args)


def ray_app(args):
    """The Ray Serve application of ``ccft serve --replicas N`` (validated before anything starts)."""
    import functools

    from ccft.core.errors import ConfigError
    from ccft.serving.malloc import check_malloc_policy
    from ccft.serving.ray_serve import build_app

    if args.replicas < 0:
        raise ConfigError(f"--replicas {args.replicas}: use 0 (no Ray) or N >= 1 engine replicas")
    if getattr(args, "allow_reload", False):
        raise ConfigError(
            "--allow-reload is not available with --replicas (a reload would reach one replica); "
            'drop one of them (docs/server.md, "Hot reload")'
        )
    _decoders(args.decoder)  # bad --decoder specs fail before Ray starts
    prefix_arena_tokens(args, None)  # so does a bad --max-prefix-tokens (each replica sizes its arena by it)
    check_prefix_pool(args)  # and a bad --prefix-pool
    check_prefix_spill(args)  # and a bad --prefix-spill-dir
    check_malloc_policy(args.malloc)  # and a bad --malloc (each replica applies it)
    options = router_options(args)
    max_body = int(args.max_body_mb * 2**20) if args.max_body_mb else None
    return build_app(
        functools.partial(build_replica_scheduler, args),
        replicas=args.replicas,
        policy=args.router,
        policy_options=options,
        max_ongoing_requests=args.max_ongoing_requests,
        replica_cpus=args.replica_cpus,
        retries=args.retries,
        app_kwargs={"default_max_tokens": args.default_max_tokens, "max_body_bytes": max_body},
    )


def run_ray(args) -> int:
    """``ccft serve --replicas N``: deploy on Ray Serve and block until Ctrl-C or SIGTERM, which shut Serve
    and the local Ray instance down (a SIGTERM without that would leave Ray's processes behind)."""
    import signal
    import time

    app = ray_app(args)
    import ray
    from ray import serve

    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="ccft", route_prefix="/")
    print(
        f"ccft serve: {args.replicas} engine replicas on Ray Serve at http://{args.host}:{args.port} "
        f"(router {args.router}; replica ids in the x-ccft-replica response header)",
        file=sys.stderr,
    )

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background, where SIGINT is ignored
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def run_replay(args) -> int:
    from ccft.serving.client import load_requests, summarize
    from ccft.serving.client import run_replay as replay

    requests = apply_model_map(load_requests(args.trace), args.model_map)
    for r in (
        requests
    ):  # the trace's sessions as session_id: ccft serve --replicas routes a session to one replica
        if r.session is not None:
            r.extra.setdefault("session_id", str(r.session))
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    records = replay(
        args.url,
        requests,
        stream=not args.no_stream,
        time_scale=args.time_scale,
        timeout=args.timeout,
        extra=extra,
    )
    summary = summarize(records)
    print(json.dumps(summary, indent=2))
    if args.out:
        from ccft.core.io import atomic_write_text

        atomic_write_text(
            args.out, json.dumps({"summary": summary, "records": [r.to_dict() for r in records]}, indent=1)
        )
    return 0 if summary["ok"] == summary["requests"] else 1


def apply_model_map(requests, specs: list[str]):
    """Requests with their ``model`` remapped by ``AGENT=MODEL`` specs (``*`` = every agent not named)."""
    from ccft.core.errors import ConfigError

    mapping = {}
    for spec in specs:
        agent, sep, model = spec.partition("=")
        if not sep or not agent or not model:
            raise ConfigError(f"--model-map {spec!r}: expected AGENT=MODEL (e.g. planner=base or '*=base')")
        mapping[agent] = model
    if not mapping:
        return requests
    for r in requests:
        r.model = mapping.get(r.model, mapping.get("*", r.model))
    return requests


def run_trace(args) -> int:
    """``ccft serve trace``: generate a workload with the base model's tokenizer and save it."""
    from transformers import AutoTokenizer

    from ccft.core.models import DEFAULT_BASE, resolve_model_path
    from ccft.serving import workloads

    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model or DEFAULT_BASE))
    trace = workloads.generate(
        args.kind,
        sessions=args.sessions,
        turns=args.turns,
        agents=list(args.agents),
        shared_tokens=args.shared_tokens,
        unique_tokens=args.unique_tokens,
        growth_tokens=args.growth_tokens,
        max_new_tokens=args.max_new_tokens,
        rate=args.rate or None,
        seed=args.seed,
        tokenizer=tok,
    )
    path = trace.save(args.out)
    print(f"wrote {path}: {len(trace)} requests, {args.sessions} sessions, agents {', '.join(trace.agents)}")
    return 0
