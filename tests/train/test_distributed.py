"""Multi-process training through accelerate on CPU (gloo): the loss equals the single-process run on the
same global batch (the loss is normalised by the GLOBAL supervised-token count, docs/design.md, invariant 4).

Each multi-process run goes through the real entry point, ``ccft train RECIPE --num-processes 2
[--accelerate-config recipes/accelerate/X.yaml]``, which re-launches itself under ``accelerate launch``.
Reference: one process, ``per_device_train_batch_size = 2 × 2``, same seed, same rows. DeepSpeed runs are
skipped when DeepSpeed is not installed (its first CPU run builds a small shared-memory op, once).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ccft.bench.process import stop_process_group
from ccft.core.errors import ConfigError
from ccft.train.config import load_recipe
from ccft.train.distributed import accelerate_command, inside_launcher
from ccft.train.run import run_training

ROOT = Path(__file__).resolve().parents[2]
ACCEL = ROOT / "recipes" / "accelerate"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")

LOSS_RTOL = 1e-5  # fp32: all-reduce and a different padding width change rounding only
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_dir) -> Path:
    """A recipe for the tiny model over 8 rows of different lengths: 2 steps of a global batch of 4."""
    d = tmp_path_factory.mktemp("dist")
    rows = [
        {
            "prompt": f"Q{i}: add {i} and {2 * i + 1}." + " Think." * (i % 3),
            "response": f"{3 * i + 1}." + " Done." * (i % 4),
        }
        for i in range(8)
    ]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "base": str(tiny_dir),
        "train_data": str(d / "rows.jsonl"),
        "train_rows": 8,
        "max_steps": 2,
        "logging_steps": 1,
        "use_cpu": True,
        "chat_template": False,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "learning_rate": 0.01,
        "lora_r": 4,
        "lora_alpha": 8,
        "seed": 11,
        "handoff_tokens": 2,
    }
    path = d / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def single_process(recipe: Path, out: Path, **kw) -> list[float]:
    ov = [f"output_dir={out}", "per_device_train_batch_size=4"] + [f"{k}={v}" for k, v in kw.items()]
    cfg, _, raw = load_recipe(recipe, ov)
    before = torch.get_num_threads()
    try:
        result = run_training(cfg, recipe=raw, resume=False)
    finally:
        torch.set_num_threads(before)
    return [loss for _, loss in result.loss_curve]


def two_processes(recipe: Path, out: Path, config: str | None = None, **kw) -> tuple[list[float], dict]:
    cmd = [
        sys.executable,
        "-m",
        "ccft.cli.main",
        "train",
        str(recipe),
        f"output_dir={out}",
        "per_device_train_batch_size=2",
        "--no-resume",
        "--num-processes",
        "2",
    ]
    cmd += [f"{k}={v}" for k, v in kw.items()]
    if config:
        cmd += ["--accelerate-config", str(ACCEL / config)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    # its own session: a failure, a timeout or an interrupted run stops the launcher's workers too, instead of
    # leaving them (and DeepSpeed's op-build lock) behind
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        stop_process_group(proc)
    assert proc.returncode == 0, stderr[-4000:]
    assert stdout.count("[ccft] trained") == 1, stdout  # one process reports, one writes
    history = json.loads((out / "log_history.json").read_text())
    meta = json.loads((out / "ccft.json").read_text())
    return [h["loss"] for h in history if "loss" in h], meta


def assert_same_curve(multi: list[float], single: list[float]) -> None:
    assert len(multi) == len(single) == 2, (multi, single)
    for a, b in zip(multi, single, strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (multi, single)
    assert multi[1] != multi[0]  # the first step changed the decoder


def assert_same_weights(a_dir: Path, b_dir: Path, name: str) -> None:
    a, b = load_file(str(a_dir / name)), load_file(str(b_dir / name))
    assert set(a) == set(b) and a
    for k in b:
        assert a[k].shape == b[k].shape, k  # gathered, not a partition
        assert torch.allclose(a[k], b[k], atol=WEIGHT_ATOL, rtol=0), (k, (a[k] - b[k]).abs().max())


def test_ddp_two_cpu_processes_equal_one_process_on_the_same_global_batch(recipe, tmp_path):
    single = single_process(recipe, tmp_path / "single")
    multi, meta = two_processes(recipe, tmp_path / "ddp")
    assert_same_curve(multi, single)
    assert meta["distributed"] == {"num_processes": 2, "type": "MULTI_CPU"}
    assert meta["train_path"] == "two-pass"
    assert_same_weights(tmp_path / "ddp", tmp_path / "single", "adapter_model.safetensors")


def test_ddp_eval_checkpoints_and_the_best_one_kept(recipe, tmp_path, tiny_dir):
    """Two processes: the eval NLL over 7 rows (uneven: accelerate repeats a row to even out the processes) is
    the single-process one, token-weighted; both processes write into the staging folder before the rename
    (barriers around it), so the checkpoint holds both RNG states; with load_best_model_at_end and
    save_total_limit=1 the best one (by eval_loss, greater_is_better=true: the earlier step, as the loss
    falls) is the one kept and the final decoder."""
    from transformers import AutoTokenizer

    from ccft.train.data import build_dataset, load_rows

    rows = recipe.parent / "rows.jsonl"
    evals = dict(eval_data=rows, eval_rows=7, eval_strategy="steps", eval_steps=1)
    cfg, _, raw = load_recipe(
        recipe,
        [f"output_dir={tmp_path / 'single'}", "per_device_train_batch_size=4"]
        + [f"{k}={v}" for k, v in evals.items()],
    )
    before = torch.get_num_threads()
    try:
        single = run_training(cfg, recipe=raw, resume=False).log_history
    finally:
        torch.set_num_threads(before)
    out = tmp_path / "ddp"
    _, meta = two_processes(
        recipe,
        out,
        **evals,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end="true",
        metric_for_best_model="eval_loss",
        greater_is_better="true",
    )
    multi = json.loads((out / "log_history.json").read_text())
    tokens = build_dataset(
        load_rows(str(rows))[:7],
        AutoTokenizer.from_pretrained(str(tiny_dir)),
        chat_template=False,
        handoff_tokens=2,
    ).supervised_tokens
    want = {h["step"]: h["eval_loss"] for h in single if "eval_loss" in h}
    got = {h["step"]: h["eval_loss"] for h in multi if "eval_loss" in h}
    assert sorted(got) == sorted(want) == [1, 2] and got[1] > got[2], (got, want)
    assert all(abs(got[s] - want[s]) <= LOSS_RTOL * want[s] for s in want), (got, want)
    assert [h["eval_tokens"] for h in multi if "eval_tokens" in h] == [tokens, tokens]  # no row counted twice

    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert not (out / ".staging").exists()
    ckpt = out / "checkpoint-1"
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(ckpt) and state["global_step"] == 1
    assert_same_weights(out, ckpt, "adapter_model.safetensors")
    assert meta["steps"] == 2


@needs_deepspeed
def test_zero2_two_cpu_processes_equal_one_process(recipe, tmp_path):
    single = single_process(recipe, tmp_path / "single")
    multi, meta = two_processes(recipe, tmp_path / "zero2", "zero2.yaml")
    assert_same_curve(multi, single)
    assert meta["distributed"] == {"num_processes": 2, "type": "DEEPSPEED"}
    assert_same_weights(tmp_path / "zero2", tmp_path / "single", "adapter_model.safetensors")


@needs_deepspeed
@pytest.mark.slow
def test_zero3_full_weight_decoder_two_cpu_processes_equal_one_process(recipe, tmp_path):
    """ZeRO-3 partitions the decoder AND the frozen base copy (TRL's reference-model placement); the
    saved decoder is gathered from the partitions."""
    single = single_process(recipe, tmp_path / "single", decoder_kind="full", learning_rate=1e-3)
    multi, meta = two_processes(
        recipe, tmp_path / "zero3", "zero3.yaml", decoder_kind="full", learning_rate=1e-3
    )
    assert_same_curve(multi, single)
    assert_same_weights(tmp_path / "zero3", tmp_path / "single", "model.safetensors")


# ------------------------------------------------------------------ launcher and shipped configs


@pytest.mark.parametrize("name", ["ddp.yaml", "zero2.yaml", "zero3.yaml"])
def test_shipped_accelerate_configs_parse_and_open_with_their_command(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ACCEL / name
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ccft train ") and f"--accelerate-config recipes/accelerate/{name}" in first
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes == 2 and str(cfg.mixed_precision) in ("no", "MixedPrecisionType.NO", "NO")
    kind = str(cfg.distributed_type).split(".")[-1]
    if name == "ddp.yaml":
        assert kind == "MULTI_GPU"
    else:
        assert kind == "DEEPSPEED"
        assert cfg.deepspeed_config["zero_stage"] == int(name[4])


def test_accelerate_command_and_refusals(monkeypatch):
    cmd = accelerate_command(["train", "r.yaml"], num_processes=2, use_cpu=True)
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in cmd
    assert cmd[-1] == "use_cpu=true" and cmd[cmd.index("--num_processes") + 1] == "2"
    assert (
        "use_cpu=true"
        not in accelerate_command(["train", "r.yaml", "use_cpu=false"], num_processes=2, use_cpu=True)[-1:]
    )
    cmd = accelerate_command(["train"], config_file=str(ACCEL / "zero2.yaml"), use_cpu=False)
    assert "--config_file" in cmd and "--multi_gpu" not in cmd
    with pytest.raises(ConfigError, match="recipes/accelerate"):
        accelerate_command(["train"], config_file="nope.yaml")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not inside_launcher()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert inside_launcher()


def test_processes_that_do_not_form_a_group_are_refused(recipe, tmp_path, monkeypatch):
    from ccft.train.run import check_process_group, setup

    cfg, _, _ = load_recipe(recipe, [f"output_dir={tmp_path}", "max_steps=1"])
    *_, trainer = setup(cfg)
    check_process_group(trainer)  # one process, no launcher: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="use_cpu=true"):
        check_process_group(trainer)
