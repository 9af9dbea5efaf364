"""The chain hash of token blocks: one prompt prefix's identity, shared by the prefix store and the router.

Block ``i`` of a token list is identified by::

    h(-1) = H("ccft-prefix-kv", producer, dtype, block_tokens)
    h(i)  = H(h(i-1), token ids of block i)

``H`` is BLAKE2b-128 over length-prefixed parts. A key therefore covers every token up to its block's
end, the producer (the fingerprint of the model that wrote the K/V), the dtype and the block size.
``ccft.serving.prefix_store.PrefixKVStore`` keys its K/V blocks with it; ``ccft.serving.router``'s
``prefix`` router keys the blocks it placed on each worker with it. Pure Python (no torch): the dtype
is only its text (``str(dtype)``).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

__all__ = ["chain_keys"]


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def chain_keys(producer: str, dtype: object, block_tokens: int, token_ids: Sequence[int]) -> list[bytes]:
    """The chain hash of every full block of ``token_ids``.

    Args:
        producer: who wrote (or would write) the K/V; ``str(producer)`` is hashed.
        dtype: the K/V dtype (a ``torch.dtype`` or any object); ``str(dtype)`` is hashed.
        block_tokens: tokens per block (≥ 1; the caller checks it).
        token_ids: the prompt's token ids (ints in ``-2**63 .. 2**63-1``); the trailing partial block
            is not keyed.
    Returns:
        ``len(token_ids) // block_tokens`` keys of 16 bytes each; key ``i`` covers tokens
        ``0 .. (i+1)*block_tokens - 1``.
    """
    key = _digest(b"ccft-prefix-kv", str(producer).encode(), str(dtype).encode(), str(block_tokens).encode())
    keys = []
    b = int(block_tokens)
    for i in range(len(token_ids) // b):
        key = _digest(key, array("q", [int(t) for t in token_ids[i * b : (i + 1) * b]]).tobytes())
        keys.append(key)
    return keys
