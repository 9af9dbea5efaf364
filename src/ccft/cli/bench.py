"""``ccft bench {decode,train,serve} [--out FILE] ...``: side-by-side benchmarks that print ratios and write JSON.

The benchmark code lives in the source checkout's ``benchmarks/`` folder (``benchmarks/decode.py``:
the inference engine against HF ``generate``, with the roofline of the decode step); this module
only finds it and runs it, so ``ccft bench`` works from a checkout (``pip install -e .``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def _checkout() -> Path | None:
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / "benchmarks" / "__init__.py").is_file():
            return root
    return None


def _module(name: str):
    root = _checkout()
    if root is None:
        from ccft.core.errors import ConfigError

        raise ConfigError("`ccft bench` runs the benchmarks of a source checkout (its benchmarks/ folder); run it "
                          "from the ccft repository or install ccft with `pip install -e .`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(name)


def add_decode_arguments(p) -> None:
    """Arguments of ``ccft bench decode`` (also ``python -m benchmarks.decode``); no heavy imports here."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name, HF folder or hub id")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights in SmolLM2-135M's shape (nothing to download; GPU check)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (EOS ignored)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="cut prompts to this many tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (medians reported)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--decode", default="auto", help="engine decode mode: auto, eager, static, cuda_graph, compile")
    p.add_argument("--out", default=None, help="write the JSON here")


def add_train_arguments(p) -> None:
    """Arguments of ``ccft bench train``, defined with the benchmark (benchmarks/train_bench.py, stdlib-only imports)."""
    try:
        _module("benchmarks.train_bench").add_arguments(p)
    except Exception:  # noqa: BLE001 - not a checkout: `run` explains it when the command is used
        p.add_argument("--out", default=None)


def add_serve_arguments(p) -> None:
    """Arguments of ``ccft bench serve`` (benchmarks/serve_bench.py, light imports at module level)."""
    try:
        _module("benchmarks.serve_bench").add_arguments(p)
    except Exception:  # noqa: BLE001 - not a checkout: `run` explains it when the command is used
        p.add_argument("--out", default=None)


#: subcommand -> (module in benchmarks/, help, argument adder)
BENCHMARKS = {
    "decode": ("benchmarks.decode", "inference engine vs HF generate: tokens/s, TTFT, roofline fraction",
               add_decode_arguments),
    "train": ("benchmarks.train_bench", "ccft Full-FT vs CCFT (each path) vs TRL SFTTrainer: tokens/s, step time, "
              "peak memory, fraction of the FLOP-count speedup", add_train_arguments),
    "serve": ("benchmarks.serve_bench", "multi-agent serving, PrefillShare vs --no-share on one KV budget: p50/p95 "
              "latency, TTFT, throughput, prefix hit ratio, peak KV vs Eq. 9", add_serve_arguments),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (ratios, JSON out)")
    kinds = p.add_subparsers(dest="benchmark", required=True)
    for kind, (module, help_text, add_arguments) in BENCHMARKS.items():
        q = kinds.add_parser(kind, help=help_text)
        add_arguments(q)
        q.set_defaults(func=run, bench_module=module)


def run(args) -> int:
    mod = _module(args.bench_module)
    return mod.report(mod.run(args), getattr(args, "out", None))
