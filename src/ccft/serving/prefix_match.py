"""Automatic shared-prefix detection: the context a request without a ``shared_len`` hint shares.

vLLM and llama.cpp find a prompt's reusable prefix themselves (block hashes; a slot's longest common
prefix); a client need not say which part of a prompt is shared. ccft's scheduler does the same for a
request that gives no ``shared_len`` (``shared_prefix_tokens`` over HTTP): at admission it compares the
request's prompt, block by block, with the prompts of every other request it holds (queued, prefilling,
decoding) and with its live contexts, and takes the longest common prefix of whole blocks as the
request's shared context. Agents of one session, whose prompts differ after a common context, then read
one prefill of that context and compute only their own tokens (their tails), exactly as with the hint
(docs/serving.md, "Shared prefix without a hint"). The split is a placement only: outputs do not depend on
it (docs/server.md, ``shared_prefix_tokens``).

Blocks are compared by chained hashes (block i's hash covers blocks 0..i, as ``PrefixKVStore`` keys its
blocks); a match is confirmed on the token ids, so a hash collision cannot join two different prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: block size of the comparison when the scheduler has no prefix store (its ``block_tokens`` otherwise)
DEFAULT_BLOCK_TOKENS = 16


def block_hashes(ids: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the whole blocks of ``ids``: entry i covers ``ids[: (i + 1) * block_tokens]``.

    Raises:
        ValueError: ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens}; it must be ≥ 1")
    out, h = [], 0
    for end in range(block_tokens, len(ids) + 1, block_tokens):
        h = hash((h, tuple(ids[end - block_tokens : end])))
        out.append(h)
    return out


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading entries two ``block_hashes`` lists share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_tokens(
    ids: Sequence[int],
    blocks: Sequence[int],
    others: Iterable[tuple[Sequence[int], Sequence[int]]],
    block_tokens: int,
) -> int:
    """Tokens of the longest whole-block prefix ``ids`` shares with any of ``others``.

    Args:
        ids: the request's prompt token ids; blocks: their ``block_hashes``.
        others: ``(token ids, their block_hashes)`` of the other prompts and contexts held.
        block_tokens: the block size both hash lists were made with.
    Returns:
        a multiple of ``block_tokens`` (0: no whole block in common with any), or ``len(ids)`` when another
        prompt starts with the whole of ``ids`` (equal prompts, e.g. ``n`` choices of one: one context).
    """
    best, n_ids = 0, len(ids)
    for other_ids, other_blocks in others:
        if len(other_ids) >= n_ids and list(other_ids[:n_ids]) == list(ids):
            return n_ids
        n = common_blocks(blocks, other_blocks)
        while n > best and list(ids[: n * block_tokens]) != list(other_ids[: n * block_tokens]):
            n -= 1  # a hash collision: back off to blocks whose tokens agree
        best = max(best, n)
    return best * block_tokens


__all__ = ["DEFAULT_BLOCK_TOKENS", "block_hashes", "common_blocks", "shared_prefix_tokens"]
