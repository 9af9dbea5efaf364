"""No read of unwritten memory across buffer growth (docs/design.md, fault class K3).

Every engine buffer is NaN-filled before use. While a request is active, its lane's tail pool
grows in slots and in capacity (a request with a long ``suffix_ids`` joins) and the prefix arena
grows (a large prefill): the active request's logits stay finite and equal those of the same
request decoded alone, in eager and static decode, for the base, a LoRA and a full-weight decoder.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from conftest import make_full, make_lora, make_tiny_folder

NAN = float("nan")
N_NEW = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(str(make_tiny_folder(tmp_path_factory.mktemp("growth"), tokenizer, seed=5)))
    full = make_full(base, 7)  # before any adapter is attached
    return base, {"math": make_lora(base, "math", 1, 4), "full": full}


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits_of(outs, rid, into):
    for o in outs:
        if o.request_id == rid:
            into.append(o.logits.clone())


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("name", ["base", "math", "full"])
def test_active_row_unaffected_by_buffer_growth(world, tokenizer, gsm8k_rows, decode, name):
    base, decs = world
    prompt = tokenize_prompt(tokenizer, gsm8k_rows[0]["prompt"], chat_template=False)[:24]
    forced = _ids(N_NEW, 0)

    ref_eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    ref: list[torch.Tensor] = []
    with ref_eng.prefill([prompt]) as h:
        rid = ref_eng.add_request(h, 0, decoder=name, forced_tokens=forced)
        while ref_eng.active:
            _logits_of(ref_eng.step(return_logits=True), rid, ref)

    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    lane = eng.decoders[name].lane
    got: list[torch.Tensor] = []
    h = eng.prefill([prompt])
    rid = eng.add_request(h, 0, decoder=name, forced_tokens=forced)
    for _ in range(2):
        _logits_of(eng.step(return_logits=True), rid, got)
    slots, cap, arena_cap = lane.pool.slots, lane.pool.capacity, eng.arena.capacity
    # the tail pool grows in slots and capacity: a request with a 100-token suffix joins the lane
    eng.add_request(h, 0, decoder=name, suffix_ids=_ids(100, 1), max_new_tokens=2)
    assert lane.pool.slots > slots and lane.pool.capacity > cap
    _logits_of(eng.step(return_logits=True), rid, got)
    # the prefix arena grows (8 prompts of 140 tokens > its 1024 initial slots); a row of it joins
    big = eng.prefill([_ids(140, 2 + i) for i in range(8)])
    assert eng.arena.capacity > arena_cap
    eng.add_request(big, 3, decoder=name, max_new_tokens=2)
    while eng.active:
        _logits_of(eng.step(return_logits=True), rid, got)
    big.release()
    h.release()

    assert len(got) == len(ref) == N_NEW
    got_t, ref_t = torch.stack(got), torch.stack(ref)
    assert torch.isfinite(got_t).all()
    torch.testing.assert_close(got_t, ref_t, atol=1e-5, rtol=0)
