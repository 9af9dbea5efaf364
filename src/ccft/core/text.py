"""Generated ids -> text: stop strings and streaming detokenisation, one rule for every path.

``StopMatcher`` is the stop-string rule used by reference generation (``ccft.core.generation``), the
inference engine and the HTTP server: a completion ends at the earliest occurrence of any stop string
and its text is cut just before it. When streaming, the longest tail of the text that could still grow
into a stop string is held back (``holdback``), so a client never receives part of a stop string.

``TextStream`` turns ids into text deltas in time linear in the output length: with a fast tokenizer it
drives ``tokenizers.decoders.DecodeStream`` (which buffers a UTF-8 character split across tokens);
otherwise it re-decodes only a short window of recent ids (prefix/read offsets). The concatenation of
its deltas equals ``tokenizer.decode(ids, skip_special_tokens=True)`` of all the ids pushed
(docs/design.md, "Stop strings and streaming").
"""

from __future__ import annotations

from typing import Iterable, Sequence

_REPLACEMENT = "\ufffd"


class StopMatcher:
    """The stop-string rule. ``stop``: strings (empty ones ignored); ``None`` or ``[]`` means never stop."""

    def __init__(self, stop: Sequence[str] | str | None = None):
        if isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = [s for s in (stop or []) if s]

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str, start: int = 0) -> int:
        """Index in ``text`` of the earliest stop string that starts at or after ``start``, or -1."""
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def scan_from(self, text: str, new_from: int) -> int:
        """``find`` over only the part of ``text`` a new delta can complete (from ``new_from`` minus the
        longest stop string), so checking each new delta costs O(delta + longest stop)."""
        width = max((len(s) for s in self.stop), default=1)
        return self.find(text, max(0, new_from - width + 1))


def _backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast Hugging Face tokenizer, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "decoder") else None


class TextStream:
    """Token ids -> text deltas, linear in the output length (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (fast: ``tokenizers`` streaming decoder; slow: offset window).
    Attributes:
        text: everything emitted so far (== ``tokenizer.decode(ids, skip_special_tokens=True)`` once the
            last multi-byte character is complete).
        pending: what is held back, as a full decode renders it now (see ``pending``).
    """

    _WINDOW = 6  # ids of context the slow-tokenizer fallback re-decodes before the new ones

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []
        self._backend = _backend(tokenizer)
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
        else:
            self._stream = None
        # ids[_prefix:_read] decode to a suffix of ``text`` (context); ids[_read:] are held back
        self._prefix = 0
        self._read = 0

    def push(self, ids: Iterable[int]) -> str:
        """Append generated ids; return the new text (possibly "" while a character is incomplete)."""
        delta = []
        for i in ids:
            self.ids.append(int(i))
            piece = self._step(int(i))
            if piece:
                delta.append(piece)
        out = "".join(delta)
        if out:
            self._pieces.append(out)
        return out

    @property
    def text(self) -> str:
        """Everything emitted so far (joined on demand: pushing stays linear in the output length)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def pending(self) -> str:
        """The text of the ids pushed after the last non-empty delta, as a full decode renders it now
        (an incomplete UTF-8 character as U+FFFD), so ``text + pending ==
        tokenizer.decode(ids, skip_special_tokens=True)`` after every push. "" when nothing is held
        back; otherwise costs a decode of a short window of recent ids. A stop rule that must see what
        a full decode sees (``ccft.core.generation``) scans ``text + pending``."""
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix, len(self.ids))
        if now.startswith(before):
            return now[len(before) :]
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)[len(self.text) :]  # pragma: no cover

    def _decode(self, a: int, b: int) -> str:
        return self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)

    def _step(self, token: int) -> str:
        if self._stream is not None:
            piece = self._stream.step(self._backend, token) or ""
            if piece:  # the stream's window moves on as tokenizers' DecodeStream does (prefix = last read)
                self._prefix, self._read = self._read, len(self.ids)
            return piece
        before = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix, len(self.ids))
        if len(now) > len(before) and not now.endswith(_REPLACEMENT):
            piece = now[len(before) :]
            self._prefix, self._read = max(0, len(self.ids) - self._WINDOW), len(self.ids)
            # keep the invariant that ids[prefix:read] decodes to a suffix of the emitted text
            return piece
        return ""
