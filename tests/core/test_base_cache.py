"""C_base: invariant 1 (docs/design.md, "Invariants") and fault kinds K2 (positions/masks), K3 (numerics), K1
(mutation).

Reference path everywhere: a plain, unpadded forward of the base over ``prompt + response`` for
one row at a time (default positions 0..n+r-1, no cache, no mask). Tolerance: 1e-5 in fp32.
"""

from __future__ import annotations

import io

import pytest
import torch

import ccft
from ccft.core.cache import BaseCache, prefill
from ccft.core.tokens import right_pad, tokenize_response

TOL = 1e-5

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Add 2 and 3.",
    "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting.",
]
RESPONSES = [
    "In May she sold 48/2 = 24 clips.\n#### 72",
    " 5",
    "She earned 12/60*50 = $10.",
]
# Extra rows that only exist in the "bigger batch" a cache is selected from (one is longer than all).
EXTRA_PROMPTS = [
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as "
    "her parents.",
    "Hi there, robot.",
]


def _rows(tokenizer, shape: str):
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    responses = [tokenize_response(tokenizer, r) for r in RESPONSES]
    if shape == "single":
        return prompts[:1], responses[:1]
    lengths = [len(p) for p in prompts]
    assert len(set(lengths)) == 3, "the batch must mix three different prompt lengths"
    return prompts, responses


@torch.no_grad()
def _reference(model, prompts, responses, k):
    """Per row: logits of a plain unpadded full forward over prompt+response, at the tail positions."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        logits = model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0]
        out.append(logits[len(p) - k :])  # (k + len(r), v)
    return out


def _tails(prompts, responses, k, pad_id):
    tails = [list(p[-k:]) + list(r) for p, r in zip(prompts, responses, strict=True)]
    return tails, *right_pad(tails, pad_id)


def _max_diff(logits, refs, tails):
    diffs = [(logits[i, : len(t)] - refs[i]).abs().max().item() for i, t in enumerate(tails)]
    return max(diffs)


class _PositionSpy:
    """Records the ``position_ids`` the inner LlamaModel is called with."""

    def __init__(self, llama_for_causal_lm):
        self.calls = []
        self.handle = llama_for_causal_lm.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls.append(kwargs.get("position_ids").detach().clone())

    def close(self):
        self.handle.remove()


CASES = [
    (shape, k, dec) for shape in ("mixed3", "single") for k in (1, 3) for dec in ("base", "lora-identity")
]


@pytest.mark.parametrize("shape,k,dec", CASES, ids=[f"{s}-k{k}-{d}" for s, k, d in CASES])
def test_invariant1_decoder_equals_base_full_forward(tiny_base, shape, k, dec):
    """Invariant 1 / K2: decoder == base ⇒ logits on C_base == unpadded full forward, per row, ≤ 1e-5."""
    tok = tiny_base.tokenizer
    prompts, responses = _rows(tok, shape)
    refs = _reference(tiny_base.model, prompts, responses, k)  # before any adapter is attached
    if dec == "base":
        model = tiny_base.model
    else:
        decoder = ccft.make_decoder(tiny_base, "lora")  # PEFT default init: B = 0, the identity
        model = decoder.model
    cache = ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=k)
    tails, tail_ids, tail_mask = _tails(prompts, responses, k, tok.pad_token_id)

    # C_base layout: (b, h, max(n) - k, d), left padded, lengths = n - k, tail = the last k prompt tokens
    cfg = tiny_base.config
    assert cache.num_layers == cfg.num_hidden_layers
    assert tuple(cache.keys[0].shape) == (
        len(prompts),
        cfg.num_key_value_heads,
        max(map(len, prompts)) - k,
        cfg.head_dim,
    )
    assert cache.lengths.tolist() == [len(p) - k for p in prompts]
    assert cache.tail_ids.tolist() == [list(p[-k:]) for p in prompts]

    spy = _PositionSpy(tiny_base.model)
    try:
        with torch.no_grad():
            logits = ccft.decoder_forward(model, cache, tail_ids, tail_mask)
    finally:
        spy.close()
    assert logits.shape == (len(prompts), tail_ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()
    diff = _max_diff(logits, refs, tails)
    print(f"\n[invariant 1] {shape} k={k} decoder={dec}: max |logit diff| = {diff:.3e}")
    assert diff <= TOL

    # K2: the first decoder position of each row is its real prompt length minus k (per row, not shared)
    (positions,) = spy.calls
    for i, p in enumerate(prompts):
        assert positions[i, 0].item() == len(p) - k
        assert positions[i, : len(tails[i])].tolist() == list(range(len(p) - k, len(p) - k + len(tails[i])))


def test_cache_copied_from_elsewhere_gives_same_logits(tiny_base, tmp_path):
    """K2: clone(), select() of a bigger batch (any row order), and a cache rebuilt from saved tensors."""
    tok = tiny_base.tokenizer
    k = 2
    prompts, responses = _rows(tok, "mixed3")
    extra = [tok(p, add_special_tokens=False)["input_ids"] for p in EXTRA_PROMPTS]
    refs = _reference(tiny_base.model, prompts, responses, k)
    tails, tail_ids, tail_mask = _tails(prompts, responses, k, tok.pad_token_id)

    # a bigger batch, rows shuffled, one row longer than every selected row (more left padding)
    big_prompts = [extra[0], prompts[2], extra[1], prompts[0], prompts[1]]
    assert len(extra[0]) > max(map(len, prompts))
    big = ccft.compute_base_cache(tiny_base, big_prompts, handoff_tokens=k)
    selected = big.select([3, 4, 1])
    assert selected.keys[0].shape[2] == max(map(len, prompts)) - k  # padding trimmed to the kept rows
    assert selected.lengths.tolist() == [len(p) - k for p in prompts]

    own = ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=k)
    cloned = own.clone()
    assert cloned.equal(own) and all(
        a.data_ptr() != b.data_ptr() for a, b in zip(cloned.keys, own.keys, strict=True)
    )

    # rebuilt from tensors that went through torch.save/torch.load (a cache stored elsewhere)
    buf = io.BytesIO()
    torch.save({"k": own.keys, "v": own.values, "m": own.attention_mask, "t": own.tail_ids}, buf)
    buf.seek(0)
    blob = torch.load(buf)
    rebuilt = BaseCache(tuple(blob["k"]), tuple(blob["v"]), blob["m"], blob["t"], k, own.fingerprint)

    with torch.no_grad():
        for name, cache in (("own", own), ("clone", cloned), ("select", selected), ("rebuilt", rebuilt)):
            logits = ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)
            diff = _max_diff(logits, refs, tails)
            print(f"\n[invariant 1] copied cache via {name}: max |logit diff| = {diff:.3e}")
            assert diff <= TOL, name
    assert big.select([3, 4, 1]).equal(selected)  # select is a pure function of the big cache


def test_pad_slots_zero_and_finite(tiny_base):
    """K3: pad slots of C_base are exactly zero, every K/V is finite, and logits are finite everywhere."""
    tok = tiny_base.tokenizer
    prompts, responses = _rows(tok, "mixed3")
    cache = ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=1)
    pad = cache.attention_mask == 0
    assert pad.any(), "the batch must have left padding"
    for t in cache.keys + cache.values:
        assert torch.isfinite(t).all()
        assert (t.permute(0, 2, 1, 3)[pad] == 0).all()
        assert (t.permute(0, 2, 1, 3)[~pad].abs().sum(-1) > 0).all()  # real slots are written
    _, tail_ids, tail_mask = _tails(prompts, responses, 1, tok.pad_token_id)
    with torch.no_grad():
        logits = ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)
    assert torch.isfinite(logits).all()  # including the right-padded tail positions


def test_nan_in_unwritten_pad_slots_never_reaches_logits(tiny_base):
    """K3: poison the pad slots of the last layer's K/V with NaN (stand-in for unwritten memory).

    The real slots stay clean (K/V of a real position only depend on that position's hidden state),
    so C_base must come out finite with zero pad slots, and the decoder's logits must be finite and
    still equal the unpadded reference.
    """
    tok = tiny_base.tokenizer
    k = 1
    prompts, responses = _rows(tok, "mixed3")
    refs = _reference(tiny_base.model, prompts, responses, k)
    prefix_lengths = torch.tensor([len(p) - k for p in prompts])
    width = int(prefix_lengths.max())
    pad = torch.arange(width)[None, :] < (width - prefix_lengths)[:, None]  # (b, p) left padding

    def poison(module, args, out):
        out = out.clone()
        out[pad] = float("nan")
        return out

    attn = tiny_base.model.model.layers[-1].self_attn
    handles = [attn.k_proj.register_forward_hook(poison), attn.v_proj.register_forward_hook(poison)]
    try:
        cache = prefill(
            tiny_base.model,
            prompts,
            handoff_tokens=k,
            pad_token_id=tok.pad_token_id,
            fingerprint=tiny_base.fingerprint,
        )
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(cache.attention_mask == 0, pad)
    for t in cache.keys + cache.values:
        assert torch.isfinite(t).all(), "NaN in a pad slot survived into C_base"
    tails, tail_ids, tail_mask = _tails(prompts, responses, k, tok.pad_token_id)
    with torch.no_grad():
        logits = ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)
    assert torch.isfinite(logits).all()
    assert _max_diff(logits, refs, tails) <= TOL


@pytest.mark.parametrize("which", ["keys", "values"])
def test_check_unmodified_raises_after_inplace_write(tiny_base, which):
    """Invariant 2: an in-place write to a C_base tensor is detected by every reader."""
    tok = tiny_base.tokenizer
    prompts, responses = _rows(tok, "mixed3")
    cache = ccft.compute_base_cache(tiny_base, prompts)
    _, tail_ids, tail_mask = _tails(prompts, responses, 1, tok.pad_token_id)
    with torch.no_grad():
        ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)  # reading does not mutate
    cache.check_unmodified()

    getattr(cache, which)[1][0, 0, -1, 0] += 1.0
    with pytest.raises(ccft.CacheMutatedError, match="modified in place"):
        cache.check_unmodified()
    with pytest.raises(ccft.CacheMutatedError):
        ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)
    with pytest.raises(ccft.CacheMutatedError):
        cache.as_dynamic_cache()


def test_compute_base_cache_rejects_short_prompt(tiny_base):
    with pytest.raises(ValueError, match="handoff_tokens"):
        ccft.compute_base_cache(tiny_base, [[5, 6, 7], [8, 9]], handoff_tokens=2)
