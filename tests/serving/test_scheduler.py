"""Scheduler on the engine: outputs equal the reference path, one prefill per shared context, the KV
budget holds, requests join / leave / cancel between steps, and live KV returns to 0 (issue #5 step 1)."""

from __future__ import annotations

import pytest

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving.scheduler import PromptTooLongError, QueueFullError, Scheduler, ServeRequest
from conftest import make_lora, make_tiny_folder

N_NEW = 5
AGENTS = ("base", "math", "code", "full")


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("sched"), tokenizer, seed=5, scale=30.0))
    )
    full = ccft.make_decoder(
        base, "full", method="ccft"
    )  # before any adapter: an unperturbed copy of the base
    full.model.eval()
    return base, {
        "full": full,
        **{name: make_lora(base, name, 20 + i, 4) for i, name in enumerate(("math", "code"))},
    }


@pytest.fixture(scope="module")
def texts(gsm8k_rows, tokenizer):
    return [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:8]]


def _requests(texts, n_ctx=2, shared=24, unique=(3, 5, 7, 9)):
    """n_ctx shared contexts, each read by every agent with its own suffix."""
    out = []
    for c in range(n_ctx):
        ctx = texts[c][:shared]
        for j, agent in enumerate(AGENTS):
            prompt = ctx + texts[4 + j][: unique[j]]
            out.append(
                ServeRequest(agent, prompt, shared_len=len(ctx), max_new_tokens=N_NEW, session_id=f"s{c}")
            )
    return out


def _reference(world, r):
    base, decs = world
    if r.decoder == "base":
        return ccft.generate([list(r.prompt_ids)], mode="base", base=base, max_new_tokens=r.max_new_tokens)[0]
    return ccft.generate(
        [list(r.prompt_ids)], mode="prefillshare", decoder=decs[r.decoder], max_new_tokens=r.max_new_tokens
    )[0]


@pytest.fixture(scope="module")
def refs(world, texts):
    return [_reference(world, r).token_ids for r in _requests(texts)]


def test_shared_outputs_equal_reference_one_prefill_per_context(world, texts, refs):
    base, decs = world
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs, fill=float("nan")), share=True)
    tickets = [sched.submit(r) for r in _requests(texts)]
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * len(tickets)
    assert [t.result.token_ids for t in tickets] == refs
    assert [t.tokens for t in tickets] == refs  # streamed tokens = final output
    assert sched.counters["prefills"] == 2  # one per shared context, 4 agents each
    assert sched.live_bytes == 0 and sched.engine.arena.used_tokens == 0
    # Eq. 9 (live KV): one context copy + each agent's own tokens and generation
    bpt = sched.bytes_per_token
    ctx_prefix = 24 - 1  # handoff k = 1: the last context token goes to each request's tail
    tails = sum(u + 1 + N_NEW for u in (3, 5, 7, 9))
    assert sched.peak_live_bytes == 2 * (ctx_prefix + tails) * bpt  # both contexts admitted at once


def _own_prefill_reference(world, r):
    """Offline generation where the request's own model prefills its whole prompt (the per-model baseline):
    the reference path of ``ccft.generate``'s own-prefill modes (``prefill`` + ``decode_on_cache``)."""
    from ccft.core.cache import prefill
    from ccft.core.generation import decode_on_cache
    from ccft.core.tokens import pad_token_id

    base, decs = world
    if r.decoder == "base":
        return _reference(world, r).token_ids
    dec = decs[r.decoder]
    if dec.kind == "lora":
        dec.model.set_adapter(r.decoder)
    cache = prefill(
        dec.model,
        [list(r.prompt_ids)],
        handoff_tokens=1,
        pad_token_id=pad_token_id(base.tokenizer),
        producer="self",
    )
    return decode_on_cache(dec.model, base.tokenizer, cache, max_new_tokens=r.max_new_tokens)[0].token_ids


def test_no_share_outputs_equal_reference_and_use_n_copies(world, texts, refs):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    sched = Scheduler(eng, share=False)
    reqs = _requests(texts)[:4]
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * 4
    assert sched.counters["prefills"] == 4  # every model prefills its own prompt
    bpt = sched.bytes_per_token
    assert sched.peak_live_bytes == sum(24 - 1 + u + 1 + N_NEW for u in (3, 5, 7, 9)) * bpt
    # every request equals offline generation with its own model's prefill
    own = [_own_prefill_reference(world, r) for r in reqs]
    assert [t.result.token_ids for t in tickets] == own
    assert [t.tokens for t in tickets] == own
    # ... which is not the shared-prefill output for the LoRA decoders: a scheduler that read C_base fails
    assert [o != s for o, s in zip(own, refs[:4], strict=True)] == [False, True, True, False]


def test_budget_queues_instead_of_exceeding(world, texts, refs):
    base, decs = world
    bpt = None
    eng = SharedPrefillEngine(base, decoders=decs)
    probe = Scheduler(eng)
    bpt = probe.bytes_per_token
    one_ctx = (23 + sum(u + 1 + N_NEW for u in (3, 5, 7, 9))) * bpt  # exactly one context with its 4 agents
    sched = Scheduler(eng, kv_budget_bytes=one_ctx)
    tickets = [sched.submit(r) for r in _requests(texts)]
    sched.run_until_idle()
    assert [t.result.token_ids for t in tickets] == refs
    assert sched.peak_total_bytes <= one_ctx
    assert sched.counters["admission_waits"] > 0  # the second context waited for the first
    assert sched.live_bytes == 0


def test_requests_join_and_leave_between_steps(world, texts, refs):
    base, decs = world
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs))
    reqs = _requests(texts)
    first = [sched.submit(r) for r in reqs[:3]]
    sched.step()
    sched.step()
    later = [sched.submit(r) for r in reqs[3:]]  # join while the first ones are mid-decode
    sched.step()
    assert sched.active > 3
    sched.run_until_idle()
    assert [t.result.token_ids for t in first + later] == refs


def test_cancel_frees_kv_and_others_continue(world, texts, refs):
    base, decs = world
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs))
    reqs = _requests(texts)[:4]
    tickets = [sched.submit(r) for r in reqs]
    sched.step()
    tickets[1].cancel()
    queued = sched.submit(reqs[2])
    queued.cancel()
    sched.run_until_idle()
    assert tickets[1].state == "cancelled" and queued.state == "cancelled"
    assert [tickets[i].result.token_ids for i in (0, 2, 3)] == [refs[i] for i in (0, 2, 3)]
    assert sched.live_bytes == 0 and sched.engine.active == 0 and sched.engine.arena.used_tokens == 0


def test_submit_errors(world, texts):
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    sched = Scheduler(eng, kv_budget_bytes=10 * Scheduler(eng).bytes_per_token, max_queue=1)
    with pytest.raises(ConfigError, match="unknown decoder 'nope'"):
        sched.submit(ServeRequest("nope", texts[0][:10]))
    with pytest.raises(PromptTooLongError, match="kv_budget_bytes"):
        sched.submit(ServeRequest("math", texts[0][:20]))
    with pytest.raises(ConfigError, match="shared_len"):
        sched.submit(ServeRequest("math", texts[0][:5], shared_len=9))
    sched.submit(ServeRequest("math", texts[0][:3], max_new_tokens=2))
    with pytest.raises(QueueFullError, match="max_queue=1"):
        sched.submit(ServeRequest("math", texts[0][:3], max_new_tokens=2))


def _break(eng, name):
    """Make decoder ``name`` raise in every forward of this engine (a wrong-shape LoRA A in layer 0)."""
    import torch

    from ccft.inference.weights import LoraWeights

    layer = eng.lanes["base"].weights.adapters[eng.decoders[name].adapter_index].layers[0]
    proj = next(iter(layer))
    layer[proj] = LoraWeights(torch.zeros(3, 5), layer[proj].b, layer[proj].scaling)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_failing_request_fails_alone(world, texts, refs, decode):
    """A broken LoRA decoder in the base lane: its requests end in "error"; base, the other LoRA and the
    full-weight requests batched with them in the same steps are served and equal the reference."""
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    _break(eng, "code")
    sched = Scheduler(eng)
    reqs = _requests(texts)
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    for t, r, want in zip(tickets, reqs, refs, strict=True):
        if r.decoder == "code":
            assert t.state == "error" and "RuntimeError" in t.error and t.result is None
        else:
            assert t.state == "done" and t.result.token_ids == want, r.decoder
    assert sched.counters["failed_in_step"] == 2
    assert sched.live_bytes == 0 and eng.active == 0 and eng.arena.used_tokens == 0
    # the engine goes on serving: the same requests again (without the broken decoder)
    again = [sched.submit(r) for r in reqs if r.decoder != "code"]
    sched.run_until_idle()
    assert [t.result.token_ids for t in again] == [
        w for r, w in zip(reqs, refs, strict=True) if r.decoder != "code"
    ]


def test_no_share_context_follows_in_place_weight_edits(tmp_path, tokenizer, texts):
    """share=False with a store: after an in-place edit of a LoRA decoder, the next request with the same
    prompt is prefilled again with the new weights (no live context, no store block of the old ones)."""
    import torch

    from ccft.serving import PrefixKVStore

    base = ccft.load_base(str(make_tiny_folder(tmp_path, tokenizer, seed=5, scale=30.0)))
    math = make_lora(base, "math", 20, 4)
    sched = Scheduler(
        SharedPrefillEngine(base, decoders={"math": math}), share=False, store=PrefixKVStore(block_tokens=4)
    )
    req = ServeRequest("math", texts[0][:24] + texts[4][:5], shared_len=24, max_new_tokens=N_NEW)
    first = sched.submit(req)
    sched.step()  # admitted: its context is live while the edit happens
    with torch.no_grad():
        math.model.base_model.model.model.layers[0].self_attn.v_proj.lora_B["math"].weight.mul_(-3.0)
    second = sched.submit(req)
    sched.run_until_idle()
    assert first.state == second.state == "done"
    assert second.prefix_hit_tokens == 0 and sched.counters["prefills"] == 2
    fresh = SharedPrefillEngine(base, decoders={"math": math})
    with fresh.prefill([list(req.prompt_ids)], producer="math") as h:
        want = fresh.generate(h, decoder="math", max_new_tokens=N_NEW)[0].token_ids
    assert second.result.token_ids == want != first.result.token_ids


def test_decode_params_pass_whole_to_the_engine(world, texts, refs, monkeypatch):
    """ServeRequest(params=DecodeParams) reaches SharedPrefillEngine.add_request as the same object (a field
    added to DecodeParams cannot be dropped on the way), and gives the outputs of the separate keywords."""
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs)
    seen = []
    real = eng.add_request

    def spy(*a, **kw):
        seen.append(kw.get("params"))
        return real(*a, **kw)

    monkeypatch.setattr(eng, "add_request", spy)
    sched = Scheduler(eng)
    old = _requests(texts)[:4]
    params = [ccft.DecodeParams(max_new_tokens=N_NEW, stop=("zzz",), logprobs=0) for _ in old]
    new = [
        ServeRequest(r.decoder, r.prompt_ids, shared_len=r.shared_len, params=p) for r, p in zip(old, params)
    ]
    assert [r.max_new_tokens for r in new] == [N_NEW] * 4 and new[0].stop == ["zzz"]  # the old fields follow
    tickets = [sched.submit(r) for r in new]
    sched.run_until_idle()
    assert [id(p) for p in seen] == [id(p) for p in params]
    assert [t.tokens for t in tickets] == refs[:4] and all(len(t.token_logprobs) == N_NEW for t in tickets)
    with pytest.raises(ConfigError, match="not both"):
        with eng.prefill([texts[0][:10]]) as h:
            real(h, 0, decoder="math", params=params[0], max_new_tokens=3)


def test_decode_params_validation_and_choices():
    p = ccft.DecodeParams(
        max_new_tokens=4, stop="x", sampling=ccft.SamplingParams(True, 0.7, 0.9, 2**63 - 1), n=3
    )
    assert p.stop == ("x",) and p.for_choice(1).sampling.seed == 0 and p.for_choice(1).n == 1
    assert ccft.DecodeParams().for_choice(5).sampling.seed == 0  # greedy: no seed to advance
    for bad in ({"max_new_tokens": -1}, {"logprobs": -2}, {"n": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ccft.DecodeParams(**bad)


def test_shared_prefix_found_without_the_hint(world, texts, refs):
    """Requests that give no ``shared_len`` share the longest whole-block prefix of their prompts
    (``prefix_match``; 16-token blocks without a store): the 24-token contexts of ``_requests`` are found as
    their first 16 tokens, one prefill per context as with the hint, the other 8 computed in each
    request's tail; outputs equal the reference path. ``auto_shared_prefix=False``: every prompt is its own
    context (8 prefills), same outputs. The caller's requests are not changed."""
    import dataclasses

    base, decs = world
    hinted = _requests(texts)
    plain = [dataclasses.replace(r, shared_len=None) for r in hinted]
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs, fill=float("nan")), share=True)
    tickets = [sched.submit(r) for r in plain]
    sched.run_until_idle()
    assert [t.result.token_ids for t in tickets] == refs
    assert sched.counters["prefills"] == 2 and sched.counters["auto_shared_tokens"] == 8 * 16
    assert [t.request.shared_len for t in tickets] == [16] * 8 and all(r.shared_len is None for r in plain)
    bpt = sched.bytes_per_token
    tails = sum(24 - 16 + u + 1 + N_NEW for u in (3, 5, 7, 9))
    assert sched.peak_live_bytes == 2 * (16 - 1 + tails) * bpt
    assert sched.live_bytes == 0 and sched.engine.arena.used_tokens == 0

    off = Scheduler(
        SharedPrefillEngine(base, decoders=decs, fill=float("nan")), share=True, auto_shared_prefix=False
    )
    tickets = [off.submit(r) for r in plain]
    off.run_until_idle()
    assert [t.result.token_ids for t in tickets] == refs
    assert off.counters["prefills"] == 8 and off.counters["auto_shared_tokens"] == 0


def test_prefix_match_known_answers():
    """Block hashes chain (a block's hash covers every block before it), the common prefix is counted in
    whole blocks, and a hash collision is caught on the token ids."""
    from ccft.serving.prefix_match import block_hashes, common_blocks, shared_prefix_tokens

    a = list(range(40))
    b = list(range(20)) + [99] + list(range(21, 40))
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert len(ha) == 5 and ha[:2] == hb[:2] and ha[2:] != hb[2:] and common_blocks(ha, hb) == 2
    assert block_hashes(list(range(8, 16)), 8) != ha[1:2]  # chained: block 1 alone hashes otherwise
    assert shared_prefix_tokens(a, ha, [(b, hb), (a[:9], block_hashes(a[:9], 8))], 8) == 16
    assert shared_prefix_tokens(a, ha, [([7] * 40, ha)], 8) == 0  # equal hashes, other tokens: no match
    assert shared_prefix_tokens(a[:20], ha[:2], [(a, ha)], 8) == 20  # its whole prompt in another: all of it
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes(a, 0)


def test_shared_prefix_found_without_the_hint_stays_per_decoder_without_sharing(world, texts):
    """``share=False`` with no hint: the common prefix is found across the agents, but each decoder prefills
    its own context (contexts are keyed by their producer), and every output equals offline generation with
    that decoder's own prefill (K5: no decoder reads another's KV)."""
    import dataclasses

    base, decs = world
    reqs = [dataclasses.replace(r, shared_len=None) for r in _requests(texts)[:4]]
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs, fill=float("nan")), share=False)
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert sched.counters["auto_shared_tokens"] == 4 * 16 and sched.counters["prefills"] == 4
    assert [t.result.token_ids for t in tickets] == [_own_prefill_reference(world, r) for r in reqs]
