"""``add_request(suffix_ids=...)``: a request's own prompt tokens after a shared prefix, computed by the
base into the request's tail, equal prefilling the whole prompt (teacher-forced logits and greedy)."""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from conftest import make_full as _full
from conftest import make_lora as _lora
from conftest import make_tiny_folder

N_NEW = 6


def _world(tmp_path, tokenizer, scale, handoff):
    base = ccft.load_base(str(make_tiny_folder(tmp_path, tokenizer, seed=3 + handoff, scale=scale)))
    full = _full(base, 7, handoff=handoff)  # before any adapter is attached: a copy of the plain base
    return base, {"math": _lora(base, "math", 1, 4, handoff=handoff), "full": full}


def _prompts(gsm8k_rows, tokenizer):
    ids = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:4]]
    return ids[0][:20], [ids[1 + j][:n] for j, n in enumerate((1, 3, 9))]


def _run(eng, rid, logits=False):
    got, gen = [], None
    while eng.active:
        for o in eng.step(return_logits=logits):
            if o.request_id == rid:
                if logits:
                    got.append(o.logits.clone())
                if o.finished:
                    gen = o.generation
    return got, gen


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("handoff", [1, 2])
def test_suffix_logits_equal_whole_prompt(tmp_path, tokenizer, gsm8k_rows, decode, handoff):
    base, decs = _world(tmp_path, tokenizer, 1.0, handoff)
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    h = eng.prefill([shared], handoff_tokens=handoff)
    snap = h.snapshot()
    forced = torch.randint(3, 200, (N_NEW,), generator=torch.Generator().manual_seed(0)).tolist()
    for name in ("base", "math", "full"):
        for suf in suffixes:
            got, _ = _run(
                eng, eng.add_request(h, 0, decoder=name, suffix_ids=suf, forced_tokens=forced), True
            )
            with eng.prefill([shared + suf], handoff_tokens=handoff) as whole:
                ref, _ = _run(eng, eng.add_request(whole, 0, decoder=name, forced_tokens=forced), True)
            assert len(got) == N_NEW
            torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # K1
    h.release()
    assert eng.arena.used_tokens == 0


@pytest.mark.parametrize("handoff", [1, 2])
def test_suffix_greedy_equals_reference(tmp_path, tokenizer, gsm8k_rows, handoff):
    base, decs = _world(tmp_path, tokenizer, 30.0, handoff)
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    with eng.prefill([shared], handoff_tokens=handoff) as h:
        for name in ("base", "math", "full"):
            for suf in suffixes:
                _, gen = _run(eng, eng.add_request(h, 0, decoder=name, suffix_ids=suf, max_new_tokens=N_NEW))
                mode, dec = ("base", None) if name == "base" else ("prefillshare", decs[name])
                want = ccft.generate([shared + suf], mode=mode, base=base, decoder=dec, max_new_tokens=N_NEW)[
                    0
                ]
                assert gen.token_ids == want.token_ids, (name, len(suf))
