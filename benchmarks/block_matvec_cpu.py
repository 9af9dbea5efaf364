"""The block kernel's products at SmolLM2-135M's shapes, weights streamed from memory against weights
resident in cache, for the kernel of this checkout and the kernel of an earlier commit (docs/inference.md,
"Fused decode step", the prefetch paragraph).

    python benchmarks/block_matvec_cpu.py --baseline-rev 6484eac \
        --out benchmarks/results/block_matvec_cpu.json

Per format (Q4_1: the projections; Q8_0: the LM head's format; F32: an fp32 lane's weights read in place),
one ``(1536, 576)`` matrix (the MLP's gate / up) times one activation row (``rows``, default 1: a batch-1
decode step): ``resident`` multiplies one matrix over and over (its 0.5-3.5 MB stay in the core's L2 cache),
``streamed`` cycles through enough distinct copies (>= 600 MB, more than the last-level cache) that every
product reads its weights from memory, as a decode step does. Both kernels run interleaved in one process
(each repeat times every variant once); medians of ``--repeats``; the products of the two kernels are
compared (``max_abs_diff``). The rates are weight bytes read per second (GB/s), beside the bandwidth
``torch`` reaches on a large fp32 reduction. The baseline kernel is built from
``git show <rev>:src/ccft/inference/kernels/blocks.cpp`` with the package's compiler and flags
(``ccft.inference.blocks.FLAGS``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ccft.inference import blocks as B

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_step import cpu_model  # noqa: E402  (the CPU's model name, as the fused-step benchmark records it)

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (1536, 576)
STREAM_BYTES = 600e6  # more than the last-level cache a core can reach (480 MB on the Xeon measured)


def baseline_kernel(rev: str, tmp: str) -> B.BlockKernel:
    """The kernel of commit ``rev``, built with the package's compiler and flags."""
    src = subprocess.run(
        ["git", "show", f"{rev}:src/ccft/inference/kernels/blocks.cpp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tmp) / "blocks_baseline.cpp"
    path.write_text(src)
    out = Path(tmp) / "blocks_baseline.so"
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    subprocess.run([compiler, *B.FLAGS, "-o", str(out), str(path)], check=True)
    return B.BlockKernel(out)


def random_raw(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random blocks with small normal fp16 scales (and minimums): ``uint8 (n, k / 32 · bytes per block)``."""
    if fmt == "F32":
        return torch.randn(n, k, generator=g).view(torch.uint8).reshape(n, -1).contiguous()
    nbytes = B.FORMATS[fmt][1]
    raw = torch.randint(0, 256, (n, k // 32, nbytes), dtype=torch.uint8, generator=g)
    raw[:, :, 1] = 0x20  # high byte of the fp16 d: ~0.0078-0.0156
    if fmt == "Q4_1":
        raw[:, :, 3] = 0xA0  # high byte of the fp16 m: ~ -0.0078-0.0156
    return raw.reshape(n, -1).contiguous()


def read_bandwidth() -> float:
    """Bytes/s of a 512 MB fp32 reduction (best of 3)."""
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default=None, help="a commit whose kernel runs beside this checkout's")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    current = B.load_kernel()
    if current is None:
        raise SystemExit("the block kernel does not build here (no C++ compiler?)")
    n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, k, generator=g)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"current": current}
        if args.baseline_rev:
            kernels["baseline"] = baseline_kernel(args.baseline_rev, tmp)
        results = {}
        for fmt in ("Q4_1", "Q8_0", "F32"):
            one = random_raw(fmt, n, k, g)
            copies = max(1, int(STREAM_BYTES // one.numel()) + 1)
            raws = [one] + [random_raw(fmt, n, k, g) for _ in range(copies - 1)]
            times: dict[str, list[float]] = {}
            outputs = {}
            for _ in range(args.repeats):
                for name, kernel in kernels.items():
                    for where, use in (("resident", raws[:1]), ("streamed", raws)):
                        mats = [B.BlockMatrix(fmt, r, n, k, kernel) for r in use]
                        for m in mats:  # warm-up pass
                            m.matmul(x)
                        outputs[name] = mats[0].matmul(x)
                        reps = max(1, 2000 // len(mats))
                        t = time.perf_counter()
                        for _ in range(reps):
                            for m in mats:
                                m.matmul(x)
                        elapsed = (time.perf_counter() - t) / reps / len(mats)
                        times.setdefault(f"{name} {where}", []).append(elapsed)
            med = {key: statistics.median(v) for key, v in times.items()}
            row = {
                "bytes": one.numel(),
                "streamed_copies": copies,
                "us": {key: 1e6 * v for key, v in med.items()},
                "GBps": {key: one.numel() / v / 1e9 for key, v in med.items()},
            }
            if "baseline" in kernels:
                row["streamed_current_over_baseline"] = med["baseline streamed"] / med["current streamed"]
                row["resident_current_over_baseline"] = med["baseline resident"] / med["current resident"]
                row["max_abs_diff"] = float((outputs["current"] - outputs["baseline"]).abs().max())
            results[fmt] = row
            gb = row["GBps"]
            line = f"{fmt}: " + ", ".join(f"{key} {v:.2f} GB/s" for key, v in gb.items())
            if "baseline" in kernels:
                line += (
                    f" | streamed current / baseline {row['streamed_current_over_baseline']:.2f}x, "
                    f"max |diff| {row['max_abs_diff']:.2e}"
                )
            print(line, flush=True)
    bw = read_bandwidth()
    print(f"fp32 reduction bandwidth: {bw / 1e9:.1f} GB/s")
    result = {
        "benchmark": "benchmarks/block_matvec_cpu.py",
        "shape": list(SHAPE),
        "rows": args.rows,
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": cpu_model(),
        "kernel_isa": current.isa,
        "baseline_rev": args.baseline_rev,
        "torch": torch.__version__,
        "reduction_bandwidth_GBps": bw / 1e9,
        "load_average": {"before": load_start, "after": os.getloadavg()},
        "formats": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
