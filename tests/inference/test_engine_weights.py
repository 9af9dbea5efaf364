"""The engine reads the weights a decoder really has: their dtype (K11) and their current values (K5).

* bf16 base + LoRA decoder: PEFT keeps the adapter in fp32; registration casts it to the base
  dtype (the engine's first decode step used to raise ``expected m1 and m2 to have the same dtype``),
  and the engine then equals the reference ``ccft.generate`` on that decoder.
* A full-weight decoder whose weights are not all in the base dtype is refused with the fix named.
* Live weights, live keys: an in-place edit of a LoRA adapter (or of an unpacked full-weight decoder)
  gives a new producer key, so the prefix store no longer serves K/V of the old weights; a handle
  written before the edit is refused; a packed full-weight decoder refuses the edit.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError, FingerprintMismatchError, IncompatibleModelError
from ccft.inference import SharedPrefillEngine
from ccft.serving import PrefixKVStore
from conftest import make_full, make_lora, make_tiny_folder, ragged_prompts

N_NEW = 4


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    return make_tiny_folder(tmp_path_factory.mktemp("weights_sharp"), tokenizer, seed=3, scale=30.0)


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    return ragged_prompts(gsm8k_rows, tokenizer, 3, 6, 5)


def _adapter_dtypes(dec, name):
    return {p.dtype for n, p in dec.model.named_parameters() if f".{name}." in n and "lora_" in n}


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_bf16_base_lora_decoder_is_served(sharp_dir, prompts, decode):
    base = ccft.load_base(str(sharp_dir), dtype="bfloat16")
    lora = make_lora(base, "math", 1, 4)
    assert _adapter_dtypes(lora, "math") == {
        torch.float32
    }  # PEFT's autocast_adapter_dtype: the reported crash
    eng = SharedPrefillEngine(base, decoders={"math": lora}, decode=decode)
    assert _adapter_dtypes(lora, "math") == {torch.bfloat16}  # cast at registration
    assert all(t.dtype == torch.bfloat16 for t in eng.decoders["math"].watched)
    ref = ccft.generate(prompts, mode="prefillshare", decoder=lora, max_new_tokens=N_NEW)
    ref_base = ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW)
    with eng.prefill(prompts) as h:
        for name, want in (("math", ref), ("base", ref_base)):
            agree = _forced_top1(eng, h, name, want)
            # bf16 (docs/design.md K3): top-1 agreement, not identity; teacher-forced on the reference's
            # tokens so one near-tie does not cascade. Bound: the first token of every row, and ≥ 80% of steps
            assert all(a[0] for a in agree), (name, agree)
            assert sum(map(sum, agree)) >= 0.8 * sum(map(len, agree)), (name, agree)


def _forced_top1(eng, handle, decoder, want):
    """Per row, per step: does the engine's argmax equal the reference's token, fed the reference's tokens?"""
    out = []
    for row, g in enumerate(want):
        assert g.token_ids, "the reference generated nothing to compare with"
        rid = eng.add_request(handle, row, decoder=decoder, forced_tokens=g.token_ids)
        got = []
        while eng.active:
            got += [int(o.logits.argmax()) for o in eng.step(return_logits=True) if o.request_id == rid]
        out.append([a == b for a, b in zip(got, g.token_ids, strict=False)])
    return out


def test_full_decoder_with_mixed_dtypes_is_refused(sharp_dir):
    base = ccft.load_base(str(sharp_dir), dtype="bfloat16")
    full = make_full(base, 7)
    full.model.lm_head.float()  # one layer left in fp32: the first parameter (the embedding) is still bf16
    with pytest.raises(IncompatibleModelError, match=r"torch.float32.*base is torch.bfloat16.*model.to"):
        SharedPrefillEngine(base, decoders={"full": full})


def _kv(handle):
    return torch.cat([t.flatten() for t in handle.snapshot()])


def test_lora_in_place_edit_gets_a_new_key(sharp_dir, prompts):
    base = ccft.load_base(str(sharp_dir))
    lora = make_lora(base, "math", 1, 4)
    eng = SharedPrefillEngine(base, decoders={"math": lora})
    store = PrefixKVStore(block_tokens=4)
    prompt = prompts[2]
    h0, hit = eng.prefill_cached(prompt, store, producer="math")
    assert hit == 0
    old_key = eng.producer_key("math")
    h1, hit = eng.prefill_cached(prompt, store, producer="math")
    assert hit > 0
    torch.testing.assert_close(_kv(h0), _kv(h1), atol=1e-5, rtol=0)
    h1.release()
    with torch.no_grad():
        lora.model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["math"].weight.add_(0.5)
    new_key = eng.producer_key("math")
    assert new_key != old_key
    # a handle written with the old weights is not read with the new ones
    with pytest.raises(FingerprintMismatchError, match="changed in place"):
        eng.add_request(h0, 0, decoder="math")
    h0.release()
    # the store's blocks of the old weights are not served (and dropped): everything is recomputed,
    # equal to a plain prefill
    assert {b.producer for b in store.blocks()} == {old_key}
    h2, hit = eng.prefill_cached(prompt, store, producer="math")
    assert hit == 0 and h2.producer_key == new_key
    assert {b.producer for b in store.blocks()} == {new_key}
    with eng.prefill([prompt], producer="math") as plain:
        torch.testing.assert_close(_kv(h2), _kv(plain), atol=1e-5, rtol=0)
    # and decoding the new handle equals the reference on the edited decoder
    rid = eng.add_request(h2, 0, decoder="math", max_new_tokens=N_NEW)
    out = None
    while eng.active:
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o.generation
    h2.release()
    fresh = SharedPrefillEngine(base, decoders={"math": lora})  # registered after the edit
    assert fresh.producer_key("math") == new_key
    with fresh.prefill([prompt], producer="math") as h:
        want = fresh.generate(h, decoder="math", max_new_tokens=N_NEW)[0]
    assert out.token_ids == want.token_ids


def test_full_decoder_in_place_edit(sharp_dir, prompts):
    base = ccft.load_base(str(sharp_dir))
    full = make_full(base, 7)
    packed = SharedPrefillEngine(base, decoders={"full": full})  # CPU eager: packed weights (a copy)
    unpacked = SharedPrefillEngine(base, decoders={"full": full}, pack_weights=False)
    assert packed.pack_weights and not unpacked.pack_weights
    key = unpacked.producer_key("full")
    assert packed.producer_key("full") == key
    with torch.no_grad():
        full.model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    assert unpacked.producer_key("full") != key
    with pytest.raises(ConfigError, match="changed in place.*pack_weights"):
        packed.producer_key("full")
    with packed.prefill([prompts[0]]) as h, pytest.raises(ConfigError, match="changed in place"):
        packed.add_request(h, 0, decoder="full")
    # the unpacked engine reads the edited weights: equal to the reference on the edited decoder
    with unpacked.prefill([prompts[1]]) as h:
        got = unpacked.generate(h, decoder="full", max_new_tokens=N_NEW)
    want = ccft.generate([prompts[1]], mode="prefillshare", decoder=full, max_new_tokens=N_NEW)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_prepack_keeps_the_plain_linear_where_onednn_refuses_the_dtype(monkeypatch):
    # on an AVX2-only CPU oneDNN raises for bf16 weights (no bf16 kernels); the lane must keep F.linear, same
    # output
    from ccft.inference import weights as W

    if not W.onednn_available():
        pytest.skip("oneDNN prepacking is not available in this torch build")
    lin = W.Linear(torch.randn(8, 4), None)

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    kept = W.prepack(lin)
    assert kept is lin and kept.packed is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(kept(x), x @ lin.weight.T, rtol=0, atol=0)
