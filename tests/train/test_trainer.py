"""CacheConditionedTrainer and the training recipe: loss values, invariants 2-4 (docs/design.md,
"Invariants the tests hold"), K1, crash safety (docs/design.md, "Atomic writes").

Every test runs a tiny random GQA Llama (fp32) with the real SmolLM2 tokenizer. Reference values are
computed independently of ``ccft.core.decoder``: a plain HF model prefills each row unpadded, a deep copy of
its cache is handed to the decoder, which runs the tail at explicit positions. Short synthetic rows
(no chat template) keep the steps cheap; only the "loss goes down" test uses real GSM8K rows.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, TrainerCallback

import ccft
from ccft.core.cache import compute_base_cache
from ccft.core.decoder import decoder_forward
from ccft.train.config import load_recipe
from ccft.train.data import TokenizedDataset
from ccft.train.run import run_training, setup
from conftest import short_run_overrides, short_sum_rows

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> Path:
    """24 short rows of different prompt and response lengths (a few tokens each), as a JSONL file."""
    return short_sum_rows(tmp_path_factory.mktemp("short_data") / "rows.jsonl", done_suffix=True)


def overrides(tiny_dir, out, data, **kw) -> list[str]:
    """Recipe overrides for a short CPU run on the tiny model; ``kw`` adds or replaces keys."""
    return short_run_overrides(tiny_dir, out, data, **kw)


def config(tiny_dir, out, data, **kw):
    cfg, _, raw = load_recipe(None, overrides(tiny_dir, out, data, **kw))
    return cfg, raw


def perturb(model, *, lora_only: bool, seed: int = 123, std: float = 0.05) -> None:
    """Make the decoder differ from the base: LoRA B ~ N(0, std) (PEFT inits B = 0), or noise on every
    weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora_only and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif not lora_only and p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * std * p.detach().abs().mean().clamp(min=1e-3))


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def close(a: float, b: float, tol: float) -> bool:
    """|a - b| ≤ tol · max(1, |b|): fp32 losses are ≈ ln(vocab) ≈ 10.8, so tolerances are relative to that."""
    return abs(a - b) <= tol * max(1.0, abs(b))


def cache_kw() -> str:
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def two_pass_reference(ref_base, decoder_model, examples) -> tuple[float, int]:
    """Σ NLL over response+EOS and the token count: base prefills prompt[:-1] unpadded (HF cache,
    deep-copied), the decoder runs prompt[-1:] + response at positions n-1, n, ... on that cache."""
    total, count = 0.0, 0
    kw = cache_kw()
    for ex in examples:
        p, r = list(ex.prompt_ids), list(ex.response_ids)
        with torch.no_grad():
            out = ref_base(input_ids=torch.tensor([p[:-1]]), use_cache=True)
        cache = copy.deepcopy(getattr(out, "cache", None) or out.past_key_values)
        tail = p[-1:] + r
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(tail))[None]
        with torch.no_grad():
            logits = decoder_model(
                input_ids=torch.tensor([tail]), position_ids=pos, use_cache=True, **{kw: cache}
            ).logits[0]
        total += F.cross_entropy(logits[:-1].double(), torch.tensor(tail[1:]), reduction="sum").item()
        count += len(r)
    return total, count


def self_prefill_reference(model, examples) -> tuple[float, int]:
    """Σ NLL over response+EOS of a plain causal-LM forward over prompt+response (HF labels, -100 on the
    prompt)."""
    total, count = 0.0, 0
    for ex in examples:
        p, r = list(ex.prompt_ids), list(ex.response_ids)
        labels = torch.tensor([[-100] * len(p) + r])
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([p + r]), labels=labels).loss  # mean over len(r) tokens
        total += loss.item() * len(r)
        count += len(r)
    return total, count


def load_plain(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


class GradCapture(TrainerCallback):
    """Records the trainable gradients just before each optimizer step (after clipping)."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in self.model.named_parameters()
                if p.requires_grad and p.grad is not None
            }
        )


def snapshot_base_caches(trainer) -> list:
    """Wrap ``trainer._base_cache`` to keep a clone of every C_base at the moment it is created."""
    snaps, orig = [], trainer._base_cache

    def wrapped(inputs):
        cache = orig(inputs)
        snaps.append((cache, cache.clone(), inputs))
        return cache

    trainer._base_cache = wrapped
    return snaps


def curve(result_or_history) -> dict[int, float]:
    hist = result_or_history if isinstance(result_or_history, list) else result_or_history.log_history
    return {h["step"]: h["loss"] for h in hist if "loss" in h}


def lora_weights(decoder) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in decoder.model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------ 1-2: loss values


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_ccft_step0_loss_equals_two_pass_reference(tmp_path, tiny_dir, short_data, kind):
    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, decoder_kind=kind)
    base, decoder, train_set, _, trainer = setup(cfg)
    perturb(decoder.model, lora_only=kind == "lora")
    examples = [train_set[i] for i in (0, 5, 10, 2)]  # mixed prompt and response lengths
    assert len({len(e.prompt_ids) for e in examples}) > 1 and len({len(e.response_ids) for e in examples}) > 1
    batch = trainer.data_collator(examples)
    loss = trainer.compute_loss(trainer.model, batch).item()

    ref_base = load_plain(tiny_dir)
    total, count = two_pass_reference(ref_base, decoder.model, examples)
    assert count == int(batch["num_supervised"]) == sum(len(e.response_ids) for e in examples)
    ref = total / count
    assert close(loss, ref, 1e-6), (loss, ref)

    # The test can fail: the decoder differs from the base, and from the decoder prefilling its own prompt.
    base_only = two_pass_reference(ref_base, ref_base, examples)[0] / count
    own_prefill = self_prefill_reference(decoder.model, examples)[0] / count
    assert abs(loss - base_only) > 1e-3 and abs(loss - own_prefill) > 1e-3, (loss, base_only, own_prefill)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_full_ft_loss_equals_masked_causal_lm_loss(tmp_path, tiny_dir, short_data, kind):
    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, decoder_kind=kind, method="full-ft")
    base, decoder, train_set, _, trainer = setup(cfg)
    perturb(decoder.model, lora_only=kind == "lora")
    examples = [train_set[i] for i in (1, 6, 11)]
    batch = trainer.data_collator(examples)
    loss = trainer.compute_loss(trainer.model, batch).item()
    total, count = self_prefill_reference(decoder.model, examples)
    assert count == int(batch["num_supervised"])
    assert close(loss, total / count, 1e-6), (loss, total / count)
    # Full-FT does not read C_base: its loss is not the two-pass one.
    ccft_ref = two_pass_reference(load_plain(tiny_dir), decoder.model, examples)[0] / count
    assert abs(loss - ccft_ref) > 1e-3


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_padding_free_full_ft_equals_the_padded_layout(tmp_path, tiny_dir, short_data, kind):
    """``padding_free`` (default) runs a Full-FT batch's real tokens as one packed sequence: the tail logits,
    the loss and every gradient equal the padded layout's up to fp32 rounding, rows of different lengths
    included."""
    from ccft.core.decoder import full_forward

    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, decoder_kind=kind, method="full-ft")
    assert cfg.padding_free is True
    base, decoder, train_set, _, trainer = setup(cfg)
    assert trainer.packs_full_ft and trainer.padding_free_reason is None
    perturb(decoder.model, lora_only=kind == "lora")
    batch = trainer.data_collator([train_set[i] for i in (1, 6, 11)])
    args = (batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"])
    assert batch["prefix_mask"].sum(1).unique().numel() > 1 and batch["tail_mask"].sum(1).unique().numel() > 1
    with torch.no_grad():
        padded, packed = (full_forward(decoder.model, *args, packed=p) for p in (False, True))
    real = batch["tail_mask"].bool()
    assert torch.allclose(packed[real], padded[real], atol=1e-4, rtol=1e-5)
    grads, losses = {}, {}
    for free in (False, True):
        trainer.args.padding_free = free
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses[free] = loss.item()
        grads[free] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        assert trainer.grad_tokens(batch) == (
            int(batch["prefix_mask"].sum() + batch["tail_mask"].sum())
            if free
            else batch["prefix_ids"].numel() + batch["tail_ids"].numel()
        )
    assert close(losses[True], losses[False], 1e-6), losses
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for n, g in grads[False].items():
        assert torch.allclose(grads[True][n], g, atol=1e-5, rtol=1e-4), n


def test_padding_free_falls_back_to_the_padded_layout_for_a_model_it_cannot_pack(
    tmp_path, tiny_dir, short_data, monkeypatch
):
    """A model type outside ``PADDING_FREE_MODEL_TYPES`` (its mask may ignore restarting positions, letting
    rows attend across the pack) trains the padded layout, says why, and counts padded positions."""
    from ccft.core import decoder as decoder_mod

    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, decoder_kind="lora", method="full-ft")
    monkeypatch.setattr(decoder_mod, "PADDING_FREE_MODEL_TYPES", frozenset({"not-this-model"}))
    *_, train_set, _, trainer = setup(cfg)
    assert (
        trainer.packs_full_ft is False and "is not one of ['not-this-model']" in trainer.padding_free_reason
    )
    batch = trainer.data_collator([train_set[i] for i in (1, 6, 11)])
    assert trainer.grad_tokens(batch) == batch["prefix_ids"].numel() + batch["tail_ids"].numel()


# ------------------------------------------------------------------ 3: K1 / invariant 2


def _one_step(tiny_dir, out, data, *, gc: bool, **kw):
    """One optimizer step of a LoRA CCFT run (perturbed B, no clipping) through ``trainer.train()``.

    Returns the trainer, the base, the C_base snapshots (cache, clone at creation, inputs), the gradients
    just before the optimizer step, and how many times layer 0's attention ran."""
    cfg, _ = config(
        tiny_dir, out, data, max_steps=1, gradient_checkpointing=str(gc).lower(), max_grad_norm=0, **kw
    )
    base, decoder, train_set, _, trainer = setup(cfg)
    seen = []
    grad_tokens = trainer.grad_tokens
    trainer.grad_tokens = lambda inputs: seen.append(grad_tokens(inputs)) or seen[-1]
    trainer.grad_tokens_seen = seen
    perturb(decoder.model, lora_only=True)
    snaps = snapshot_base_caches(trainer)
    grads = GradCapture(trainer.model)
    trainer.add_callback(grads)
    calls = []
    handle = base.model.get_decoder().layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        trainer.train()
    finally:
        handle.remove()
    return trainer, base, snaps, grads.grads, len(calls)


def test_base_cache_unchanged_and_checkpointing_equal(tmp_path, tiny_dir, short_data):
    runs = {gc: _one_step(tiny_dir, tmp_path / f"gc{gc}", short_data, gc=gc) for gc in (False, True)}
    losses = {}
    for gc, (trainer, base, snaps, grads, calls) in runs.items():
        assert len(snaps) == 1 and len(grads) == 1
        cache, snap, inputs = snaps[0]
        assert cache is trainer.last_base_cache
        # Bit-identical after the forward, the backward (and its checkpoint recompute) and the optimizer step.
        assert cache.equal(snap)
        for t in cache.keys + cache.values:
            assert t.shape[-2] == cache.attention_mask.shape[1]  # nothing appended
        cache.check_unmodified()
        # The base is unchanged by the step: recomputing C_base for the same rows gives the same bits.
        prompts = [
            row[m.bool()].tolist() + [int(t)]
            for row, m, t in zip(
                inputs["prefix_ids"], inputs["prefix_mask"], inputs["tail_ids"][:, 0], strict=True
            )
        ]
        recomputed = compute_base_cache(base, prompts)
        assert recomputed.equal(snap)
        losses[gc] = trainer.state.log_history[0]["loss"]
        # Layer 0's attention runs once per forward; checkpointing recomputes it in the backward pass.
        # (+1 per forward of the base prefill, run without gradient.)
        assert calls == (3 if gc else 2), (gc, calls)

    assert close(losses[True], losses[False], 1e-6), losses
    g0, g1 = runs[False][3][0], runs[True][3][0]
    assert set(g0) == set(g1) and len(g0) > 0
    assert all("lora_" in n for n in g0)
    for n in g0:
        assert torch.allclose(g1[n], g0[n], atol=1e-6, rtol=0), n
    assert any(g0[n].abs().max() > 1e-4 for n in g0 if "lora_A" in n)  # A gets gradient: B was perturbed


@pytest.mark.parametrize("method", ["ccft", "full-ft"])
def test_checkpointing_min_tokens_skips_the_recompute_of_short_batches_only(
    tmp_path, tiny_dir, short_data, method
):
    """``activation_checkpointing_min_tokens``: a batch with fewer token positions under gradient than the
    threshold runs without the recompute, one with exactly as many is checkpointed, and either way the step's
    loss and gradients are those of checkpointing every batch (bit for bit: the recompute repeats the same
    kernels)."""
    ref = _one_step(tiny_dir, tmp_path / "all", short_data, gc=True, method=method)
    (g,) = ref[0].grad_tokens_seen or [None]
    assert g is None  # without a threshold the step does not look at the batch size
    probe = _one_step(
        tiny_dir,
        tmp_path / "probe",
        short_data,
        gc=True,
        method=method,
        activation_checkpointing_min_tokens=10**9,
    )
    (g,) = probe[0].grad_tokens_seen
    inputs = ref[2][0][2] if method == "ccft" else None
    if inputs is not None:  # two-pass CCFT: only the tail runs with gradient
        assert g == inputs["tail_ids"].numel()
    own_prefill = 0 if method == "full-ft" else 1  # the base's no-grad prefill runs layer 0 once more
    assert ref[4] == own_prefill + 2 and probe[4] == own_prefill + 1  # recompute / none
    at = _one_step(
        tiny_dir, tmp_path / "at", short_data, gc=True, method=method, activation_checkpointing_min_tokens=g
    )
    above = _one_step(
        tiny_dir,
        tmp_path / "above",
        short_data,
        gc=True,
        method=method,
        activation_checkpointing_min_tokens=g + 1,
    )
    assert at[4] == own_prefill + 2 and above[4] == own_prefill + 1
    for run in (probe, at, above):
        assert run[0].state.log_history[0]["loss"] == ref[0].state.log_history[0]["loss"]
        assert set(run[3][0]) == set(ref[3][0]) and ref[3][0]
        for n, grad in ref[3][0].items():
            assert torch.equal(run[3][0][n], grad), n
    # the flags are back as transformers set them
    layers = [m for m in above[0].model.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(m.gradient_checkpointing is True for m in layers)


def test_checkpointing_min_tokens_needs_checkpointing(tmp_path, tiny_dir, short_data):
    with pytest.raises(
        ccft.ConfigError, match="activation_checkpointing_min_tokens=512 needs activation_checkpointing"
    ):
        config(tiny_dir, tmp_path / "run", short_data, activation_checkpointing_min_tokens=512)
    with pytest.raises(ccft.ConfigError, match="activation_checkpointing_min_tokens=-1"):
        config(
            tiny_dir,
            tmp_path / "run",
            short_data,
            activation_checkpointing="true",
            activation_checkpointing_min_tokens=-1,
        )


# ------------------------------------------------------------------ 4: invariant 3


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_no_gradient_reaches_the_base(tmp_path, tiny_dir, short_data, kind):
    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, decoder_kind=kind, max_steps=2)
    base, decoder, train_set, _, trainer = setup(cfg)
    if kind == "full":
        assert decoder.model is not base.model
        base_params = dict(base.model.named_parameters())
    else:
        assert decoder.model.get_base_model() is base.model
        base_params = {n: p for n, p in base.model.named_parameters() if "lora_" not in n}
    assert base_params and all(not p.requires_grad for p in base_params.values())
    before = {n: p.detach().clone() for n, p in base_params.items()}
    dec_before = trainable(decoder.model)
    trainer.train()

    for n, p in base_params.items():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
    changed = [n for n, p in trainable(decoder.model).items() if not torch.equal(p, dec_before[n])]
    assert changed, "training changed no decoder parameter"
    # One more forward + backward (no optimizer step): gradient lands on the decoder only.
    trainer.model.train()
    batch = trainer.data_collator([train_set[i] for i in range(3)])
    trainer.compute_loss(trainer.model, batch).backward()
    assert all(p.grad is None for p in base_params.values())
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in decoder.model.parameters() if p.requires_grad
    )


# ------------------------------------------------------------------ 5: invariant 4


def test_loss_curves_equal_across_checkpointing_accumulation_and_resume(tmp_path, tiny_dir, short_data):
    plain = run_training(
        config(tiny_dir, tmp_path / "plain", short_data, save_strategy="steps", save_steps=2)[0]
    )
    ref = curve(plain)
    assert sorted(ref) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in ref.values())
    assert len(set(ref.values())) > 1  # the loss moves

    def assert_same_curve(other, steps, what):
        got = curve(other)
        for s in steps:
            assert close(got[s], ref[s], 1e-5), (what, s, got[s], ref[s])

    gc = run_training(config(tiny_dir, tmp_path / "gc", short_data, gradient_checkpointing="true")[0])
    assert_same_curve(gc, [1, 2, 3, 4], "gradient checkpointing")

    ga = run_training(
        config(
            tiny_dir,
            tmp_path / "ga",
            short_data,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=3,
        )[0]
    )
    assert_same_curve(ga, [1, 2, 3, 4], "gradient accumulation")

    # Resume: a new run folder holding only checkpoint-2 of the plain run trains steps 3-4.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "plain" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = run_training(config(tiny_dir, resumed_dir, short_data, save_strategy="steps", save_steps=2)[0])
    assert resumed.trainer.state.global_step == 4
    assert_same_curve(resumed, [3, 4], "resume")
    a, b = lora_weights(plain.decoder), lora_weights(resumed.decoder)
    assert set(a) == set(b) and a
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6, rtol=0), n
    # The adapter did move away from its checkpoint-2 value (so equality is not trivial).
    assert any(b[n].abs().max() > 0 for n in b if "lora_B" in n)


# ------------------------------------------------------------------ 6: crash safety

CRASH_SCRIPT = r"""
import os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[2]))
from transformers import Trainer
from ccft.train.config import load_recipe
from ccft.train.run import run_training

marker = Path(sys.argv[1])
orig = Trainer._save_optimizer_and_scheduler

def save_then_hang(self, output_dir):
    orig(self, output_dir)
    if self.state.global_step == 4:  # checkpoint-4 half written: adapter + optimizer, no trainer_state.json
        marker.write_text(str(output_dir))
        for _ in range(900):
            time.sleep(1)
        os._exit(3)

Trainer._save_optimizer_and_scheduler = save_then_hang
cfg, _, raw = load_recipe(None, sys.argv[3:])
run_training(cfg, recipe=raw)
"""


def _complete_checkpoint(path: Path) -> bool:
    return (path / "trainer_state.json").is_file() and (path / "adapter_model.safetensors").is_file()


def test_killed_run_leaves_only_complete_checkpoints_and_resumes_exactly(tmp_path, tiny_dir, short_data):
    kw = dict(max_steps=8, save_strategy="steps", save_steps=1)
    out = tmp_path / "killed"
    marker = tmp_path / "blocked"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    log = tmp_path / "child.log"  # a file, not a pipe: a full pipe would block the child
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CRASH_SCRIPT,
                str(marker),
                str(torch.get_num_threads()),
                *overrides(tiny_dir, out, short_data, **kw),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        # The uninterrupted reference runs meanwhile (the child spends its first seconds importing).
        straight = run_training(config(tiny_dir, tmp_path / "straight", short_data, max_steps=8)[0])
        deadline = time.monotonic() + 600  # guard against a hang only; no timing is asserted
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), log.read_text(errors="replace")[-3000:]
        assert (out / "checkpoint-3").is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    # Killed while checkpoint-4 was being written: it exists only outside the checkpoint-N namespace.
    half = Path(marker.read_text())
    assert half.is_dir() and not (half / "trainer_state.json").exists() and half.name == "checkpoint-4"
    assert half.parent != out
    visible = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert visible == ["checkpoint-1", "checkpoint-2", "checkpoint-3"], visible
    assert all(_complete_checkpoint(out / v) for v in visible)
    assert not (out / "ccft.json").exists()  # no final decoder from a killed run

    from transformers.trainer_utils import get_last_checkpoint

    assert Path(get_last_checkpoint(str(out))).name == "checkpoint-3"
    resumed = run_training(config(tiny_dir, out, short_data, **kw)[0])
    assert resumed.trainer.state.global_step == 8
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{i}" for i in range(1, 9)
    ]
    assert all(_complete_checkpoint(out / f"checkpoint-{i}") for i in range(1, 9))

    a, b = lora_weights(straight.decoder), lora_weights(resumed.decoder)
    assert set(a) == set(b) and a
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6, rtol=0), n
    ref, got = curve(straight), curve(resumed)
    for s in range(4, 9):
        assert close(got[s], ref[s], 1e-5), (s, got[s], ref[s])


# ------------------------------------------------------------------ 7: the loss goes down on real data


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny model whose lm_head is scaled up: with the default init, the final RMSNorm bounds every logit
    near 0, so a LoRA adapter (which cannot touch lm_head) could hardly move the loss off ln(vocab)."""
    from conftest import make_tiny_folder

    return make_tiny_folder(tmp_path_factory.mktemp("sharp"), tokenizer, seed=1, scale=8.0)


@pytest.mark.parametrize("method", ["ccft", "full-ft"])
def test_loss_goes_down_on_gsm8k_and_eval_nll_is_token_weighted(tmp_path, sharp_dir, method):
    cfg, _ = config(
        sharp_dir,
        tmp_path / "run",
        "gsm8k:train",
        method=method,
        train_rows=24,
        max_steps=20,
        per_device_train_batch_size=1,
        lr_scheduler_type="constant",
        eval_data="gsm8k:test",
        eval_rows=8,
        per_device_eval_batch_size=4,
    )
    base, decoder, train_set, eval_set, trainer = setup(cfg)
    assert len(train_set) == 24 and len(eval_set) == 8
    trainer.train()
    losses = [v for _, v in sorted(curve(trainer.state.log_history).items())]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    last5 = sum(losses[-5:]) / 5
    assert last5 < losses[0] - 1.0, (losses[0], last5)  # seen here: 11.9 -> 9.9 (ccft), 9.5 (full-ft)

    metrics = trainer.evaluate()
    nll = metrics["eval_loss"]
    assert math.isfinite(nll) and 0 < nll < losses[0]
    # Reference: one row at a time (no padding), compute_loss (mean over the row) weighted by its token count.
    trainer.model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in eval_set:
            one = trainer.data_collator([ex])
            n = int(one["num_supervised"])
            total += trainer.compute_loss(trainer.model, one).item() * n
            count += n
    assert metrics["eval_tokens"] == count == eval_set.supervised_tokens
    assert close(nll, total / count, 1e-5), (nll, total / count)


# ------------------------------------------------------------------ 8: the run folder


def test_run_folder_records_metadata_and_reloads(tmp_path, tiny_dir, tiny_base, short_data):
    cfg, raw = config(tiny_dir, tmp_path / "run", short_data, max_steps=2, handoff_tokens=2, train_rows=9)
    result = run_training(cfg, recipe=raw)
    out = result.output_dir
    meta = json.loads((out / "ccft.json").read_text())
    assert meta["method"] == "ccft" and meta["decoder_kind"] == "lora"
    assert meta["base_fingerprint"] == tiny_base.fingerprint == result.decoder.base.fingerprint
    assert meta["handoff_tokens"] == 2
    assert meta["data"]["train_rows"] == 9 and meta["data"]["train_data"] == str(short_data)
    assert meta["recipe"]["max_steps"] == 2
    assert (out / "adapter_model.safetensors").is_file()

    loaded = ccft.load_decoder(out, base=tiny_base)
    assert loaded.kind == "lora" and loaded.method == "ccft" and loaded.handoff_tokens == 2
    rows = [result.trainer.train_dataset[i] for i in range(3)]
    batch = result.trainer.data_collator(rows)
    prompts = [list(e.prompt_ids) for e in rows]
    trained = result.decoder
    trained.model.eval()
    with torch.no_grad():
        want = decoder_forward(
            trained,
            compute_base_cache(trained.base, prompts, handoff_tokens=2),
            batch["tail_ids"],
            batch["tail_mask"],
        )
        got = decoder_forward(
            loaded,
            compute_base_cache(tiny_base, prompts, handoff_tokens=2),
            batch["tail_ids"],
            batch["tail_mask"],
        )
        with tiny_base.base_weights() as m:  # the base alone gives other logits: the adapter was trained
            plain = decoder_forward(
                m,
                compute_base_cache(tiny_base, prompts, handoff_tokens=2),
                batch["tail_ids"],
                batch["tail_mask"],
            )
    real = batch["tail_mask"].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=0)
    assert (plain[real] - want[real]).abs().max() > 1e-3


# ------------------------------------------------------------------ 9: the Trainer hooks


def test_unused_column_removal_keeps_the_fields_the_collator_reads(tmp_path, tiny_dir, short_data):
    """``_set_signature_columns_if_needed`` (the hook transformers calls) keeps ``Collator.features``: a
    ``datasets.Dataset`` of tokenised rows loses its other columns, not the ids, and batches like the
    Examples."""
    import datasets
    from transformers import Trainer

    from ccft.train.data import Collator

    cfg, _ = config(tiny_dir, tmp_path / "run", short_data, per_device_eval_batch_size=5)
    assert cfg.remove_unused_columns  # the stock default
    base, decoder, train_set, _, trainer = setup(cfg)
    examples = train_set.examples[:10]
    table = datasets.Dataset.from_list(
        [
            {"prompt_ids": list(e.prompt_ids), "response_ids": list(e.response_ids), "text": f"row {i}"}
            for i, e in enumerate(examples)
        ]
    )

    # The stock hook keeps the model's forward arguments, none of which the collator reads.
    probe = SimpleNamespace(_signature_columns=None, model=trainer.model, label_names=trainer.label_names)
    Trainer._set_signature_columns_if_needed(probe)
    assert "input_ids" in probe._signature_columns and "prompt_ids" not in probe._signature_columns

    calls = []
    hook = trainer._set_signature_columns_if_needed
    trainer._set_signature_columns_if_needed = lambda: (calls.append(1), hook())[1]
    loader = trainer.get_eval_dataloader(table)
    assert calls, "transformers did not call _set_signature_columns_if_needed"
    assert trainer._signature_columns == list(Collator.features) == ["prompt_ids", "response_ids"]
    assert loader.dataset.column_names == ["prompt_ids", "response_ids"]  # `text` removed
    batches = list(loader)
    assert [len(b["labels"]) for b in batches] == [5, 5]
    for i, batch in enumerate(batches):
        want = trainer.data_collator(examples[5 * i : 5 * i + 5])
        assert (
            set(batch)
            == set(want)
            == {"prefix_ids", "prefix_mask", "tail_ids", "tail_mask", "labels", "num_supervised"}
        )
        for key in want:
            assert torch.equal(batch[key], want[key]), key
    # The same rows as a datasets.Dataset and as Examples give the same held-out NLL.
    from_table, from_examples = trainer.evaluate(table), trainer.evaluate(TokenizedDataset(list(examples)))
    assert (
        from_table["eval_tokens"]
        == from_examples["eval_tokens"]
        == sum(len(e.response_ids) for e in examples)
    )
    assert from_table["eval_loss"] == from_examples["eval_loss"]


def test_evaluate_calls_compute_metrics_with_the_tail_logits(tmp_path, tiny_dir, short_data):
    cfg, _ = config(
        tiny_dir,
        tmp_path / "run",
        short_data,
        eval_data=str(short_data),
        eval_rows=7,
        per_device_eval_batch_size=3,
    )
    base, decoder, train_set, eval_set, trainer = setup(cfg)
    perturb(decoder.model, lora_only=True)
    without = trainer.evaluate()
    assert set(without) >= {"eval_loss", "eval_tokens"}

    seen = []

    def compute_metrics(pred):
        seen.append(pred)
        return {"known": 42.0, "rows": len(pred.label_ids)}

    trainer.compute_metrics = compute_metrics
    metrics = trainer.evaluate()
    assert len(seen) == 1
    assert metrics["eval_known"] == 42.0 and metrics["eval_rows"] == 7
    assert metrics["eval_loss"] == without["eval_loss"] and metrics["eval_tokens"] == without["eval_tokens"]
    # What compute_metrics received: each row's tail logits and labels (padded with -100 across batches),
    # equal to the row run alone.
    logits, labels = seen[0].predictions, seen[0].label_ids
    assert logits.shape[0] == labels.shape[0] == 7 and logits.shape[-1] == decoder.model.config.vocab_size
    trainer.model.eval()
    for i, ex in enumerate(eval_set):
        one = trainer.data_collator([ex])
        with torch.no_grad():
            want = trainer.tail_logits(trainer.model, one)[0]
        t = want.shape[0]
        assert np.array_equal(labels[i, :t], one["labels"][0].numpy()) and (labels[i, t:] == -100).all()
        assert np.allclose(logits[i, :t], want.numpy(), atol=1e-5, rtol=0), i


@pytest.mark.parametrize("greater_is_better", [False, True])
def test_load_best_model_at_end_keeps_the_best_checkpoint(tmp_path, tiny_dir, short_data, greater_is_better):
    """Checkpoints every step, save_total_limit=1, load_best_model_at_end on eval_loss: the one checkpoint
    left is the best step's and the final decoder equals it. ``greater_is_better=True`` makes the best an
    early step (the eval loss falls), so the best is not simply the latest checkpoint."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cfg, raw = config(
        tiny_dir,
        out,
        short_data,
        max_steps=4,
        eval_data=str(short_data),
        eval_rows=6,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end="true",
        metric_for_best_model="eval_loss",
        greater_is_better=str(greater_is_better).lower(),
    )

    class StepWeights(TrainerCallback):
        def __init__(self):
            self.weights = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.weights[state.global_step] = {
                n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n
            }

    base, decoder, train_set, eval_set, trainer = setup(cfg)
    steps = StepWeights()
    trainer.add_callback(steps)
    trainer.train()

    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert sorted(evals) == [1, 2, 3, 4] and len(set(evals.values())) == 4
    best = (max if greater_is_better else min)(evals, key=evals.get)
    if greater_is_better:
        assert best != 4, evals
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == [f"checkpoint-{best}"], (kept, evals)
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{best}")
    assert trainer.state.best_global_step == best
    assert not (out / ".staging").exists()
    state = json.loads((out / f"checkpoint-{best}" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{best}")  # a resume finds it

    stored = load_file(str(out / f"checkpoint-{best}" / "adapter_model.safetensors"))
    final = lora_weights(decoder)
    assert len(stored) == len(final) > 0
    for name, w in final.items():
        assert torch.equal(w, steps.weights[best][name]), name  # the final model is the best step's
    for key, w in stored.items():
        match = [n for n in final if n.replace(".default", "") == key]
        assert len(match) == 1, key
        assert torch.equal(w, final[match[0]]), key  # ... and the kept checkpoint holds it
    if best != 4:
        assert any(not torch.equal(final[n], steps.weights[4][n]) for n in final)  # not the last step's


def test_checkpoints_of_another_recipe_are_not_resumed(tmp_path, tiny_dir, short_data):
    """A run folder whose checkpoints another recipe trained (a changed learning rate, step count or
    checkpointing) is refused before any work, naming the keys; the same recipe resumes; --no-resume
    trains."""
    from ccft.core.errors import ConfigError
    from ccft.train.run import RECIPE_STAMP, train_or_reuse

    out = tmp_path / "run"
    kw = dict(max_steps=2, save_strategy="steps", save_steps=1)
    cfg, raw = config(tiny_dir, out, short_data, **kw)
    first = run_training(cfg, recipe=raw)
    assert json.loads((out / RECIPE_STAMP).read_text()) == raw
    assert (out / "checkpoint-2").is_dir()
    cfg2, raw2 = config(tiny_dir, out, short_data, learning_rate=5e-3, **kw)
    with pytest.raises(
        ConfigError, match=r"another recipe \{'learning_rate': \(0.01, 0.005\)\}.*Delete the folder"
    ):
        train_or_reuse(cfg2, raw2)  # the finished run is not reused, and its checkpoints are not resumed
    assert json.loads((out / RECIPE_STAMP).read_text()) == raw  # nothing written
    assert train_or_reuse(cfg, raw)[2] is True  # the same recipe: the finished run is reused
    cfg3, raw3 = config(tiny_dir, out, short_data, max_steps=3, save_strategy="steps", save_steps=1)
    with pytest.raises(ConfigError, match="max_steps"):
        run_training(cfg3, recipe=raw3)
    fresh = run_training(cfg2, recipe=raw2, resume=False)  # --no-resume: trains this recipe from step 0
    assert fresh.trainer.state.global_step == 2
    assert fresh.log_history[0]["learning_rate"] != first.log_history[0]["learning_rate"]
    assert json.loads((out / RECIPE_STAMP).read_text()) == raw2
