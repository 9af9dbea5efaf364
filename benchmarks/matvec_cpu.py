"""The linears of one decode step at SmolLM2-135M's shapes (fp32, 2 threads), batch 1 and 16: which torch
kernel streams the weights fastest (docs/inference.md, "Beside llama.cpp").

    python benchmarks/matvec_cpu.py [OUT.json]      # result committed as benchmarks/results/matvec_cpu.json

Every layer gets its own weight copy (30 layers, as in the model), so weights come from memory, not from a
cache. Kernels: oneDNN prepacked (``torch.ops.mkldnn._linear_pointwise``, what the engine uses on CPU),
``F.linear``, ``x @ W.T`` with ``W.T`` stored contiguous (in, out), and ``torch.mv`` at batch 1. Medians of 7
runs.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COUNTS = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "lm_head": 1}


def measure(batch: int) -> dict:
    lin = torch.ops.mkldnn._linear_pointwise.default
    out: dict = {}
    for name, (o, i) in SHAPES.items():
        ws = [torch.randn(o, i) for _ in range(COUNTS[name])]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn(batch, i)
        variants = {
            "onednn_packed": lambda: [lin(x, p, None, "none", [], "") for p in packed],  # noqa: B023
            "F.linear": lambda: [F.linear(x, w) for w in ws],  # noqa: B023
            "x@Wt(in,out)": lambda: [x @ w for w in wts],  # noqa: B023
        }
        if batch == 1:
            variants["torch.mv"] = lambda: [torch.mv(w, x[0]) for w in ws]  # noqa: B023
        for v, fn in variants.items():
            with torch.inference_mode():
                fn()
                fn()
                ts = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
            t = sorted(ts)[3]
            out.setdefault(name, {})[v] = {"ms": 1e3 * t, "GBps": o * i * 4 * COUNTS[name] / t / 1e9}
    return out


def main() -> None:
    torch.set_num_threads(2)
    res = {}
    for batch in (1, 16):
        res[str(batch)] = r = measure(batch)
        for v in next(iter(r.values())):
            total = sum(r[n][v]["ms"] for n in SHAPES)
            rates = "  ".join(f"{n} {r[n][v]['GBps']:.1f}GB/s" for n in SHAPES)
            print(f"batch {batch} {v:16s} all linears of a step: {total:6.1f} ms   {rates}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
