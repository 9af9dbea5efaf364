"""Streaming detokenisation of ``ccft serve`` (``ccft.serving.streaming.StreamText``:
``ccft.core.text.TextStream`` + ``StopMatcher``; docs/design.md, "Stop strings and streaming", fault class
K7).

The reference is the engine's rule for the final, non-streamed text: after every generated token the
whole output is decoded (``skip_special_tokens=True``) and cut before the earliest stop string; the
request ends at the first token where one appears. Streamed deltas must never contain an incomplete
character, a stop string or what follows it, and must concatenate (with ``finish``) to exactly that text.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ccft.core.generation import Generation
from ccft.core.text import StopMatcher, TextStream
from ccft.serving.scheduler import ServeRequest, Ticket
from ccft.serving.schemas import Reply
from ccft.serving.streaming import DONE, StreamText, TokenSink, sse_events

TEXTS = [
    "Prix: 12€ — 東京 🙂🚀 naïve café, done.\n\nEnd",
    "emoji 😀👍🏽 and CJK 漢字かな한국어 mixed with code `print('é')`",
    "東京都の天気は晴れ 🌞; 서울은 비 ☔. 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math: ∑ ∞ ½",
]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _engine_final(tokenizer, ids: list[int], stop) -> tuple[str, list[int]]:
    """The engine's final text and generated ids (the stop rule applied after every token)."""
    matcher = StopMatcher(stop)
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True)
        cut = matcher.find(text)
        if cut >= 0:
            return text[:cut], ids[:i]
    return tokenizer.decode(ids, skip_special_tokens=True), list(ids)


def _spanning_stops(tokenizer, text: str, ids: list[int]) -> list[str]:
    """Stop strings that straddle token boundaries (2 characters each side of a boundary)."""
    out = []
    for k in range(2, len(ids) - 1, 3):
        b = len(tokenizer.decode(ids[:k], skip_special_tokens=True))
        s = text[max(0, b - 2) : b + 2]
        if len(s) == 4 and "\ufffd" not in s and s not in out:
            out.append(s)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_text_stream_equals_full_decode_multibyte(tokenizer, text):
    ids = _ids(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the test needs tokens that split a character"
    stream = TextStream(tokenizer)
    deltas = [stream.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == stream.text == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_stream_text_multibyte_and_stop(tokenizer):
    """(moved from the server tests: the streamer formerly in ``serving/text_stream.py``)"""
    text = TEXTS[0]
    ids = _ids(tokenizer, text)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert final == text
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the test needs tokens that split a character"
    d = StreamText(tokenizer)
    deltas = [d.push([i]) for i in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.finish(final) == final
    # a stop string spanning tokens: nothing of it (or after it) is ever emitted
    stop = "\n\nE"
    d = StreamText(tokenizer, [stop, "never"])
    sent = ""
    for i in ids:
        sent += d.push([i])
        assert stop not in sent and "\n" not in sent  # "\n" could start the stop string: held back
    cut = text[: text.find(stop)]
    assert sent == cut.rstrip("\n")[: len(sent)] and cut.startswith(sent)
    assert sent + d.finish(cut) == cut


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_text_deltas_equal_engine_final_text(tokenizer, text, chunk):
    """Every stop string straddling a token boundary, ids pushed one or three at a time."""
    ids = _ids(tokenizer, text)
    stops = _spanning_stops(tokenizer, text, ids)
    assert len(stops) >= 4
    cases = [None] + [[s] for s in stops] + [[stops[-1], stops[0]], [stops[1], "absent stop"]]
    fired = 0
    for stop in cases:
        final, gen_ids = _engine_final(tokenizer, ids, stop)
        if stop:
            assert final == text[: min(text.find(s) for s in stop if s in text)]
        d = StreamText(tokenizer, stop)
        sent = ""
        for k in range(0, len(gen_ids), chunk):
            delta = d.push(gen_ids[k : k + chunk])
            assert "\ufffd" not in delta
            sent += delta
            assert final.startswith(sent), (stop, sent, final)
            assert not any(s in sent for s in stop or ())
        if d.stopped:  # the stream saw the stop string: everything before it was already sent
            assert sent == final
            fired += 1
        assert sent + d.finish(final) == final == d.sent
    assert fired >= 2


def test_stream_text_holds_back_partial_stop_until_it_breaks(tokenizer):
    """A tail that could grow into a stop string waits; once it cannot, it is sent."""
    d = StreamText(tokenizer, ["</tool_call>"])
    assert d.push(_ids(tokenizer, "result </tool")) == "result "
    assert d.held == "</tool"
    assert d.push(_ids(tokenizer, "bar done")) == "</toolbar done"
    assert d.sent == "result </toolbar done"


def test_sse_events_concatenate_to_final_text(tokenizer):
    """The SSE generator itself: chunks of tokens arriving together, the final chunk, usage, [DONE]."""
    text = TEXTS[1]
    ids = _ids(tokenizer, text)
    stop = _spanning_stops(tokenizer, text, ids)[2]
    final, gen_ids = _engine_final(tokenizer, ids, [stop])

    async def run(chat: bool) -> list[dict]:
        loop = asyncio.get_running_loop()
        ticket = Ticket(1, ServeRequest("base", [1, 2, 3], stop=[stop]))
        sink = TokenSink(loop, lambda t: None)
        for k, tok in enumerate(gen_ids):  # two tokens per queue batch, as if they arrived together
            sink.queue.put_nowait(tok)
            if k % 2:
                await asyncio.sleep(0)
        ticket.state, ticket.result = "done", Generation(final, list(gen_ids), "stop")
        ticket.done.set()
        sink.queue.put_nowait(DONE)
        reply = Reply(chat, "base", [1, 2, 3], return_token_ids=True, include_usage=True)
        events = [e async for e in sse_events(ticket, sink, reply, StreamText(tokenizer, [stop]))]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e[len("data: ") :]) for e in events[:-1]]

    for chat in (False, True):
        chunks = asyncio.run(run(chat))
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(gen_ids)
        choices = [c["choices"][0] for c in chunks]
        texts = [(c["delta"].get("content", "") if chat else c["text"]) for c in choices]
        assert "".join(texts) == final
        assert [t for c in choices for t in c["token_ids"]] == gen_ids
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
        assert choices[0]["prompt_token_ids"] == [1, 2, 3]
