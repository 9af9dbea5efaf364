"""Log-probabilities of the engine and the server's prompt scoring, against independent references.

* ``SharedPrefillEngine.add_request(logprobs=k)``: every step's logprob / top-k equal the log-softmax of
  the reference teacher-forced forward (``ccft.compute_base_cache`` + ``ccft.decoder_forward`` over
  the generated tokens; the base: its plain HF forward), greedy and sampled (the raw distribution,
  before temperature); without ``logprobs`` nothing is reported.
* ``ccft.inference.scoring.prompt_logprobs``: each prompt position equals a separate prefill of its
  own prefix + decoder forward (handoff k = 1 and 2, positions shorter than k included), equals the
  engine's logprob of that token forced as the first generated one, and with ``context_tokens`` the
  continuation equals the reference continuation forward.
* ``Scheduler.submit_many``: n choices on one prompt prefill it once.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.decoder import decoder_forward
from ccft.core.sampling import SamplingParams
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.inference.scoring import prompt_logprobs
from ccft.serving.scheduler import Scheduler, ServeRequest
from conftest import make_lora, make_tiny_folder

TOL = 1e-4  # fp32: the engine's kernels vs HF's forward


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(str(make_tiny_folder(tmp_path_factory.mktemp("lp"), tokenizer, seed=3, scale=8.0)))
    decs = {"k1": make_lora(base, "k1", 21, 4), "k2": make_lora(base, "k2", 22, 4, handoff=2)}
    return base, decs


@pytest.fixture(scope="module")
def prompt(tokenizer, gsm8k_rows):
    return tokenize_prompt(tokenizer, gsm8k_rows[3]["prompt"][:60], chat_template=False)


def _reference_logprobs(base, dec, context: list[int], cont: list[int]) -> torch.Tensor:
    """``(len(cont), V)`` log-softmax predicting each of ``cont`` after ``context`` (teacher forcing)."""
    with torch.no_grad():
        if dec is None:
            with base.base_weights() as m:
                logits = m(input_ids=torch.tensor([context + cont])).logits[0, len(context) - 1 : -1]
        else:
            k = min(dec.handoff_tokens, len(context) - 1)
            cache = ccft.compute_base_cache(base, [context], handoff_tokens=k)
            logits = decoder_forward(dec, cache, torch.tensor([context[-k:] + cont]))[0, k - 1 : -1]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("decoder", ["base", "k1", "k2"])
@pytest.mark.parametrize("sampled", [False, True])
def test_step_logprobs_equal_teacher_forced_reference(world, prompt, decoder, sampled):
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    k = 1 if decoder == "base" else decs[decoder].handoff_tokens
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=5) if sampled else None
    with engine.prefill([prompt], handoff_tokens=k) as h:
        rid = engine.add_request(
            h, decoder=decoder, max_new_tokens=6, logprobs=3, sampling=sampling, ignore_eos=True
        )
        plain = engine.add_request(h, decoder=decoder, max_new_tokens=6, sampling=sampling, ignore_eos=True)
        outs = []
        while engine.active:
            outs += engine.step()
    mine = [o for o in outs if o.request_id == rid]
    assert all(o.logprob is None and o.top_logprobs is None for o in outs if o.request_id == plain)
    toks = [o.token_id for o in mine]
    assert toks == [o.token_id for o in outs if o.request_id == plain]  # asking for logprobs changes nothing
    ref = _reference_logprobs(base, decs.get(decoder), prompt, toks)
    for j, o in enumerate(mine):
        assert o.logprob == pytest.approx(float(ref[j, toks[j]]), abs=TOL)
        vals, ids = ref[j].topk(3)
        assert [t for t, _ in o.top_logprobs] == ids.tolist()
        assert [v for _, v in o.top_logprobs] == pytest.approx(vals.tolist(), abs=TOL)
        assert o.top_logprobs[0][1] >= o.logprob  # the top list is sorted, the token is in the distribution
    if not sampled:  # greedy: each token is the top-1 of its distribution
        assert all(o.token_id == o.top_logprobs[0][0] for o in mine)


@pytest.mark.parametrize("decoder", ["base", "k1", "k2"])
def test_prompt_logprobs_equal_per_position_reference(world, prompt, decoder):
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    dec = decs.get(decoder)
    got = prompt_logprobs(engine, decoder, prompt, top=2, rows_per_batch=5)  # several row batches
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        if dec is not None and i <= dec.handoff_tokens:  # shorter than the handoff: the decoder over it all
            with torch.no_grad():
                ref = torch.log_softmax(
                    dec.activate()(input_ids=torch.tensor([prompt[:i]])).logits[0, -1].float(), -1
                )
        else:
            ref = _reference_logprobs(base, dec, prompt[:i], prompt[i : i + 1])[0]
        lp, top = got[i]
        assert lp == pytest.approx(float(ref[prompt[i]]), abs=TOL), i
        assert [t for t, _ in top] == ref.topk(2).indices.tolist()


@pytest.mark.parametrize("decoder", ["k1", "k2"])
def test_prompt_logprobs_equal_the_engines_first_token(world, prompt, decoder):
    """Echo position i = the logprob the engine gives prompt[i] as the first token generated after
    prompt[:i]."""
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    got = prompt_logprobs(engine, decoder, prompt)
    k = decs[decoder].handoff_tokens
    for i in range(k + 1, len(prompt), 3):
        with engine.prefill([prompt[:i]], handoff_tokens=k) as h:
            engine.add_request(h, decoder=decoder, forced_tokens=[prompt[i]], logprobs=0)
            (out,) = engine.step()
        assert out.logprob == pytest.approx(got[i][0], abs=TOL) and out.top_logprobs == []


@pytest.mark.parametrize("decoder", ["base", "k1", "k2"])
def test_context_tokens_scores_the_continuation_as_generated(world, prompt, decoder):
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    c = 9
    got = prompt_logprobs(engine, decoder, prompt, context_tokens=c)
    per_position = prompt_logprobs(engine, decoder, prompt)
    ref = _reference_logprobs(base, decs.get(decoder), prompt[:c], prompt[c:])
    want = [float(ref[j, t]) for j, t in enumerate(prompt[c:])]
    assert [e[0] for e in got[c:]] == pytest.approx(want, abs=TOL)
    assert [e[0] for e in got[1 : c + 1]] == pytest.approx([e[0] for e in per_position[1 : c + 1]], abs=TOL)
    if decoder != "base":  # the decoder's later continuation tokens read its own K/V, not the base's
        assert max(abs(a[0] - b[0]) for a, b in zip(got[c + 1 :], per_position[c + 1 :], strict=True)) > 1e-3
    with pytest.raises(ccft.ConfigError, match="context_tokens=.* must be in 1.."):
        prompt_logprobs(engine, decoder, prompt, context_tokens=len(prompt))


def test_n_choices_prefill_the_prompt_once(world, prompt):
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    sched = Scheduler(engine)
    reqs = [
        ServeRequest(
            "k1", prompt, max_new_tokens=4, sampling=SamplingParams(True, 1.0, 1.0, 7 + j), logprobs=1
        )
        for j in range(3)
    ]
    tickets = sched.submit_many(reqs)
    sched.run_until_idle()
    stats = sched.stats()
    assert stats["prefills"] == 1 and stats["prefill_tokens"] == len(prompt) - 1
    assert stats["context_reuse_tokens"] == 2 * (len(prompt) - 1)
    for j, t in enumerate(tickets):  # each choice equals its own seed alone on a fresh engine
        with SharedPrefillEngine(base, decoders=decs).prefill([prompt], handoff_tokens=1) as h:  # k1's k
            ref = h.engine.generate(
                h, decoder="k1", max_new_tokens=4, sampling=SamplingParams(True, 1.0, 1.0, 7 + j)
            )
        assert t.state == "done" and t.tokens == ref[0].token_ids and len(t.token_logprobs) == len(t.tokens)


def test_score_only_request(world, prompt):
    """max_new_tokens=0 with prompt_logprobs: no KV, no lane slot, an empty generation, the prompt's
    logprobs."""
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)
    sched = Scheduler(engine)
    (t,) = sched.submit_many([ServeRequest("k2", prompt, max_new_tokens=0, prompt_logprobs=1)])
    sched.run_until_idle()
    assert t.state == "done" and t.result.token_ids == [] and sched.stats().get("prefills", 0) == 0
    assert [e and e[0] for e in t.prompt_logprobs] == [
        e and e[0] for e in prompt_logprobs(engine, "k2", prompt, top=1)
    ]
    with pytest.raises(ccft.ConfigError, match="0 only with prompt_logprobs"):
        sched.submit(ServeRequest("k2", prompt, max_new_tokens=0))


def test_default_path_computes_no_logprobs(world, prompt, monkeypatch):
    """Without ``logprobs`` no row's distribution is normalised: a step never calls log_softmax."""
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)

    def refuse(*a, **kw):
        raise AssertionError("log_softmax called")

    with engine.prefill([prompt, prompt[:-3]], handoff_tokens=1) as h:  # k1's k
        ref = engine.generate(h, decoder="k1", max_new_tokens=4)
        monkeypatch.setattr(torch, "log_softmax", refuse)
        got = engine.generate(h, decoder="k1", max_new_tokens=4)
        assert [g.token_ids for g in got] == [g.token_ids for g in ref]
        engine.add_request(h, decoder="k1", max_new_tokens=2, logprobs=0)
        with pytest.raises(AssertionError, match="log_softmax called"):  # asked: computed
            engine.step()
