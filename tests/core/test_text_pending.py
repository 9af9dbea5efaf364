"""TextStream.pending: ``text + pending`` is the full decode after every push (docs/design.md,
"Stop strings and streaming"), for the fast (DecodeStream) and the slow (offset window) paths."""

from __future__ import annotations

import pytest

from ccft.core.text import TextStream

TEXTS = [
    "Plain ASCII: 12 + 30 = 42.\n#### 42",
    "emoji 😀👍🏽 and CJK 漢字かな한국어 mixed with code `print('é')`",
    "答案是 42 🎉 done 漢字",
    "Ünïcödé ñ — “quotes” … ½ ∑ ∞",
]


class _Slow:
    """A tokenizer without a ``tokenizers`` backend (the offset-window path)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
@pytest.mark.parametrize("text", TEXTS)
def test_text_plus_pending_is_the_full_decode_after_every_push(tokenizer, text, slow):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:5] + [tokenizer.eos_token_id] + ids[5:]  # a skipped special token inside, too
    stream = TextStream(_Slow(tokenizer) if slow else tokenizer)
    for n, i in enumerate(ids, 1):
        stream.push([i])
        assert stream.text + stream.pending == tokenizer.decode(ids[:n], skip_special_tokens=True)
    assert stream.pending == "" and stream.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_pending_holds_complete_text_that_shares_a_token_with_a_split_character(tokenizer):
    """Byte-level BPE has tokens such as " " + the first byte of an emoji: the stream holds the whole
    token back (the space too) while a full decode already shows the space."""
    ids = tokenizer("42 🎉", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    split = next(j for j, p in enumerate(pieces) if p.startswith(" ") and p.endswith("\ufffd"))
    stream = TextStream(tokenizer)
    stream.push(ids[: split + 1])
    assert stream.text == "42" and stream.pending == " \ufffd"
    stream.push(ids[split + 1 :])
    assert stream.text == "42 🎉" and stream.pending == ""
