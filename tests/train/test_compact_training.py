"""CCFT on the compact C_base (issue 35, item 3; ``cache_format: int8`` in the recipe): the trainer
quantises its C_base (computed or from the store, at depth m too) so the decoder learns the cache it will be
served; checked against references built by hand from ``ccft.core.compact``'s quantise / dequantise
functions; ``native`` is today's run bit for bit; ``ccft.json``; what refuses a compact-trained decoder
(engine, aLoRA export).

A 4-layer tiny Llama (fp32), as tests/train/test_depth_training.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ccft
from ccft.core.cache import BaseCache, compute_base_cache
from ccft.core.compact import dequantize, quantize_keys, quantize_values
from ccft.core.decoder import decoder_forward
from ccft.core.errors import ConfigError
from ccft.train.run import run_training, setup
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


def reference_loss(model, base, batch, *, compact: bool, m: int = 0):
    """The response NLL per token on a prefix built by hand: C_base (``compute_base_cache``) quantised and
    dequantised layer by layer (when ``compact``), the decoder's own K/V from a plain HF forward (with
    gradient) in layers < m."""
    prefix_ids, prefix_mask = batch["prefix_ids"], batch["prefix_mask"]
    prompts = [
        row[mk.bool()].tolist() + [int(t)]
        for row, mk, t in zip(prefix_ids, prefix_mask, batch["tail_ids"][:, 0], strict=True)
    ]
    c_base = compute_base_cache(base, prompts)
    keys, values = list(c_base.keys), list(c_base.values)
    if compact:
        keys = [dequantize(*quantize_keys(k)) for k in keys]
        values = [dequantize(*quantize_values(v)) for v in values]
    if m:
        pos = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=pos, use_cache=True)
        own = getattr(out, "cache", None) or out.past_key_values
        pad = (prefix_mask == 0)[:, None, :, None]
        for i in range(m):
            keys[i] = own.layers[i].keys.masked_fill(pad, 0.0)
            values[i] = own.layers[i].values.masked_fill(pad, 0.0)
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


def test_cache_format_is_validated_before_any_model_loads(tmp_path, deep_train_dir, short_data):
    with pytest.raises(ConfigError, match=r"cache_format='int4': use one of native, int8"):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, cache_format="int4")
    with pytest.raises(
        ConfigError, match="cache_format=int8 applies to method=ccft only.*cache_format: native"
    ):
        two_step_config(deep_train_dir, tmp_path / "r", short_data, cache_format="int8", method="full-ft")
    with pytest.raises(ConfigError, match="cache_format=int8 needs train_path two-pass.*train_path=auto"):
        two_step_config(
            deep_train_dir, tmp_path / "r", short_data, cache_format="int8", train_path="one-pass"
        )
    from ccft.train.fastpath import resolve_train_path

    with pytest.raises(ConfigError, match="train_path=one-pass cannot train on cache_format=int8"):
        resolve_train_path("one-pass", method="ccft", decoder_kind="lora", cache_format="int8")
    assert resolve_train_path("auto", method="ccft", decoder_kind="lora", cache_format="int8") == "two-pass"


def test_a_two_method_recipe_keeps_the_cache_format_for_ccft_only(tmp_path, deep_train_dir, short_data):
    from ccft.train.run import method_config

    cfg, raw = two_step_config(
        deep_train_dir, tmp_path / "r", short_data, cache_format="int8", share_from_layer=1
    )
    c_cfg, c_raw = method_config(cfg, raw, "ccft", tmp_path / "ccft")
    f_cfg, f_raw = method_config(cfg, raw, "full-ft", tmp_path / "ft")
    assert c_cfg.cache_format == "int8" and c_raw["cache_format"] == "int8"
    assert f_cfg.cache_format == "native" and "cache_format" not in f_raw and f_cfg.method == "full-ft"


# ------------------------------------------------------------------ equalities


def test_native_is_todays_run_bit_for_bit(tmp_path, deep_train_dir, short_data):
    curves = {}
    for name, kw in (("default", {}), ("native", {"cache_format": "native"})):
        cfg, _ = two_step_config(deep_train_dir, tmp_path / name, short_data, max_steps=3, **kw)
        base, decoder, train_set, _, trainer = setup(cfg)
        assert trainer.cache_format == "native" == decoder.cache_format
        trainer.train()
        curves[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        curves[name + "-w"] = {
            n: p.detach().clone() for n, p in decoder.model.named_parameters() if "lora_" in n
        }
    assert curves["default"] == curves["native"] and len(curves["native"]) == 3
    for n, w in curves["default-w"].items():
        assert torch.equal(w, curves["native-w"][n]), n


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_loss_and_gradients_equal_the_hand_dequantised_cache(tmp_path, deep_train_dir, short_data, kind):
    """Both decoder kinds (full: C_base from the base's separate copy, inference tensors): loss and gradients
    equal those on the hand-dequantised C_base, C_base itself is unchanged (K1), and the native cache gives
    another loss (the test can fail)."""
    cfg, _ = two_step_config(
        deep_train_dir, tmp_path / "run", short_data, cache_format="int8", decoder_kind=kind
    )
    base, decoder, train_set, _, trainer = setup(cfg)
    assert trainer.train_path == "two-pass" and trainer.cache_format == "int8" == decoder.cache_format
    if kind == "lora":
        perturb_lora(decoder.model)
    batch = trainer.data_collator([train_set[i] for i in (0, 5, 10, 2)])  # ragged prompts (K2)
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    got = grads(model)
    snap = trainer.last_base_cache.clone()
    model.zero_grad()
    want = reference_loss(model, base, batch, compact=True)
    want.backward()
    ref = grads(model)
    assert abs(loss.item() - want.item()) < 1e-6, (loss.item(), want.item())
    assert set(got) == set(ref) and got
    for n in got:
        assert torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-4), n
    assert trainer.last_base_cache.equal(snap)
    with torch.no_grad():
        native = reference_loss(model, base, batch, compact=False)
    assert 1e-6 < abs(native.item() - loss.item()) < 0.05


def test_the_store_and_depth_two_read_the_compact_cache(tmp_path, deep_train_dir, short_data):
    """C_base from a store is quantised like a computed one; at m = 2 only C_base's layers 2..3 are compact
    (the decoder's own K/V below)."""
    results = {}
    for name, kw in (
        ("plain", {}),
        ("store", {"base_cache_store": str(tmp_path / "store")}),
        ("depth", {"share_from_layer": 2}),
    ):
        cfg, _ = two_step_config(deep_train_dir, tmp_path / name, short_data, cache_format="int8", **kw)
        base, decoder, train_set, _, trainer = setup(cfg)
        perturb_lora(decoder.model)
        batch = trainer.data_collator([train_set[i] for i in (1, 4, 7)])
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        results[name] = (loss.item(), grads(trainer.model))
        if name == "store":
            assert trainer.cache_store.hits >= 1  # C_base came from the store
        if name == "depth":
            trainer.model.zero_grad()
            want = reference_loss(trainer.model, base, batch, compact=True, m=2)
            want.backward()
            assert abs(want.item() - loss.item()) < 1e-6
            for n, g in grads(trainer.model).items():
                assert torch.allclose(results["depth"][1][n], g, atol=1e-6, rtol=1e-4), n
    assert abs(results["store"][0] - results["plain"][0]) < 1e-6
    for n, g in results["plain"][1].items():
        assert torch.allclose(results["store"][1][n], g, atol=1e-6, rtol=1e-5), n


def test_loss_goes_down_on_the_compact_cache(tmp_path, deep_train_dir):
    losses = sixteen_step_losses(deep_train_dir, tmp_path / "run", cache_format="int8")
    assert sum(losses[-4:]) / 4 < losses[0] - 0.5, losses


# ------------------------------------------------------------------ the run folder


@pytest.fixture(scope="module")
def compact_run(tmp_path_factory, deep_train_dir, short_data):
    """A finished one-step run on the compact C_base: its folder and the trainer."""
    out = tmp_path_factory.mktemp("compact_run") / "run"
    cfg, raw = two_step_config(deep_train_dir, out, short_data, cache_format="int8", max_steps=1)
    return run_training(cfg, recipe=raw)


def test_run_folder_records_the_cache_format_and_a_load_restores_it(compact_run, deep_train_dir):
    meta = json.loads((compact_run.output_dir / "ccft.json").read_text())
    assert meta["cache_format"] == "int8" and meta["recipe"]["cache_format"] == "int8"
    assert reload_generates_the_same(compact_run, deep_train_dir).cache_format == "int8"


# ------------------------------------------------------------------ who refuses


def test_engine_serves_a_compact_trained_decoder_and_alora_exports_refuse_it(
    compact_run, deep_train_dir, tmp_path
):
    from ccft.inference import SharedPrefillEngine
    from ccft.train.export import export_decoder

    base = ccft.load_base(str(deep_train_dir))
    loaded = ccft.load_decoder(compact_run.output_dir, base=base)
    prompts = [list(compact_run.trainer.train_dataset[i].prompt_ids) for i in range(3)]
    want = ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=4)
    # the engine serves it on the compact C_base, from the object or from the folder
    for eng in (
        SharedPrefillEngine(base, decoders={"d": loaded}),
        SharedPrefillEngine(ccft.load_base(str(deep_train_dir)), decoders={"d": str(compact_run.output_dir)}),
    ):
        assert eng.decoders["d"].cache_format == "int8"
        with eng.prefill(prompts) as h:
            got = eng.generate(h, decoder="d", max_new_tokens=4)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
    # a live reload of a served (native) decoder from the compact-trained folder: refused, nothing changes
    import shutil

    native = tmp_path / "native"
    shutil.copytree(compact_run.output_dir, native)
    meta = json.loads((native / "ccft.json").read_text())
    (native / "ccft.json").write_text(json.dumps(dict(meta, cache_format="native")))
    engine = SharedPrefillEngine(ccft.load_base(str(deep_train_dir)), decoders={"d": str(native)})
    refusal = "'cache_format' is int8 but the served decoder was trained on native"
    with pytest.raises(ConfigError, match="reload of decoder 'd' .*" + refusal):
        engine.reload_decoder("d", compact_run.output_dir)
    with pytest.raises(ConfigError, match="cache_format=int8.*--to merged.*cache_format: native"):
        export_decoder(compact_run.output_dir, "peft-alora", tmp_path / "alora")
    assert not (tmp_path / "alora").exists()
    from ccft.bench.llamacpp_alora import export_gguf_alora

    def no_build(*a, **k):  # the refusal comes before llama.cpp is built or run
        raise AssertionError("llama.cpp was run before the refusal")

    with pytest.raises(ConfigError, match="cache_format=int8.*gguf-alora"):
        export_gguf_alora(compact_run.output_dir, tmp_path / "gguf", runner=no_build)
    assert not (tmp_path / "gguf").exists()
    merged = export_decoder(compact_run.output_dir, "merged", tmp_path / "merged")
    assert json.loads((Path(merged.out) / "ccft.json").read_text())["cache_format"] == "int8"
