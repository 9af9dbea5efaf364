"""Chunked prefill (issue #15 item 1): a prefill done in pieces writes the same K/V as a one-shot prefill,
and the scheduler interleaves the pieces of a 1k+-token context with the decode steps of running requests
(a running decode gets a token at every step a piece is computed; piece boundaries on store blocks)
while every request's greedy tokens stay equal to offline ``ccft.generate``."""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving import PrefixKVStore
from ccft.serving.scheduler import PromptTooLongError, Scheduler, ServeRequest
from conftest import make_lora, make_tiny_folder

BLOCK = 16


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("chunk"), tokenizer, seed=5, scale=30.0))
    )
    full = ccft.make_decoder(base, "full", method="ccft")
    full.model.eval()
    return base, {
        "full": full,
        **{name: make_lora(base, name, 30 + i, 4) for i, name in enumerate(("math", "code"))},
    }


@pytest.fixture(scope="module")
def long_ids(gsm8k_rows, tokenizer):
    """1200 real tokens: GSM8K questions one after the other."""
    ids: list[int] = []
    for r in gsm8k_rows:
        ids += tokenize_prompt(tokenizer, r["prompt"], chat_template=False)
        if len(ids) >= 1200:
            return ids[:1200]
    raise AssertionError("not enough GSM8K text")


def _reference(world, r, share=True):
    """Offline ``ccft.generate`` (shared prefill: mode prefillshare). The no-share baseline (a decoder
    prefills its own prompt) has no offline mode for a ccft decoder: there, a fresh engine's one-shot prefill
    with the decoder's weights and its ``generate`` (as tests/serving/test_scheduler.py does)."""
    base, decs = world
    if not share and r.decoder != "base":
        fresh = SharedPrefillEngine(base, decoders=decs)
        with fresh.prefill([list(r.prompt_ids)], producer=r.decoder) as h:
            return fresh.generate(h, decoder=r.decoder, max_new_tokens=r.max_new_tokens)[0]
    if r.decoder == "base":
        return ccft.generate([list(r.prompt_ids)], mode="base", base=base, max_new_tokens=r.max_new_tokens)[0]
    return ccft.generate(
        [list(r.prompt_ids)], mode="prefillshare", decoder=decs[r.decoder], max_new_tokens=r.max_new_tokens
    )[0]


@pytest.mark.parametrize("producer", [None, "math"])
def test_prefill_in_pieces_equals_one_shot(world, long_ids, producer):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    prompt = long_ids[:1101]
    with eng.prefill([prompt], producer=producer) as ref:
        want = ref.snapshot()
    job = eng.begin_prefill(prompt, producer=producer)
    assert job.hit == 0 and job.total == job.remaining == 1100
    sizes = []
    while job.remaining:
        sizes.append(job.advance(96))
        eng.prefill([long_ids[:40]]).release()  # other allocations between pieces (the arena may move)
    assert sizes == [96] * 11 + [44]
    handle, hit = job.finish()
    got = handle.snapshot()
    assert hit == 0 and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    handle.release()
    with pytest.raises(ConfigError, match="finished or cancelled"):
        job.advance(1)
    assert eng.arena.used_tokens == 0


def test_pieces_on_top_of_the_store_equal_one_shot(world, long_ids):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    store = PrefixKVStore(block_tokens=BLOCK)
    first, _ = eng.prefill_cached(long_ids[:501], store)  # 500 positions: 31 full blocks in the store
    first.release()
    prompt = long_ids[:1101]
    job = eng.begin_prefill(prompt, store)
    assert job.hit == 31 * BLOCK and job.remaining == 1100 - 31 * BLOCK
    while job.remaining:
        job.advance(4 * BLOCK)
    handle, hit = job.finish()
    with eng.prefill([prompt]) as ref:
        for a, b in zip(handle.snapshot(), ref.snapshot(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert hit == 31 * BLOCK
    assert store.match(eng.producer_key(), base.dtype, prompt[:-1])  # the new full blocks were inserted
    handle.release()
    cancelled = eng.begin_prefill(prompt, store)
    cancelled.advance(BLOCK)
    cancelled.cancel()  # references dropped, region freed
    assert eng.arena.used_tokens == 0


@pytest.mark.parametrize("share", [True, False])
def test_long_prefill_mid_decode_is_interleaved_and_outputs_equal(world, long_ids, texts_short, share):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    budget = 128
    sched = Scheduler(eng, share=share, store=PrefixKVStore(block_tokens=BLOCK), prefill_chunk_tokens=budget)
    early = [ServeRequest(d, texts_short[i], max_new_tokens=48) for i, d in enumerate(("code", "base"))]
    ctx = long_ids[:1100]
    late = [
        ServeRequest(d, ctx + texts_short[2 + i][: 5 + i], shared_len=len(ctx), max_new_tokens=6)
        for i, d in enumerate(("math", "full", "base"))
    ]
    tickets = [sched.submit(r) for r in early]
    sched.step()
    sched.step()
    assert [len(t.tokens) for t in tickets] == [2, 2]
    tickets += [sched.submit(r) for r in late]
    chunk_steps = 0
    expected_contexts = 1 if share else 3
    while True:
        before = [len(t.tokens) for t in tickets[:2]]
        chunks = sched.counters["prefill_chunks"]
        sched.step()
        pending = sched.prefill_progress()
        if sched.counters["prefill_chunks"] == chunks:
            break
        chunk_steps += 1
        # the running decodes got their token in the same step as the piece
        assert [len(t.tokens) for t in tickets[:2]] == [b + 1 for b in before]
        for computed, _total in pending:  # piece boundaries on store blocks
            assert computed % BLOCK == 0
        if not pending and all(t.state not in ("queued", "prefilling") for t in tickets[2:]):
            break
    # 1099 positions per context, in pieces of (128 - decode rows) rounded down to blocks, at least one block
    assert chunk_steps >= 1099 * expected_contexts // budget
    assert (
        sched.counters["prefills"] == 2 + expected_contexts
    )  # the two early requests, then the long context(s)
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * 5
    for t in tickets:
        assert t.tokens == list(_reference(world, t.request, share).token_ids), t.request.decoder
    assert sched.live_bytes == 0 and eng.active == 0 and eng.arena.used_tokens == 0


def test_budget_below_decode_rows_still_progresses_one_block(world, long_ids, texts_short):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    sched = Scheduler(eng, store=PrefixKVStore(block_tokens=BLOCK), prefill_chunk_tokens=1)
    runner = sched.submit(ServeRequest("math", texts_short[0], max_new_tokens=40))
    sched.step()
    sched.step()  # 29 context positions: two one-block pieces (budget 1 < one block)
    assert runner.state == "running" and len(runner.tokens) == 1
    long = sched.submit(
        ServeRequest("code", long_ids[:200] + texts_short[1][:4], shared_len=200, max_new_tokens=3)
    )
    steps = 0
    while long.state != "running":
        sched.step()
        steps += 1
    assert steps == -(-199 // BLOCK)  # one block per step: 199 positions
    sched.run_until_idle()
    for t in (runner, long):
        assert t.tokens == list(_reference(world, t.request).token_ids)


def test_cancel_while_its_context_is_prefilled(world, long_ids, texts_short):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    store = PrefixKVStore(block_tokens=BLOCK)
    sched = Scheduler(eng, store=store, prefill_chunk_tokens=64)
    t = sched.submit(
        ServeRequest("math", long_ids[:600] + texts_short[0][:3], shared_len=600, max_new_tokens=3)
    )
    sched.step()
    sched.step()
    assert t.state == "prefilling" and sched.pending_prefill_tokens > 0
    t.cancel()
    sched.run_until_idle()
    assert t.state == "cancelled" and sched.live_bytes == 0 and eng.arena.used_tokens == 0
    assert sched.pending_prefill_tokens == 0 and sched.live_contexts == 0


def test_kv_budget_holds_while_a_context_is_prefilled_in_pieces(world, long_ids, texts_short):
    """The store blocks an unfinished chunked prefill will insert count against the KV budget from admission:
    a second context arriving meanwhile waits instead of taking that room, so live + store never exceeds the
    budget when the blocks arrive (without the reservation the peak went over it)."""
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    bpt = eng.kv_bytes_per_token
    budget = 1300 * bpt  # one 400-token context + its 400 store tokens + a tail fit; two do not
    sched = Scheduler(
        eng, store=PrefixKVStore(block_tokens=BLOCK), prefill_chunk_tokens=64, kv_budget_bytes=budget
    )
    reqs = [
        ServeRequest(
            d, long_ids[400 * i : 400 * (i + 1)] + texts_short[i][:4], shared_len=400, max_new_tokens=4
        )
        for i, d in enumerate(("math", "code"))
    ]
    tickets = [sched.submit(reqs[0])]
    sched.step()
    assert sched.pending_prefill_tokens > 0  # the first context is being prefilled in pieces
    tickets.append(sched.submit(reqs[1]))
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done", "done"]
    assert sched.counters["admission_waits"] >= 1
    assert sched.stats()["peak_total_kv_bytes"] <= budget
    for t in tickets:
        assert t.tokens == list(_reference(world, t.request).token_ids)
    assert sched.live_bytes == 0 and sched.pending_store_bytes == 0


def test_bad_knobs(world):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        Scheduler(eng, prefill_chunk_tokens=0)
    with pytest.raises(ConfigError, match="policy='lifo'"):
        Scheduler(eng, policy="lifo")


@pytest.fixture(scope="module")
def texts_short(gsm8k_rows, tokenizer):
    return [tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[:30] for r in gsm8k_rows[100:108]]


def test_serve_cli_flags(world):
    from ccft.cli.main import build_parser
    from ccft.cli.serve import build_scheduler

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            world[0].path,
            "--prefill-chunk-tokens",
            "64",
            "--policy",
            "mlfq",
            "--max-running",
            "3",
        ]
    )
    sched, _ = build_scheduler(args)
    assert sched.prefill_chunk_tokens == 64 and sched.policy == "mlfq" and sched.max_running == 3
    sched, _ = build_scheduler(build_parser().parse_args(["serve", "--model", world[0].path]))
    assert sched.prefill_chunk_tokens is None and sched.policy == "fcfs"
    bench = build_parser().parse_args(
        ["bench", "serve", "--prefill-chunk-tokens", "32", "--policy", "both", "--agents", "8"]
    )
    assert (bench.prefill_chunk_tokens, bench.policy, bench.agents) == (32, "both", 8)


@pytest.mark.parametrize("chunk", [None, 64])
def test_a_request_whose_store_blocks_never_fit_is_refused_at_submit(world, long_ids, texts_short, chunk):
    """With a prefix store, admitting a new context also counts the store blocks its prefill inserts. A
    request that fits the budget only without those blocks could never be admitted: it is refused at submit
    (before, it passed that check and then waited in the queue for ever with nothing running). One that fits
    with them is served."""
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    bpt = eng.kv_bytes_per_token
    req = ServeRequest("math", long_ids[:400] + texts_short[0][:4], shared_len=400, max_new_tokens=4)
    k = eng.decoders["math"].decoder.handoff_tokens  # the context holds the shared tokens before the handoff
    alone = (400 + 4 + 4) * bpt  # context + tail (its k handoff tokens included) + generated tokens
    blocks = (400 - k) // BLOCK * BLOCK * bpt  # the full blocks the prefill copies to the store
    tight = Scheduler(
        eng, store=PrefixKVStore(block_tokens=BLOCK), prefill_chunk_tokens=chunk, kv_budget_bytes=alone
    )
    with pytest.raises(PromptTooLongError, match=rf"needs {alone + blocks} bytes.*kv_budget_bytes={alone}"):
        tight.submit(req)
    assert tight.queue_depth == 0
    enough = Scheduler(
        eng,
        store=PrefixKVStore(block_tokens=BLOCK),
        prefill_chunk_tokens=chunk,
        kv_budget_bytes=alone + blocks,
    )
    t = enough.submit(req)
    enough.run_until_idle()
    assert t.state == "done" and t.tokens == list(_reference(world, req).token_ids)
