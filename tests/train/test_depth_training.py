"""CCFT at sharing depth m (issue 35, item 1; ``share_from_layer`` in the recipe): the trainer's hybrid prefix
(the decoder's own prompt K/V with gradient in layers 0..m-1, C_base in m..L-1), checked against references
built without ``ccft.core.depth``; m = 0 is today's run bit for bit; the store path; ``ccft.json``; what
refuses a depth-m decoder (engine, aLoRA export) and what falls back (the eval runner).

A 4-layer tiny Llama (fp32) so that m = 2 is a proper middle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ccft
from ccft.core.cache import BaseCache, compute_base_cache
from ccft.core.decoder import decoder_forward, full_forward
from ccft.core.errors import ConfigError
from ccft.train.run import check_run, run_training, setup
from conftest import (
    DEEP_LAYERS,
    grads,
    perturb_lora,
    reload_generates_the_same,
    sixteen_step_losses,
    two_step_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = DEEP_LAYERS


def reference_loss(model, base, batch, m):
    """The response NLL per token with the hybrid prefix built by hand: the decoder's K/V from a plain HF
    forward over the left-padded prefix (with gradient), layers < m, and C_base (``compute_base_cache``),
    layers ≥ m."""
    prefix_ids, prefix_mask = batch["prefix_ids"], batch["prefix_mask"]
    prompts = [
        row[mk.bool()].tolist() + [int(t)]
        for row, mk, t in zip(prefix_ids, prefix_mask, batch["tail_ids"][:, 0], strict=True)
    ]
    c_base = compute_base_cache(base, prompts)
    pos = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=pos, use_cache=True)
    own = getattr(out, "cache", None) or out.past_key_values
    pad = (prefix_mask == 0)[:, None, :, None]
    keys = [own.layers[i].keys.masked_fill(pad, 0.0) if i < m else c_base.keys[i] for i in range(L)]
    values = [own.layers[i].values.masked_fill(pad, 0.0) if i < m else c_base.values[i] for i in range(L)]
    hand = BaseCache.from_tensors(
        keys, values, prefix_mask, c_base.tail_ids, 1, c_base.fingerprint, "mixed" if m else "base"
    )
    logits = decoder_forward(model, hand, batch["tail_ids"], batch["tail_mask"], fingerprint=base.fingerprint)
    labels = batch["labels"][:, 1:]
    lg = logits[:, :-1].float()
    nll = F.cross_entropy(
        lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return nll / (labels != -100).sum()


# ------------------------------------------------------------------ the recipe key


def test_share_from_layer_is_validated_before_any_model_loads(
    tmp_path, deep_train_dir, short_data, monkeypatch
):
    with pytest.raises(ConfigError, match="share_from_layer=-1; it must be ≥ 0"):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, share_from_layer=-1)
    with pytest.raises(ConfigError, match="share_from_layer=2 applies to method=ccft only"):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, share_from_layer=2, method="full-ft")
    with pytest.raises(ConfigError, match="share_from_layer=2 needs train_path two-pass"):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, share_from_layer=2, train_path="one-pass")
    with pytest.raises(ConfigError, match="expects int"):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, share_from_layer="two")
    cfg, _ = two_step_config(
        deep_train_dir, tmp_path / "r", short_data, share_from_layer=L + 1
    )  # L is the base's

    def no_weights(*a, **k):
        raise AssertionError("the base's weights were loaded before share_from_layer was checked")

    monkeypatch.setattr("ccft.train.run.load_base", no_weights)
    for check in (check_run, setup):  # --dry-run, and a real run before its base loads
        with pytest.raises(ConfigError, match=rf"share_from_layer={L + 1}: it must be in 0\.\.{L}"):
            check(cfg)
    assert not (tmp_path / "r").exists()


def test_a_two_method_recipe_keeps_the_depth_for_ccft_only(tmp_path, deep_train_dir, short_data):
    """``ccft demo`` / ``ccft study`` train both methods from one recipe: the Full-FT run leaves the CCFT key
    out (Full-FT prefills the whole prompt itself), the CCFT run keeps it."""
    from ccft.train.run import method_config

    cfg, raw = two_step_config(deep_train_dir, tmp_path / "r", short_data, share_from_layer=2)
    c_cfg, c_raw = method_config(cfg, raw, "ccft", tmp_path / "ccft")
    f_cfg, f_raw = method_config(cfg, raw, "full-ft", tmp_path / "ft")
    assert c_cfg.share_from_layer == 2 and c_raw["share_from_layer"] == 2
    assert f_cfg.share_from_layer == 0 and "share_from_layer" not in f_raw and f_cfg.method == "full-ft"


# ------------------------------------------------------------------ equalities


def test_depth_zero_is_todays_run_bit_for_bit(tmp_path, deep_train_dir, short_data):
    curves = {}
    for name, kw in (("default", {}), ("zero", {"share_from_layer": 0})):
        cfg, _ = two_step_config(deep_train_dir, tmp_path / name, short_data, max_steps=3, **kw)
        base, decoder, train_set, _, trainer = setup(cfg)
        assert trainer.share_from_layer == 0 and decoder.share_from_layer == 0
        trainer.train()
        curves[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        weights = {n: p.detach().clone() for n, p in decoder.model.named_parameters() if "lora_" in n}
        curves[name + "-w"] = weights
    assert curves["default"] == curves["zero"] and len(curves["zero"]) == 3
    for n, w in curves["default-w"].items():
        assert torch.equal(w, curves["zero-w"][n]), n


@pytest.mark.parametrize("m", [2, L])
def test_loss_and_gradients_equal_the_hand_built_hybrid(tmp_path, deep_train_dir, short_data, m):
    cfg, _ = two_step_config(deep_train_dir, tmp_path / "run", short_data, share_from_layer=m)
    base, decoder, train_set, _, trainer = setup(cfg)
    assert trainer.train_path == "two-pass" and trainer.share_from_layer == m == decoder.share_from_layer
    perturb_lora(decoder.model)
    batch = trainer.data_collator([train_set[i] for i in (0, 5, 10, 2)])  # ragged prompts (K2)
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    got = grads(model)
    snap = trainer.last_base_cache.clone()
    model.zero_grad()
    want = reference_loss(model, base, batch, m)
    want.backward()
    ref = grads(model)
    assert abs(loss.item() - want.item()) < 1e-5, (loss.item(), want.item())
    assert set(got) == set(ref) and got
    for n in got:
        assert torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-4), n
    assert trainer.last_base_cache.equal(snap)  # C_base unchanged by forward and backward (K1)
    # the test can fail: at depth 0 the loss and the first layer's gradients differ
    model.zero_grad()
    flat = reference_loss(model, base, batch, 0)
    flat.backward()
    assert abs(flat.item() - loss.item()) > 1e-4
    first = [n for n in got if ".layers.0." in n and "lora_A" in n]
    assert first and any((got[n] - model.get_parameter(n).grad).abs().max() > 1e-6 for n in first)
    if m == L:  # m = L: the decoder's own prefill, Full-FT's forward
        with torch.no_grad():
            own = full_forward(
                model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"]
            )
            lg, lab = own[:, :-1], batch["labels"][:, 1:]
            ft = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1), ignore_index=-100)
        assert abs(ft.item() - loss.item()) < 1e-5


def test_a_full_weight_decoder_trains_on_the_hybrid_too(tmp_path, deep_train_dir, short_data):
    """decoder_kind=full at m = 2: C_base comes from the base's separate copy (inference tensors); loss and
    gradients equal the hand-built hybrid, and the own layers' gradients are not those of depth 0."""
    cfg, _ = two_step_config(
        deep_train_dir, tmp_path / "run", short_data, share_from_layer=2, decoder_kind="full"
    )
    base, decoder, train_set, _, trainer = setup(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a decoder that differs from the base: its own K/V differ from C_base
        for name, p in decoder.model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch = trainer.data_collator([train_set[i] for i in (0, 5, 10, 2)])
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    got = grads(model)
    model.zero_grad()
    want = reference_loss(model, base, batch, 2)
    want.backward()
    ref = grads(model)
    assert abs(loss.item() - want.item()) < 1e-5 and set(got) == set(ref) and got
    for n in got:
        assert torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-4), n
    model.zero_grad()
    reference_loss(model, base, batch, 0).backward()
    name = next(n for n in got if ".layers.0." in n and "k_proj" in n)
    assert (got[name] - model.get_parameter(name).grad).abs().max() > 1e-6


def test_gradient_checkpointing_and_the_store_give_the_same_step(tmp_path, deep_train_dir, short_data):
    """At m = 2: activation checkpointing (the partial prefill's cache is replayed in the backward) and a
    C_base store give the plain run's loss and gradients."""
    results = {}
    for name, kw in (
        ("plain", {}),
        ("ckpt", {"gradient_checkpointing": "true"}),
        ("store", {"base_cache_store": str(tmp_path / "store")}),
    ):
        cfg, _ = two_step_config(deep_train_dir, tmp_path / name, short_data, share_from_layer=2, **kw)
        base, decoder, train_set, _, trainer = setup(cfg)
        perturb_lora(decoder.model)
        if name == "ckpt":
            trainer.model.train()
            trainer.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        batch = trainer.data_collator([train_set[i] for i in (1, 4, 7)])
        trainer.model.zero_grad()
        calls = []
        attn = trainer.model.get_base_model().model.layers[0].self_attn
        hook = attn.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        hook.remove()
        results[name] = (loss.item(), grads(trainer.model), len(calls))
        if name == "store":
            assert trainer.cache_store.hits >= 1  # C_base came from the store
    # layer 0 runs in the base prefill (no grad), the partial prefill and the tail; checkpointing recomputes
    # the last two in the backward; with the store the base prefill is a read
    assert (results["plain"][2], results["ckpt"][2], results["store"][2]) == (3, 5, 2)
    for name in ("ckpt", "store"):
        assert abs(results[name][0] - results["plain"][0]) < 1e-6, name
        for n, g in results["plain"][1].items():
            assert torch.allclose(results[name][1][n], g, atol=1e-6, rtol=1e-5), (name, n)


def test_loss_goes_down_at_depth_two(tmp_path, deep_train_dir):
    losses = sixteen_step_losses(deep_train_dir, tmp_path / "run", share_from_layer=2)
    assert sum(losses[-4:]) / 4 < losses[0] - 0.5, losses


# ------------------------------------------------------------------ the run folder


@pytest.fixture(scope="module")
def depth_run(tmp_path_factory, deep_train_dir, short_data):
    """A finished one-step run at share_from_layer=2: its folder and the trainer."""
    out = tmp_path_factory.mktemp("depth_run") / "run"
    cfg, raw = two_step_config(deep_train_dir, out, short_data, share_from_layer=2, max_steps=1)
    return run_training(cfg, recipe=raw)


def test_run_folder_records_the_depth_and_a_load_restores_it(depth_run, deep_train_dir):
    meta = json.loads((depth_run.output_dir / "ccft.json").read_text())
    assert meta["share_from_layer"] == 2 and meta["recipe"]["share_from_layer"] == 2
    assert reload_generates_the_same(depth_run, deep_train_dir).share_from_layer == 2


# ------------------------------------------------------------------ who refuses or falls back


def test_engine_serves_a_depth_decoder_and_alora_exports_refuse_it(depth_run, deep_train_dir, tmp_path):
    from ccft.inference import SharedPrefillEngine
    from ccft.train.export import export_decoder

    base = ccft.load_base(str(deep_train_dir))
    loaded = ccft.load_decoder(depth_run.output_dir, base=base)
    prompts = [list(depth_run.trainer.train_dataset[i].prompt_ids) for i in range(3)]
    want = [
        g.token_ids for g in ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=4)
    ]
    # the engine serves it at its depth (its own K/V in layers 0..1), from the object or from the folder
    for eng in (
        SharedPrefillEngine(base, decoders={"d": loaded}),
        SharedPrefillEngine(ccft.load_base(str(deep_train_dir)), decoders={"d": str(depth_run.output_dir)}),
    ):
        assert eng.decoders["d"].depth == 2
        with eng.prefill(prompts) as h:
            assert [g.token_ids for g in eng.generate(h, decoder="d", max_new_tokens=4)] == want
    with pytest.raises(ConfigError, match="share_from_layer=2.*--to merged"):
        export_decoder(depth_run.output_dir, "peft-alora", tmp_path / "alora")
    assert not (tmp_path / "alora").exists()
    merged = export_decoder(depth_run.output_dir, "merged", tmp_path / "merged")
    assert json.loads((Path(merged.out) / "ccft.json").read_text())["share_from_layer"] == 2


def test_eval_modes_name_the_depth_and_the_engine_reads_it(deep_train_dir):
    from ccft.evals.generation import make_engine
    from ccft.evals.settings import ModeSpec

    base = ccft.load_base(str(deep_train_dir))
    dec = ccft.make_decoder(base, "lora", method="ccft", share_from_layer=2)
    flat = ccft.make_decoder(ccft.load_base(str(deep_train_dir)), "lora", method="ccft")
    engine = make_engine(base, [ModeSpec("base"), ModeSpec("prefillshare", dec)], cache_format="int8")
    assert (engine.decoders["prefillshare"].depth, engine.decoders["prefillshare"].cache_format) == (
        2,
        "int8",
    )
    assert ModeSpec("prefillshare", dec).describe()["share_from_layer"] == 2
    assert "share_from_layer" not in ModeSpec("prefillshare", flat).describe()  # old records still resume
