"""Static KV storage: the shared prefix arena and the per-lane tail pools.

Both are preallocated buffers written at explicit positions (gpt-fast style); nothing grows per
token. They grow only between steps, by doubling (a new buffer, old contents copied), which
bumps ``generation`` so captured decode graphs bound to the old addresses are dropped.

* ``PrefixArena``: C_base of every live ``PrefixHandle``. One flat buffer per layer for keys and
  one for values, ``(L, capacity_elements)``; a handle of b prompts with prefix length p owns one
  contiguous region viewed per layer as ``(b, h, p, d)`` (left-padded like ``BaseCache``, pad
  slots zero). Regions are allocated first-fit and freed when the handle's refcount drops to 0.
  After the prefill writes it, a region is only ever read. The engine keeps three more of them, same
  allocator: the own-layer arena (decoders at sharing depth m: their own K/V in the first layers,
  ``handles.OwnPrefix``; ``set_layers`` grows its layer count) and the compact C_base's code arena
  (int8) and scale arenas (bfloat16, keys only: ``pair=False``; ``handles.CompactHandle``).
* ``TailPool``: the decoder's own K/V (handoff tokens + generated tokens) of every active row of
  one lane, ``(L, slots, h, capacity, d)``. Active rows occupy slots ``0..R-1`` (compacted on
  finish) so a decode step reads ``[:R]`` as a view; a row's slot is zeroed on admission, and
  when the pool grows the new positions of the existing slots are zeroed too (a live row reads
  keys up to the batch's widest tail, masked; a masked NaN key or value still makes the output
  NaN), so attention reads only memory written for this request or zeroed (K3).

Shape notation: L layers, h KV heads, d head dim, b rows, p prefix length.
"""

from __future__ import annotations

import torch

from ccft.core.errors import CCFTError


class CapacityError(CCFTError, ValueError):
    """A request does not fit the engine's configured capacities (batch slots, tail or prefix tokens)."""


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two ≥ max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def _full(shape, fill: float, dtype, device) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype, device=device)


class PrefixArena:
    """Flat preallocated storage for prefix K/V regions (see module docstring).

    Args:
        num_layers, kv_heads, head_dim, dtype, device: the base model's KV geometry.
        capacity_tokens: initial capacity in token slots (a region of b rows × p tokens uses b·p).
        max_tokens: hard cap; an allocation beyond it raises CapacityError (None: unbounded).
        fill: value of never-written memory (0; NaN in tests so a read of unwritten memory shows).
        pair: hold a value buffer ``v`` beside the key buffer ``k`` (False: ``k`` only, ``v`` empty: the
            scales of the compact C_base, ``handles.CompactHandle``).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        *,
        capacity_tokens: int = 1024,
        max_tokens: int | None = None,
        fill: float = 0.0,
        pair: bool = True,
    ):
        self.pair = bool(pair)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.unit = kv_heads * head_dim  # elements per token per layer
        self.dtype, self.device, self.fill = dtype, torch.device(device), float(fill)
        self.max_tokens = max_tokens
        cap = max(1, int(capacity_tokens))
        if max_tokens is not None:
            cap = min(cap, int(max_tokens))
        self.k = self._buffer(num_layers, cap)
        self.v = self._buffer(num_layers, cap if self.pair else 0)
        self.capacity = cap  # tokens
        self.free_ranges: list[tuple[int, int]] = [(0, cap)]  # (start token, size), sorted, merged
        self.used: dict[int, int] = {}  # start token -> size
        self.generation = 0

    def _buffer(self, layers: int, tokens: int) -> torch.Tensor:
        fill = 0 if not self.dtype.is_floating_point else self.fill  # int8 codes: no NaN
        return _full((layers, tokens * self.unit), fill, self.dtype, self.device)

    @property
    def used_tokens(self) -> int:
        return sum(self.used.values())

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage the arena holds (its whole capacity, used or free)."""
        return self.k.nbytes + self.v.nbytes

    def allocate(self, tokens: int) -> int:
        """Reserve ``tokens`` contiguous token slots; returns the start slot. Grows the arena if needed."""
        tokens = max(1, int(tokens))
        start = self._fit(tokens)
        if start is None:
            self._grow(tokens)
            start = self._fit(tokens)
        assert start is not None
        self.used[start] = tokens
        return start

    def fits(self, tokens: int) -> bool:
        """Whether ``allocate(tokens)`` succeeds now: a free range that large, or room to grow to one (always,
        without ``max_tokens``)."""
        tokens = max(1, int(tokens))
        if any(n >= tokens for _, n in self.free_ranges) or self.max_tokens is None:
            return True
        tail_free = next((n for s, n in self.free_ranges if s + n == self.capacity), 0)
        return int(self.max_tokens) - self.capacity + tail_free >= tokens

    def _fit(self, tokens: int) -> int | None:
        for i, (s, n) in enumerate(self.free_ranges):
            if n >= tokens:
                if n == tokens:
                    self.free_ranges.pop(i)
                else:
                    self.free_ranges[i] = (s + tokens, n - tokens)
                return s
        return None

    def reserve(self, tokens: int) -> None:
        """Make ``tokens`` contiguous free token slots available now, growing (at most once) to exactly the
        capacity that needs, instead of the doubling ``allocate`` does when it runs out.

        For a caller that knows what it will allocate (an evaluation group's prefills, one region per
        producer): one growth to the sum, where allocating region by region doubles the arena for each and
        holds the old and the new storage at once while copying (the measured peak is in docs/study.md,
        "Time"). Beyond ``max_tokens`` it grows to ``max_tokens`` (``allocate`` then raises CapacityError).
        """
        tokens = int(tokens)
        if tokens <= 0 or any(n >= tokens for _, n in self.free_ranges):
            return
        tail_free = next((n for s, n in self.free_ranges if s + n == self.capacity), 0)
        new_cap = self.capacity + tokens - tail_free
        if self.max_tokens is not None:
            new_cap = min(new_cap, int(self.max_tokens))
        if new_cap > self.capacity:
            self._resize(new_cap)

    def _grow(self, tokens: int) -> None:
        old_cap = self.capacity
        new_cap = bucket(max(2 * old_cap, old_cap + tokens))
        if self.max_tokens is not None:
            new_cap = min(new_cap, int(self.max_tokens))
        tail_free = next((n for s, n in self.free_ranges if s + n == old_cap), 0)
        if new_cap - old_cap + tail_free < tokens:
            raise CapacityError(
                f"the prefix arena holds at most max_prefix_tokens={self.max_tokens} token slots "
                f"({self.used_tokens} in use, {tokens} requested); release finished PrefixHandles or "
                "raise max_prefix_tokens"
            )
        self._resize(new_cap)

    def _resize(self, new_cap: int) -> None:
        old_cap = self.capacity
        k = self._buffer(self.num_layers, new_cap)
        v = self._buffer(self.num_layers, new_cap if self.pair else 0)
        k[:, : old_cap * self.unit].copy_(self.k)
        v[:, : old_cap * self.unit].copy_(self.v)
        self.k, self.v, self.capacity = k, v, new_cap
        self._release_range(old_cap, new_cap - old_cap)
        self.generation += 1

    def set_layers(self, num_layers: int) -> None:
        """Hold ``num_layers`` layers from now on (only more: the regions' contents in the layers held so far
        are kept, the new layers are ``fill``). Bumps ``generation`` (new buffers). For the arena of the
        decoders' own prefix K/V, whose depth is the largest sharing depth registered (``lanes``)."""
        num_layers = int(num_layers)
        if num_layers <= self.num_layers:
            return
        k = self._buffer(num_layers, self.capacity)
        v = self._buffer(num_layers, self.capacity if self.pair else 0)
        k[: self.num_layers].copy_(self.k)
        v[: self.num_layers].copy_(self.v)
        self.k, self.v, self.num_layers = k, v, num_layers
        self.generation += 1

    def free(self, start: int) -> None:
        """Return the region starting at ``start`` to the free list."""
        size = self.used.pop(start)
        self._release_range(start, size)

    def _release_range(self, start: int, size: int) -> None:
        ranges = sorted(self.free_ranges + [(start, size)])
        merged: list[tuple[int, int]] = []
        for s, n in ranges:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free_ranges = merged

    def view(self, which: str, layer: int, start: int, rows: int, length: int) -> torch.Tensor:
        """The ``(rows, h, length, d)`` view of a region in layer ``layer`` of ``k`` or ``v``."""
        buf = self.k if which == "k" else self.v
        a = start * self.unit
        return buf[layer, a : a + rows * length * self.unit].view(rows, self.kv_heads, length, self.head_dim)

    def view_layers(self, which: str, start: int, rows: int, length: int) -> torch.Tensor:
        """The ``(L, rows, h, length, d)`` view of a region in every layer of ``k`` or ``v``."""
        buf = self.k if which == "k" else self.v
        a = start * self.unit
        return buf[:, a : a + rows * length * self.unit].view(
            self.num_layers, rows, self.kv_heads, length, self.head_dim
        )


class TailPool:
    """Per-lane static tail caches ``(L, slots, h, capacity, d)`` for keys and values (see module docstring).

    Args:
        slots, capacity: initial sizes (grown by doubling up to ``max_slots`` / ``max_capacity``).
        fill: value of never-written memory (0; NaN in tests).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        *,
        slots: int = 1,
        capacity: int = 64,
        max_slots: int = 64,
        max_capacity: int = 4096,
        fill: float = 0.0,
    ):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.fill = dtype, torch.device(device), float(fill)
        self.max_slots, self.max_capacity = int(max_slots), int(max_capacity)
        self.slots = min(bucket(slots), self.max_slots)
        self.capacity = min(bucket(capacity), self.max_capacity)
        self.k = self._alloc(self.slots, self.capacity)
        self.v = self._alloc(self.slots, self.capacity)
        self.generation = 0

    def _alloc(self, slots: int, capacity: int) -> torch.Tensor:
        return _full(
            (self.num_layers, slots, self.kv_heads, capacity, self.head_dim),
            self.fill,
            self.dtype,
            self.device,
        )

    def ensure(self, slots: int, capacity: int) -> None:
        """Grow (by doubling) so that ``slots`` rows of ``capacity`` tokens fit; contents are kept."""
        if slots > self.max_slots:
            raise CapacityError(
                f"{slots} active rows exceed max_batch={self.max_slots}; finish or abort requests, "
                "or raise max_batch"
            )
        if capacity > self.max_capacity:
            raise CapacityError(
                f"a request needs {capacity} tail tokens (handoff + max_new_tokens) but "
                f"max_tail_tokens={self.max_capacity}; lower max_new_tokens or raise max_tail_tokens"
            )
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = min(max(self.slots, bucket(slots)), self.max_slots)
        new_cap = min(max(self.capacity, bucket(capacity)), self.max_capacity)
        k, v = self._alloc(new_slots, new_cap), self._alloc(new_slots, new_cap)
        k[:, : self.slots, :, : self.capacity].copy_(self.k)
        v[:, : self.slots, :, : self.capacity].copy_(self.v)
        # grown positions of the old slots: live rows attend to them (masked) up to the batch's widest
        # tail, and a masked NaN (never-written memory) still yields NaN: zero them as clear_slot does
        k[:, : self.slots, :, self.capacity :].zero_()
        v[:, : self.slots, :, self.capacity :].zero_()
        self.k, self.v, self.slots, self.capacity = k, v, new_slots, new_cap
        self.generation += 1

    def permute(self, order: list[int]) -> None:
        """Reorder the first ``len(order)`` slots: slot i gets what slot ``order[i]`` held (all positions)."""
        idx = torch.tensor(order, dtype=torch.long, device=self.k.device)
        n = len(order)
        self.k[:, :n] = self.k[:, idx]
        self.v[:, :n] = self.v[:, idx]

    def clear_slot(self, slot: int) -> None:
        """Zero a slot before a new request uses it."""
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` tail positions of slot ``src`` into slot ``dst`` (compaction)."""
        if src == dst:
            return
        self.clear_slot(dst)
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])


__all__ = ["PrefixArena", "TailPool", "CapacityError", "bucket"]
