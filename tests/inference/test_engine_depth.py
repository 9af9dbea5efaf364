"""SharedPrefillEngine serving decoders at sharing depth m (issue 35, item 2; ``handles.OwnPrefix``): the
decoder's own prompt K/V in layers 0..m-1 (a partial prefill with its weights, per producer, in the own-layer
arena) and C_base in m..L-1 — equal to the reference path (``ccft.generate`` / ``decoder_forward`` on
``ccft.core.depth.decoder_prefix``), eager and static, LoRA and full-weight decoders, handoff k = 1 and 2.

A 4-layer tiny Llama (``deep_dir``: lm_head ×20, clear greedy margins) so m = 1, 2 are proper middles and
m = 4 = L is the decoder's own prefill; every cache buffer NaN-filled (a read of unwritten memory shows).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ccft
from ccft.core.depth import decoder_prefix, prompt_prefixes
from ccft.core.errors import ConfigError
from ccft.core.tokens import pad_token_id, right_pad
from ccft.inference import SharedPrefillEngine
from conftest import DEEP_LAYERS, forced_step_logits, make_full, make_lora, ragged_prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = DEEP_LAYERS
N_NEW = 6
NAN = float("nan")


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Five real prompts of 6 .. 26 tokens: ragged prefixes, left padding."""
    return ragged_prompts(gsm8k_rows, tokenizer, 5, 6, 5)


def _world(deep_dir, m: int, handoff: int = 1):
    """A base with a LoRA decoder and a full-weight decoder at depth m and a LoRA decoder at depth 0."""
    base = ccft.load_base(str(deep_dir))
    full = make_full(base, 7, handoff)  # before any adapter is attached: a copy of the plain base
    full.share_from_layer = m
    deep = make_lora(base, "deep", 1, 4, handoff)
    deep.share_from_layer = m
    flat = make_lora(base, "flat", 2, 2, handoff, ["q_proj", "v_proj", "down_proj"])
    return base, {"deep": deep, "full": full, "flat": flat}


def _reference(dec, prompts, n=N_NEW):
    return [g.token_ids for g in ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=n)]


def _drain(eng):
    done = {}
    while eng.active:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.generation.token_ids
    return done


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("m", [1, 2, L])
def test_greedy_at_depth_equals_reference(deep_dir, prompts, decode, m):
    """Each decoder alone, then every decoder's rows in one step (a lane mixing depths m and 0)."""
    base, decs = _world(deep_dir, m)
    refs = {name: _reference(dec, prompts) for name, dec in decs.items()}
    # the test can fail: the depth decoders read at depth 0 decode other tokens on some prompt
    decs["deep"].share_from_layer = 0
    assert _reference(decs["deep"], prompts) != refs["deep"]
    decs["deep"].share_from_layer = m
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    assert eng.own_arena.num_layers == m
    with eng.prefill(prompts) as h:
        snap = h.snapshot()
        for name in decs:
            assert [g.token_ids for g in eng.generate(h, decoder=name, max_new_tokens=N_NEW)] == refs[name]
        used = eng.own_arena.used_tokens  # one own region per depth decoder, kept beside the handle
        assert used == 2 * len(prompts) * h.width
        rid = {
            (name, i): eng.add_request(h, i, decoder=name, max_new_tokens=N_NEW)
            for i in range(len(prompts))
            for name in decs
        }
        out = _drain(eng)
        assert eng.own_arena.used_tokens == used  # reused, not computed again
        for (name, i), r in rid.items():
            assert out[r] == refs[name][i], (name, i)
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # C_base read only
    assert eng.arena.used_tokens == 0 and eng.own_arena.used_tokens == 0  # freed with the handle


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("handoff", [1, 2])
def test_step_and_teacher_forced_logits_at_depth(deep_dir, prompts, decode, handoff):
    """Forced tokens: every step's logits and ``tail_logits`` == ``decoder_forward`` on the hybrid prefix."""
    m = 2
    base, decs = _world(deep_dir, m, handoff)
    pad = pad_token_id(base.tokenizer)
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=handoff)
    ids, mask = prompt_prefixes(prompts, handoff, pad)
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN, max_batch=32)
    h = eng.prefill(prompts)
    forced, rid, steps = forced_step_logits(eng, h, decs, len(prompts), N_NEW)
    tails = [cache.tail_ids[i].tolist() + forced[i] for i in range(len(prompts))]
    tail_ids, tail_mask = right_pad(tails, pad)
    for n, dec in decs.items():
        with torch.no_grad():
            prefix = decoder_prefix(dec, cache, ids, mask, share_from_layer=dec.share_from_layer)
            ref = ccft.decoder_forward(dec, prefix, tail_ids, tail_mask)
        scale = ref.abs().max().item()
        tl = eng.tail_logits(h, range(len(prompts)), tail_ids, tail_mask, decoder=n)
        assert (tl - ref)[tail_mask.bool()].abs().max().item() <= 1e-5 * scale, n
        for i in range(len(prompts)):
            got = torch.stack([s[rid[n, i]] for s in steps])
            want = ref[i, handoff - 1 : handoff - 1 + N_NEW]
            assert (got - want).abs().max().item() <= 1e-5 * scale, (n, i)
    h.release()


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_suffix_at_depth_equals_whole_prompt(deep_dir, prompts, decode):
    """``suffix_ids``: the decoder's own K/V of the suffix below m, the base's above, == the whole prompt."""
    base, decs = _world(deep_dir, 2, handoff=2)
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    shared, suffix = prompts[2], prompts[4][:7]
    g = torch.Generator().manual_seed(1)
    forced = torch.randint(3, 200, (N_NEW,), generator=g).tolist()

    def logits(handle, **kw):
        rid = eng.add_request(handle, 0, decoder=name, forced_tokens=forced, **kw)
        got = []
        while eng.active:
            got += [o.logits.clone() for o in eng.step(return_logits=True) if o.request_id == rid]
        return torch.stack(got)

    with eng.prefill([shared]) as h, eng.prefill([shared + suffix]) as whole:
        for name in ("deep", "full"):
            got, want = logits(h, suffix_ids=suffix), logits(whole)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), name


def test_depth_zero_is_unchanged_bit_for_bit(deep_dir, prompts):
    """The step logits of a depth-0 decoder's rows are the same bits whether the decoders beside it in the
    lane (same adapters, same batch) run at depth 0 or 2: its rows never read the own-layer arena."""
    forced = [5, 9, 11, 13]

    def run(m):
        base, decs = _world(deep_dir, m)
        eng = SharedPrefillEngine(base, decoders=decs, decode="static", fill=NAN)
        with eng.prefill(prompts) as h:
            rids = [
                eng.add_request(h, i, decoder=n, forced_tokens=forced)
                for i in range(len(prompts))
                for n in ("flat", "deep")
            ]
            out = []
            while eng.active:
                out.append({o.request_id: o.logits.clone() for o in eng.step(return_logits=True)})
        logits = [torch.stack([s[r] for s in out]) for r in rids]
        return logits[0::2], logits[1::2], eng

    flat0, deep0, eng0 = run(0)
    flat2, deep2, eng2 = run(2)
    assert eng0.own_arena.num_layers == 0 and eng2.own_arena.num_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(flat0, flat2, strict=True))
    assert not any(torch.allclose(a, b) for a, b in zip(deep0, deep2, strict=True))  # depth 2 shows


def test_clear_errors_at_depth(deep_dir, prompts, tmp_path):
    base, decs = _world(deep_dir, 2)
    eng = SharedPrefillEngine(base, decoders=decs, fill=NAN)
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=1)
    with eng.prefill_cache(cache) as h:  # no prompt ids: no partial prefill
        with pytest.raises(ConfigError, match="share_from_layer=2.*prefill the prompts with engine.prefill"):
            eng.add_request(h, 0, decoder="deep")
        eng.generate(h, decoder="flat", max_new_tokens=2)  # depth 0 reads an imported C_base as before
    # a reload from a folder of another depth: refused before anything changes
    folder = Path(ccft.save_decoder(decs["deep"], tmp_path / "deep"))
    meta = json.loads((folder / "ccft.json").read_text())
    assert meta["share_from_layer"] == 2
    eng.reload_decoder("deep", folder)  # the same depth: accepted
    (folder / "ccft.json").write_text(json.dumps(dict(meta, share_from_layer=1)))
    with pytest.raises(ConfigError, match="'share_from_layer' is 1 but the served decoder has 2"):
        eng.reload_decoder("deep", folder)
