"""``IncrementalDetokenizer``: generated token ids → text deltas for streaming responses.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji or a CJK character
often spans two or three tokens), and a stop string can span tokens. The streamer therefore

* decodes the cumulative ids and emits only the new suffix of the text;
* holds back text that ends in U+FFFD (the decoder's stand-in for an incomplete UTF-8 sequence)
  until the next token completes it;
* holds back text that could be the start of a stop string, and never emits a stop string or what
  follows it (the engine cuts the final text before the first stop string it finds);

so the concatenation of every delta is always a prefix of the final text, and ``finish`` emits the
rest of it (the final text is the engine's ``Generation.text``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``, as the engine).
        stop: the request's stop strings (empty strings are ignored).
    """

    def __init__(self, tokenizer, stop: Sequence[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; returns the text that is now safe to send (possibly "")."""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.startswith(self.emitted):
            return ""  # earlier text changed when decoded with more ids: wait for the final text
        end = len(text)
        if self.stop:
            cut = min((text.find(s) for s in self.stop if s in text), default=-1)
            if cut >= 0:
                end = cut
            else:
                end -= self._stop_prefix_len(text)
        while end > len(self.emitted) and text[end - 1] == _REPLACEMENT:
            end -= 1
        if end <= len(self.emitted):
            return ""
        delta = text[len(self.emitted):end]
        self.emitted += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` after what was already emitted (the request's last delta)."""
        if final_text.startswith(self.emitted):
            delta = final_text[len(self.emitted):]
        else:  # cannot happen with prefix-stable decoding; send what is new past the common prefix
            common = 0
            for a, b in zip(self.emitted, final_text):
                if a != b:
                    break
                common += 1
            delta = final_text[common:] if common == len(self.emitted) else ""
        self.emitted += delta
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
