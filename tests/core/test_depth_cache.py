"""Sharing depth m (issue 35, item 1; ``ccft.core.depth``): the decoder's own prompt K/V in layers 0..m-1,
C_base in m..L-1 — the hybrid prefix cache against references built without ``ccft.core.depth``.

A 4-layer tiny Llama (fp32) so that m = 2 is a proper middle; ragged real GSM8K prompts (left padding, K2).
References: every row prefilled unpadded by plain HF forwards (the decoder's and the base's own caches), their
layers picked by hand (own below m, base above), the tail run at explicit positions.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.cache import BaseCache, cache_kwarg, compute_base_cache, prefill
from ccft.core.checkpoint import read_meta
from ccft.core.decoder import decoder_forward, full_forward
from ccft.core.depth import MIXED, depth_cache, mix_layers, partial_prefill, prompt_prefixes
from ccft.core.errors import ConfigError
from ccft.core.generation import decode_on_cache
from ccft.core.tokens import left_pad, pad_token_id, right_pad, tokenize_prompt
from conftest import DEEP_LAYERS, make_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = DEEP_LAYERS


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Four real prompts of different lengths (ragged prefixes: left padding in a batch)."""
    ids = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:4]]
    return [p[: 9 + 5 * i] for i, p in enumerate(ids)]


def close(a, b, tol=1e-5) -> bool:
    """fp32 rounding: max |a − b| ≤ tol × the largest |logit| (the lm_head is scaled up here)."""
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _decoder(base, m=0, name="d", method="ccft"):
    dec = make_lora(base, name, seed=5, r=4, method=method)  # random A and B: the adapter shows
    dec.share_from_layer = m
    return dec


def _tails(prompts, k, pad):
    tails = [list(p[-k:]) + [11, 12, 13][: 1 + i % 3] for i, p in enumerate(prompts)]
    ids, mask = right_pad(tails, pad)
    return tails, ids, mask


def _row_reference(decoder_model, base_model, prompt, tail, m, k):
    """Logits ``(len(tail), v)`` of one row, unpadded: HF caches of ``prompt[:-k]`` from the decoder and the
    base, layer i taken from the decoder's when i < m, from the base's otherwise."""
    from transformers import DynamicCache

    prefix = torch.tensor([prompt[:-k]])
    with torch.no_grad():
        own = decoder_model(input_ids=prefix, use_cache=True)
        with base_model() as bm:
            shared = bm(input_ids=prefix, use_cache=True)
    own_c = getattr(own, "cache", None) or own.past_key_values
    base_c = getattr(shared, "cache", None) or shared.past_key_values
    layers = [
        (own_c.layers[i].keys, own_c.layers[i].values)
        if i < m
        else (base_c.layers[i].keys, base_c.layers[i].values)
        for i in range(L)
    ]
    cache = DynamicCache(ddp_cache_data=layers)
    n = len(prompt) - k
    pos = torch.arange(n, n + len(tail))[None]
    with torch.no_grad():
        out = decoder_model(
            input_ids=torch.tensor([tail]),
            position_ids=pos,
            use_cache=True,
            **{cache_kwarg(decoder_model): cache},
        )
    return out.logits[0]


@pytest.mark.parametrize("m", [1, 2, L])
@pytest.mark.parametrize("k", [1, 3])
def test_hybrid_forward_equals_per_row_reference(deep_base, prompts, m, k):
    dec = _decoder(deep_base, m)
    pad = pad_token_id(deep_base.tokenizer)
    c_base = compute_base_cache(deep_base, prompts, handoff_tokens=k)
    snap = c_base.clone()
    ids, mask = prompt_prefixes(prompts, k, pad)
    with torch.no_grad():
        hybrid = depth_cache(dec, c_base, ids, mask, m)
        tails, tail_ids, tail_mask = _tails(prompts, k, pad)
        got = decoder_forward(dec, hybrid, tail_ids, tail_mask)
    assert hybrid.producer == MIXED and hybrid.num_layers == L
    for i in range(m, L):  # C_base's own tensors above m: nothing copied, nothing written (K1)
        assert hybrid.keys[i] is c_base.keys[i] and hybrid.values[i] is c_base.values[i]
    assert c_base.equal(snap)
    for r, (p, tail) in enumerate(zip(prompts, tails)):
        want = _row_reference(dec.activate(), deep_base.base_weights, p, tail, m, k)
        assert close(got[r, : len(tail)], want), (m, k, r)
    # the test can fail: depth 0 (plain C_base) gives other logits
    with torch.no_grad():
        dec.share_from_layer = 0
        flat = decoder_forward(dec, c_base, tail_ids, tail_mask)
    assert (flat - got)[tail_mask.bool()].abs().max() > 1e-3


def _hand_built(base, dec, prompts, m: int, k: int) -> tuple[BaseCache, BaseCache, BaseCache]:
    """(C_base, the decoder's own full prefill, the hand-built hybrid: its layers < m and C_base's >= m),
    built without ccft.core.depth."""
    pad = pad_token_id(base.tokenizer)
    c_base = compute_base_cache(base, prompts, handoff_tokens=k)
    own = prefill(dec.activate(), prompts, handoff_tokens=k, pad_token_id=pad, producer="self")
    hand = BaseCache.from_tensors(
        own.keys[:m] + c_base.keys[m:],
        own.values[:m] + c_base.values[m:],
        c_base.attention_mask,
        c_base.tail_ids,
        k,
        c_base.fingerprint,
        "mixed",
    )
    return c_base, own, hand


def test_hybrid_cache_equals_hand_built_layer_cat(deep_base, prompts):
    """depth_cache == the per-layer cat of the decoder's full prefill (layers < m) and C_base (layers ≥ m)."""
    m, k = 2, 1
    dec = _decoder(deep_base, m)
    pad = pad_token_id(deep_base.tokenizer)
    c_base, own, hand = _hand_built(deep_base, dec, prompts, m, k)
    ids, mask = prompt_prefixes(prompts, k, pad)
    with torch.no_grad():
        got = depth_cache(dec, c_base, ids, mask, m)
        keys, values = partial_prefill(dec, ids, mask, m)
    assert len(keys) == m  # only m layers ran
    for a, b in zip(got.keys + got.values, hand.keys + hand.values):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    tails, tail_ids, tail_mask = _tails(prompts, k, pad)
    with torch.no_grad():
        x = decoder_forward(dec, got, tail_ids, tail_mask)
        y = decoder_forward(dec, hand, tail_ids, tail_mask)
    assert close(x[tail_mask.bool()], y[tail_mask.bool()])
    # the rule itself: mix_layers picks the own layers given, C_base's elsewhere
    mixed = mix_layers(c_base, own.keys, own.values, [0, 3])
    assert [t is o for t, o in zip(mixed.keys, own.keys)] == [True, False, False, True]
    assert mix_layers(c_base, own.keys, own.values, []) is c_base


def test_depth_zero_is_prefillshare_bit_for_bit(deep_base, prompts):
    dec = _decoder(deep_base, 0)
    pad = pad_token_id(deep_base.tokenizer)
    c_base = compute_base_cache(deep_base, prompts)
    ids, mask = prompt_prefixes(prompts, 1, pad)
    assert depth_cache(dec, c_base, ids, mask, 0) is c_base
    plain = ccft.generate(prompts, mode="prefillshare", decoder=dec, cache=c_base, max_new_tokens=6)
    zero = ccft.generate(
        prompts, mode="prefillshare", decoder=dec, cache=c_base, max_new_tokens=6, share_from_layer=0
    )
    assert [g.token_ids for g in zero] == [g.token_ids for g in plain]


def test_depth_L_equals_the_decoders_own_prefill(deep_base, prompts):
    """m = L: every layer is the decoder's own prefill — Full-FT's forward, within fp32 rounding."""
    dec = _decoder(deep_base, L)
    pad = pad_token_id(deep_base.tokenizer)
    c_base = compute_base_cache(deep_base, prompts)
    ids, mask = prompt_prefixes(prompts, 1, pad)
    tails, tail_ids, tail_mask = _tails(prompts, 1, pad)
    with torch.no_grad():
        got = decoder_forward(dec, depth_cache(dec, c_base, ids, mask, L), tail_ids, tail_mask)
        own = full_forward(dec, ids, mask, tail_ids, tail_mask)
    real = tail_mask.bool()
    assert close(got[real], own[real])
    # generation at m = L equals the full-ft mode (the decoder prefilling its own prompt): same greedy tokens
    dec.method = "ccft"
    at_l = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=6)
    dec.method = "full-ft"
    own_gen = ccft.generate(prompts, mode="full-ft", decoder=dec, max_new_tokens=6)
    assert [g.token_ids for g in at_l] == [g.token_ids for g in own_gen]


@pytest.mark.parametrize("mode", ["prefillshare", "naive"])
def test_generate_at_depth_equals_decoding_on_the_hand_built_cache(deep_base, prompts, mode):
    m, k = 2, 1
    method = "ccft" if mode == "prefillshare" else "full-ft"
    dec = _decoder(deep_base, m if mode == "prefillshare" else 0, method=method)
    kw = {} if mode == "prefillshare" else {"share_from_layer": m}  # naive: the depth is the caller's
    got = ccft.generate(prompts, mode=mode, decoder=dec, max_new_tokens=8, batch_size=2, **kw)
    _, _, hand = _hand_built(deep_base, dec, prompts, m, k)
    want = decode_on_cache(dec.activate(), deep_base.tokenizer, hand, max_new_tokens=8)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    flat = ccft.generate(prompts, mode=mode, decoder=dec, max_new_tokens=8, share_from_layer=0)
    assert [g.token_ids for g in flat] != [g.token_ids for g in got]  # the depth changes the outputs


def test_depth_errors_name_the_key_and_the_fix(deep_base, prompts):
    with pytest.raises(ConfigError, match=r"share_from_layer=5: it must be in 0\.\.4"):
        ccft.make_decoder(deep_base, "lora", method="ccft", share_from_layer=5)
    dec = _decoder(deep_base, 2)
    c_base = compute_base_cache(deep_base, prompts)
    tails, tail_ids, tail_mask = _tails(prompts, 1, pad_token_id(deep_base.tokenizer))
    # plain C_base would run a depth-2 decoder at depth 0: refused, not silently wrong
    with pytest.raises(ConfigError, match="share_from_layer=2.*depth_cache"):
        decoder_forward(dec, c_base, tail_ids, tail_mask)
    with pytest.raises(ConfigError, match="share_from_layer=-1"):
        ccft.generate(prompts, mode="prefillshare", decoder=dec, share_from_layer=-1, max_new_tokens=2)
    dec.method = "full-ft"
    with pytest.raises(ConfigError, match="applies to the modes that read C_base"):
        ccft.generate(prompts, mode="full-ft", decoder=dec, share_from_layer=2, max_new_tokens=2)
    other, _ = left_pad([p[:-1] for p in prompts[:2]], 0)
    with pytest.raises(ConfigError, match="not those C_base"):
        depth_cache(dec, c_base, other, torch.ones_like(other), 2)


def test_decoder_roundtrip_restores_the_depth(deep_dir, prompts, tmp_path):
    base = ccft.load_base(str(deep_dir))
    dec = _decoder(base, 3)
    ccft.save_decoder(dec, tmp_path / "d")
    assert read_meta(tmp_path / "d")["share_from_layer"] == 3
    loaded = ccft.load_decoder(tmp_path / "d", base=ccft.load_base(str(deep_dir)))
    assert loaded.share_from_layer == 3
    a = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=5)
    b = ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=5)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
