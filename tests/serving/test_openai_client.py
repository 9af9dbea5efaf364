"""``ccft serve`` as the official ``openai`` Python package uses it (a client no one here wrote), over
loopback.

A real uvicorn server on 127.0.0.1 (port 0: the OS picks a free one) over a tiny Llama and a LoRA
decoder. Every answer is checked against an independent reference: the engine's offline output on a
separate engine (text, token ids, finish reasons, seeded sampling with seed + j per choice) and the
teacher-forced log-softmax of ``ccft.compute_base_cache`` + ``ccft.decoder_forward`` (logprobs).
Covered: completions and chat, streaming (deltas concatenate to the non-streamed text, per-chunk
logprobs), usage, ``logprobs`` / ``top_logprobs``, ``echo`` with ``max_tokens=0``, ``n > 1``
(distinct seeds, own finish reasons, the prompt prefilled once: ``/metrics`` prefill counter).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import ccft
from ccft.core.decoder import decoder_forward
from ccft.core.sampling import SamplingParams
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.inference.scoring import prompt_logprobs
from ccft.serving.scheduler import Scheduler
from ccft.serving.server import BackgroundServer, create_app
from conftest import make_lora, make_tiny_folder

openai = pytest.importorskip("openai")

WAIT = 120.0  # seconds: bound on every request (against hangs only; nothing asserts on time)
TOL = 1e-4


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(str(make_tiny_folder(tmp_path_factory.mktemp("oa"), tokenizer, seed=13, scale=8.0)))
    return base, {"math": make_lora(base, "math", 31, 4)}


@pytest.fixture(scope="module")
def server(world):
    base, decs = world
    scheduler = Scheduler(SharedPrefillEngine(base, decoders=decs))
    srv = BackgroundServer(create_app(scheduler, base.tokenizer)).start()
    srv.scheduler = scheduler
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline(world):
    base, decs = world
    engine = SharedPrefillEngine(base, decoders=decs)

    def run(ids, decoder="math", max_tokens=6, sampling=None, stop=None):
        with engine.prefill([list(ids)]) as h:
            return engine.generate(
                h, decoder=decoder, max_new_tokens=max_tokens, sampling=sampling, stop=stop
            )[0]

    run.engine = engine
    return run


@pytest.fixture(scope="module")
def text(gsm8k_rows):
    return gsm8k_rows[5]["prompt"][:70]


def _ref_logprobs(world, decoder, prompt: list[int], out: list[int]) -> torch.Tensor:
    base, decs = world
    with torch.no_grad():
        if decoder == "base":
            with base.base_weights() as m:
                logits = m(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        else:
            cache = ccft.compute_base_cache(base, [prompt])
            logits = decoder_forward(decs[decoder], cache, torch.tensor([prompt[-1:] + out]))[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def _metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", timeout=WAIT).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _prefills(server) -> float:
    return _metric(server, "ccft_scheduler_prefills_total")


def test_models_list(client):
    assert {m.id for m in client.models.list()} == {"base", "math"}


def test_completion_logprobs_and_usage(client, world, tokenizer, text, offline):
    ids = tokenize_prompt(tokenizer, text, chat_template=False)
    ref = offline(ids, max_tokens=5)
    r = client.completions.create(model="math", prompt=text, max_tokens=5, logprobs=3)
    (choice,) = r.choices
    assert choice.text == ref.text and choice.finish_reason == {"eos": "stop"}.get(
        ref.finish_reason, ref.finish_reason
    )
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    want = _ref_logprobs(world, "math", ids, ref.token_ids)
    assert lp.token_logprobs == pytest.approx(
        [float(want[j, t]) for j, t in enumerate(ref.token_ids)], abs=TOL
    )
    for j, top in enumerate(lp.top_logprobs):
        vals, tids = want[j].topk(3)
        assert list(top) == [tokenizer.decode([t]) for t in tids.tolist()]  # most likely first
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=TOL)
        assert max(top.values()) == lp.token_logprobs[j]  # greedy: the chosen token is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


def test_echo_scores_the_prompt(client, world, tokenizer, text):
    """echo + max_tokens=0 + logprobs=1: the prompt's tokens, first logprob null (lm-eval's loglikelihood
    call)."""
    ids = tokenize_prompt(tokenizer, text, chat_template=False)
    r = client.completions.create(model="math", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    (choice,) = r.choices
    assert choice.text == tokenizer.decode(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    base, decs = world
    ref = prompt_logprobs(SharedPrefillEngine(base, decoders=decs), "math", ids, top=1)
    assert lp.token_logprobs[1:] == pytest.approx([e[0] for e in ref[1:]], abs=1e-5)
    # as the first generated token: position i's logprob is the decoder's on C_base of prompt[:i]
    for i in (5, len(ids) - 1):
        want = _ref_logprobs(world, "math", ids[:i], [ids[i]])[0, ids[i]]
        assert lp.token_logprobs[i] == pytest.approx(float(want), abs=TOL)
    # echo with generation: prompt then completion, one logprobs list
    g = client.completions.create(model="base", prompt=text, max_tokens=3, logprobs=0, echo=True).choices[0]
    assert g.text.startswith(text) and len(g.logprobs.tokens) == len(ids) + 3
    assert g.logprobs.top_logprobs[1:] == [{}] * (len(ids) + 2)
    full = _ref_logprobs(world, "base", ids[:1], ids[1:])  # the base over its own prompt
    assert g.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        [float(full[j, t]) for j, t in enumerate(ids[1:])], abs=TOL
    )


def test_chat_logprobs_streaming_and_usage(client, world, tokenizer, offline):
    messages = [{"role": "user", "content": "What is 7 times 6?"}]
    ids = tokenize_prompt(tokenizer, messages, chat_template=True)
    ref = offline(ids, max_tokens=6)
    r = client.chat.completions.create(
        model="math", messages=messages, max_tokens=6, logprobs=True, top_logprobs=2
    )
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    want = _ref_logprobs(world, "math", ids, ref.token_ids)
    content = choice.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref.token_ids]
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    assert [c.logprob for c in content] == pytest.approx(
        [float(want[j, t]) for j, t in enumerate(ref.token_ids)], abs=TOL
    )
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(
        model="math",
        messages=messages,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref.token_ids)
    deltas = [c.choices[0] for c in chunks[:-1]]
    assert "".join(d.delta.content or "" for d in deltas) == ref.text
    assert (
        deltas[0].delta.role == "assistant" and [d.finish_reason for d in deltas][-1] == choice.finish_reason
    )
    streamed = [c for d in deltas if d.logprobs for c in d.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completion_stream_equals_non_stream(client, tokenizer, text, offline):
    ids = tokenize_prompt(tokenizer, text, chat_template=False)
    ref = offline(ids, max_tokens=7)
    chunks = list(
        client.completions.create(
            model="math",
            prompt=text,
            max_tokens=7,
            stream=True,
            logprobs=1,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    body = [c.choices[0] for c in chunks[:-1]]
    assert "".join(c.text for c in body) == ref.text
    tokens = [t for c in body if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in body if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]


def test_n_choices_distinct_seeds_prefilled_once(client, server, tokenizer, text, offline):
    ids = tokenize_prompt(tokenizer, text, chat_template=False)
    before, prompt_before = _prefills(server), _metric(server, "ccft_prompt_tokens_total", model="math")
    r = client.completions.create(
        model="math", prompt=ids, max_tokens=8, n=4, temperature=1.0, seed=11, stop=["\n"], logprobs=0
    )
    assert _prefills(server) - before == 1  # one prefill for the 4 choices
    assert _metric(server, "ccft_prompt_tokens_total", model="math") - prompt_before == len(ids)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = [
        offline(ids, max_tokens=8, sampling=SamplingParams(True, 1.0, 1.0, 11 + j), stop=["\n"])
        for j in range(4)
    ]
    assert [c.text for c in r.choices] == [g.text for g in refs]
    assert [c.finish_reason for c in r.choices] == [
        {"eos": "stop"}.get(g.finish_reason, g.finish_reason) for g in refs
    ]
    assert len({c.text for c in r.choices}) > 1  # distinct seeds, distinct samples
    assert r.usage.completion_tokens == sum(len(g.token_ids) for g in refs)
    assert r.usage.prompt_tokens == len(ids)

    before = _prefills(server)
    chunks = list(
        client.chat.completions.create(
            model="math",
            messages=[{"role": "user", "content": text}],
            max_tokens=5,
            n=3,
            temperature=1.0,
            seed=2,
            stream=True,
        )
    )
    assert _prefills(server) - before == 1
    chat_ids = tokenize_prompt(tokenizer, [{"role": "user", "content": text}], chat_template=True)
    texts = {i: "" for i in range(3)}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    refs = [offline(chat_ids, max_tokens=5, sampling=SamplingParams(True, 1.0, 1.0, 2 + j)) for j in range(3)]
    assert [texts[i] for i in range(3)] == [g.text for g in refs]
    assert sorted(finish) == [0, 1, 2]


def test_errors_reach_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="math", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


def test_echo_streams_the_prompt_first_and_stop_keeps_token_logprobs(client, tokenizer, text, offline):
    ids = tokenize_prompt(tokenizer, text, chat_template=False)
    whole = client.completions.create(model="math", prompt=text, max_tokens=4, logprobs=1, echo=True).choices[
        0
    ]
    chunks = list(
        client.completions.create(model="math", prompt=text, max_tokens=4, logprobs=1, echo=True, stream=True)
    )
    first = chunks[0].choices[0]
    assert first.text == text and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(
        whole.logprobs.token_logprobs[1 : len(ids)], abs=1e-6
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert streamed == whole.logprobs.tokens
    # a stop string cuts the text; the logprobs still cover every generated token id
    ref = offline(ids, max_tokens=6)
    cut = ref.text[2:4]
    stopped = offline(ids, max_tokens=6, stop=[cut])
    r = client.completions.create(model="math", prompt=text, max_tokens=6, logprobs=0, stop=[cut])
    assert r.choices[0].text == stopped.text and r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens == len(stopped.token_ids)
