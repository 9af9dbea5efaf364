"""A trained CCFT decoder inside llama-server: outputs and log-probabilities against ccft's prefillshare.

Trains a CCFT LoRA decoder on the embedded SmolLM2-135M-Instruct with ``ccft train`` (the math recipe,
``handoff_tokens=4``, a few steps; or takes ``--decoder``), exports it with ``ccft export --to gguf-alora``
(and a second, random, decoder for the aLoRA → aLoRA cache check), serves both from one ``llama-server``
(fp32 weights and KV, ``-fa off``) and compares, on GSM8K test questions as chat prompts:

* greedy tokens: llama.cpp's vs ``ccft.generate(mode="prefillshare")`` (share of equal rows, and ccft's top-2
  margin where a row diverges: a near tie or not);
* log-probabilities: llama.cpp's top ``--n-probs`` per generated token vs ccft's along the same tokens;
* the same with the *naive* conversion (llama.cpp's converter on the ``--to peft-alora`` folder, invocation =
  the k handoff ids): what the one-token shift costs;
* prompt cache: tokens computed by a base request, then an aLoRA request, then the other aLoRA, on one prompt.

    .venv/bin/python benchmarks/gguf_alora_equality.py --out benchmarks/results/gguf_alora_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(folder: Path, steps: int) -> Path:
    from ccft.train.config import load_recipe
    from ccft.train.run import run_training

    cfg, _, raw = load_recipe(
        REPO / "recipes" / "math-gsm8k.yaml",
        [
            "handoff_tokens=4",
            "train_rows=64",
            f"max_steps={steps}",
            "per_device_train_batch_size=4",
            "gradient_accumulation_steps=1",
            "learning_rate=2e-3",
            "warmup_steps=0",
            "eval_strategy=no",
            "save_strategy=no",
            "logging_steps=1",
            "use_cpu=true",
            "disable_tqdm=true",
            f"output_dir={folder}",
        ],
    )
    result = run_training(cfg, recipe=raw)
    print(
        f"trained {steps} steps: loss {result.loss_curve[0][1]:.3f} -> {result.loss_curve[-1][1]:.3f}",
        file=sys.stderr,
    )
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--decoder", default=None, help="a trained CCFT LoRA decoder (handoff_tokens >= 2); default: train"
    )
    p.add_argument("--steps", type=int, default=12, help="training steps when no --decoder is given")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--n-probs", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    import ccft
    from ccft.bench import llamacpp as lc
    from ccft.bench.llamacpp_alora import (
        alora_server_args,
        cache_reuse,
        compare_with_prefillshare,
        export_gguf_alora,
    )
    from ccft.core.models import resolve_model_path
    from ccft.core.tokens import tokenize_prompt
    from ccft.evals.results import hardware

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="gguf-alora-"))
    t0 = time.perf_counter()
    dec_dir = Path(args.decoder) if args.decoder else train(work / "trained", args.steps)
    base = ccft.load_base("smollm2-135m-instruct")
    torch.manual_seed(11)
    other = ccft.make_decoder(
        base,
        "lora",
        lora={"r": 8, "lora_alpha": 2, "init_lora_weights": False},
        method="ccft",
        handoff_tokens=4,
        adapter_name="other",
    )
    ccft.save_decoder(other, work / "other", recipe={"chat_template": "auto"})
    build = lc.ensure_built()
    ex = export_gguf_alora(dec_dir, work / "gguf")
    ex2 = export_gguf_alora(work / "other", work / "gguf-other")
    naive = work / "naive.gguf"
    subprocess.run(
        [
            sys.executable,
            str(build.source / "convert_lora_to_gguf.py"),
            "--base",
            resolve_model_path("smollm2-135m-instruct"),
            "--outtype",
            "f32",
            "--outfile",
            str(naive),
            str(ex.peft_dir),
        ],
        check=True,
        capture_output=True,
    )
    dec = ccft.load_decoder(dec_dir, base=base, adapter_name="trained")
    rows = [
        json.loads(line)
        for line in (REPO / "src/ccft/resources/gsm8k/test.jsonl").read_text().splitlines()
        if line.strip()
    ][: args.prompts]
    prompts = [tokenize_prompt(base.tokenizer, r["question"], chat_template=True) for r in rows]
    ctx = max(map(len, prompts)) + args.new_tokens + 16
    adapters = [ex.adapter_gguf, ex2.adapter_gguf, naive]
    with lc.server(build, ex.base_gguf, ctx, args.threads, extra_args=alora_server_args(adapters)) as url:
        exported = compare_with_prefillshare(dec, url, 0, 3, prompts, args.new_tokens, n_probs=args.n_probs)
        shifted = compare_with_prefillshare(dec, url, 2, 3, prompts, args.new_tokens, n_probs=args.n_probs)
        reuse = [cache_reuse(url, pr, 3) for pr in prompts[:4]]
    meta = json.loads((ex.out / "ccft_export.json").read_text())
    result = {
        "benchmark": "gguf-alora-equality",
        "model": "SmolLM2-135M-Instruct (embedded, Q4_1/Q8_0 dequantised, fp32)",
        "decoder": {
            "trained_steps": None if args.decoder else args.steps,
            "handoff_tokens": meta["handoff_tokens"],
            "peft_invocation": meta["peft_alora_invocation_tokens"],
            "gguf_invocation": meta["gguf_alora_invocation_tokens"],
        },
        "llamacpp": {
            "version": build.version,
            "ggml": build.build_info.get("ggml_version"),
            "flags": ["-ctk", "f32", "-ctv", "f32", "-fa", "off"],
        },
        "prompts": f"GSM8K test questions 0..{args.prompts - 1}, SmolLM2 chat template",
        "exported": exported,
        "naive_conversion": shifted,
        "cache_reuse": reuse,
        "machine": {"hardware": hardware(), "threads": args.threads},
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps({k: result[k] for k in ("decoder", "cache_reuse")}, indent=1))
    for name in ("exported", "naive_conversion"):
        r = result[name]
        print(
            f"{name}: rows equal {r['rows_equal']}/{r['rows']}, max log-prob gap {r['max_logprob_gap']:.2e}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
