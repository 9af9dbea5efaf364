"""Running the static decode step: eagerly, under ``torch.compile``, or captured as CUDA graphs.

``StaticRunner`` pads a lane's active rows to a batch bucket, picks tail / prefix width buckets,
builds the fixed-shape ``StaticInputs`` (``planner.static_inputs``) and runs ``model.decode_step_static``:

* ``static``: eagerly (the CPU check of exactly the function that is captured);
* ``compile``: through ``torch.compile(dynamic=False)``; one compilation per key;
* ``compiled_graph``: the fused step: as ``cuda_graph``, but what runs and is captured is the
  ``torch.compile`` d step (its generated kernels fuse the ~1,000 small elementwise ops of a step:
  norms, RoPE, residuals, KV writes, LoRA masks); the warm-up run also compiles that key;
* ``cuda_graph``: the first step of a key runs once for real (warm-up, which also compiles the
  Triton kernel), is captured into a ``torch.cuda.CUDAGraph`` whose input buffers are that key's
  ``StaticInputs``, and is replayed after copying each step's inputs into those buffers. The
  logits are cloned out of the graph's output buffer before the next replay (fault class K1 in
  docs/design.md).

Key = (batch bucket, tail width, prefix width, adapters on the lane, own layers read (rows of decoders
at sharing depth m > 0 read their own prefix K/V from the own-layer arena), tail-pool and arena
generations). Widths are powers of two, so captures/compilations are bounded by
log2(max_batch) · log2(max_tail_tokens) · log2(longest prefix) per lane and adapter count; a pool
or arena that grew (new addresses) drops that lane's graphs. ``captures`` counts them (tests, K4).

The runner sees a lane only through its weights and tail pool and the engine's prefix arena (all
grown in place), and its rows only through what ``planner.static_inputs`` reads.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ccft.inference import model as M
from ccft.inference.kv import PrefixArena, TailPool, bucket
from ccft.inference.planner import static_inputs
from ccft.inference.requests import Request
from ccft.inference.weights import LaneWeights

MIN_WIDTH = 16
#: the decode modes whose steps are captured as CUDA graphs (the engine refuses them off CUDA)
GRAPH_MODES = ("cuda_graph", "compiled_graph")


class StaticRunner:
    """Static-shape decode for one lane (see the module docstring).

    Args:
        weights, pool: the lane's weights (adapters may be added later) and tail pool.
        arena: the engine's prefix arena.  own_arena: its own-layer arena (the own prefix K/V of decoders at
            sharing depth m > 0, ``handles.OwnPrefix``), read by the rows that have some.
        compact_arenas: its code, value-scale and key-scale arenas (the compact C_base,
            ``handles.CompactHandle``), read by the rows on it.
        mode: ``"static"``, ``"compile"``, ``"cuda_graph"`` or ``"compiled_graph"``.
        attention: prefix attention, ``"gather"`` or ``"triton"``.  device: where inputs are built.
    """

    def __init__(
        self,
        weights: LaneWeights,
        pool: TailPool,
        arena: PrefixArena,
        mode: str,
        attention: str,
        device,
        own_arena: PrefixArena | None = None,
        compact_arenas: tuple = (),
    ):
        self.weights, self.pool, self.arena, self.own_arena = weights, pool, arena, own_arena
        self.compact_arenas = tuple(compact_arenas)
        self.mode, self.attention, self.device = mode, attention, device
        self.captures = 0  # graphs captured / compilations triggered (distinct keys)
        self._graphs: dict[tuple, tuple] = {}
        self._generations: tuple[int, int] | None = None
        self._compiled = None
        self._keys: set[tuple] = set()
        self._mempool = None

    def key(
        self, n_rows: int, max_tail: int, max_prefix: int, own: bool = False, compact: bool = False
    ) -> tuple:
        """(batch bucket, tail width, prefix width, adapters, own layers read, compact read, pool generation,
        arena generation, own arena generation, compact arenas' generations); own layers: 0 when no row reads
        its own prefix K/V; the prefix width is also set under Triton when a row reads the compact C_base
        (always gathered)."""
        pool = self.pool
        b = min(bucket(n_rows), pool.slots)
        tail_width = min(bucket(max_tail, MIN_WIDTH), pool.capacity)
        prefix_width = bucket(max_prefix, MIN_WIDTH) if self.attention == "gather" or compact else 0
        own_arena = self.own_arena
        return (
            b,
            tail_width,
            prefix_width,
            len(self.weights.adapters),
            own_arena.num_layers if own and own_arena is not None else 0,
            bool(compact),
            pool.generation,
            self.arena.generation,
            own_arena.generation if own_arena is not None else 0,
            *(a.generation for a in self.compact_arenas),
        )

    def run(
        self, rows: Sequence[Request], tokens: Sequence[int], positions: Sequence[int], write: Sequence[int]
    ) -> torch.Tensor:
        """Logits ``(len(rows), V)`` of one decode step for the lane's active rows (slots 0..n-1).

        Args: per row its input token, RoPE position and tail write index.
        """
        n = len(rows)
        compact = any(getattr(r.handle, "cache_format", "native") != "native" for r in rows)
        own = any(r.own is not None for r in rows)
        key = self.key(n, max(write) + 1, max(r.prefix_len for r in rows), own, compact)
        b, tail_width, prefix_width = key[:3]
        graphs = self.mode in GRAPH_MODES  # host-built inputs, copied into the graph's buffers in one copy
        inp = static_inputs(self.weights, rows, tokens, positions, write, b, "cpu" if graphs else self.device)
        gens = key[6:]
        if gens != self._generations:  # buffers moved: graphs bound to the old addresses are stale
            self._graphs.clear()
            # the memory pool dies with the last graph that used it: capturing into its old handle
            # trips the caching allocator's use-count assertion, so the next capture takes a new one
            self._mempool = None
            self._generations = gens
        if graphs:
            return self._replay(key, inp, tail_width, prefix_width)[:n].clone()
        if self.mode == "compile":
            if key not in self._keys:
                self._keys.add(key)
                self.captures += 1
            fn = self._compiled_fn()
        else:
            fn = M.decode_step_static
        return fn(*self._args(inp, tail_width, prefix_width))[:n]

    def _args(self, inp, tail_width, prefix_width):
        arena, pool = self.arena, self.pool
        own = self.own_arena if inp.own_meta is not None else None
        return (
            self.weights,
            inp,
            arena.k,
            arena.v,
            pool.k,
            pool.v,
            tail_width,
            prefix_width,
            self.attention,
            None if own is None else own.k,
            None if own is None else own.v,
            self._compact_buffers() if inp.compact_meta is not None else None,
        )

    def _compact_buffers(self) -> tuple[torch.Tensor, ...]:
        codes, vscales, kscales = self.compact_arenas
        return (codes.k, codes.v, vscales.k, kscales.k)

    def _compiled_fn(self):
        if self._compiled is None:
            self._compiled = torch.compile(torch.no_grad()(M.decode_step_static), dynamic=False)
        return self._compiled

    @torch.no_grad()
    def _replay(self, key, inp, tail_width, prefix_width) -> torch.Tensor:
        entry = self._graphs.get(key)
        if entry is None:
            inp = inp.to(self.device)
            graph, out, warm = self._capture(inp, tail_width, prefix_width)
            self._graphs[key] = (graph, inp, out)  # ``inp`` is now the graph's input buffer set
            return warm  # the warm-up ran this step for real; the graph replays from the next step on
        graph, static, out = entry
        static.copy_from(inp)
        graph.replay()
        return out

    def _capture(self, inp, tail_width, prefix_width):
        args = self._args(inp, tail_width, prefix_width)
        fn = self._compiled_fn() if self.mode == "compiled_graph" else M.decode_step_static
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = fn(*args)  # compiles kernels (and, compiled, the step); writes what the replays write
        torch.cuda.current_stream().wait_stream(stream)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = fn(*args)
        self.captures += 1
        return graph, out, warm
