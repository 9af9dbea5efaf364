"""Every documented CLI path, run through the real console script (``ccft`` of this environment) on a tiny
model.

``ccft train --dry-run`` (loads no model), ``ccft train --help-config``, a single-process ``ccft train``,
``ccft eval --task list`` and a tiny smoke run of each ``ccft bench {decode,serve,train}``: exit status 0 and
output whose values are checked against what they must be (hand-computed where the number is known).
Each command is a separate process, as a user runs it (README "Usage").
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def ccft_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m ccft`` (same entry point)."""
    script = Path(sys.executable).with_name("ccft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ccft"]


def run_ccft(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        ccft_command() + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir, gsm8k_rows) -> Path:
    """A folder with 6 GSM8K rows (data.jsonl) and a LoRA recipe on the tiny model (r.yaml)."""
    d = tmp_path_factory.mktemp("cli_smoke")
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows[:6]))
    write_recipe(d, tiny_dir)
    return d


def write_recipe(d: Path, base: Path, name: str = "r.yaml", **extra) -> Path:
    fields = {
        "base": str(base),
        "train_data": "data.jsonl",
        "output_dir": "out",
        "decoder_kind": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-3,
        "max_length": 384,
        "chat_template": "false",
        "logging_steps": 1,
        "use_cpu": "true",
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        **extra,
    }
    (d / name).write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    return d / name


# ------------------------------------------------------------------ ccft train


def test_train_dry_run_loads_no_model(workdir, tiny_dir, tmp_path):
    """``--dry-run`` validates recipe, data and tokenizer without reading the weights: on a copy of the tiny
    model whose ``model.safetensors`` is garbage it still succeeds, while a real run on it fails to load."""
    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(b"\0not safetensors\0" * (weights.stat().st_size // 17 + 1))
    write_recipe(workdir, broken, name="broken.yaml", output_dir="out_broken")
    out = _ok(run_ccft(["train", "broken.yaml", "--dry-run"], workdir))
    assert "[ccft] recipe OK: method=ccft decoder=lora" in out and "train rows=6" in out, out
    assert not (workdir / "out_broken").exists()  # nothing is written
    # the marker bites: loading these weights fails (so the dry run above really did not load them)
    real = run_ccft(["train", "broken.yaml", "max_steps=1"], workdir)
    assert real.returncode == 2 and "model weights cannot be read" in real.stderr, real.stderr[-2000:]


def test_help_config_lists_the_ccft_fields():
    from ccft.train.config import TrainConfig

    out = _ok(run_ccft(["train", "--help-config"], ROOT))
    train_part, _, eval_part = out.partition("... plus every transformers.TrainingArguments field")
    listed = {line.split()[0] for line in train_part.splitlines() if line.strip()}
    # independent: the TrainConfig fields that transformers.TrainingArguments does not have (+ output_dir)
    import dataclasses

    from transformers import TrainingArguments

    hf = {f.name for f in dataclasses.fields(TrainingArguments)}
    want = {f.name for f in dataclasses.fields(TrainConfig) if f.name not in hf} | {"output_dir"}
    assert listed == want and {"method", "handoff_tokens", "decoder_kind", "train_data"} <= listed
    # then the recipe's eval: section, every EvalConfig field as eval.KEY
    from ccft.train.config import EvalConfig

    eval_keys = {line.split()[0] for line in eval_part.splitlines() if line.startswith("eval.")}
    assert eval_keys == {f"eval.{f.name}" for f in dataclasses.fields(EvalConfig)}


def test_single_process_train_writes_a_loadable_decoder(workdir):
    import torch

    import ccft

    out = _ok(run_ccft(["train", "r.yaml", "--no-resume"], workdir))
    assert "[ccft] trained ccft decoder" in out, out
    folder = workdir / "out"
    history = json.loads((folder / "log_history.json").read_text())
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    assert [s for s, _ in losses] == [1, 2, 3]
    assert all(math.isfinite(v) and v > 0 for _, v in losses), losses
    assert f"loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}" in out, out  # the summary line's loss
    dec = ccft.load_decoder(folder)
    assert dec.method == "ccft" and dec.kind == "lora"
    ids = dec.base.tokenizer("Natalia sold clips to 48 of her friends.", add_special_tokens=False)[
        "input_ids"
    ]
    cache = ccft.compute_base_cache(dec.base, [ids])
    with torch.no_grad():
        logits = ccft.decoder_forward(dec, cache, torch.tensor([ids[-1:]]))
    assert logits.shape == (1, 1, len(dec.base.tokenizer)) and bool(torch.isfinite(logits).all())


def test_train_summary_says_when_no_step_loss_was_logged(workdir):
    """Fewer steps than ``logging_steps``: the summary says so instead of printing ``loss nan -> nan``."""
    out = _ok(
        run_ccft(["train", "r.yaml", "--no-resume", "logging_steps=10", "output_dir=out_quiet"], workdir)
    )
    assert "no step loss logged: fewer steps than logging_steps=10" in out and "nan" not in out, out


# ------------------------------------------------------------------ ccft eval


def test_eval_task_list_prints_the_registry():
    from ccft.evals.tasks import task_names

    out = _ok(run_ccft(["eval", "--task", "list"], ROOT))
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert names == sorted(task_names()) and {"gsm8k", "humaneval", "gsm-plus", "bfcl-multiple"} <= set(names)


# ------------------------------------------------------------------ ccft bench


def test_bench_decode_tiny(tiny_dir, tmp_path):
    out_json = tmp_path / "decode.json"
    _ok(
        run_ccft(
            [
                "bench",
                "decode",
                "--model",
                str(tiny_dir),
                "--device",
                "cpu",
                "--batch-sizes",
                "1",
                "2",
                "--new-tokens",
                "3",
                "--prompt-tokens",
                "8",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--out",
                str(out_json),
            ],
            ROOT,
        )
    )
    d = json.loads(out_json.read_text())
    # documented keys (benchmarks/decode.py docstring and result dict)
    assert {
        "model",
        "device",
        "dtype",
        "threads",
        "decode_mode",
        "new_tokens",
        "repeats",
        "bandwidth_GBps",
        "batches",
        "speedup_batch1",
        "roofline_fraction_batch1",
    } <= set(d)
    assert d["new_tokens"] == 3 and d["repeats"] == 1 and d["dtype"] == "float32" and d["threads"] == 1
    assert sorted(d["batches"]) == ["1", "2"]
    for row in d["batches"].values():
        assert (
            row["greedy_rows_identical"] == 1.0
        )  # fraction of rows whose engine greedy tokens equal HF generate's
        assert row["prompt_tokens_mean"] == 8
        for side in ("hf", "engine"):
            assert row[side]["decode_tok_s"] > 0 and row[side]["ttft_s"] > 0
        assert row["speedup"] == pytest.approx(row["engine"]["decode_tok_s"] / row["hf"]["decode_tok_s"])
        roof = row["roofline"]
        assert roof["roofline_tok_s"] > 0 and roof["bound"] in ("memory", "matmul")
        assert row["roofline_fraction"] == pytest.approx(
            row["engine"]["decode_tok_s"] / roof["roofline_tok_s"]
        )
    assert d["speedup_batch1"] == pytest.approx(d["batches"]["1"]["speedup"])


def test_bench_train_tiny(tiny_dir, tmp_path):
    out_json = tmp_path / "train.json"
    _ok(
        run_ccft(
            [
                "bench",
                "train",
                "--model",
                str(tiny_dir),
                "--kinds",
                "lora",
                "--ratios",
                "4:1",
                "--row-tokens",
                "40",
                "--batch-size",
                "2",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--no-trl",
                "--in-process",
                "--threads",
                "1",
                "--out",
                str(out_json),
            ],
            ROOT,
        )
    )
    d = json.loads(out_json.read_text())
    assert d["benchmark"] == "train" and d["steps"] == 1 and d["batch_size"] == 2
    assert {"cases", "fraction_of_theory", "fullft_vs_trl", "goals"} <= set(d)
    (case,) = d["cases"]
    assert (case["decoder"], case["ratio"], case["prompt_tokens"], case["response_tokens"]) == (
        "lora",
        "4:1",
        32,
        8,
    )
    # LoRA FLOP count by hand: (4·32 + 4·8) / (2·32 + 4·8) = 160 / 96
    assert case["theory_speedup"] == pytest.approx(160 / 96)
    assert set(case["runs"]) == {"ccft-full-ft", "ccft-two-pass", "ccft-one-pass"}
    for run in case["runs"].values():
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0 and run["peak_rss_mb"] > 0
    for path, s in case["ccft_speedup"].items():
        assert case["fraction_by_path"][path] == pytest.approx(s / case["theory_speedup"])
    assert d["fullft_vs_trl"] is None  # --no-trl


@pytest.mark.parametrize("bad", ["4x1", "4:0", "1:2:3", "a:b"])
def test_bench_train_bad_ratio_is_a_usage_error(bad, tmp_path):
    proc = run_ccft(["bench", "train", "--ratios", bad, "--out", str(tmp_path / "t.json")], ROOT)
    assert proc.returncode == 2 and "--ratios" in proc.stderr and "PROMPT:RESPONSE" in proc.stderr, (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "t.json").exists()


def test_bench_serve_tiny(tiny_dir, tmp_path):
    out_json = tmp_path / "serve.json"
    _ok(
        run_ccft(
            [
                "bench",
                "serve",
                "--model",
                str(tiny_dir),
                "--sessions",
                "1",
                "2",
                "--turns",
                "2",
                "--shared-tokens",
                "16",
                "--unique-tokens",
                "4",
                "--growth-tokens",
                "2",
                "--max-new-tokens",
                "2",
                "--threads",
                "1",
                "--out",
                str(out_json),
                "--plots",
                str(tmp_path / "plots"),
            ],
            ROOT,
        )
    )
    d = json.loads(out_json.read_text())
    assert d["benchmark"] == "serve" and {
        "workload",
        "points",
        "kv_bytes_per_token",
        "kv_budget_bytes",
    } <= set(d)
    agents = d["workload"]["agents"]
    assert len(agents) == 4 and d["workload"]["turns"] == 2
    # tiny model: 2 layers × (K and V) × 2 KV heads × head dim 16 × 4 bytes (fp32)
    assert d["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert [p["sessions"] for p in d["points"]] == [1, 2]
    for p in d["points"]:
        requests = p["sessions"] * len(agents) * 2
        for system in ("shared", "no_share"):
            r = p[system]
            assert r["requests"] == requests and r["generated_tokens"] == requests * 2
            assert r["peak_total_kv_bytes"] <= d["kv_budget_bytes"]
            assert r["latency_p50_s"] > 0 and r["throughput_tok_s"] > 0 and 0 <= r["prefix_hit_ratio"] <= 1
        # shared: at most one base prefill per session and turn; no-share: each agent prefills its own prompt
        # (a prompt whose blocks its own store namespace already holds is not prefilled again)
        assert 1 <= p["shared"]["prefills"] <= p["sessions"] * 2 < p["no_share"]["prefills"] <= requests
        assert p["shared"]["peak_live_kv_bytes"] < p["no_share"]["peak_live_kv_bytes"]
    assert (tmp_path / "plots" / "serve_sweep.png").stat().st_size > 0
