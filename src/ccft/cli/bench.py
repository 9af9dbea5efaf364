"""``ccft bench {decode,train,serve,soak,peers} [--out FILE] ...``: benchmarks that print ratios, write JSON.

The benchmark code is the package ``ccft.bench`` (``ccft.bench.decode``: the inference engine against
HF ``generate``, with the roofline of the decode step; ``ccft.bench.train``; ``ccft.bench.serve``), so
``ccft bench`` works from an installed wheel with no checkout; this module only registers and runs it.
Every result written to ``--out`` records its provenance (``ccft.bench.provenance``) under
``"provenance"``.
"""

from __future__ import annotations

import importlib

#: subcommand -> (module, help)
BENCHMARKS = {
    "decode": ("ccft.bench.decode", "inference engine vs HF generate: tokens/s, TTFT, roofline fraction"),
    "train": (
        "ccft.bench.train",
        "ccft Full-FT vs CCFT (each path) vs TRL SFTTrainer: tokens/s, step time, "
        "peak memory, fraction of the FLOP-count speedup",
    ),
    "serve": (
        "ccft.bench.serve",
        "multi-agent serving, PrefillShare vs --no-share on one KV budget: p50/p95 "
        "latency, TTFT, throughput, prefix hit ratio, peak KV vs Eq. 9",
    ),
    "soak": (
        "ccft.bench.soak",
        "ccft serve under a steady load with abandoned streams, hostile bodies and hot reloads: "
        "lost requests, 5xx, RSS, live KV, p95 per token first vs last window (`make soak`)",
    ),
    "peers": (
        "ccft.bench.peers",
        "ccft serve vs vLLM (multi-LoRA, prefix caching) and llama.cpp (aLoRA) on the same "
        "multi-agent traces over HTTP: outputs vs offline, latency, TTFT, throughput, ratios "
        "(`make peers` first)",
    ),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (ratios, JSON out)")
    kinds = p.add_subparsers(dest="benchmark", required=True)
    for kind, (module, help_text) in BENCHMARKS.items():
        q = kinds.add_parser(kind, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(q)
        q.set_defaults(func=run, bench_module=module)


def run(args) -> int:
    """Run ``args.bench_module``: its ``run(args)``, then its ``report(result, --out)``. The result carries
    ``"provenance"`` (``ccft.bench.provenance``: commit, dirty tree, UTC start, CPU, ISA, load, settings),
    collected before the run starts, unless the module's run put one there (a resumed run keeps its
    file's)."""
    from ccft.bench import provenance

    mod = importlib.import_module(args.bench_module)
    return mod.report(provenance.recorded(mod.run, args), getattr(args, "out", None))
