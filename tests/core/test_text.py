"""ccft.core.text: the one stop rule and streaming detokenisation (docs/design.md, "Stop strings and
streaming")."""

from __future__ import annotations

import pytest

from ccft.core.text import StopMatcher, TextStream

TEXTS = [
    "Plain ASCII: 12 + 30 = 42.\n#### 42",
    "emoji 😀👍🏽 and CJK 漢字かな한국어 mixed with code `print('é')`",
    "    def f(x):\n        return x  # indented\n\n\ndef g():",
    "Ünïcödé ñ — “quotes” … ½ ∑ ∞",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_stream_equals_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    deltas = [stream.push([i]) for i in ids]
    assert "".join(deltas) == stream.text == tokenizer.decode(ids, skip_special_tokens=True)
    # every prefix that was emitted is a prefix of the full decode (no retractions)
    acc = ""
    for d in deltas:
        acc += d
        assert tokenizer.decode(ids, skip_special_tokens=True).startswith(acc)


def test_text_stream_holds_back_split_character(tokenizer):
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji: the first pieces alone are not text
    stream = TextStream(tokenizer)
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "😀"


def test_text_stream_skips_special_tokens(tokenizer):
    ids = tokenizer("hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    stream = TextStream(tokenizer)
    stream.push(ids)
    assert stream.text == tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_text_stream_slow_fallback_equals_full_decode(tokenizer):
    class Slow:  # a tokenizer without a ``tokenizers`` backend: the offset-window path
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stream = TextStream(Slow())
        out = "".join(stream.push([i]) for i in ids)
        assert out == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "stop, text, cut",
    [
        (["\n\n"], "a\nb\n\nc", 3),
        (["Question:", "\n\n"], "x Question: y\n\n", 2),  # the earliest occurrence wins, not the first listed
        (["abc"], "xxabxabc", 5),
        ([], "anything", -1),
        ([""], "empty stop strings are ignored", -1),
        ("##", "a ## b", 2),  # a single string is one stop string
    ],
)
def test_stop_matcher_find(stop, text, cut):
    assert StopMatcher(stop).find(text) == cut


def test_stop_matcher_holdback():
    m = StopMatcher(["</tool_call>", "\n\n"])
    assert m.holdback("result </tool") == len("</tool")
    assert m.holdback("line\n") == 1
    assert m.holdback("done") == 0
    assert m.holdback("</tool_call>") == 0  # a whole stop string is found, not held back


def test_stop_matcher_incremental_scan_equals_full_find():
    m = StopMatcher(["STOP", "\n\n"])
    text = "abc ST" + "OP tail"
    # feed in small deltas: scanning only the new part (plus the longest stop) finds the same cut
    seen, found = "", -1
    for i in range(0, len(text), 2):
        new_from = len(seen)
        seen += text[i : i + 2]
        found = m.scan_from(seen, new_from)
        if found >= 0:
            break
    assert found == m.find(text) == 4
