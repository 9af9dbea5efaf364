"""Writing prefixes: a batch of prompts, one prompt on top of a prefix store, a request's own tail.

The computations behind the engine's prefill entry points (``SharedPrefillEngine.prefill``,
``prefill_cached``, ``prefill_cache``) and the tail written when a request is admitted
(``add_request``). Each runs the producer's weights (``lanes.Producer``: the base for C_base, or a
decoder's own weights for the no-share baseline) and writes K/V at explicit positions; none reads
or writes anything outside the region or slot it is given (docs/design.md, "C_base"; K1, K2).

Shape notation: L layers, b rows, h KV heads, p prefix width, d head dim.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from ccft.core.cache import BaseCache
from ccft.inference import model as M
from ccft.inference.handles import OwnPrefix, PrefixHandle
from ccft.inference.kv import PrefixArena
from ccft.inference.lanes import Producer
from ccft.inference.weights import LaneWeights

log = logging.getLogger(__name__)

#: attention scores of one prefill pass are kept below this many elements (~256 MB in fp32)
SCORE_ELEMENTS = 2**26


#: prefill rows go in chunks of about this many (padded) tokens, each chunk padded only to its own longest row
CHUNK_TOKENS = 1024


def row_chunks(lengths: Sequence[int], heads: int) -> list[tuple[int, int, int]]:
    """Consecutive row ranges ``(r0, r1, width)`` to prefill together, ``width`` = the range's longest prefix.

    A range grows while its padded size ``rows × width`` stays within ``CHUNK_TOKENS`` (or it has one row)
    and its ``(rows, heads, width, width)`` attention scores within ``SCORE_ELEMENTS``. Rows sorted by
    length (as the eval runner sends them) then pad little; any order is correct.
    """
    chunks: list[tuple[int, int, int]] = []
    r0, width = 0, 0
    for r, n in enumerate(lengths):
        w = max(width, int(n), 1)
        rows = r - r0 + 1
        if rows > 1 and (rows * w > CHUNK_TOKENS or rows * heads * w * w > SCORE_ELEMENTS):
            chunks.append((r0, r, width))
            r0, w = r, max(int(n), 1)
        width = w
    if lengths:
        chunks.append((r0, len(lengths), width))
    return chunks


def prefill_rows(
    producer: Producer,
    ids: torch.Tensor,
    mask: torch.Tensor,
    handle: PrefixHandle | OwnPrefix,
    layers: int | None = None,
) -> None:
    """Run the producer over left-padded prefixes and write their K/V into ``handle``'s region.

    Args:
        ids, mask: ``(b, p)`` left-padded ``prompt[:n-k]`` ids and attention mask, b = handle.batch_size,
            p = handle.width.
        handle: a ``PrefixHandle``, or an ``OwnPrefix`` with ``layers`` = its depth m (the partial prefill of
            a decoder at sharing depth m: its own K/V in layers ``0..m-1``).
        layers: run and write only the first ``layers`` layers (default all L).
    Rows go in chunks (``row_chunks``), each computed at its own width w ≤ p (its longest row): its
    last w slots are written by the forward, the p - w slots before them are zeroed (pad slots).
    Per-row positions start at 0 at the first real token (``model.prefill``), so a row's K/V do not
    depend on the chunk it is in; this equals ``ccft.core.cache.compute_base_cache`` (tested).
    """
    w = producer.weights
    p = ids.shape[1]
    n_layers = w.num_layers if layers is None else int(layers)
    for r0, r1, width in row_chunks(mask.sum(-1).tolist(), w.heads):
        rs, off = slice(r0, r1), p - width
        if off:
            for i in range(n_layers):
                handle.keys(i)[rs, :, :off].zero_()
                handle.values(i)[rs, :, :off].zero_()
        M.prefill(
            w,
            ids[rs, off:],
            mask[rs, off:],
            lambda i, rs=rs, off=off: handle.keys(i)[rs, :, off:],
            lambda i, rs=rs, off=off: handle.values(i)[rs, :, off:],
            producer.lora,
            n_layers,
        )


def prefill_from_store(
    producer: Producer,
    prefix: Sequence[int],
    handle: PrefixHandle,
    arena: PrefixArena,
    store,
    chunk_tokens: int | None = None,
) -> tuple[list, int]:
    """Fill a batch-1 ``handle`` (width n = len(prefix)) from a prefix store, computing only the rest.

    The longest chain of full blocks of ``prefix`` cached in ``store`` under ``producer.key`` and its
    dtype is copied into the region; the remaining tokens are computed by chunked prefill attending
    to what is already there (``model.prefill_chunk``); the newly completed full blocks are then
    inserted into the store. ``ChunkedPrefill`` run to the end in one call.

    Args:
        store: a ``ccft.serving.PrefixKVStore`` (``block_tokens``, ``match``, ``insert``, ``release``).
        chunk_tokens: tokens computed per pass (default: as many as keep the ``(heads, chunk, n)``
            attention scores below ``SCORE_ELEMENTS``, at least 64).
    Returns:
        ``(blocks, hit_tokens)``: every store block covering the prefix, each with one reference
        taken for the caller (matched, then inserted), and the positions copied from the store (a
        multiple of ``store.block_tokens``).
    Raises:
        whatever the store or the forward raises; the references taken are dropped first.
    """
    job = ChunkedPrefill(producer, prefix, handle, arena, store)
    try:
        chunk = (
            int(chunk_tokens)
            if chunk_tokens
            else max(64, SCORE_ELEMENTS // max(1, producer.weights.heads * len(prefix)))
        )
        while job.remaining:
            job.advance(chunk)
        return job.finish(), job.hit
    except BaseException:
        job.abandon()
        raise


class ChunkedPrefill:
    """One prompt's prefix prefilled in pieces into a batch-1 ``handle`` (chunked prefill across steps).

    At construction the longest chain of full store blocks of ``prefix`` (under ``producer.key`` and
    its dtype; none without a store) is copied into the handle's region (``hit`` positions, a
    multiple of the block size). Each ``advance(t)`` computes the next ``t`` positions with
    ``model.prefill_chunk`` (they attend to everything before them in the region), so a scheduler
    can interleave decode steps between the pieces; ``finish`` inserts the newly completed full
    blocks into the store. The K/V equal a one-shot prefill of the prefix (``prefill_from_store``
    is this object run to the end; tested against ``prefill`` within fp32 rounding).

    The region's views are taken afresh on every call: the arena may grow (a new buffer) between
    two chunks when other handles are allocated.

    Attributes:
        hit: positions copied from the store.  done: positions written so far (``hit ≤ done ≤ n``).
        blocks: the matched store blocks (one reference each, held for the caller).
    """

    def __init__(
        self, producer: Producer, prefix: Sequence[int], handle: PrefixHandle, arena: PrefixArena, store=None
    ):
        self.producer, self.prefix, self.handle, self.arena, self.store = (
            producer,
            list(prefix),
            handle,
            arena,
            store,
        )
        self.blocks: list = []
        self.hit = 0
        if store is not None:
            bt = int(store.block_tokens)
            self.blocks = store.match(producer.key, producer.weights.dtype, self.prefix)
            try:
                rk, rv = self._region()
                for j, blk in enumerate(self.blocks):
                    rk[:, :, j * bt : (j + 1) * bt].copy_(blk.k)
                    rv[:, :, j * bt : (j + 1) * bt].copy_(blk.v)
            except BaseException:
                store.release(self.blocks)
                raise
            self.hit = len(self.blocks) * bt
        self.done = self.hit
        self._finished = False

    def _region(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.prefix)
        return (
            self.arena.view_layers("k", self.handle.start, 1, n)[:, 0],
            self.arena.view_layers("v", self.handle.start, 1, n)[:, 0],
        )  # (L, h, n, d) each

    @property
    def total(self) -> int:
        """n, the prefix length (positions the handle holds)."""
        return len(self.prefix)

    @property
    def remaining(self) -> int:
        """Positions still to compute."""
        return len(self.prefix) - self.done

    def advance(self, tokens: int) -> int:
        """Compute the next ``min(tokens, remaining)`` positions; returns how many were computed.

        Raises:
            ValueError: ``tokens`` < 1 while positions remain.
        """
        if self.remaining == 0:
            return 0
        if int(tokens) < 1:
            raise ValueError(f"tokens={tokens}; a prefill chunk needs at least 1 token")
        t = min(int(tokens), self.remaining)
        rk, rv = self._region()
        ids = torch.tensor(self.prefix[self.done : self.done + t], dtype=torch.long, device=self.arena.device)
        M.prefill_chunk(self.producer.weights, ids, self.done, rk, rv, self.producer.lora)
        self.done += t
        return t

    def finish(self) -> list:
        """Insert the newly completed full blocks into the store; returns every block covering the prefix
        (matched + inserted, one reference each for the caller; ``[]`` without a store).

        Raises:
            ValueError: positions remain to compute.
        """
        if self.remaining:
            raise ValueError(f"{self.remaining} prefix positions are not computed yet; advance first")
        self._finished = True
        if self.store is None:
            return []
        rk, rv = self._region()
        try:
            new = self.store.insert(
                self.producer.key,
                self.producer.weights.dtype,
                self.prefix,
                rk,
                rv,
                start_block=len(self.blocks),
            )
        except BaseException:
            self.store.release(self.blocks)
            raise
        return self.blocks + new

    def abandon(self) -> None:
        """Drop the matched blocks' references (a prefill given up before ``finish``)."""
        if not self._finished and self.store is not None:
            self._finished = True
            self.store.release(self.blocks)


def import_cache(cache: BaseCache, handle: PrefixHandle) -> None:
    """Copy a ``BaseCache``'s keys and values ``(b, h, p, d)`` per layer into ``handle``'s region (bit for
    bit)."""
    for i in range(len(cache.keys)):
        handle.keys(i).copy_(cache.keys[i])
        handle.values(i).copy_(cache.values[i])


def prefill_tail(
    handle: PrefixHandle,
    row: int,
    tail: Sequence[int],
    producer: Producer,
    weights: LaneWeights,
    lora: M.LoraPlan,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
    own: OwnPrefix | None = None,
    *,
    producer_done: bool = False,
) -> None:
    """Write a request's tail before its first decode step.

    ``tail`` = the row's k handoff tokens + the request's suffix tokens; the last one is fed by the
    first ``step()``. The producer computes the K/V of the suffix part the decoder does not
    recompute (``tail[:-k]``, positions from the row's prefix length), the decoder (``weights``,
    ``lora``) the first k-1 of its k recomputed tokens; both attend to the row's prefix and to the
    slot so far, and are written into the slot ``slot_k, slot_v (L, h, capacity, d)`` from index 0.

    ``own``: the decoder's own prefix K/V below its sharing depth m (``handles.OwnPrefix``): the decoder
    reads it in layers ``0..m-1``, and the suffix part's K/V in those layers are the decoder's own too (a
    partial forward of the decoder over the suffix, attending to its own prefix K/V, overwrites the
    producer's there), as a hybrid prefix over the whole ``prompt + suffix`` holds them.

    ``producer_done``: the producer's part is in the slot already (``write_tails`` computed it batched with
    other requests'); only the decoder's parts run.
    """
    k = handle.handoff_tokens
    n_pre = len(tail) - k  # suffix tokens the producer computes (C_base of the suffix)
    prefix_len, key_start = handle.lengths[row], int(handle.key_start[row])
    kf, vf = (lambda i: handle.keys(i)[row]), (lambda i: handle.values(i)[row])
    device = slot_k.device
    if n_pre > 0 and not producer_done:
        M.extend(
            producer.weights,
            torch.tensor(tail[:n_pre], device=device),
            prefix_len,
            kf,
            vf,
            key_start,
            slot_k,
            slot_v,
            0,
            producer.lora,
            logits=False,  # only the K/V: the suffix's logits are never read
        )
    if own is not None:
        kf = lambda i: handle.layer_keys(i, own)[row]  # noqa: E731
        vf = lambda i: handle.layer_values(i, own)[row]  # noqa: E731
        if n_pre > 0:  # the decoder's own K/V of the suffix below its depth
            M.extend(
                weights,
                torch.tensor(tail[:n_pre], device=device),
                prefix_len,
                kf,
                vf,
                key_start,
                slot_k,
                slot_v,
                0,
                lora,
                logits=False,
                layers=own.depth,
            )
    if k > 1:  # the first k-1 handoff tokens: one small forward for this row now
        M.extend(
            weights,
            torch.tensor(tail[n_pre:-1], device=device),
            prefix_len + n_pre,
            kf,
            vf,
            key_start,
            slot_k,
            slot_v,
            n_pre,
            lora,
            logits=False,
        )


def _rows(layer: torch.Tensor, one: int | None, index: torch.Tensor) -> torch.Tensor:
    """``layer (b, h, p, d)`` at row ``one`` (a ``(1, h, p, d)`` view), or else at the rows ``index`` (a
    gathered copy)."""
    if one is not None:
        return layer[one : one + 1]
    return layer.index_select(0, index)


@dataclass(eq=False)
class PendingTail:
    """A request admitted by ``SharedPrefillEngine.add_request`` whose tail is written before the lane's next
    step (``write_tails``), together with the others admitted since: the arguments of ``prefill_tail``
    (the decoder's weights are its lane's)."""

    request: object
    handle: PrefixHandle
    row: int
    tail: list[int]
    producer: Producer
    lora: M.LoraPlan
    own: OwnPrefix | None


def write_tails(
    pending: list[PendingTail],
    weights: LaneWeights,
    rows: Sequence[object],
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
) -> dict[int, BaseException]:
    """Write the tails of requests admitted together (``prefill_tail`` for each), the producer's part of
    those reading one handle batched into one forward (``model.extend_rows``): agents admitted on one
    context, each with its own suffix, cost one forward over their suffixes instead of one per agent.

    Args:
        pending: the admitted requests, in admission order.  weights: their lane's (the decoders').
        rows: the lane's active requests in slot order (each pending request's slot is its index there).
        pool_k, pool_v: the lane's tail pool.
    Returns:
        ``id(request) -> exception`` for the requests whose tail could not be written (a batched forward
        that fails is retried request by request, so a failure is confined to the requests that cause it).
    """
    slot = {id(r): i for i, r in enumerate(rows)}
    groups: dict[tuple[str, int, int], list[PendingTail]] = {}
    for p in pending:
        if len(p.tail) > p.handle.handoff_tokens:  # a suffix part the producer computes
            groups.setdefault((p.producer.key, id(p.producer.weights), id(p.handle)), []).append(p)
    done: set[int] = set()
    for group in groups.values():
        if len(group) < 2:
            continue
        first = group[0]
        k = first.handle.handoff_tokens
        lengths = [len(p.tail) - k for p in group]
        device = pool_k.device
        tokens = torch.zeros(len(group), max(lengths), dtype=torch.long, device=device)
        for r, p in enumerate(group):
            tokens[r, : lengths[r]] = torch.tensor(p.tail[: lengths[r]], device=device)
        index = torch.tensor([p.row for p in group], dtype=torch.long, device=device)
        one = first.row if len({p.row for p in group}) == 1 else None  # one context row: not gathered per row
        if one is not None:
            index = index[:1]
        starts = torch.tensor([p.handle.lengths[p.row] for p in group], dtype=torch.long, device=device)
        try:
            M.extend_rows(
                first.producer.weights,
                tokens,
                lengths,
                starts,
                lambda i: _rows(first.handle.keys(i), one, index),  # noqa: B023  (called in the loop)
                lambda i: _rows(first.handle.values(i), one, index),  # noqa: B023
                first.handle.real_slots(index),
                pool_k,
                pool_v,
                [slot[id(p.request)] for p in group],
                first.producer.lora,
            )
        except Exception as e:  # noqa: BLE001  (retried request by request below, where the error is confined)
            log.warning(
                "batched tail write of %d requests failed (%s); writing them one by one", len(group), e
            )
            continue
        done.update(id(p) for p in group)
    failed: dict[int, BaseException] = {}
    for p in pending:
        s = slot[id(p.request)]
        try:
            prefill_tail(
                p.handle,
                p.row,
                p.tail,
                p.producer,
                weights,
                p.lora,
                pool_k[:, s],
                pool_v[:, s],
                p.own,
                producer_done=id(p) in done,
            )
        except Exception as e:  # noqa: BLE001  (reported per request: the engine fails that request alone)
            failed[id(p.request)] = e
    return failed


__all__ = [
    "SCORE_ELEMENTS",
    "ChunkedPrefill",
    "prefill_rows",
    "prefill_from_store",
    "import_cache",
    "prefill_tail",
    "PendingTail",
    "write_tails",
]
