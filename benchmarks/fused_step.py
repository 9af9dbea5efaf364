"""The fused CPU decode step against the layer loop it replaces (issue 32; docs/inference.md, "Fused decode
step").

One process, the embedded SmolLM2-135M-Instruct, GSM8K test questions as prompts (chat template), the engine's
base lane in eager decode. Four engines, measured interleaved (each repeat runs every engine once per batch
size): the block engine (Q4_1 / Q8_0 blocks) and the fp32 engine, each with the fused step
(``blocks.decode_step_layers``: every decoder layer in one kernel call) and with the layer loop of PyTorch ops
(``LaneWeights.block_step = None``), each running the base's rows (``--decoder base``) or a LoRA decoder's
(``--decoder lora``: r = 16 on every projection, random weights, ``ccft.make_decoder``). Per batch size:
decode tokens per second (median of the repeats, after 3 warm-up steps), the ratio fused ÷ loop, whether the
fused step ran at that batch (``max_rows``), and whether the greedy tokens of the fused step equal the loop's
on every row.

    python benchmarks/fused_step.py --batch-sizes 1 4 8 16 32 --repeats 3 \
        --out benchmarks/results/fused_step_cpu.json

``--shared-context T``: every row of a batch reads one context of T tokens (agents sharing a prompt's KV
cache, the case of ``ccft serve``'s multi-agent turns) instead of a prompt of its own.
``--fp32-fused-rows N`` runs the fp32 engine's fused step up to N rows instead of ``blocks.F32_FUSED_ROWS``
(to find where the oneDNN layer loop overtakes it). The comparison with llama.cpp on the same weights is
``ccft bench decode --llamacpp --blocks`` (needs ``make llamacpp``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import ccft
from ccft.bench.decode import load, make_prompts
from ccft.inference import SharedPrefillEngine
from ccft.inference import blocks as B


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shared_context(base, tokens: int) -> list[int]:
    """A context of exactly ``tokens`` tokens: GSM8K test prompts (``make_prompts``) one after another."""
    out: list[int] = []
    n = 8
    while len(out) < tokens:
        prompts = make_prompts(base, n, None, True)
        out = [t for p in prompts for t in p]
        if len(prompts) < n and len(out) < tokens:
            raise SystemExit(f"--shared-context {tokens}: the GSM8K test questions hold {len(out)} tokens")
        n *= 2
    return out[:tokens]


def run(
    engine, prompts, new_tokens: int, decoder: str, rows: int | None = None
) -> tuple[float, list[list[int]]]:
    """Decode tokens per second of ``prompts`` (3 warm-up steps left out) and each row's greedy tokens; with
    ``rows``, that many requests all read the one prompt (agents on one context)."""
    with engine.prefill(prompts) as h:
        reads = range(len(prompts)) if rows is None else [0] * rows
        ids = [
            engine.add_request(h, i, decoder=decoder, max_new_tokens=new_tokens, ignore_eos=True)
            for i in reads
        ]
        tokens: dict[int, list[int]] = {r: [] for r in ids}
        for _ in range(3):
            for o in engine.step():
                tokens[o.request_id].append(o.token_id)
        t0, n = time.perf_counter(), 0
        while engine.active:
            for o in engine.step():
                tokens[o.request_id].append(o.token_id)
                n += 1
        return n / (time.perf_counter() - t0), [tokens[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32-fused-rows", type=int, default=None)
    ap.add_argument("--decoder", choices=["base", "lora"], default="base")
    ap.add_argument(
        "--shared-context",
        type=int,
        default=None,
        metavar="T",
        help="every row of a batch reads one context of T tokens (agents sharing a prompt's KV cache), "
        "instead of a prompt of its own",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, description = load("smollm2-135m-instruct", random_weights=False, device="cpu", dtype=torch.float32)
    cap = max(args.batch_sizes)
    decoders, decoder = {}, "base"
    if args.decoder == "lora":
        torch.manual_seed(0)
        lora = {"r": 16, "lora_alpha": 32, "init_lora_weights": False, "target_modules": "all-linear"}
        dec = ccft.make_decoder(
            base, "lora", lora=lora, method="ccft", adapter_name="decoder", handoff_tokens=1
        )
        dec.model.eval()
        decoders, decoder = {"decoder": dec}, "decoder"
    engines = {}
    for weights in ("blocks", "fp32"):
        for variant in ("fused", "loop"):
            engine = SharedPrefillEngine(
                base,
                decoders,
                max_batch=cap,
                decode="eager",
                max_tail_tokens=max(64, 2 * args.new_tokens),
                block_weights="on" if weights == "blocks" else "off",
            )
            lw = engine.lanes["base"].weights
            if lw.block_step is None:
                raise SystemExit(f"{weights}: the fused step is not available (no C++ compiler?)")
            if variant == "loop":
                lw.block_step = None
            elif weights == "fp32" and args.fp32_fused_rows is not None:
                lw.block_step.max_rows = args.fp32_fused_rows
            engines[f"{weights}-{variant}"] = engine
    max_rows = {k: e.lanes["base"].weights.block_step.max_rows for k, e in engines.items() if "fused" in k}
    load_start = os.getloadavg()
    rows = []
    for b in args.batch_sizes:
        if args.shared_context is None:
            prompts, reads = make_prompts(base, b, None, True), None
        else:
            prompts, reads = [shared_context(base, args.shared_context)], b
        tps: dict[str, list[float]] = {k: [] for k in engines}
        toks: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                rate, tokens = run(engine, prompts, args.new_tokens, decoder, reads)
                tps[name].append(rate)
                toks[name] = tokens
        med = {k: statistics.median(v) for k, v in tps.items()}
        row = {"batch": b, "tok_s": med, "tok_s_all": tps}
        for weights in ("blocks", "fp32"):
            fused, loop = f"{weights}-fused", f"{weights}-loop"
            row[f"{weights}_fused_ran"] = b <= max_rows[fused]
            row[f"{weights}_fused_over_loop"] = med[fused] / med[loop]
            row[f"{weights}_greedy_rows_equal"] = sum(
                a == c for a, c in zip(toks[fused], toks[loop], strict=True)
            )
        rows.append(row)
        print(
            f"batch {b:3d}: blocks fused {med['blocks-fused']:7.1f} loop {med['blocks-loop']:7.1f} "
            f"({row['blocks_fused_over_loop']:.2f}x) | fp32 fused {med['fp32-fused']:7.1f} "
            f"loop {med['fp32-loop']:7.1f} ({row['fp32_fused_over_loop']:.2f}x) tok/s",
            flush=True,
        )
    kernel = B.load_kernel()
    result = {
        "benchmark": "benchmarks/fused_step.py",
        "model": description,
        "prompts": "GSM8K test questions (chat template), one per row"
        if args.shared_context is None
        else f"one context of {args.shared_context} tokens (GSM8K test questions in a row) read by every row",
        "decoder": args.decoder,
        "new_tokens": args.new_tokens,
        "shared_context_tokens": args.shared_context,
        "repeats": args.repeats,
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
        "kernel_isa": kernel.isa if kernel else None,
        "torch": torch.__version__,
        "ccft": ccft.__version__,
        "max_rows": max_rows,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
