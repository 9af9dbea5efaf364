"""The compact C_base (issue 35, item 3; ``ccft.core.compact``): int8 keys per channel and values per token.

Known answers on hand-made tensors (scales exact in bfloat16, ties included), the ``scale / 2`` error bound
per channel / token, byte counts (the SmolLM2-135M shape's real ratio), ``native`` = today bit for bit, and
generation on the compact cache against a hand-built reference (dequantise, then the native path) on a 4-layer
tiny Llama (fp32) with ragged real GSM8K prompts (left padding, K2).
"""

from __future__ import annotations

import json

import pytest
import torch

import ccft
from ccft.core.cache import BaseCache, compute_base_cache, prefill
from ccft.core.checkpoint import META_FILE, read_meta
from ccft.core.compact import (
    CompactCache,
    dequantize,
    kv_nbytes,
    quantize_keys,
    quantize_values,
    read_cache,
)
from ccft.core.decoder import decoder_forward
from ccft.core.depth import decoder_prefix
from ccft.core.errors import ConfigError
from ccft.core.generation import decode_on_cache
from ccft.core.tokens import pad_token_id, right_pad
from conftest import DEEP_LAYERS, make_lora, ragged_prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = DEEP_LAYERS


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    return ragged_prompts(gsm8k_rows, tokenizer, 4, 9, 5)


def _decoder(base, fmt="native", m=0, method="ccft"):
    dec = make_lora(base, "d", seed=5, r=4, method=method)
    dec.cache_format, dec.share_from_layer = fmt, m
    return dec


def _hand_dequantised(c: BaseCache) -> BaseCache:
    """C_base quantised and dequantised layer by layer with the module's functions, not ``CompactCache``."""
    keys = tuple(dequantize(*quantize_keys(k)) for k in c.keys)
    values = tuple(dequantize(*quantize_values(v)) for v in c.values)
    return BaseCache.from_tensors(
        keys, values, c.attention_mask, c.tail_ids, c.handoff_tokens, c.fingerprint, c.producer
    )


def test_keys_per_channel_known_answer():
    # (b=1, h=1, p=3, d=3); channel scales 0.25 (31.75 = 127 · 0.25), 1 (all-zero channel), 2 (254 = 127 · 2)
    k = torch.tensor([[31.75, 0.0, -254.0], [-10.0, 0.0, 3.0], [0.1, 0.0, 1.0]]).view(1, 1, 3, 3)
    q, s = quantize_keys(k)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16
    assert s.shape == (1, 1, 1, 3) and s.flatten().tolist() == [0.25, 1.0, 2.0]
    # 3.0 / 2 = 1.5 and 1.0 / 2 = 0.5 are ties: round half to even
    assert q.view(3, 3).tolist() == [[127, 0, -127], [-40, 0, 2], [0, 0, 0]]
    back = dequantize(q, s)
    assert back.dtype == torch.float32
    assert back.view(3, 3).tolist() == [[31.75, 0.0, -254.0], [-10.0, 0.0, 4.0], [0.0, 0.0, 0.0]]
    # the tie is the bound's worst case: |x − x̂| = scale / 2 exactly (channel 2, token 1)
    assert (k - back).abs().max().item() == 1.0


def test_values_per_token_known_answer():
    # (b=1, h=1, p=2, d=3): token 0's scale 0.125 (15.875 = 127 · 0.125), token 1 all zero (scale 1)
    v = torch.tensor([[15.875, -1.0, 0.0625], [0.0, 0.0, 0.0]]).view(1, 1, 2, 3)
    q, s = quantize_values(v)
    assert s.shape == (1, 1, 2, 1) and s.flatten().tolist() == [0.125, 1.0]
    assert q.view(2, 3).tolist() == [[127, -8, 0], [0, 0, 0]]
    assert dequantize(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert dequantize(q, s).view(2, 3).tolist() == [[15.875, -1.0, 0.0], [0.0, 0.0, 0.0]]


def test_error_bound_per_channel_and_per_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g)
    x[:, :, :, 5] *= 100.0  # an outlier key channel (KIVI's case): it must not coarsen the other channels
    x[:, :, 7, :] *= 50.0  # an outlier token
    qk, sk = quantize_keys(x)
    qv, sv = quantize_values(x)
    ek = (x - dequantize(qk, sk)).abs()
    ev = (x - dequantize(qv, sv)).abs()
    tol = 1e-6
    assert bool((ek <= sk.float() / 2 * (1 + tol)).all()) and bool((ev <= sv.float() / 2 * (1 + tol)).all())
    # each scale is max |x| / 127 of its own channel / token, up to bfloat16's rounding (2^-9 relative)
    want_k = x.abs().amax(dim=-2, keepdim=True) / 127
    want_v = x.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.allclose(sk.float(), want_k, rtol=2**-8, atol=0)
    assert torch.allclose(sv.float(), want_v, rtol=2**-8, atol=0)
    # the outlier channel's step is ~100x the others': per channel, the others keep their own fine step
    others = [c for c in range(16) if c != 5]
    assert ek[..., others].max() < ek[..., 5].max() / 10
    # quantising a dequantised tensor gives the same codes back (reading a compact cache twice is harmless)
    again, s2 = quantize_keys(dequantize(qk, sk))
    assert torch.equal(again, qk) and torch.equal(s2, sk)


def test_compact_cache_of_c_base(deep_base, prompts):
    """Pad slots stay zero, C_base is not written, a row's codes do not depend on its batch (left padding),
    and the bytes equal the formula."""
    c = compute_base_cache(deep_base, prompts)
    snap = c.clone()
    cc = CompactCache.from_base(c)
    back = cc.dequantize()
    assert c.equal(snap)  # K1
    assert back.producer == c.producer and back.fingerprint == c.fingerprint and back.dtype == c.dtype
    pad = (c.attention_mask == 0)[:, None, :, None]
    for t in back.keys + back.values:
        assert bool((t.masked_select(pad) == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(back.keys, _hand_dequantised(c).keys))
    # row 0 (the shortest: most left padding) alone gives the same codes as in the batch
    alone = CompactCache.from_base(compute_base_cache(deep_base, prompts[:1]))
    p0 = alone.key_codes[0].shape[2]
    for a, b in zip(alone.key_codes + alone.value_codes, cc.key_codes + cc.value_codes):
        assert torch.equal(a[0], b[0, :, -p0:])
    for a, b in zip(alone.key_scales, cc.key_scales):
        assert torch.equal(a[0], b[0])
    b_, h, p, d = c.keys[0].shape
    native = sum(t.numel() * t.element_size() for t in c.keys + c.values)
    assert native == kv_nbytes("native", layers=L, kv_heads=h, head_dim=d, tokens=p, rows=b_)
    assert cc.nbytes == kv_nbytes("int8", layers=L, kv_heads=h, head_dim=d, tokens=p, rows=b_)
    assert cc.nbytes == 2 * L * b_ * h * p * d + 2 * L * b_ * h * (d + p)


def test_smollm2_135m_ratio(smol_dir):
    """The real ratio for SmolLM2-135M's shape (30 layers, 3 KV heads, head dim 64): 8-bit codes are exactly
    4x fewer bytes than fp32, and the scales take a little back, so the ratio is just under 4."""
    cfg = json.loads((smol_dir / "config.json").read_text())
    shape = dict(
        layers=cfg["num_hidden_layers"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    assert shape == dict(layers=30, kv_heads=3, head_dim=64)
    ratios = {
        p: kv_nbytes("native", tokens=p, **shape) / kv_nbytes("int8", tokens=p, **shape)
        for p in (128, 512, 2048)
    }
    # per token and layer: 384 B of codes + 6 B of value scales, + 384 B of key scales per row / p
    assert ratios[512] == pytest.approx(23592960 / 6001920)  # 3.931
    assert (
        3.90 < ratios[128] < ratios[512] < ratios[2048] < 4 * 384 / 390 < 4.0
    )  # the limit: codes + value scales
    assert kv_nbytes("native", tokens=512, dtype=torch.bfloat16, **shape) / kv_nbytes(
        "int8", tokens=512, **shape
    ) == pytest.approx(3.931 / 2, abs=1e-3)


def test_native_is_today_bit_for_bit(deep_base, prompts):
    c = compute_base_cache(deep_base, prompts)
    assert read_cache(c, "native") is c
    assert decoder_prefix(None, c, None, None) is c
    dec = _decoder(deep_base)
    plain = ccft.generate(prompts, mode="prefillshare", decoder=dec, cache=c, max_new_tokens=6)
    native = ccft.generate(
        prompts, mode="prefillshare", decoder=dec, cache=c, max_new_tokens=6, cache_format="native"
    )
    assert [g.token_ids for g in native] == [g.token_ids for g in plain]


def _tails(prompts, pad):
    tails = [list(p[-1:]) + [11, 12, 13][: 1 + i % 3] for i, p in enumerate(prompts)]
    ids, mask = right_pad(tails, pad)
    return ids, mask


def test_teacher_forced_logits_on_the_compact_cache(deep_base, prompts):
    """Logits on the compact C_base equal those on the hand-dequantised cache, differ from the native cache's
    a little (the quantisation shows), and stay close to them."""
    dec = _decoder(deep_base)
    c = compute_base_cache(deep_base, prompts)
    ids, mask = _tails(prompts, pad_token_id(deep_base.tokenizer))
    with torch.no_grad():
        got = decoder_forward(dec, read_cache(c, "int8"), ids, mask)
        hand = decoder_forward(dec, _hand_dequantised(c), ids, mask)
        native = decoder_forward(dec, c, ids, mask)
    real = mask.bool()
    assert torch.equal(got[real], hand[real])
    diff = (got - native)[real].abs().max().item()
    assert 0 < diff < 0.05 * native[real].abs().max().item()


@pytest.mark.parametrize("how", ["decoder", "option"])
def test_generate_on_the_compact_cache_equals_the_hand_built_reference(deep_base, prompts, how):
    """An int8-trained decoder (``how=decoder``) and a native one served on the compact cache (``option``)
    both decode on ``dequantise(quantise(C_base))``: the same tokens as decoding on it by hand, at batch 1
    and 4."""
    dec = _decoder(deep_base, "int8" if how == "decoder" else "native")
    kw = {} if how == "decoder" else {"cache_format": "int8"}
    c = compute_base_cache(deep_base, prompts)
    want = decode_on_cache(dec.activate(), deep_base.tokenizer, _hand_dequantised(c), max_new_tokens=8)
    for bs in (1, 4):
        got = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=8, batch_size=bs, **kw)
        assert [g.token_ids for g in got] == [g.token_ids for g in want], bs
    on_cache = ccft.generate(prompts, mode="prefillshare", decoder=dec, cache=c, max_new_tokens=8, **kw)
    assert [g.token_ids for g in on_cache] == [g.token_ids for g in want]
    # naive sharing reads the compact cache too when asked (a Full-FT decoder on C_base)
    dec.method = "full-ft"
    naive = ccft.generate(prompts, mode="naive", decoder=dec, max_new_tokens=8, cache_format="int8")
    assert [g.token_ids for g in naive] == [g.token_ids for g in want]


def test_compact_cache_at_depth_m(deep_base, prompts):
    """With ``share_from_layer`` m > 0 only C_base's layers m..L−1 are compact: the decoder's own layers are
    its own prefill (the hand-built hybrid of its own K/V and the dequantised C_base)."""
    m = 2
    dec = _decoder(deep_base, "int8", m)
    pad = pad_token_id(deep_base.tokenizer)
    c = compute_base_cache(deep_base, prompts)
    own = prefill(dec.activate(), prompts, handoff_tokens=1, pad_token_id=pad, producer="self")
    deq = _hand_dequantised(c)
    hand = BaseCache.from_tensors(
        own.keys[:m] + deq.keys[m:],
        own.values[:m] + deq.values[m:],
        c.attention_mask,
        c.tail_ids,
        1,
        c.fingerprint,
        "mixed",
    )
    want = decode_on_cache(dec.activate(), deep_base.tokenizer, hand, max_new_tokens=8)
    got = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=8, batch_size=2)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_cache_format_errors_name_the_field_and_the_fix(deep_base, prompts):
    with pytest.raises(ConfigError, match=r"cache_format='int4': use one of native, int8"):
        ccft.make_decoder(deep_base, "lora", method="ccft", cache_format="int4")
    dec = _decoder(deep_base)
    with pytest.raises(ConfigError, match=r"cache_format='fp8': use one of native, int8"):
        ccft.generate(prompts, mode="prefillshare", decoder=dec, cache_format="fp8", max_new_tokens=2)
    dec.method = "full-ft"
    with pytest.raises(ConfigError, match="cache_format='int8' applies to the modes that read C_base"):
        ccft.generate(prompts, mode="full-ft", decoder=dec, cache_format="int8", max_new_tokens=2)
    with pytest.raises(ConfigError, match="cache_format"):
        read_cache(compute_base_cache(deep_base, prompts), "fp32")


def test_decoder_roundtrip_restores_the_cache_format(deep_dir, prompts, tmp_path):
    base = ccft.load_base(str(deep_dir))
    dec = _decoder(base, "int8")
    ccft.save_decoder(dec, tmp_path / "d")
    assert read_meta(tmp_path / "d")["cache_format"] == "int8"
    loaded = ccft.load_decoder(tmp_path / "d", base=ccft.load_base(str(deep_dir)))
    assert loaded.cache_format == "int8"
    a = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=5)
    b = ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=5)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    # a folder written before the key: native; a damaged value: the file and the fix named
    meta = json.loads((tmp_path / "d" / META_FILE).read_text())
    meta.pop("cache_format")
    (tmp_path / "d" / META_FILE).write_text(json.dumps(meta))
    assert ccft.load_decoder(tmp_path / "d", base=ccft.load_base(str(deep_dir))).cache_format == "native"
    (tmp_path / "d" / META_FILE).write_text(json.dumps(dict(meta, cache_format="int3")))
    with pytest.raises(ConfigError, match=r"ccft\.json: cache_format='int3'.*damaged, save it again"):
        ccft.load_decoder(tmp_path / "d", base=ccft.load_base(str(deep_dir)))
