"""``PrefixHandle``: a batch of prompts prefilled into the engine's prefix arena, refcounted.

A handle owns one contiguous region of ``SharedPrefillEngine.arena`` (``kv.PrefixArena``) holding
the K/V of ``prompt[:n-k]`` for each of its b prompts, left-padded to width p, viewed per layer as
``(b, kv_heads, p, head_dim)`` (pad slots zero). After the prefill writes it the region is only
read (docs/design.md, "C_base"; fault class K1). Who wrote it is recorded (``producer``) and checked
by every reader (K5).

The region lives while anyone references it: the user (until ``release()``) and each active
request reading one of its rows (``acquire()`` on admission, ``unref()`` when the request leaves).

A decoder trained at sharing depth m > 0 (``share_from_layer``; docs/design.md, "Terms") reads its own
prompt K/V in layers ``0..m-1`` and C_base in ``m..L-1``. Its own K/V of a C_base handle's prefixes is an
``OwnPrefix``: a region of the engine's own-layer arena (m layers, not L), computed by a partial prefill
with the decoder's weights the first time the decoder reads the handle, kept per producer key (decoder and
weights) beside the handle and freed with it. ``PrefixHandle.layer_keys`` / ``layer_values`` give what a
reader attends to in a layer: its own K/V below its depth, C_base above.

A decoder served on the compact C_base (``cache_format`` ``int8``; ``ccft.core.compact``) reads a second
handle derived from the C_base handle (``PrefixHandle.formats``), a ``CompactHandle``: the same prefixes as
int8 codes (keys per channel, values per token) and bfloat16 scales in the engine's code and scale arenas,
read back as the values ``read_cache`` gives.
"""

from __future__ import annotations

import itertools

import torch

from ccft.core.cache import BaseCache
from ccft.core.compact import dequantize
from ccft.core.errors import ConfigError

BASE = "base"  #: decoder name of the base model itself (decodes on its own C_base: ``mode="base"``)


class PrefixHandle:
    """A batch of prompts prefilled by the base into the engine's prefix arena (read-only).

    Attributes:
        engine: the ``SharedPrefillEngine`` whose arena holds the region.
        start, width: the region's first arena slot and its per-row width p (tokens).
        batch_size: b prompts.  lengths: real prefix length per row (``n - k``; the first decoder
            position).  tail_ids: per row the k handoff tokens the decoder recomputes.
        handoff_tokens: k.  fingerprint: the base fingerprint.
        producer: who wrote the K/V: ``"base"`` (C_base, shared mode; any decoder may read it) or a
            decoder's name (the no-share baseline: that decoder prefilled its own prompt; only it may
            read it).  producer_key: the producer's key (``engine.producer_key``).
        key_start: ``(b,)`` long, the first real key slot per row (``width - lengths``).
        refs: references held (the user's and one per active request).
        prefix_ids: per row the ``prompt[:n-k]`` ids (None for an imported cache, ``prefill_cache``): what
            the partial prefill of a decoder at sharing depth m > 0 runs over.
        own: producer key -> ``OwnPrefix``, the own K/V of the depth-m decoders that read this handle.
        formats: cache format -> a handle holding this C_base as a reader of that format sees it (``int8``:
            ``ccft.core.compact.read_cache``'s values; made by the engine for a first such reader, released
            when this handle is freed).  cache_format: the format of this handle's K/V (``native`` unless it
            is one of another handle's ``formats``).
    The region is freed when ``refs`` reaches 0 (and then the handle drops its references on
    prefix-store blocks, ``hold``).
    """

    _ids = itertools.count()

    def __init__(
        self,
        engine,
        start: int,
        width: int,
        lengths: list[int],
        tail_ids: list[list[int]],
        handoff_tokens: int,
        fingerprint: str,
        producer: str = BASE,
        producer_key: str | None = None,
        prefix_ids: list[list[int]] | None = None,
    ):
        self.engine, self.start, self.width = engine, start, width
        self.prefix_ids = prefix_ids
        self.lengths, self.tail_ids, self.handoff_tokens = lengths, tail_ids, handoff_tokens
        self.fingerprint = fingerprint
        self.producer = producer
        self.producer_key = producer_key if producer_key is not None else fingerprint
        self.held: tuple = ()  # (store, blocks) whose references this handle holds until it is freed
        self.own: dict[str, OwnPrefix] = {}  # producer key -> a depth-m decoder's own K/V of these prefixes
        self.formats: dict[str, PrefixHandle] = {}  # cache format -> this C_base as a reader of it sees it
        self.cache_format = "native"
        self.id = next(self._ids)
        self.refs = 1
        self.released = False
        self.freed = False
        self.key_start = torch.tensor([width - n for n in lengths], dtype=torch.long, device=engine.device)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def keys(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` view of this handle's prefix keys in ``layer`` (left-padded; pads are 0).

        Raises:
            ConfigError: the handle was freed.
        """
        self._check_alive()
        return self.engine.arena.view("k", layer, self.start, self.batch_size, self.width)

    def values(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` view of this handle's prefix values in ``layer`` (as ``keys``)."""
        self._check_alive()
        return self.engine.arena.view("v", layer, self.start, self.batch_size, self.width)

    def real_slots(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """``(b, p)`` bool: the real (not left-padding) prefix slots of every row, or of the rows ``index``
        (``(n,)`` long) in that order (``key_start`` onwards; docs/design.md, "C_base")."""
        key_start = self.key_start if index is None else self.key_start.index_select(0, index)
        return torch.arange(self.width, device=key_start.device)[None, :] >= key_start[:, None]

    def every_layer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(L, b, h, p, d)`` views of this handle's keys and values in every layer at once (one view each,
        what the fused decode step reads), or None where the layers are not one arena region.

        Raises:
            ConfigError: the handle was freed.
        """
        self._check_alive()
        arena = self.engine.arena
        return (
            arena.view_layers("k", self.start, self.batch_size, self.width),
            arena.view_layers("v", self.start, self.batch_size, self.width),
        )

    def layer_keys(self, layer: int, own: "OwnPrefix | None" = None) -> torch.Tensor:
        """``(b, h, p, d)``: what a reader attends to in ``layer``: ``own``'s keys below its depth m (a
        decoder at sharing depth m), this handle's above (and in every layer without ``own``)."""
        return own.keys(layer) if own is not None and layer < own.depth else self.keys(layer)

    def layer_values(self, layer: int, own: "OwnPrefix | None" = None) -> torch.Tensor:
        """``(b, h, p, d)`` values as ``layer_keys``."""
        return own.values(layer) if own is not None and layer < own.depth else self.values(layer)

    def snapshot(self) -> list[torch.Tensor]:
        """Clones of every layer's keys then values (tests compare them bit for bit, K1)."""
        n = self.engine.num_layers
        return [self.keys(i).clone() for i in range(n)] + [self.values(i).clone() for i in range(n)]

    def to_base_cache(self) -> BaseCache:
        """A ``BaseCache`` copy of this prefix (for the reference path ``ccft.generate(cache=...)``)."""
        n = self.engine.num_layers
        mask = self.real_slots().long()
        tail = torch.tensor(self.tail_ids, dtype=torch.long, device=self.key_start.device)
        return BaseCache.from_tensors(
            [self.keys(i).clone() for i in range(n)],
            [self.values(i).clone() for i in range(n)],
            mask,
            tail,
            self.handoff_tokens,
            self.fingerprint,
            self.producer,
        )

    def _check_alive(self) -> None:
        if self.freed:
            raise ConfigError(
                f"PrefixHandle {self.id} was released and its prefix freed; prefill the prompts again"
            )

    # ------------------------------------------------------------------ references
    def hold(self, store, blocks: list) -> None:
        """Keep the references on prefix-store ``blocks`` (of ``store``) until this handle is freed."""
        self.held = (store, list(blocks))

    def acquire(self) -> None:
        """One more reference (an admitted request reads a row of this handle)."""
        self.refs += 1

    def unref(self) -> None:
        """Drop one reference; at 0 the arena region is freed and held store blocks are released."""
        self.refs -= 1
        if self.refs == 0 and not self.freed:
            self._free_storage()
            self.freed = True
            for own in self.own.values():
                own.free()
            self.own = {}
            for derived in self.formats.values():  # freed once no request reads it either
                derived.release()
            self.formats = {}
            if self.held:
                store, blocks = self.held
                self.held = ()
                store.release(blocks)

    def _free_storage(self) -> None:
        self.engine.arena.free(self.start)

    def release(self) -> None:
        """Drop the user's reference; the prefix is freed once no active request reads it."""
        if not self.released:
            self.released = True
            self.unref()

    def __enter__(self) -> "PrefixHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("released" if self.released else "live")
        who = "" if self.producer == BASE else f", producer={self.producer!r}"
        return (
            f"PrefixHandle(id={self.id}, rows={self.batch_size}, width={self.width}, refs={self.refs}{who}, "
            f"{state})"
        )


class CompactHandle(PrefixHandle):
    """A C_base handle's prefixes in the ``int8`` format, stored compactly (``PrefixHandle.formats``;
    ``ccft.core.compact``): per layer int8 codes of keys and values (the engine's code arena), bfloat16 key
    scales per (row, head, channel) and value scales per (row, head, token) (its two scale arenas).

    ``keys(i)`` / ``values(i)`` return the dequantised ``(b, h, p, d)`` tensors (``ccft.core.compact
    .dequantize``, in the base dtype: a new tensor per call, what the eager attention and the tail prefill
    read); the static step gathers codes and scales itself (``attention.prefix_attention_gathered_int8``).
    Its regions are freed when its references reach 0 (its parent's is one, dropped when the parent is freed;
    each request reading it holds one).

    Attributes:
        code_start: its region of the code arena (b·p token slots); vscale_start: of the value-scale arena
            (b·p slots of h scales); kscale_start: of the key-scale arena (b slots of h·d scales).
        dtype: the dtype dequantised values are returned in.
    """

    def __init__(self, engine, parent: PrefixHandle, code_start: int, vscale_start: int, kscale_start: int):
        super().__init__(
            engine,
            -1,
            parent.width,
            list(parent.lengths),
            parent.tail_ids,
            parent.handoff_tokens,
            parent.fingerprint,
            parent.producer,
            parent.producer_key,
            parent.prefix_ids,
        )
        self.code_start, self.vscale_start, self.kscale_start = code_start, vscale_start, kscale_start
        self.cache_format = "int8"
        self.dtype = engine.arena.dtype

    def key_codes(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` int8 view."""
        return self.engine.code_arena.view("k", layer, self.code_start, self.batch_size, self.width)

    def value_codes(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` int8 view."""
        return self.engine.code_arena.view("v", layer, self.code_start, self.batch_size, self.width)

    def key_scales(self, layer: int) -> torch.Tensor:
        """``(b, h, 1, d)`` bfloat16 view (per channel)."""
        return self.engine.kscale_arena.view("k", layer, self.kscale_start, self.batch_size, 1)

    def value_scales(self, layer: int) -> torch.Tensor:
        """``(b, h, p, 1)`` bfloat16 view (per token)."""
        return self.engine.vscale_arena.view("k", layer, self.vscale_start, self.batch_size, self.width)

    def every_layer(self) -> None:
        """None: the codes are dequantised per layer (``keys`` / ``values``)."""
        return None

    def keys(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` the dequantised keys of ``layer`` (a new tensor)."""
        self._check_alive()
        return dequantize(self.key_codes(layer), self.key_scales(layer), self.dtype)

    def values(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` the dequantised values of ``layer`` (a new tensor)."""
        self._check_alive()
        return dequantize(self.value_codes(layer), self.value_scales(layer), self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of its codes and scales in every layer (``ccft.core.compact.kv_nbytes``)."""
        e = self.engine
        codes = 2 * self.width * e.code_arena.unit * e.code_arena.k.element_size()
        scales = (self.width * e.vscale_arena.unit + e.kscale_arena.unit) * e.vscale_arena.k.element_size()
        return e.num_layers * self.batch_size * (codes + scales)

    def _free_storage(self) -> None:
        self.engine.code_arena.free(self.code_start)
        self.engine.vscale_arena.free(self.vscale_start)
        self.engine.kscale_arena.free(self.kscale_start)


class OwnPrefix:
    """A decoder's own K/V of a handle's prefixes in its first m layers (sharing depth m; module docstring).

    Attributes:
        arena: the engine's own-layer arena (``kv.PrefixArena`` of at least m layers).
        start: the region's first slot; the region has the handle's shape, ``(b, h, p, d)`` per layer,
            left-padded like it (pad slots zero; the same ``key_start``).
        handle: the C_base handle whose prefixes it covers.  depth: m.
        producer, producer_key: the decoder's name and key (``lanes.LaneRegistry.producer``).
    Freed with its handle (``PrefixHandle.unref``).
    """

    def __init__(self, arena, start: int, handle: PrefixHandle, depth: int, producer: str, producer_key: str):
        self.arena, self.start, self.handle, self.depth = arena, start, handle, int(depth)
        self.producer, self.producer_key = producer, producer_key
        self.id = next(PrefixHandle._ids)
        self.freed = False

    @property
    def batch_size(self) -> int:
        return self.handle.batch_size

    @property
    def width(self) -> int:
        return self.handle.width

    def keys(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` view of the own keys in ``layer`` (< m)."""
        return self.arena.view("k", layer, self.start, self.batch_size, self.width)

    def values(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` view of the own values in ``layer`` (< m)."""
        return self.arena.view("v", layer, self.start, self.batch_size, self.width)

    def free(self) -> None:
        if not self.freed:
            self.arena.free(self.start)
            self.freed = True


__all__ = ["BASE", "CompactHandle", "OwnPrefix", "PrefixHandle"]
