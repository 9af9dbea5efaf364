"""The scheduler with decoders at sharing depth m and on the compact C_base (issue 35, items 2 and 3): outputs
equal the reference path, and the KV ledger counts what the engine keeps for them (a depth-m decoder's own
K/V in m of the L layers beside the context; a context read only on the compact C_base held as its int8
codes and scales) at known byte counts."""

from __future__ import annotations

import pytest

import ccft
from ccft.core.compact import kv_nbytes
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving import PrefixKVStore
from ccft.serving.scheduler import Scheduler, ServeRequest
from conftest import DEEP_LAYERS, make_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N_NEW = 5
SHARED = 24
L = DEEP_LAYERS


@pytest.fixture(scope="module")
def texts(gsm8k_rows, tokenizer):
    return [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:8]]


@pytest.mark.parametrize("chunk", [None, 16])
def test_depth_and_int8_agents_on_one_context(deep_dir, texts, chunk):
    """Whole prefills (peak bytes known) and chunked ones with a prefix store (a context is compacted when its
    last piece is done; while it is prefilled its native bytes are reserved)."""
    base = ccft.load_base(str(deep_dir))
    deep = make_lora(base, "deep", 21, 4)
    deep.share_from_layer = 2
    flat = make_lora(base, "flat", 22, 4)
    eng = SharedPrefillEngine(base, decoders={"deep": deep, "flat": flat}, fill=float("nan"))
    eng.add_decoder("compact", flat, cache_format="int8")  # the native decoder served on the compact C_base
    ctx = texts[0][:SHARED]
    unique = {"flat": 3, "deep": 5, "compact": 7}
    reqs = [
        ServeRequest(a, ctx + texts[4 + j][:u], shared_len=SHARED, max_new_tokens=N_NEW)
        for j, (a, u) in enumerate(unique.items())
    ]
    store = PrefixKVStore(block_tokens=8) if chunk else None
    sched = Scheduler(eng, share=True, store=store, prefill_chunk_tokens=chunk)
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * 3
    want = [
        ccft.generate([list(r.prompt_ids)], mode="prefillshare", decoder=d, max_new_tokens=N_NEW, **kw)[0]
        for r, d, kw in zip(reqs, (flat, deep, flat), ({}, {}, {"cache_format": "int8"}), strict=True)
    ]
    assert [t.result.token_ids for t in tickets] == [g.token_ids for g in want]
    # flat and deep read one context of SHARED - 1 prefix tokens, deep adds its own K/V in 2 of the 4 layers;
    # compact takes its whole prompt as its context (an int8 cache cannot be extended by a suffix), held only
    # as its int8 codes and scales (kv_nbytes; the native handle is released once they are made)
    bpt = sched.bytes_per_token
    prefix, compact_prefix = SHARED - 1, SHARED + unique["compact"] - 1
    tails = (unique["flat"] + 1 + N_NEW) + (unique["deep"] + 1 + N_NEW) + (1 + N_NEW)
    a = eng.code_arena
    int8 = kv_nbytes("int8", layers=L, kv_heads=a.kv_heads, head_dim=a.head_dim, tokens=compact_prefix)
    assert 3.5 * int8 < compact_prefix * bpt  # the compact copy costs under a quarter of the native (fp32)
    want_peak = (prefix + tails) * bpt + prefix * 2 * bpt // L + int8
    if chunk is None:
        assert sched.peak_live_bytes == want_peak
    else:  # the compact context's native bytes were reserved while it was prefilled in pieces
        assert sched.peak_live_bytes > want_peak
    assert sched.counters["prefills"] == 2
    assert sched.live_bytes == 0 and eng.arena.used_tokens == 0 and eng.own_arena.used_tokens == 0
    assert eng.code_arena.used_tokens == 0 and eng.kscale_arena.used_tokens == 0
    assert eng.own_arena.nbytes // eng.own_arena.capacity == 2 * bpt // L  # 2 layers of K and V per slot
