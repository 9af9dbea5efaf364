"""One-pass LoRA training path == the two-pass reference (docs/design.md, invariant 6), path choice and
recording.

Equivalence table (PEFT style): (batch layout, handoff k, gradient checkpointing) -> loss and every LoRA
gradient of the one-pass path equal the two-pass path's in fp32, on a tiny random GQA Llama with
``init_lora_weights=False`` (a fresh PEFT adapter equals the base, so such a test could not fail).
"""

from __future__ import annotations

import json

import pytest
import torch

from ccft import ConfigError, load_base, make_decoder
from ccft.core.cache import prefill_tensors
from ccft.core.decoder import decoder_forward, full_forward
from ccft.train.config import load_recipe
from ccft.train.data import Collator, build_dataset
from ccft.train.fastpath import (
    DEFAULT_LORA_PATH,
    LoraTokenGate,
    one_pass_forward,
    one_pass_unsupported,
    resolve_train_path,
)
from ccft.train.run import run_training, setup
from ccft.train.trainer import response_nll_sum

LOSS_TOL = 2e-6  # fp32 losses ≈ ln(vocab) ≈ 10.8; the paths differ in summation order only
GRAD_TOL = 1e-5  # relative to the largest gradient entry of the tensor


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rows(n: int = 5) -> list[dict]:
    """Rows whose prompts and responses differ in length, so the batch is left- and right-padded."""
    return [
        {
            "prompt": f"Q{i}: add {i} and {2 * i + 1}." + " Think step by step." * (i % 3),
            "response": f"{i} + {2 * i + 1} = {3 * i + 1}." + " So the answer is that." * ((i + 1) % 3),
        }
        for i in range(n)
    ]


def lora_decoder(base, seed: int = 0):
    torch.manual_seed(seed)
    return make_decoder(
        base,
        "lora",
        lora={
            "r": 4,
            "lora_alpha": 8,
            "init_lora_weights": False,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    )


def batch_for(tokenizer, k: int, n: int = 5) -> dict:
    ds = build_dataset(rows(n), tokenizer, chat_template=False, handoff_tokens=k)
    batch = Collator(tokenizer.pad_token_id, k)([ds[i] for i in range(len(ds))])
    assert (batch["prefix_mask"] == 0).any() and (batch["tail_mask"] == 0).any()  # both paddings present
    return batch


def two_pass_logits(base, model, batch, k):
    with base.base_weights() as m:
        cache = prefill_tensors(
            m,
            batch["prefix_ids"],
            batch["prefix_mask"],
            batch["tail_ids"][:, :k],
            handoff_tokens=k,
            fingerprint=base.fingerprint,
        )
    return decoder_forward(model, cache, batch["tail_ids"], batch["tail_mask"])


def loss_and_grads(model, logits_fn, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    nll, count = response_nll_sum(logits_fn(), batch["labels"])
    loss = nll / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("k,checkpointing", [(1, False), (3, False), (1, True), (3, True)])
def test_one_pass_equals_two_pass_loss_and_gradients(tiny_base, tokenizer, k, checkpointing):
    decoder = lora_decoder(tiny_base)
    model = decoder.model
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.enable_input_require_grads()
    batch = batch_for(tokenizer, k)

    with LoraTokenGate(model) as gate:  # kept on through the backward (checkpoint recompute)
        one, g1 = loss_and_grads(
            model,
            lambda: one_pass_forward(
                model,
                batch["prefix_ids"],
                batch["prefix_mask"],
                batch["tail_ids"],
                batch["tail_mask"],
                gate=gate,
            ),
            batch,
        )
    two, g2 = loss_and_grads(model, lambda: two_pass_logits(tiny_base, model, batch, k), batch)

    assert abs(one - two) <= LOSS_TOL * abs(two), (one, two)
    assert set(g1) == set(g2) and all("lora_" in n for n in g1) and len(g1) == 2 * 7 * 2
    for n in g2:
        scale = g2[n].abs().max().item()
        assert scale > 0, n  # every LoRA tensor gets gradient (B ≠ 0, so A does too)
        assert torch.allclose(g1[n], g2[n], atol=GRAD_TOL * scale, rtol=0), (n, (g1[n] - g2[n]).abs().max())
    # The gate is gone after the context: no hook left on any lora_A.
    assert all(not m._forward_hooks for name, m in model.named_modules() if name.endswith("lora_A.default"))


@pytest.mark.parametrize("k", [1, 3])
def test_one_pass_logits_equal_two_pass_for_every_row(tiny_base, tokenizer, k):
    decoder = lora_decoder(tiny_base, seed=1)
    model = decoder.model
    model.eval()
    batch = batch_for(tokenizer, k)
    with torch.no_grad():
        one = one_pass_forward(
            model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"]
        )
        two = two_pass_logits(tiny_base, model, batch, k)
        everywhere = full_forward(
            model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"]
        )
    real = batch["tail_mask"].bool()
    assert one.shape == two.shape
    assert (one[real] - two[real]).abs().max().item() <= 1e-5
    # The gate matters: with the adapter on over the prompt too (Full-FT's computation) the logits differ.
    assert (everywhere[real] - two[real]).abs().max().item() > 1e-3


def test_gate_runs_the_base_before_the_handoff_and_the_adapter_after(tiny_base, tokenizer):
    decoder = lora_decoder(tiny_base, seed=2)
    model = decoder.model
    model.eval()
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]])
    s = ids.shape[1]
    cut = s // 2
    gate_mask = torch.zeros(1, s, dtype=torch.bool)
    gate_mask[:, cut:] = True
    with torch.no_grad():
        with LoraTokenGate(model) as gate:
            gate.set(gate_mask)
            gated = model(input_ids=ids).logits
        with tiny_base.base_weights() as m:
            plain = m(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
    assert torch.equal(gated[:, :cut], plain[:, :cut])  # bit-identical: the masked delta is an exact +0
    assert (gated[:, cut:] - plain[:, cut:]).abs().max() > 1e-3
    assert (adapted[:, :cut] - plain[:, :cut]).abs().max() > 1e-3
    # A gate of the wrong shape is an error, not a silently ungated forward.
    with LoraTokenGate(model) as gate, pytest.raises(RuntimeError, match="does not match"):
        gate.set(gate_mask[:, :-1])
        model(input_ids=ids)


def test_resolve_train_path_and_refusals(tiny_base):
    assert resolve_train_path("auto", method="full-ft", decoder_kind="lora") == "self-prefill"
    assert resolve_train_path("auto", method="ccft", decoder_kind="full") == "two-pass"
    with pytest.raises(ConfigError, match="LoRA decoder"):
        resolve_train_path("one-pass", method="ccft", decoder_kind="full")
    with pytest.raises(ConfigError, match="train_path"):
        resolve_train_path("fast", method="ccft", decoder_kind="lora")
    decoder = lora_decoder(tiny_base)
    assert one_pass_unsupported(decoder.model) is None
    assert (
        resolve_train_path("auto", method="ccft", decoder_kind="lora", model=decoder.model)
        == DEFAULT_LORA_PATH
    )
    assert (
        resolve_train_path("one-pass", method="ccft", decoder_kind="lora", model=decoder.model) == "one-pass"
    )


@pytest.mark.parametrize(
    "extra,why",
    [
        ({"use_dora": True}, "variant"),
        ({"lora_bias": True}, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_one_pass_refused_where_it_would_not_be_exact(tiny_dir, extra, why):
    base = load_base(str(tiny_dir))
    decoder = make_decoder(base, "lora", lora={"r": 4, "target_modules": ["q_proj", "v_proj"], **extra})
    assert why in one_pass_unsupported(decoder.model)
    with pytest.raises(ConfigError, match=why):
        resolve_train_path("one-pass", method="ccft", decoder_kind="lora", model=decoder.model)
    assert resolve_train_path("auto", method="ccft", decoder_kind="lora", model=decoder.model) == "two-pass"
    with pytest.raises(ConfigError, match=why):
        LoraTokenGate(decoder.model)


def test_config_refuses_one_pass_outside_lora_ccft():
    with pytest.raises(ConfigError, match="train_path"):
        load_recipe(None, ["train_path=fastest", "report_to=none"])
    with pytest.raises(ConfigError, match="one-pass"):
        load_recipe(None, ["train_path=one-pass", "decoder_kind=full"])
    with pytest.raises(ConfigError, match="one-pass"):
        load_recipe(None, ["train_path=one-pass", "method=full-ft"])


def _overrides(tiny_dir, out, data_path, **kw) -> list[str]:
    ov = {
        "base": str(tiny_dir),
        "output_dir": str(out),
        "train_data": str(data_path),
        "train_rows": 8,
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "learning_rate": 5e-3,
        "use_cpu": "true",
        "disable_tqdm": "true",
        "chat_template": "false",
        "save_strategy": "no",
        "seed": 3,
        "lora_r": 4,
        "lora_alpha": 8,
        "handoff_tokens": 2,
    }
    ov.update(kw)
    return [f"{k}={v}" for k, v in ov.items()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_loss_curves_equal_across_paths_and_record_the_path(tmp_path, tiny_dir, checkpointing):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(8)))
    curves, metas = {}, {}
    for path in ("two-pass", "one-pass"):
        cfg, _, raw = load_recipe(
            None,
            _overrides(
                tiny_dir,
                tmp_path / path,
                data,
                train_path=path,
                gradient_checkpointing=str(checkpointing).lower(),
            ),
        )
        # B ≠ 0 from the first step: PEFT's default init would make step 0 identical for any path.
        base, decoder, *_, trainer = setup(cfg)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for n, p in decoder.model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        assert trainer.train_path == path
        trainer.train()
        curves[path] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        from ccft.core.checkpoint import save_decoder

        save_decoder(decoder, tmp_path / path / "final", train_path=trainer.train_path)
        metas[path] = json.loads((tmp_path / path / "final" / "ccft.json").read_text())
    assert len(curves["one-pass"]) == 3
    for a, b in zip(curves["one-pass"], curves["two-pass"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), curves
    assert curves["two-pass"][-1] < curves["two-pass"][0]  # it trains
    assert metas["one-pass"]["train_path"] == "one-pass" and metas["two-pass"]["train_path"] == "two-pass"


def test_run_training_records_the_resolved_path(tmp_path, tiny_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    cfg, _, raw = load_recipe(None, _overrides(tiny_dir, tmp_path / "auto", data, max_steps=1))
    result = run_training(cfg, recipe=raw)
    assert json.loads((result.output_dir / "ccft.json").read_text())["train_path"] == DEFAULT_LORA_PATH
    cfg, _, raw = load_recipe(
        None, _overrides(tiny_dir, tmp_path / "fullft", data, max_steps=1, method="full-ft")
    )
    result = run_training(cfg, recipe=raw)
    assert json.loads((result.output_dir / "ccft.json").read_text())["train_path"] == "self-prefill"


def test_full_weight_base_stays_frozen_in_eval_and_inference_mode(tmp_path, tiny_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    cfg, _, _ = load_recipe(
        None, _overrides(tiny_dir, tmp_path / "full", data, max_steps=1, decoder_kind="full")
    )
    base, decoder, train_set, _, trainer = setup(cfg)
    assert decoder.model is not base.model and trainer.train_path == "two-pass"
    seen = []
    orig = trainer._base_cache

    def spy(inputs):
        cache = orig(inputs)
        seen.append((base.model.training, cache.keys[0].is_inference(), cache.keys[0].requires_grad))
        return cache

    trainer._base_cache = spy
    trainer.train()
    assert seen and all(s == (False, True, False) for s in seen)  # eval mode, inference tensors, no grad
    assert not base.model.training and not any(p.requires_grad for p in base.model.parameters())


def test_bench_train_runs_every_path_and_writes_the_json(tmp_path, tiny_dir, capsys):
    """`ccft bench train` smoke test on the tiny model (in-process, one case): the JSON carries every path and
    the top-level ratios; the numbers themselves come from the real benchmark (docs/training.md)."""
    from ccft.cli.main import main

    out = tmp_path / "train.json"
    before = torch.get_num_threads()
    try:
        assert (
            main(
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
                    "20",
                    "--batch-size",
                    "2",
                    "--steps",
                    "1",
                    "--warmup",
                    "0",
                    "--threads",
                    "1",
                    "--no-trl",
                    "--in-process",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(before)
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert set(case["runs"]) == {"ccft-full-ft", "ccft-two-pass", "ccft-one-pass"}
    assert (case["prompt_tokens"], case["response_tokens"]) == (16, 4)
    assert case["runs"]["ccft-two-pass"]["train_path"] == "two-pass"
    assert case["runs"]["ccft-one-pass"]["train_path"] == "one-pass"
    assert case["runs"]["ccft-full-ft"]["train_path"] == "self-prefill"
    assert abs(case["theory_speedup"] - (4 * 16 + 4 * 4) / (2 * 16 + 4 * 4)) < 1e-12
    assert result["fraction_of_theory"] == case["fraction_by_path"][DEFAULT_LORA_PATH] > 0
    assert "fullft_vs_trl" in result and "| lora | 4:1 |" in capsys.readouterr().out
