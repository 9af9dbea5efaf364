"""Moved sessions on a shared prefix pool (issue 36; docs/serving.md, "Prefix pool"): the TTFT of a session's
turn on a replica that never saw the session, its context fetched from the pool vs prefilled again.

Three schedulers in this process stand for replicas, each with its own engine and prefix store: A and B
over one pool (a redis-server started on a free 127.0.0.1 port, or Ray's object store of a local Ray
instance: both over loopback), C with no pool. Per session of a ReAct trace (4 agents, the long-context
shape of docs/serving.md by default: 1024 shared tokens, 128 appended per turn): turns 1..T-1 run on A
(they publish the context's blocks); the last turn moves: it runs on B (a fetch) and on C (a re-prefill);
the greedy tokens of B and C are compared; then it runs on A too, with A's pool off (the session at
home, for reference: what A holds of it, not what B published). Every call decodes ``--max-new-tokens``
tokens (EOS ignored). The JSON records its provenance (``ccft.bench.provenance``: commit, dirty tree, UTC
start, CPU, ISA, load, settings) under ``"provenance"``.

    python benchmarks/prefix_pool.py --backend redis --out pool_redis.json
    python benchmarks/prefix_pool.py --backend ray --out pool_ray.json

Blocks are published from a background thread, as ``ccft serve`` does (``--inline-publish``: before the
prefill returns); the threads are flushed between measured turns. ``--malloc`` applies an allocator policy
as ``ccft serve --malloc`` does (``ccft.serving.malloc``; default ``glibc``: none, as in every run before
the option existed). Reported: the median over sessions of
the TTFT of the moved turn's first request (the one that waits for the context: prefill or fetch; also
per session) and the mean over all its requests, on B, C and A, the ratios B / C, the moved turns'
prefix hit ratio on B (context tokens copied from its store, pool blocks included, ÷ context tokens)
and A's at home, bytes fetched and published, seconds spent publishing, the pool's errors, and the
blocks each replica's store holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch

import ccft
from ccft.bench import provenance
from ccft.bench.serve import agent_names, random_agent_decoder
from ccft.serving import PrefixKVStore
from ccft.serving.malloc import apply_malloc_policy
from ccft.serving.prefix_pool import PrefixPool, pool_from_spec
from ccft.serving.scheduler import Scheduler, ServeRequest
from ccft.serving.workloads import add_trace_options, generate_from_options, trace_options


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_backend(kind: str):
    """(spec, stop) for the pool backend."""
    if kind == "redis":
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("--backend redis needs a redis-server binary on PATH")
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

        def stop():
            proc.kill()
            proc.wait()

        return f"redis://127.0.0.1:{port}/0", stop
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return "ray", ray.shutdown


def run_turn(sched: Scheduler, reqs) -> list:
    tickets = [
        sched.submit(
            ServeRequest(
                r.agent,
                r.prompt_ids,
                shared_len=r.shared_len,
                max_new_tokens=r.max_new_tokens,
                ignore_eos=True,
                session_id=str(r.session),
            )
        )
        for r in reqs
    ]
    sched.run_until_idle()
    bad = [t for t in tickets if t.state != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests ended as {bad[0].state}: {bad[0].error}")
    return tickets


def trace_world(args):
    """``(base, agents, decoders, turns, last)`` for the trace options in ``args``: the base, the agent names,
    their random LoRA decoders, the trace's requests by ``(session, turn)`` and the last turn's index."""
    base = ccft.load_base(args.model)
    agents = agent_names(args.agents)
    decoders = {n: random_agent_decoder(base, n, 100 + i) for i, n in enumerate(agents)}
    trace = generate_from_options(args, sessions=args.sessions, agents=agents, tokenizer=base.tokenizer)
    turns: dict[tuple[int, int], list] = {}
    for r in trace.requests:
        turns.setdefault((r.session, r.turn), []).append(r)
    return base, agents, decoders, turns, max(t for _, t in turns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="redis", choices=["redis", "ray"])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    add_trace_options(ap)
    ap.add_argument("--timeout-ms", type=float, default=2000.0, help="pool timeout (a loaded 2-core machine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inline-publish", action="store_true", help="publish before the prefill returns")
    ap.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="the schedulers' per-step token budget (chunked prefill, as ccft serve --prefill-chunk-tokens)",
    )
    ap.add_argument(
        "--malloc",
        default="glibc",
        help="the allocator policy, as ccft serve --malloc (trim, mmap-64k, glibc; default glibc: none)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = provenance.collect(provenance.settings_of(args))  # commit, CPU, load, settings: at the start
    trimmer = apply_malloc_policy(args.malloc)
    torch.set_num_threads(args.threads)

    base, agents, decoders, turns, last = trace_world(args)

    spec, stop = _start_backend(args.backend)
    try:
        pools = [
            pool_from_spec(spec, timeout_s=args.timeout_ms / 1000, background=not args.inline_publish)
            for _ in range(2)
        ]

        def quiet():  # the publisher threads done before the next measured turn
            for pool in pools:
                pool.flush()

        def replica(pool: PrefixPool | None) -> Scheduler:
            engine = ccft.SharedPrefillEngine(base, decoders=decoders)
            return Scheduler(
                engine,
                share=True,
                store=PrefixKVStore(args.block_tokens, pool=pool),
                prefill_chunk_tokens=args.prefill_chunk_tokens,
            )

        a, b, c = replica(pools[0]), replica(pools[1]), replica(None)
        for sched in (a, b, c):  # warm-up: a short prompt of its own on each engine (first-call overheads)
            warm = ServeRequest(agents[0], list(range(1000, 1000 + 40)), max_new_tokens=2, ignore_eos=True)
            sched.submit(warm)
            sched.run_until_idle()
        pools[0].backend.stats()  # (ray: the directory is up)
        moved = {"pool": [], "reprefill": [], "home": []}
        equal = True
        home_hits = home_computed = 0
        hit0 = b.counters["prefix_hit_tokens"]
        miss0 = b.counters["prefill_tokens"]
        for s in range(args.sessions):
            for t in range(last):
                run_turn(a, turns[(s, t)])
                quiet()
            tb = run_turn(b, turns[(s, last)])
            quiet()
            tc = run_turn(c, turns[(s, last)])
            moved["pool"].append([x.ttft for x in tb])
            moved["reprefill"].append([x.ttft for x in tc])
            h0, m0 = a.counters["prefix_hit_tokens"], a.counters["prefill_tokens"]
            pool, a.store.pool = a.store.pool, None  # the same turn at home (not moved; B's blocks unseen)
            ta = run_turn(a, turns[(s, last)])
            a.store.pool = pool
            home_hits += a.counters["prefix_hit_tokens"] - h0
            home_computed += a.counters["prefill_tokens"] - m0
            moved["home"].append([x.ttft for x in ta])
            equal = equal and [x.tokens for x in ta] == [x.tokens for x in tc]
            equal = equal and [x.tokens for x in tb] == [x.tokens for x in tc]
        hits = b.counters["prefix_hit_tokens"] - hit0
        computed = b.counters["prefill_tokens"] - miss0

        def summary(rows):
            first = [min(r) for r in rows]
            return {
                "ttft_first_s": statistics.median(first),
                "ttft_mean_s": statistics.mean(x for r in rows for x in r),
                "ttft_first_per_session_s": [round(x, 4) for x in first],
            }

        pool_stats, a_stats = pools[1].stats(), pools[0].stats()
        context_blocks = sum(
            len(r[0].prompt_ids[: r[0].shared_len - 1]) // args.block_tokens
            for r in [turns[(s, last)] for s in range(args.sessions)]
        )
        result = {
            "backend": args.backend,
            "publish": "inline" if args.inline_publish else "background",
            "model": args.model,
            "dtype": str(base.dtype) if hasattr(base, "dtype") else "float32",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
            "trace": trace_options(args),
            "prefill_chunk_tokens": args.prefill_chunk_tokens,
            "malloc": args.malloc,
            "moved_pool": summary(moved["pool"]),
            "moved_reprefill": summary(moved["reprefill"]),
            "home": summary(moved["home"]),
            "moved_hit_ratio": hits / (hits + computed) if hits + computed else 0.0,
            "home_hit_ratio": home_hits / (home_hits + home_computed) if home_hits + home_computed else 0.0,
            "outputs_equal": equal,
            "fetched_bytes": pool_stats["fetched_bytes"],
            "fetch_seconds": pool_stats["fetch_seconds"],
            "fetches": pool_stats["fetches"],
            "published_bytes": a_stats["published_bytes"],
            "publish_seconds_on_a": a_stats["publish_seconds"],
            "published_blocks": a_stats["published_blocks"],
            "pool_errors": {k: a_stats["errors"][k] + pool_stats["errors"][k] for k in a_stats["errors"]},
            "moved_context_blocks": context_blocks,
            "store_blocks": {"a": len(a.store), "b": len(b.store), "c_no_pool": len(c.store)},
            "provenance": started,
        }
        r = result
        r["ttft_ratio_first"] = r["moved_pool"]["ttft_first_s"] / r["moved_reprefill"]["ttft_first_s"]
        r["ttft_ratio_mean"] = r["moved_pool"]["ttft_mean_s"] / r["moved_reprefill"]["ttft_mean_s"]
    finally:
        stop()
        if trimmer is not None:
            trimmer.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
