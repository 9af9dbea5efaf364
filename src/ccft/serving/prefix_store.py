"""``PrefixKVStore``: reusable prompt-prefix K/V in token blocks, keyed by the model that wrote them.

Multi-agent workloads send prompts that share long prefixes (a shared context that grows every
turn, then agent-specific text). The store keeps the K/V of full token blocks of prompts already
prefilled so that the next prefill copies the longest cached prefix and computes only the rest
(``SharedPrefillEngine.prefill_cached``).

Keys (K5). Block ``i`` of a token list is identified by a hash chain::

    h(-1) = H("ccft-prefix-kv", producer, dtype, block_tokens)
    h(i)  = H(h(i-1), token ids of block i)

so a block's key depends on every token before it and on the *producer* (the fingerprint of the
model that wrote the K/V: the base's fingerprint in shared mode, a decoder's own key in the
no-share baseline) and the dtype. K/V written by another model or in another dtype is therefore
never served. ``H`` is BLAKE2b-128 (``ccft.serving.block_keys.chain_keys``, which the ``prefix`` router of
``ccft.serving.router`` uses too); a match also compares the stored token ids and parent block,
so a hash collision cannot serve wrong K/V either.

Blocks. Only full blocks of ``block_tokens`` tokens are stored; a block holds a copy of its K/V
for every layer, ``k, v: (L, h, block_tokens, d)`` (L layers, h KV heads, d head dim) on the
device of the tensors it was inserted from. A block's positions are implied by its index (block
``i`` covers prompt positions ``i*B .. (i+1)*B-1``; the prompt is not padded).

References and eviction. ``match`` and ``insert`` acquire one reference per returned block
(``release`` drops it); a referenced block is never evicted. Under ``budget_bytes`` the least
recently used unreferenced *leaf* blocks (no cached child) are evicted first, so a chain always
loses its tail before its head and every stored block stays reachable; touching a block also
touches its ancestors (a parent is never older than its children). Lookups stop at the first
missing block.

Counters (``stats()``): ``lookups`` (``match`` calls), ``hit_blocks`` / ``hit_tokens`` (full
blocks served), ``miss_blocks`` / ``miss_tokens`` (full blocks looked up and not found; the
trailing partial block of a token list is never looked up or counted), ``hit_ratio`` =
hit_tokens / (hit_tokens + miss_tokens) (0.0 before any full block was looked up),
``inserted_blocks``, ``skipped_blocks`` (not stored: the budget was full of referenced blocks, or
the chain's parent was missing), ``evicted_blocks`` / ``evicted_bytes``, ``blocks``,
``bytes_in_use``, ``referenced_blocks``, ``budget_bytes``.

Pool. With a ``pool`` (``ccft.serving.prefix_pool.PrefixPool``, issue 36) a lookup that runs out of
local blocks asks the pool for the rest of the chain (one ``fetch_chain`` call), and stores each block it gets
here before it is served (the chain stops at the first block the pool lacks, or that does not fit
the budget); every block ``insert`` stores is published to the pool. ``hit_blocks`` counts blocks
served from either place, ``pool_hit_blocks`` those that came from the pool (``stats()["pool"]``
holds the pool tier's own counters).

Spill. With a ``spill`` (``ccft.serving.prefix_spill.DiskSpill``: local disk, the ``ccft precompute`` shard
format) every block ``evict`` drops is written there first (unless it is there already), and a lookup
whose local chain ends reads the next blocks of the chain from disk, in order, storing each here like a
pool block, before it asks the pool. ``spilled_blocks`` counts the evicted blocks written,
``spill_hit_blocks`` the blocks served from disk (also in ``hit_blocks``); ``stats()["spill"]`` holds the
disk tier's own counters (errors, bytes on disk). ``forget`` deletes the producer's files too; ``clear``
leaves the disk alone.

Not thread-safe: one scheduler thread calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ccft.core.errors import ConfigError
from ccft.serving.block_keys import BlockId, chain_keys


@dataclass(eq=False)
class Block:
    """One cached block of ``block_tokens`` tokens.

    Attributes:
        key: the chain hash (bytes).  parent: the previous block of the chain (None for block 0).
        index: block position in the prompt (covers tokens ``index*B .. index*B+B-1``).
        tokens: the block's token ids.  producer, dtype: who wrote the K/V, in which dtype.
        k, v: ``(L, h, B, d)`` copies of the block's keys and values for every layer.
        refs: holders (a prefill in progress, a live handle).  children: cached child blocks.
    """

    key: bytes
    parent: "Block | None"
    index: int
    tokens: tuple[int, ...]
    producer: str
    dtype: torch.dtype
    k: torch.Tensor
    v: torch.Tensor
    refs: int = 0
    children: int = 0
    stored: bool = field(default=True, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def __repr__(self) -> str:
        return (
            f"Block(index={self.index}, key={self.key.hex()[:12]}, refs={self.refs}, "
            f"children={self.children}, {'stored' if self.stored else 'dropped'})"
        )


class PrefixKVStore:
    """Content-addressed K/V of full prompt blocks with refcounts and LRU eviction (module docstring).

    Args:
        block_tokens: tokens per block (B ≥ 1). Smaller blocks hit more often (a hit can end closer
            to where two prompts diverge) but cost more bookkeeping and copies.
        budget_bytes: the most bytes of K/V kept (None: unbounded). Inserting past it evicts
            unreferenced blocks (LRU leaves first); blocks that still do not fit are not stored.
        pool: a ``ccft.serving.prefix_pool.PrefixPool`` shared with other stores (None: none). ``match``
            continues a local chain with blocks fetched from it (stored here like inserted ones) and
            ``insert`` publishes the blocks it stores (module docstring, "Pool").
        spill: a ``ccft.serving.prefix_spill.DiskSpill`` (None: none). ``evict`` writes the blocks it drops
            there and ``match`` continues a local chain from it before the pool (module docstring, "Spill").
    Raises:
        ConfigError: ``block_tokens < 1`` or a negative budget.
    """

    def __init__(self, block_tokens: int = 16, budget_bytes: int | None = None, pool=None, spill=None):
        if int(block_tokens) < 1:
            raise ConfigError(f"block_tokens={block_tokens}; it must be ≥ 1")
        if budget_bytes is not None and int(budget_bytes) < 0:
            raise ConfigError(f"budget_bytes={budget_bytes}; use None (unbounded) or a size in bytes ≥ 0")
        self.block_tokens = int(block_tokens)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # LRU first, MRU last
        self.bytes_in_use = 0
        self.pool = pool
        self.spill = spill
        self.reset_stats()

    # ------------------------------------------------------------------ keys
    def chain_keys(self, producer: str, dtype: torch.dtype, token_ids: Sequence[int]) -> list[bytes]:
        """The chain hash of every full block of ``token_ids`` (``len(token_ids) // block_tokens`` keys of
        16 bytes; ``ccft.serving.block_keys.chain_keys`` with this store's block size)."""
        return chain_keys(producer, dtype, self.block_tokens, token_ids)

    def _lookup(
        self, key: bytes, parent: Block | None, tokens: tuple[int, ...], producer: str, dtype: torch.dtype
    ) -> Block | None:
        blk = self._blocks.get(key)
        if (
            blk is None
            or blk.parent is not parent
            or blk.tokens != tokens
            or blk.producer != producer
            or blk.dtype != dtype
        ):
            return None
        return blk

    def _tokens(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        b = self.block_tokens
        return tuple(int(t) for t in token_ids[i * b : (i + 1) * b])

    def _id(
        self, key: bytes, producer: str, dtype: torch.dtype, index: int, tokens: tuple[int, ...]
    ) -> BlockId:
        """A block's identity with this store's ``block_tokens``, as the spill and the pool take it."""
        return BlockId(key, producer, dtype, self.block_tokens, index, tokens)

    # ------------------------------------------------------------------ API
    def match(self, producer: str, dtype: torch.dtype, token_ids: Sequence[int]) -> list[Block]:
        """The longest cached chain of full blocks that prefixes ``token_ids``; acquires one ref on each.

        Args:
            producer: key of the model that must have written the K/V (base fingerprint, or a
                decoder's own key). dtype: the reader's K/V dtype.
            token_ids: the prompt (prefix) ids; its trailing partial block is not looked up.
        Returns:
            blocks ``0..m-1`` (``m * block_tokens`` hit tokens); release them with ``release``.
        """
        keys = self.chain_keys(producer, dtype, token_ids)
        found: list[Block] = []
        parent = None
        for i, key in enumerate(keys):
            blk = self._lookup(key, parent, self._tokens(token_ids, i), producer, dtype)
            if blk is None:
                break
            found.append(blk)
            parent = blk
        for blk in found:  # referenced before the pool's blocks take room: making it never evicts them
            blk.refs += 1
        if self.spill is not None:  # the DRAM chain ends: continue it from local disk, block by block
            first = len(found)
            from_disk = (
                self.spill.get(self._id(keys[i], producer, dtype, i, self._tokens(token_ids, i)))
                for i in range(first, len(keys))
            )
            parent = self._extend(keys, token_ids, producer, dtype, found, parent, from_disk)
            self.spill_hit_blocks += len(found) - first
        if self.pool is not None and len(found) < len(keys):  # then from the pool, in one call
            first = len(found)
            fetched = self.pool.fetch_chain(
                [
                    self._id(keys[i], producer, dtype, i, self._tokens(token_ids, i))
                    for i in range(first, len(keys))
                ]
            )
            parent = self._extend(keys, token_ids, producer, dtype, found, parent, fetched)
            self.pool_hit_blocks += len(found) - first
        if found:
            self._touch(found[-1])
        self.lookups += 1
        self.hit_blocks += len(found)
        self.miss_blocks += len(keys) - len(found)
        self.hit_tokens += len(found) * self.block_tokens
        self.miss_tokens += (len(keys) - len(found)) * self.block_tokens
        return found

    def _extend(
        self,
        keys: list[bytes],
        token_ids: Sequence[int],
        producer: str,
        dtype: torch.dtype,
        found: list[Block],
        parent: Block | None,
        kvs: Iterable[tuple[torch.Tensor, torch.Tensor] | None],
    ) -> Block | None:
        """Extend ``found`` (blocks ``0..len(found)-1``, referenced) with the next blocks of the chain, whose
        ``(k, v)`` a lower tier gives in order (``kvs``: disk or pool; None: it lacks the block), each stored
        here (``copy=False``) and referenced; stops at the first block the tier lacks or that does not fit
        the budget (``kvs`` is not read further). Returns the chain's last block."""
        for i, kv in zip(range(len(found), len(keys)), kvs):
            tokens = self._tokens(token_ids, i)
            blk = (
                None
                if kv is None
                else self._add(keys[i], parent, i, tokens, producer, dtype, *kv, copy=False)
            )
            if blk is None:
                break
            blk.refs += 1
            found.append(blk)
            parent = blk
        return parent

    def insert(
        self,
        producer: str,
        dtype: torch.dtype,
        token_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        start_block: int = 0,
    ) -> list[Block]:
        """Store the full blocks ``start_block ..`` of ``token_ids`` (copies of ``k``/``v``); acquires one ref
        on each.

        Blocks already stored are reused (and touched), not overwritten. Blocks ``< start_block`` must
        be stored (normally: the ones ``match`` returned, still referenced); a block whose parent is
        not stored, or that does not fit the budget after evicting every evictable block, is not
        stored, and neither is any block after it (``skipped_blocks`` counts them).

        Args:
            token_ids: the ids behind ``k``/``v`` (n tokens, positions ``0..n-1``).
            k, v: ``(L, h, n', d)`` with ``n' ≥ (len(token_ids) // block_tokens) * block_tokens``:
                keys / values of those positions for every layer, in ``dtype``.
            start_block: the first block to store.
        Returns:
            the blocks ``start_block .. start_block+m-1`` now stored (m may be smaller than asked);
            release them with ``release``.
        Raises:
            ConfigError: ``k``/``v`` of another dtype than ``dtype``, mismatched or too short.
        """
        if k.dtype != dtype or v.dtype != dtype:
            raise ConfigError(
                f"insert(dtype={dtype}) but k/v are {k.dtype}/{v.dtype}; the dtype is part of the key "
                "(K5): pass the dtype the K/V were computed in"
            )
        if k.dim() != 4 or k.shape != v.shape:
            raise ConfigError(f"k and v must both be (L, h, n, d); got {tuple(k.shape)} and {tuple(v.shape)}")
        keys = self.chain_keys(producer, dtype, token_ids)
        b = self.block_tokens
        if k.shape[2] < len(keys) * b:
            raise ConfigError(
                f"k/v cover {k.shape[2]} positions but token_ids has {len(keys)} full blocks of {b}"
            )
        start_block = max(0, int(start_block))
        parent = None
        for i in range(start_block):  # the chain up to start_block must be stored
            parent = self._lookup(keys[i], parent, self._tokens(token_ids, i), producer, dtype)
            if parent is None:
                self.skipped_blocks += len(keys) - start_block
                return []
        out: list[Block] = []
        created: list[Block] = []
        for i in range(start_block, len(keys)):
            tokens = self._tokens(token_ids, i)
            blk = self._lookup(keys[i], parent, tokens, producer, dtype)
            if blk is None:
                s = i * b
                blk = self._add(
                    keys[i], parent, i, tokens, producer, dtype, k[:, :, s : s + b], v[:, :, s : s + b]
                )
                if blk is None:
                    self.skipped_blocks += len(keys) - i
                    break
                self.inserted_blocks += 1
                created.append(blk)
            blk.refs += 1
            out.append(blk)
            parent = blk
        if out:
            self._touch(out[-1])
        if self.pool is not None:  # publish what this prefill computed (a pool that is down is skipped)
            for blk in created:
                self.pool.publish(self._id(blk.key, blk.producer, dtype, blk.index, blk.tokens), blk.k, blk.v)
        return out

    def _add(
        self,
        key: bytes,
        parent: Block | None,
        index: int,
        tokens: tuple[int, ...],
        producer: str,
        dtype: torch.dtype,
        k: torch.Tensor,
        v: torch.Tensor,
        copy: bool = True,
    ) -> Block | None:
        """Store a new block (copies of ``k``/``v``: ``(L, h, B, d)``; ``copy=False``: the tensors themselves,
        which no one else holds) under ``parent``; None when the key is
        taken by another chain (a hash collision: the stored one is kept) or it does not fit the budget
        after evicting every evictable block."""
        if key in self._blocks:
            return None
        need = k.numel() * k.element_size() + v.numel() * v.element_size()
        if self.budget_bytes is not None and self.bytes_in_use + need > self.budget_bytes:
            self.evict(self.bytes_in_use + need - self.budget_bytes)
            if self.bytes_in_use + need > self.budget_bytes:
                return None
        if copy:
            k, v = k.clone(), v.clone()
        blk = Block(key, parent, index, tokens, str(producer), dtype, k, v)
        self._blocks[key] = blk
        if parent is not None:
            parent.children += 1
        self.bytes_in_use += blk.nbytes
        return blk

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block (blocks dropped by ``clear`` are ignored).

        Raises:
            ConfigError: a block released more often than it was acquired.
        """
        for blk in blocks:
            if blk.refs <= 0:
                raise ConfigError(f"{blk!r} released more often than it was acquired")
            blk.refs -= 1

    def evict(self, bytes_needed: int) -> int:
        """Evict unreferenced leaf blocks, least recently used first, until ``bytes_needed`` are freed; with a
        ``spill`` each one is written to disk first (unless it is there; module docstring, "Spill").

        Returns:
            bytes freed (less than asked when every remaining block is referenced or has a
            referenced descendant).
        """
        freed = 0
        while freed < bytes_needed:
            victim = next((blk for blk in self._blocks.values() if blk.refs == 0 and blk.children == 0), None)
            if victim is None:
                break
            if self.spill is not None:  # to local disk instead of lost (unless it is there already)
                self._spill(victim)
            freed += self._drop(victim)
            self.evicted_blocks += 1
            self.evicted_bytes += victim.nbytes
        return freed

    def forget(self, producer: str) -> int:
        """Drop every block written by ``producer`` (a key no model writes any more, e.g. a decoder's key
        from before an in-place edit of its weights; referenced blocks too, as ``clear``: their holders
        keep their own copies). Chains never mix producers, so no other block loses its parent.

        Returns:
            bytes freed.
        """
        freed = 0
        for blk in [b for b in self._blocks.values() if b.producer == str(producer)]:
            del self._blocks[blk.key]
            blk.stored = False
            self.bytes_in_use -= blk.nbytes
            freed += blk.nbytes
        if self.spill is not None:  # its files would never hit again either
            self.spill.forget(str(producer))
        return freed

    def clear(self) -> None:
        """Drop every block (referenced ones too: their holders keep their own copies; a later
        ``release`` of them is harmless). Counters are kept (``reset_stats`` resets them)."""
        for blk in self._blocks.values():
            blk.stored = False
        self._blocks.clear()
        self.bytes_in_use = 0

    def reset_stats(self) -> None:
        """Zero the hit / miss / insert / eviction counters."""
        self.lookups = self.hit_blocks = self.miss_blocks = self.hit_tokens = self.miss_tokens = 0
        self.inserted_blocks = self.skipped_blocks = self.evicted_blocks = self.evicted_bytes = 0
        self.pool_hit_blocks = self.spill_hit_blocks = self.spilled_blocks = 0

    # ------------------------------------------------------------------ internals
    def _drop(self, blk: Block) -> int:
        del self._blocks[blk.key]
        blk.stored = False
        if blk.parent is not None and blk.parent.stored:
            blk.parent.children -= 1
        self.bytes_in_use -= blk.nbytes
        return blk.nbytes

    def _spill(self, blk: Block) -> None:
        if self.spill.put(self._id(blk.key, blk.producer, blk.dtype, blk.index, blk.tokens), blk.k, blk.v):
            self.spilled_blocks += 1

    def _touch(self, blk: Block | None) -> None:
        """Mark ``blk`` and its ancestors most recently used (ancestors after, so never older)."""
        while blk is not None:
            if blk.stored:
                self._blocks.move_to_end(blk.key)
            blk = blk.parent

    # ------------------------------------------------------------------ reporting
    @property
    def hit_ratio(self) -> float:
        """hit_tokens / (hit_tokens + miss_tokens) over every full block looked up; 0.0 before any."""
        looked = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / looked if looked else 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def blocks(self) -> list[Block]:
        """Stored blocks, least recently used first."""
        return list(self._blocks.values())

    def stats(self) -> dict:
        """Counters and occupancy (see the module docstring for definitions); a plain dict (JSON-ready)."""
        return {
            "block_tokens": self.block_tokens,
            "blocks": len(self._blocks),
            "bytes_in_use": self.bytes_in_use,
            "budget_bytes": self.budget_bytes,
            "referenced_blocks": sum(1 for b in self._blocks.values() if b.refs > 0),
            "lookups": self.lookups,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "hit_ratio": self.hit_ratio,
            "inserted_blocks": self.inserted_blocks,
            "skipped_blocks": self.skipped_blocks,
            "evicted_blocks": self.evicted_blocks,
            "evicted_bytes": self.evicted_bytes,
            "pool_hit_blocks": self.pool_hit_blocks,
            "spilled_blocks": self.spilled_blocks,
            "spill_hit_blocks": self.spill_hit_blocks,
            **({"pool": self.pool.stats()} if self.pool is not None else {}),
            **({"spill": self.spill.stats()} if self.spill is not None else {}),
        }

    def __repr__(self) -> str:
        return (
            f"PrefixKVStore(block_tokens={self.block_tokens}, blocks={len(self._blocks)}, "
            f"bytes_in_use={self.bytes_in_use}, budget_bytes={self.budget_bytes})"
        )


__all__ = ["PrefixKVStore", "Block"]
