"""The chain hash of token blocks: one prompt prefix's identity, shared by the prefix store and the router.

Block ``i`` of a token list is identified by::

    h(-1) = H("ccft-prefix-kv", producer, dtype, block_tokens)
    h(i)  = H(h(i-1), token ids of block i)

``H`` is BLAKE2b-128 over length-prefixed parts. A key therefore covers every token up to its block's
end, the producer (the fingerprint of the model that wrote the K/V), the dtype and the block size.
``ccft.serving.prefix_store.PrefixKVStore`` keys its K/V blocks with it; ``ccft.serving.router``'s
``prefix`` router keys the blocks it placed on each worker with it. Pure Python (no torch): the dtype
is only its text (``str(dtype)``).

``BlockId`` is one K/V block's full identity (its chain key and what the key was built from), the
argument of every tier under the store: ``ccft.serving.prefix_spill.DiskSpill`` and
``ccft.serving.prefix_pool.PrefixPool`` (and its ``encode_block`` / ``decode_block``) name their files,
keys and headers after it and compare it with what they read back. ``producer_hash`` is the producer's
part of those names.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["chain_keys", "BlockId", "producer_hash"]


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


def producer_hash(producer: str, digest_size: int) -> str:
    """BLAKE2b of ``str(producer)`` in hex (``2 * digest_size`` characters): the producer's part of a pool
    key (16 bytes) and of a spill file name (8 bytes)."""
    return hashlib.blake2b(str(producer).encode(), digest_size=int(digest_size)).hexdigest()


@dataclass(frozen=True)
class BlockId:
    """One full K/V block's identity in the prefix store, as its disk and pool tiers name and check it.

    A tier keys a block by ``chain_key``, ``producer`` and ``dtype`` and stores every field next to the
    K/V; a read compares each stored field with the ``BlockId`` the reader asks for and treats a
    difference as a miss, so a disk or a pool can never hand one producer's K/V (or another dtype's,
    block size's, position's or tokens') to another reader.

    Attributes:
        chain_key: the block's chain hash (``chain_keys``: 16 bytes covering the producer, the dtype, the
            block size and every token up to the block's end).
        producer: who wrote the K/V: the base's fingerprint in shared mode, a decoder's own key in the
            no-share baseline (``str`` of what was given).
        dtype: the K/V dtype (a ``torch.dtype``).
        block_tokens: tokens per block (``int``); the K/V of the block are ``(L, h, block_tokens, d)``.
        index: the block's position in its prompt (it covers tokens ``index * block_tokens ..
            (index + 1) * block_tokens - 1``; ``int``).
        tokens: the block's token ids, a tuple of ints (any sequence of ints is converted).
    """

    chain_key: bytes
    producer: str
    dtype: torch.dtype
    block_tokens: int
    index: int
    tokens: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "chain_key", bytes(self.chain_key))
        object.__setattr__(self, "producer", str(self.producer))
        object.__setattr__(self, "block_tokens", int(self.block_tokens))
        object.__setattr__(self, "index", int(self.index))
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
