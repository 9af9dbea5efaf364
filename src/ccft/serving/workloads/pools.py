"""Text and token pieces of workload traces: the bundled data sets as text pools, and exact-length
token pieces cut from them (with chat markup for ChatML tokenizers, plain labels otherwise).

Texts come from the bundled GSM8K (math), MBPP (code) and glaive (tools) rows under
``ccft/resources``. Each piece is tokenized on its own (``add_special_tokens=False``) and ids are
concatenated, so a trace's ids are authoritative (docs/design.md, "Token boundary").
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from pathlib import Path

from ccft.core.errors import ConfigError
from ccft.core.tokens import as_ids

__all__ = ["RESOURCES", "DOMAINS", "text_pool", "TokenPieces", "tokenizer_info"]

RESOURCES = Path(__file__).resolve().parents[2] / "resources"
DOMAINS = ("math", "code", "tools")


@functools.lru_cache(maxsize=None)
def text_pool(domain: str, part: str) -> tuple[str, ...]:
    """Texts of a bundled data set. ``part``: "task" (questions, requests) or "record" (answers,
    solutions)."""

    def rows(rel: str) -> list[dict]:
        path = RESOURCES / rel
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    if domain == "math":
        data = rows("gsm8k/train.jsonl")
        return tuple(r["question"] if part == "task" else r["answer"] for r in data)
    if domain == "code":
        data = rows("mbpp/train.jsonl")
        return tuple(r["prompt"].strip() if part == "task" else r["response"] for r in data)
    if domain == "tools":
        out = []
        for r in rows("glaive_tools/train.jsonl"):
            msgs = r["messages"]
            if part == "task":
                user = next((m["content"] for m in msgs if m["role"] == "user"), "")
                tools = " ".join(
                    t["function"]["name"] + ": " + t["function"].get("description", "")
                    for t in r.get("tools", [])
                )
                out.append(f"{user}\nAvailable functions: {tools}" if tools else user)
            else:
                out.append(msgs[-1]["content"])
        return tuple(dict.fromkeys(t for t in out if t.strip()))  # dedupe, keep order
    raise ConfigError(f"unknown text domain {domain!r}; choices: {', '.join(DOMAINS)}")


class TokenPieces:
    """Tokenizes pool rows once and cuts/extends token streams to exact lengths.

    Attributes:
        chatml: the tokenizer has ``<|im_start|>`` / ``<|im_end|>`` (pieces carry ChatML markup).
        bos: ``[bos_token_id]`` when the tokenizer adds a BOS to plain text (non-ChatML contexts start
            with it), else ``[]``.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[tuple[str, str, int], list[int]] = {}
        self._text: dict[str, list[int]] = {}
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.chatml = "<|im_start|>" in vocab and "<|im_end|>" in vocab
        plain = as_ids(tokenizer("a", add_special_tokens=False))
        special = as_ids(tokenizer("a", add_special_tokens=True))
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = (
            [bos]
            if (not self.chatml and bos is not None and special[:1] == [bos] and plain[:1] != [bos])
            else []
        )

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` alone (no special tokens added); memoised."""
        if text not in self._text:
            self._text[text] = as_ids(self.tok(text, add_special_tokens=False))
        return list(self._text[text])

    def row(self, domain: str, part: str, index: int) -> list[int]:
        """The ids of row ``index`` of ``text_pool(domain, part)`` plus a newline; memoised."""
        key = (domain, part, index)
        if key not in self._cache:
            self._cache[key] = as_ids(
                self.tok(text_pool(domain, part)[index] + "\n", add_special_tokens=False)
            )
        return self._cache[key]

    def body(self, rng: random.Random, domains: Sequence[str], part: str, length: int) -> list[int]:
        """At least ``length`` tokens: whole rows drawn from ``domains`` (in turn) until long enough."""
        out: list[int] = []
        i = rng.randrange(len(domains))  # which domain opens the text
        while len(out) < length:
            domain = domains[i % len(domains)]
            out += self.row(domain, part, rng.randrange(len(text_pool(domain, part))))
            i += 1
        return out

    def turn(self, role: str, header: str = "") -> tuple[list[int], list[int]]:
        """(head, tail) ids of one chat turn of ``role`` whose content starts with ``header``."""
        if self.chatml:
            return self.encode(f"<|im_start|>{role}\n{header}"), self.encode("<|im_end|>\n")
        return self.encode(f"{role.capitalize()}: {header}"), self.encode("\n\n")

    def fit(self, head: list[int], body: list[int], tail: list[int], length: int) -> list[int]:
        """Exactly ``length`` ids: head + body (cut) + tail; when too short for head and tail, the tail
        (the part that opens the next turn) is kept and the head cut first."""
        room = length - len(head) - len(tail)
        if room >= 0:
            return head + body[:room] + tail
        if length >= len(tail):
            return head[: length - len(tail)] + tail
        return tail[len(tail) - length :]


def tokenizer_info(tokenizer) -> dict:
    """``{name, vocab_size, digest}`` of a tokenizer, as a trace's meta records it (``digest``: ccft's
    tokenizer digest)."""
    from ccft.core.fingerprint import tokenizer_digest

    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return {
        "name": Path(name).name if name else "",
        "vocab_size": len(tokenizer),
        "digest": tokenizer_digest(tokenizer),
    }
