"""``SharedPrefillEngine``: one shared prefill, many decoders, static caches, step-level API.

The serving side of PrefillShare (arXiv 2602.12029): the frozen base prefills each prompt's KV once
(``C_base``) and any number of decoders decode on it (docs/design.md, "Terms", "Modes": decoding on
C_base is mode ``base``, ``naive`` or ``prefillshare`` by the decoder; ``prefill(producer=name)`` is
the decoder's own prefill, the no-share baseline of mode ``full-ft``).

Life cycle::

    engine = ccft.SharedPrefillEngine(base, decoders={"math": "runs/math", "code": "runs/code"})
    with engine.prefill(prompts) as handle:            # the base runs once; C_base in the arena
        math = engine.generate(handle, decoder="math", max_new_tokens=256)
        code = engine.generate(handle, decoder="code", max_new_tokens=256, stop=["\\nclass"])

Scheduler view (continuous batching): ``add_request(handle, row, decoder=...)`` admits a row,
``step()`` runs one decode step for every active row of every decoder and returns the new tokens,
``finish(rid)`` / ``abort(rid)`` end a request early; requests join and leave between steps.
``generate`` is built on these.

Decoders are grouped into *lanes* by weights (``lanes``): the base and every LoRA decoder on it
form one lane, each full-weight decoder is a lane of its own. Every active row of a lane has a
slot in the lane's static tail pool; its decode attention reads its prompt's prefix from the
shared arena (read once for all rows and decoders sharing it) and its own tail (``attention``).

The parts, one concept per module of ``ccft.inference``:

* ``handles``: ``PrefixHandle``, a refcounted arena region holding a batch of prefixes; ``OwnPrefix``, a
  decoder's own K/V of them below its sharing depth m; ``CompactHandle``, them in the int8 format;
* ``lanes``: the decoder / lane registry and producers (who wrote a prefix, and its key);
* ``prefill``: the computations behind the prefill entry points and a request's tail;
* ``requests``: an admitted row (token bookkeeping, EOS / stop strings / length) and ``StepOutput``;
* ``planner``: per-step plans (prefix groups, LoRA rows, static inputs);
* ``graphs``: the static step run eagerly, compiled or captured as CUDA graphs;
* ``model``, ``attention``, ``kv``, ``weights``: the forward, its attention, its buffers, its weights.
* ``blocks``: the base's linear layers computed from the GGUF's own Q4_1 / Q8_0 blocks (``block_weights``).

Decode modes (``decode=``):
  * ``eager`` (CPU default): host-side grouping of rows by prefix, exact-width views, no copies.
  * ``static``: the static-shape step (``model.decode_step_static``) run eagerly; what is captured.
  * ``cuda_graph`` (CUDA default): that step captured once per (lane, batch bucket, tail bucket,
    prefix bucket, adapter count) and replayed; outputs copied out before the next replay.
  * ``compile``: that step through ``torch.compile`` (CPU or CUDA), same buckets, bounded recompiles.
  * ``compiled_graph`` (CUDA): the fused step: that step through ``torch.compile`` (norms, RoPE,
    residuals, KV writes and LoRA masks fused into generated kernels), then captured as CUDA graphs
    per key like ``cuda_graph``; one compilation per key, before its capture.

Every fast path equals the reference path ``ccft.core.generation`` (docs/design.md, "Invariants
the tests hold" 6; fault classes K1-K5 and K12 for its entry points).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Sequence

import torch

from ccft.core.cache import BaseCache
from ccft.core.compact import SCALE_DTYPE, kv_nbytes, quantize_keys, quantize_values
from ccft.core.decoder import Decoder
from ccft.core.errors import ConfigError, FingerprintMismatchError
from ccft.core.generation import Generation
from ccft.core.sampling import DecodeParams, SamplingParams
from ccft.core.text import StopMatcher
from ccft.core.tokens import left_pad, pad_token_id
from ccft.inference import model as M
from ccft.inference import planner
from ccft.inference.architectures import architecture
from ccft.inference.blocks import use_block_weights
from ccft.inference.graphs import GRAPH_MODES
from ccft.inference.handles import BASE, CompactHandle, OwnPrefix, PrefixHandle
from ccft.inference.kv import CapacityError, PrefixArena
from ccft.inference.lanes import Lane, LaneRegistry
from ccft.inference.prefill import (
    ChunkedPrefill,
    PendingTail,
    import_cache,
    prefill_from_store,
    prefill_rows,
    write_tails,
)
from ccft.inference.reload import StagedReload, apply_reload, stage_reload
from ccft.inference.requests import Request, StepError, StepOutput, choose_tokens, token_logprobs
from ccft.inference.weights import lane_weights


def _inference(fn):
    """Run an engine entry point under ``torch.inference_mode()``: no autograd bookkeeping (version
    counters, view tracking) on the thousands of small ops of a decode step (about 8% of a batch-1
    CPU step). Every method that writes the engine's buffers is wrapped, so buffers (re)allocated
    inside are only ever written inside inference mode; returned tensors are inference tensors
    (read them freely, clone them to modify them)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


DECODE_MODES = ("eager", "static", "cuda_graph", "compile", "compiled_graph")


def kv_bytes_per_token(base) -> int:
    """Bytes of K and V one token takes over all layers of ``base``'s model: layers × 2 × kv_heads ×
    head_dim × dtype bytes (``SharedPrefillEngine.kv_bytes_per_token``, known before an engine is built: what
    sizes its prefix arena from a byte budget, ``ccft serve --max-prefix-tokens budget``)."""
    return _kv_bytes_per_token(lane_weights(base.model))


def _kv_bytes_per_token(bw) -> int:
    return bw.num_layers * 2 * bw.kv_heads * bw.head_dim * bw.dtype.itemsize


class PrefillJob:
    """A prefill in progress (``SharedPrefillEngine.begin_prefill``): ``advance`` it, then ``finish`` or
    ``cancel``.

    Attributes:
        handle: the ``PrefixHandle`` being written (not readable before ``finish``).
        hit: prompt positions copied from the store.  total: positions of the prefix (n - k).
    """

    def __init__(self, job: ChunkedPrefill, handle: PrefixHandle, store):
        self._job, self.handle, self._store = job, handle, store
        self.hit, self.total = job.hit, job.total
        self._closed = False

    @property
    def remaining(self) -> int:
        """Prefix positions still to compute (0: ready to ``finish``)."""
        return self._job.remaining

    @_inference
    def advance(self, tokens: int) -> int:
        """Compute the next ``min(tokens, remaining)`` positions; returns how many were computed.

        Raises:
            ConfigError: the job was finished or cancelled, or ``tokens`` < 1.
        """
        if self._closed:
            raise ConfigError("this prefill job was finished or cancelled")
        if self._job.remaining and int(tokens) < 1:
            raise ConfigError(f"tokens={tokens}; a prefill chunk needs at least 1 token")
        return self._job.advance(tokens)

    @_inference
    def finish(self) -> tuple[PrefixHandle, int]:
        """Insert the new full blocks into the store; returns ``(handle, hit_tokens)`` as ``prefill_cached``
        (the handle holds one reference on every store block covering the prompt until it is freed).

        Raises:
            ConfigError: positions remain (``advance`` first), or the job was closed.
        """
        if self._closed:
            raise ConfigError("this prefill job was finished or cancelled")
        if self._job.remaining:
            raise ConfigError(f"{self._job.remaining} prefix positions are not computed yet; advance first")
        self._closed = True
        try:
            blocks = self._job.finish()
        except BaseException:
            self.handle.release()
            raise
        if self._store is not None:
            self.handle.hold(self._store, blocks)
        return self.handle, self.hit

    def cancel(self) -> None:
        """Give the prefill up: store references dropped, the handle released (no-op once closed)."""
        if not self._closed:
            self._closed = True
            self._job.abandon()
            self.handle.release()


class SharedPrefillEngine:
    """One base model's shared prefill and N decoders decoding on it (see the module docstring).

    Args:
        base: the ``ccft.Base`` that runs prefill (and the lane of every LoRA decoder on it).
        decoders: name -> ``ccft.Decoder`` or decoder folder (loaded onto ``base``).
        max_batch: active rows per lane (tail-pool slots).
        max_tail_tokens: per-request tail capacity limit (handoff tokens + max_new_tokens).
        max_prefix_tokens: the prefix arena's size in token slots (b·p per handle), allocated whole here; it
            never grows, and a prefill beyond it raises CapacityError. None: it starts at 1024 slots and
            doubles when full.
        decode: ``"auto"`` (CUDA: ``cuda_graph``; else ``eager``), ``"eager"``, ``"static"``,
            ``"cuda_graph"``, ``"compile"`` or ``"compiled_graph"`` (CUDA; the compiled step captured).
        attention: prefix attention of the static step: ``"auto"`` (Triton on CUDA when available,
            else ``"gather"``), ``"gather"`` or ``"triton"``.
        pack_weights: keep each lane's weights packed ([q;k;v], [gate;up]) and, on the CPU, prepacked for
            oneDNN (about 2x faster CPU decode; one extra copy of the lane's weights, taken at registration,
            so later in-place edits of the model's weights are not seen). On CUDA the packed [q;k;v] and
            [gate;up] are one extra copy of those five projections (about 2/3 of a layer's weights) and cut
            a captured step's matmuls from 7 to 4 per layer. Default: True on CPU unless
            ``decode="compile"``; on CUDA, True for ``cuda_graph`` and ``compiled_graph``.
        fill: value of never-written cache memory (0; tests use NaN to catch reads of it, K3 in
            docs/design.md).
        block_weights: compute the base lane's linear layers from the GGUF's own Q4_1 / Q8_0 blocks
            (``blocks``; LoRA deltas stay fp32 on top): ``"auto"`` (on when the block kernel compiles, the
            base was dequantised from such a GGUF and its blocks equal the fp32 weights bit for bit, on
            the CPU in fp32 with decode eager or static; else off), ``"on"`` (the same, raising instead
            of falling back), ``"off"``, or the GGUF file's path. Default: ``$CCFT_BLOCK_WEIGHTS``
            (``auto``, ``1`` = on, ``0`` = off), else ``"off"``. ``self.block_weights`` is the GGUF used
            (None: fp32).
    Raises:
        IncompatibleModelError: a model the engine cannot run, or a decoder that cannot read the base's KV.
        FingerprintMismatchError: a decoder conditioned on another base.
        ConfigError: an unknown ``decode`` / ``attention``, or one this device cannot run; a
            ``block_weights`` that is unknown or, when asked for explicitly, cannot be used.
        BlockMismatchError: ``block_weights`` "on" or a path whose blocks differ from the fp32 weights.
    """

    def __init__(
        self,
        base,
        decoders: dict | None = None,
        *,
        max_batch: int = 16,
        max_tail_tokens: int = 4096,
        max_prefix_tokens: int | None = None,
        decode: str = "auto",
        attention: str = "auto",
        pack_weights: bool | None = None,
        fill: float = 0.0,
        block_weights: str | Path | None = None,
    ):
        self.base = base
        self.tokenizer = base.tokenizer
        self._arch = architecture(base.config)  # refuses an unsupported family by name, before anything loads
        device = base.device
        self.device = device
        if decode == "auto":
            decode = "cuda_graph" if device.type == "cuda" else "eager"
        if decode not in DECODE_MODES:
            raise ConfigError(f"decode={decode!r}; use one of auto, {', '.join(DECODE_MODES)}")
        if decode in GRAPH_MODES and device.type != "cuda":
            raise ConfigError(
                f"decode={decode!r} needs the model on a CUDA device; "
                "use 'eager', 'static' or 'compile' on CPU"
            )
        from ccft.inference.triton_kernels import kernel_supports, triton_available

        bw = lane_weights(base.model)
        if attention == "auto":
            attention = (
                "triton"
                if (device.type == "cuda" and triton_available(device) and kernel_supports(bw.head_dim))
                else "gather"
            )
        if attention not in ("gather", "triton"):
            raise ConfigError(f"attention={attention!r}; use auto, gather or triton")
        if attention == "triton" and not (triton_available(device) and kernel_supports(bw.head_dim)):
            raise ConfigError(
                f"attention='triton' needs triton on a CUDA device (or TRITON_INTERPRET=1 on CPU) and a "
                f"power-of-two head_dim ≥ 16 (this model: {bw.head_dim}); use attention='gather'"
            )
        self.decode_mode, self.attention = decode, attention
        if pack_weights is None:
            # CPU: packed and oneDNN-prepacked (not under torch.compile); CUDA: [q;k;v] and [gate;up] packed
            # for the captured steps (fewer, larger matmuls per replay)
            pack_weights = decode != "compile" if device.type == "cpu" else decode in GRAPH_MODES
        if pack_weights and device.type == "cpu" and decode == "compile":
            raise ConfigError(
                "pack_weights=True cannot be combined with decode='compile' on the CPU (the oneDNN-prepacked "
                "weights are opaque to torch.compile); leave pack_weights unset"
            )
        self.pack_weights = bool(pack_weights)
        #: the GGUF file whose blocks the base lane computes from (None: fp32 weights)
        self.block_weights = use_block_weights(base, bw, block_weights, decode_mode=decode)
        self.max_batch, self.max_tail_tokens = int(max_batch), int(max_tail_tokens)
        self.fill = float(fill)
        self.num_layers = bw.num_layers
        #: bytes of K and V per token over all layers: layers × 2 × kv_heads × head_dim × dtype bytes
        self.kv_bytes_per_token = _kv_bytes_per_token(bw)

        def arena(layers: int, dim: int, dtype: torch.dtype, **kw) -> PrefixArena:
            """A prefix-shaped arena sized like the prefix arena (``max_prefix_tokens``)."""
            kw.setdefault("capacity_tokens", 1024 if max_prefix_tokens is None else max_prefix_tokens)
            kw.setdefault("max_tokens", max_prefix_tokens)
            return PrefixArena(layers, bw.kv_heads, dim, dtype, device, **kw)

        self.arena = arena(bw.num_layers, bw.head_dim, bw.dtype, fill=self.fill)
        #: the decoders' own prefix K/V below their sharing depth m (``handles.OwnPrefix``): as many layers as
        #: the deepest decoder registered (none until one with m > 0 is), regions allocated like the arena's
        self.own_arena = arena(0, bw.head_dim, bw.dtype, fill=self.fill)
        #: the compact C_base (``handles.CompactHandle``): int8 codes of keys and values, bfloat16 value
        #: scales (per token and head) and key scales (per row, head and channel); no layers until a
        #: decoder reading the int8 format is registered
        self.code_arena = arena(0, bw.head_dim, torch.int8)
        self.vscale_arena = arena(0, 1, SCALE_DTYPE, pair=False)
        self.kscale_arena = arena(
            0, bw.head_dim, SCALE_DTYPE, capacity_tokens=64, max_tokens=None, pair=False
        )
        self._registry = LaneRegistry(
            base,
            bw,
            self.arena,
            own_arena=self.own_arena,
            compact_arenas=(self.code_arena, self.vscale_arena, self.kscale_arena),
            max_batch=self.max_batch,
            max_tail_tokens=self.max_tail_tokens,
            fill=self.fill,
            pack_weights=self.pack_weights,
            decode_mode=decode,
            attention=attention,
        )
        #: lane key -> ``lanes.Lane`` (``"base"``: the base and its LoRA decoders; one per full-weight
        #: decoder)
        self.lanes: dict[str, Lane] = self._registry.lanes
        #: decoder name -> ``lanes.DecoderEntry`` (``"base"`` included; ``.decoder`` is the ``ccft.Decoder``)
        self.decoders = self._registry.decoders
        self._requests: dict[int, Request] = {}
        self._rid = itertools.count()
        #: lane steps whose batched forward raised (then stepped in parts, ``step``), and the last such error
        self.step_errors = 0
        self.last_step_error: BaseException | None = None
        for name, dec in (decoders or {}).items():
            self.add_decoder(name, dec)

    # ------------------------------------------------------------------ decoders
    def add_decoder(
        self, name: str, decoder: Decoder | str | Path, *, tokenizer=None, cache_format: str | None = None
    ) -> None:
        """Register a decoder under ``name`` (a ``ccft.Decoder``, or a decoder folder loaded onto the base).

        It reads C_base as it was trained to (``Decoder.share_from_layer``, ``Decoder.cache_format``): at
        sharing depth m > 0 its own prompt K/V in layers ``0..m-1`` (a partial prefill with its weights, the
        first time it reads a handle; ``handles.OwnPrefix``), C_base above; on ``int8`` the compact C_base's
        values (``ccft.core.compact.read_cache``; ``handles.PrefixHandle.formats``). ``cache_format``
        overrides the format (``int8``: a decoder trained on the native cache served on the compact one).

        A LoRA decoder joins the base's lane as one more adapter; a full-weight decoder gets its own.
        A LoRA adapter's weights are cast in place to the base dtype (PEFT keeps them in fp32 on a
        bf16 base; the decoder object then runs in that dtype everywhere, ``ccft.generate`` included;
        docs/design.md K11). The engine reads LoRA weights live; in-place edits of them give the
        decoder a new producer key (``producer_key``).

        Raises:
            FingerprintMismatchError: the decoder was conditioned on another base.
            IncompatibleModelError: its tokenizer, layer count, KV geometry or RoPE differ from the base's,
                a full-weight decoder has weights in another dtype than the base, or it is a model /
                LoRA variant the engine does not run.
            ConfigError: ``name`` already used; an unknown ``cache_format``.
        """
        self._registry.add(name, decoder, tokenizer=tokenizer, cache_format=cache_format)

    def stage_reload(self, name: str, path: str | Path) -> StagedReload:
        """Read and validate the decoder folder ``path`` as new weights for LoRA decoder ``name``; the live
        decoder is not touched (``ccft.inference.reload.stage_reload``). Safe to call from any thread.

        Raises:
            ConfigError: an unknown ``name``, the base or a full-weight decoder, or a folder whose
                ``handoff_tokens``, adapter config fields or tensors differ from the served adapter's (the
                message names the field and the fix); FingerprintMismatchError: another base;
            IncompatibleModelError: another tokenizer.
        """
        if name not in self.decoders:
            raise ConfigError(f"unknown decoder {name!r}; registered: {', '.join(self.decoders)}")
        return stage_reload(self.decoders[name], self.base, path, tokenizer=self.tokenizer)

    def reload_decoder(self, name: str, path: str | Path | StagedReload) -> str:
        """Swap LoRA decoder ``name``'s adapter weights in place for those of decoder folder ``path``.

        The folder is validated completely before a weight is written (``stage_reload``; a ``StagedReload``
        from it may be passed instead of the path); then the new values are copied into the live
        parameters, which gives the decoder a new producer key (``producer_key``). Call it between
        steps (``ccft.serving.Scheduler.reload_decoder`` does); requests of the decoder already decoding
        go on with the new weights from the next step.

        Returns:
            the decoder's new producer key.
        Raises:
            as ``stage_reload``; nothing is changed when it raises.
        """
        staged = path if isinstance(path, StagedReload) else self.stage_reload(name, path)
        if staged.name != name:
            raise ConfigError(f"reload_decoder({name!r}): the staged reload is for decoder {staged.name!r}")
        apply_reload(staged)
        return self.producer_key(name)

    # ------------------------------------------------------------------ prefill
    @_inference
    def reserve_prefix(
        self, prompts: Sequence[Sequence[int]], *, handoff_tokens: int | None = None, prefills: int = 1
    ) -> None:
        """Grow the prefix arena once, so that ``prefills`` calls of :meth:`prefill` over ``prompts`` (each a
        region of len(prompts) rows × the longest prefix) then fit without growing it again.

        Memory only: results are the same with or without it. Without it each such prefill that does not fit
        doubles the arena (power-of-two capacity) and holds the old and new storage at once while copying
        (measured: docs/study.md, "Time").

        Args:
            prompts: the prompts the prefills will take; handoff_tokens: their k (as for ``prefill``).
            prefills: how many prefills of them will be held at once (one per producer).
        Raises:
            ConfigError: no prompt, or a prompt shorter than k+1 tokens.
        """
        k = self._registry.handoff(handoff_tokens, None)
        if not prompts or min(len(p) for p in prompts) < k + 1:
            raise ConfigError(f"reserve_prefix needs prompts of at least handoff_tokens+1={k + 1} tokens")
        self.arena.reserve(int(prefills) * len(prompts) * max(len(p) - k for p in prompts))

    @_inference
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        handoff_tokens: int | None = None,
        producer: str | None = None,
    ) -> PrefixHandle:
        """Run the base once over ``prompt[:n-k]`` of every prompt into a new arena region.

        The prefixes are left-padded with ``pad_token_id`` (masked; pad slots zeroed) to the longest,
        and each row's positions start at its first real token, as ``ccft.compute_base_cache``
        (docs/design.md, "C_base"; K2).

        Args:
            prompts: b lists of prompt token ids (each ≥ k+1 tokens).
            handoff_tokens: k ≥ 1, the last k prompt tokens the decoder recomputes. Default: the k the
                registered decoders were trained with (when they agree), else 1 (with ``producer``:
                that decoder's k).
            producer: None (or ``"base"``): the base writes C_base (shared mode). A decoder's name: the
                no-share baseline, that decoder prefills with its own weights (a full-weight decoder's
                weights, or the base with its LoRA adapter active); only that decoder may then read
                the handle (``add_request`` refuses the others).
        Returns:
            a ``PrefixHandle`` (release it, or use it as a context manager).
        Raises:
            ConfigError: no prompt, a prompt shorter than k+1 tokens or longer than ``max_positions``, k < 1,
                an unknown producer.
            CapacityError: the arena is full (``max_prefix_tokens``).
        """
        k = self._registry.handoff(handoff_tokens, producer)
        if not prompts:
            raise ConfigError("prefill needs at least one prompt")
        short = [i for i, p in enumerate(prompts) if len(p) < k + 1]
        if short:
            raise ConfigError(f"prompts {short} have fewer than handoff_tokens+1={k + 1} tokens")
        prod = self._registry.producer(producer)
        ids, mask = left_pad([list(p[:-k]) for p in prompts], pad_token_id(self.tokenizer))
        handle = self._new_handle(
            mask.sum(-1).tolist(),
            ids.shape[1],
            [list(p[-k:]) for p in prompts],
            k,
            prod.name,
            prod.key,
            [[int(t) for t in p[:-k]] for p in prompts],
        )
        prefill_rows(prod, ids.to(self.device), mask.to(self.device), handle)
        return handle

    @_inference
    def prefill_cached(
        self,
        prompt: Sequence[int],
        store,
        *,
        producer: str | None = None,
        handoff_tokens: int | None = None,
        hold: bool = True,
        chunk_tokens: int | None = None,
    ) -> tuple[PrefixHandle, int]:
        """Prefill ONE prompt's ``prompt[:n-k]`` into a new batch-1 handle, reusing K/V from a prefix store.

        The longest chain of full blocks of ``prompt[:n-k]`` cached in ``store`` under this producer and
        dtype is copied into the handle's region; only the remaining tokens are computed (chunked
        prefill attending to the copied prefix, ``model.prefill_chunk``); the newly completed full
        blocks are then inserted into the store (``prefill.prefill_from_store``). Equal to
        ``prefill([prompt], producer=producer)`` (K/V within fp32 rounding; tested with greedy decodes).
        Blocks the producer wrote with weights since edited in place are dropped from ``store`` first
        (its ``forget``, when it has one; they are never matched anyway: the key follows the weights).

        Args:
            prompt: the prompt's token ids (≥ k+1).
            store: a ``ccft.serving.PrefixKVStore`` (any object with its ``block_tokens``, ``match``,
                ``insert`` and ``release``).
            producer: as in ``prefill``: None / ``"base"`` (shared mode, keyed by the base fingerprint)
                or a decoder's name (no-share baseline, keyed by ``producer_key(name)``).
            handoff_tokens: k, as in ``prefill``.
            hold: keep one reference on every block covering this prompt until the handle is freed
                (blocks in use by live requests are not evicted); False: drop them on return.
            chunk_tokens: tokens computed per chunked-prefill pass (default: as many as keep the
                ``(heads, chunk, n)`` attention scores under ~256 MB, at least 64).
        Returns:
            ``(handle, hit_tokens)``: hit_tokens = prompt positions copied from the store (a multiple
            of ``store.block_tokens``, ≤ n-k).
        Raises:
            ConfigError: as ``prefill``.  CapacityError: the arena is full.
        """
        if chunk_tokens is not None and int(chunk_tokens) < 1:
            raise ConfigError(f"chunk_tokens={chunk_tokens}; it must be ≥ 1 (or None)")
        prod, prefix, handle = self._one_prompt_handle(prompt, store, producer, handoff_tokens)
        try:
            blocks, hit = prefill_from_store(prod, prefix, handle, self.arena, store, chunk_tokens)
        except BaseException:
            handle.release()
            raise
        if hold:
            handle.hold(store, blocks)
        else:
            store.release(blocks)
        return handle, hit

    @_inference
    def begin_prefill(
        self,
        prompt: Sequence[int],
        store=None,
        *,
        producer: str | None = None,
        handoff_tokens: int | None = None,
    ) -> "PrefillJob":
        """Start prefilling ONE prompt's ``prompt[:n-k]`` in pieces (chunked prefill across scheduler steps).

        The handle's region is allocated now and the longest chain of full blocks cached in ``store``
        (when given) is copied in, as ``prefill_cached`` does; the rest is computed by
        ``PrefillJob.advance(t)`` calls (t positions each, attending to everything before them), with
        decode steps free to run in between; ``PrefillJob.finish()`` then inserts the new full blocks
        into the store and returns ``(handle, hit_tokens)``. The K/V equal ``prefill([prompt])`` /
        ``prefill_cached`` (fp32 rounding; tested). Until ``finish`` the handle must not be read.

        Args:
            prompt, producer, handoff_tokens: as in ``prefill_cached``.
            store: a ``PrefixKVStore`` (or None: everything is computed, nothing is inserted).
        Raises:
            ConfigError: as ``prefill``.  CapacityError: the arena is full.
        """
        prod, prefix, handle = self._one_prompt_handle(prompt, store, producer, handoff_tokens)
        try:
            job = ChunkedPrefill(prod, prefix, handle, self.arena, store)
        except BaseException:
            handle.release()
            raise
        return PrefillJob(job, handle, store)

    def _one_prompt_handle(self, prompt, store, producer, handoff_tokens):
        """(producer, prefix ids, a new batch-1 handle for them) for ``prefill_cached`` / ``begin_prefill``;
        the store first forgets K/V of the producer's weights from before an in-place edit."""
        k = self._registry.handoff(handoff_tokens, producer)
        prompt = [int(t) for t in prompt]
        if len(prompt) < k + 1:
            raise ConfigError(f"the prompt has {len(prompt)} tokens, fewer than handoff_tokens+1={k + 1}")
        prod = self._registry.producer(producer)
        forget = getattr(store, "forget", None) if store is not None else None
        stale = self.decoders[prod.name].stale_keys if prod.name != BASE else []
        while stale and forget is not None:  # K/V of this decoder's weights from before an in-place edit
            forget(stale.pop())
        prefix = prompt[:-k]
        return (
            prod,
            prefix,
            self._new_handle([len(prefix)], len(prefix), [prompt[-k:]], k, prod.name, prod.key, [prefix]),
        )

    def producer_key(self, producer: str | None = None) -> str:
        """The key K/V written by ``producer`` is stored under (prefix store, ``PrefixHandle.producer_key``).

        None / ``"base"``: the base fingerprint. A decoder's name:
        ``"{base fingerprint}+{name}/{weights id}"``, weights id = 16 hex digits of a digest of the decoder's
        own weights (its LoRA A/B and scalings, or a full-weight decoder's parameters), recomputed when their
        version counters moved: weights edited in place get a new key (``lanes``; a packed full-weight decoder
        refuses the edit).

        Raises:
            ConfigError: an unknown producer, or a packed full-weight decoder edited in place.
        """
        return self._registry.producer(producer).key

    @_inference
    def prefill_cache(self, cache: BaseCache) -> PrefixHandle:
        """Import a precomputed ``C_base`` (``ccft.compute_base_cache``) into a new arena region (a copy).

        Raises:
            FingerprintMismatchError: the cache was written by another base, another dtype, or not by a base.
        """
        cache.check_reader(self.base.fingerprint, self.base.dtype)
        handle = self._new_handle(
            cache.lengths.tolist(),
            cache.attention_mask.shape[1],
            cache.tail_ids.tolist(),
            cache.handoff_tokens,
        )
        import_cache(cache, handle)
        cache.check_unmodified()
        return handle

    def _new_handle(
        self,
        lengths: list[int],
        width: int,
        tail_ids: list[list[int]],
        k: int,
        producer: str = BASE,
        producer_key: str | None = None,
        prefix_ids: list[list[int]] | None = None,
    ) -> PrefixHandle:
        limit = self.max_positions
        if limit is not None:
            over = [i for i, n in enumerate(lengths) if n + k > limit]
            if over:
                raise ConfigError(
                    f"prompts {over} are longer than the base model's {limit} positions "
                    f"({self.max_positions_field}; the longest has {max(lengths[i] for i in over) + k} "
                    "tokens); shorten them"
                )
        start = self.arena.allocate(len(lengths) * width)
        return PrefixHandle(
            self,
            start,
            width,
            [int(n) for n in lengths],
            tail_ids,
            k,
            self.base.fingerprint,
            producer,
            producer_key,
            prefix_ids,
        )

    def reader_extras(self, decoder: str, tokens: int) -> list[tuple[str, int]]:
        """What reading a C_base handle of ``tokens`` prefix tokens (one row) with ``decoder`` keeps beside
        the handle, as ``(key, bytes)``: its own prefix K/V (``"own:{producer key}"``: K and V in the
        own-layer arena, whose slots hold as many layers as the deepest decoder registered; ``_own_prefix``)
        and the handle's int8 format (``"format:int8"``: codes and scales, ``ccft.core.compact.kv_nbytes``;
        ``_read_handle``), each made once per handle and key and freed with it. ``[]`` for a depth-0 decoder
        on the native cache. A byte ledger counts each key a context does not hold yet
        (``ccft.serving.Scheduler``).

        Raises:
            ConfigError: an unknown decoder, or a packed decoder edited in place (``producer_key``).
        """
        if decoder not in self.decoders:
            raise ConfigError(f"unknown decoder {decoder!r}; registered: {', '.join(self.decoders)}")
        entry, tokens = self.decoders[decoder], int(tokens)
        extras = []
        if entry.cache_format != "native":
            a = self.code_arena
            nbytes = kv_nbytes(
                entry.cache_format,
                layers=self.num_layers,
                kv_heads=a.kv_heads,
                head_dim=a.head_dim,
                tokens=tokens,
            )
            extras.append((f"format:{entry.cache_format}", nbytes))
        if entry.depth:
            own = self.own_arena
            nbytes = 2 * own.num_layers * tokens * own.unit * own.k.element_size()
            extras.append((f"own:{self._registry.producer(decoder).key}", nbytes))
        return extras

    def _read_handle(self, handle: PrefixHandle, decoder: str) -> PrefixHandle:
        """The handle ``decoder`` reads for ``handle``: ``handle`` itself, or, for a decoder reading C_base in
        ``int8``, the handle's ``int8`` format (``PrefixHandle.formats``), made now when it has none: a
        ``CompactHandle`` holding every layer of C_base as int8 codes and bfloat16 scales
        (``ccft.core.compact``: ``quantize_keys`` per channel, ``quantize_values`` per token), read back
        through ``dequantize``: the values ``read_cache`` gives.

        A handle already in the decoder's format (``compact``) is read as it is.

        Raises:
            ConfigError: a decoder reading the native C_base given a compact handle.
            CapacityError: the code arena is full (``max_prefix_tokens`` slots, as the prefix arena).
        """
        fmt = self.decoders[decoder].cache_format
        if handle.cache_format != "native":
            if fmt != handle.cache_format:
                raise ConfigError(
                    f"decoder {decoder!r} reads C_base in cache_format={fmt}, but PrefixHandle {handle.id} "
                    f"holds it only in {handle.cache_format} (engine.compact); give it a native handle"
                )
            return handle
        if fmt == "native" or handle.producer != BASE:
            return handle
        derived = handle.formats.get(fmt)
        if derived is None:
            derived = handle.formats[fmt] = self._compact(handle)
        return derived

    @_inference
    def compact(self, handle: PrefixHandle) -> CompactHandle:
        """A new handle holding ``handle``'s C_base in the ``int8`` format (``handles.CompactHandle``: int8
        codes and bfloat16 scales, ``kv_nbytes`` bytes), yours to release; ``handle`` is not changed. Release
        ``handle`` afterwards when only decoders reading int8 will read these prompts: the native K/V are
        freed and only the compact copy (3.9× fewer bytes than fp32) stays. Decoders reading the native
        C_base refuse the compact handle (``add_request``).

        Raises:
            ConfigError: ``handle`` is not a C_base handle (a decoder's own prefill, or already compact), or
                was released.
            CapacityError: the code arena is full (``max_prefix_tokens`` slots).
        """
        if handle.engine is not self or handle.released or handle.freed:
            raise ConfigError("compact needs a live PrefixHandle of this engine; prefill the prompts again")
        if handle.producer != BASE or handle.cache_format != "native":
            raise ConfigError(
                f"PrefixHandle {handle.id} holds {handle.cache_format} K/V written by {handle.producer!r}; "
                "compact takes a native C_base handle (engine.prefill with the base as producer)"
            )
        for arena in (self.code_arena, self.vscale_arena, self.kscale_arena):
            arena.set_layers(self.num_layers)
        return self._compact(handle)

    def _compact(self, handle: PrefixHandle) -> CompactHandle:
        """A ``CompactHandle`` of ``handle``'s C_base (one reference, the caller's)."""
        b, p = handle.batch_size, handle.width
        starts = []
        try:
            for arena, slots in (
                (self.code_arena, b * p),
                (self.vscale_arena, b * p),
                (self.kscale_arena, b),
            ):
                starts.append((arena, arena.allocate(slots)))
        except BaseException:
            for arena, start in starts:
                arena.free(start)
            raise
        derived = CompactHandle(self, handle, *(start for _, start in starts))
        for i in range(self.num_layers):
            q, scale = quantize_keys(handle.keys(i))
            derived.key_codes(i).copy_(q)
            derived.key_scales(i).copy_(scale)
            q, scale = quantize_values(handle.values(i))
            derived.value_codes(i).copy_(q)
            derived.value_scales(i).copy_(scale)
        return derived

    def _own_prefix(self, handle: PrefixHandle, decoder: str) -> OwnPrefix | None:
        """The own prefix K/V ``decoder`` reads on ``handle`` below its sharing depth m: None at m = 0 or on a
        handle the decoder prefilled itself (its own K/V in every layer); else the handle's ``OwnPrefix`` for
        the decoder's current producer key, computed now by a partial prefill (its first m layers, its own
        weights) over the handle's prefixes when the handle has none yet (``handles``).

        Raises:
            ConfigError: the handle was imported from a ``BaseCache`` (``prefill_cache``): its prompt ids are
                not known, so the partial prefill cannot run.
            CapacityError: the own-layer arena is full (``max_prefix_tokens``).
        """
        entry = self.decoders[decoder]
        if not entry.depth or handle.producer != BASE:
            return None
        prod = self._registry.producer(decoder)
        own = handle.own.get(prod.key)
        if own is not None:
            return own
        if handle.prefix_ids is None:
            raise ConfigError(
                f"decoder {decoder!r} was trained at share_from_layer={entry.depth}: it computes its own "
                f"prompt K/V in layers 0..{entry.depth - 1} from the prompt ids, which PrefixHandle "
                f"{handle.id} (imported from a BaseCache with prefill_cache) does not keep; prefill the "
                "prompts with engine.prefill (or prefill_cached) instead"
            )
        own = OwnPrefix(
            self.own_arena,
            self.own_arena.allocate(handle.batch_size * handle.width),
            handle,
            entry.depth,
            prod.name,
            prod.key,
        )
        ids, mask = left_pad(handle.prefix_ids, pad_token_id(self.tokenizer))
        try:
            prefill_rows(prod, ids.to(self.device), mask.to(self.device), own, entry.depth)
        except BaseException:
            own.free()
            raise
        handle.own[prod.key] = own
        return own

    # ------------------------------------------------------------------ step API
    def _check_reader(self, handle: PrefixHandle, decoder: str):
        """``decoder``'s registry entry, after checking it may read ``handle`` (K5; see ``add_request``)."""
        if handle.engine is not self:
            raise ConfigError("this PrefixHandle belongs to another engine")
        if handle.released or handle.freed:
            raise ConfigError(
                f"PrefixHandle {handle.id} was released; prefill again (or add requests before release)"
            )
        if decoder not in self.decoders:
            raise ConfigError(f"unknown decoder {decoder!r}; registered: {', '.join(self.decoders)}")
        if handle.producer != BASE and handle.producer != decoder:
            raise FingerprintMismatchError(
                f"PrefixHandle {handle.id} holds K/V written by decoder {handle.producer!r} with its own "
                f"weights (no-share prefill), but decoder {decoder!r} was asked to read it; a decoder reads "
                "only C_base written by the base (prefill with producer=None) or K/V it wrote itself "
                f"(prefill with producer={decoder!r})"
            )
        if handle.producer != BASE and handle.producer_key != self._registry.producer(handle.producer).key:
            raise FingerprintMismatchError(
                f"PrefixHandle {handle.id} holds K/V written by decoder {handle.producer!r} before its "
                "weights were changed in place; prefill again with the current weights"
            )
        entry = self.decoders[decoder]
        self._registry.check_unchanged(entry)
        if entry.decoder is not None and entry.decoder.handoff_tokens != handle.handoff_tokens:
            raise ConfigError(
                f"decoder {decoder!r} was trained with handoff_tokens={entry.decoder.handoff_tokens} "
                f"but the handle was prefilled with {handle.handoff_tokens}; prefill with "
                f"handoff_tokens={entry.decoder.handoff_tokens}"
            )
        return entry

    @_inference
    def tail_logits(
        self,
        handle: PrefixHandle,
        rows: Sequence[int],
        tail_ids: torch.Tensor,
        tail_mask: torch.Tensor,
        *,
        decoder: str = BASE,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits of ``decoder`` over given tails on ``rows`` of ``handle`` (one batched
        forward).

        Row i's tail starts at the handle's k handoff tokens of prompt ``rows[i]`` (the tokens the decoder
        recomputes) and goes on with any tokens, e.g. a reference response: ``tail_ids[i, j]`` sits at
        position ``lengths[rows[i]] + j`` and attends to the prompt's prefix in the handle and causally to
        the tail before it. Equal (fp32 rounding) to ``ccft.core.decoder.decoder_forward`` on the handle's
        ``to_base_cache()`` (tested); nothing is written to the handle, the tail pools or the requests.

        Args:
            rows: b row indices of the handle.  tail_ids, tail_mask: ``(b, t)`` right-padded tails.
            decoder: a registered decoder (``"base"``: the base) allowed to read the handle.
            keep: ``(b, t)`` bool: return only these positions' logits (e.g. the scored ones of a reference).
        Returns:
            logits ``(b, t, V)`` in the lane's dtype; with ``keep``, ``(keep.sum(), V)`` in row-major order.
        Raises:
            ConfigError / FingerprintMismatchError: as ``add_request`` for a handle the decoder may not
            read; a row out of range or tails not shaped ``(len(rows), t)``.
        """
        self._check_reader(handle, decoder)
        handle = self._read_handle(handle, decoder)
        rows = [int(r) for r in rows]
        if any(not 0 <= r < handle.batch_size for r in rows):
            raise ConfigError(f"rows {rows} out of range: the handle has {handle.batch_size} prompts")
        if tail_ids.shape != tail_mask.shape or tail_ids.dim() != 2 or tail_ids.shape[0] != len(rows):
            raise ConfigError(
                f"tail_ids {tuple(tail_ids.shape)} and tail_mask {tuple(tail_mask.shape)} must both be "
                f"(len(rows)={len(rows)}, t)"
            )
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        starts = torch.tensor([handle.lengths[r] for r in rows], dtype=torch.long, device=self.device)
        prefix_real = handle.real_slots(index)
        prod = self._registry.producer(decoder)  # the decoder's weights and adapter, as it reads
        own = self._own_prefix(handle, decoder)
        return M.tail_forward(
            prod.weights,
            tail_ids.to(self.device),
            tail_mask.to(self.device),
            starts,
            lambda i: handle.layer_keys(i, own).index_select(0, index),
            lambda i: handle.layer_values(i, own).index_select(0, index),
            prefix_real,
            prod.lora,
            keep=None if keep is None else keep.to(self.device),
        )

    @_inference
    def add_request(
        self,
        handle: PrefixHandle,
        row: int = 0,
        *,
        decoder: str = BASE,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | str | None = None,
        sampling: SamplingParams | None = None,
        forced_tokens: Sequence[int] | None = None,
        ignore_eos: bool = False,
        suffix_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        params: DecodeParams | None = None,
    ) -> int:
        """Admit one prompt row of ``handle`` for ``decoder``; it decodes from the next ``step()``.

        The next ``step()`` first writes the request's tail (its suffix's K/V and the handoff), batched with
        the other requests admitted since: the suffixes of requests on one handle (agents admitted together
        on one context) take one forward (``prefill.write_tails``). A tail that cannot be written fails that
        request alone (``StepError``).

        Args:
            params: the decoding settings whole (``ccft.core.sampling.DecodeParams``: max_new_tokens, stop,
                ignore_eos, sampling, logprobs), as the scheduler passes them; or the same settings as the
                separate keywords below (not both).
            row: the prompt's index in the handle.
            suffix_ids: prompt tokens that follow the handle's prompt for this request only (an
                agent's own instruction after a shared context). The request's prompt is
                ``handle prompt + suffix_ids``: the handle's producer (the base) computes the KV of
                all but its last k tokens into this request's tail slot (so the shared prefix is
                stored once for every request that reads it), the decoder recomputes the last k
                (the handoff). Equal to prefilling the whole prompt (tested).
            max_new_tokens: default 256 (with ``forced_tokens``: their count).
            stop: stop strings (``ccft.core.text.StopMatcher``: the text is cut before the earliest
                one); EOS (``ccft.core.tokens.eos_token_ids`` of the decoder) always stops.
            sampling: ``ccft.core.sampling.SamplingParams`` (default greedy); a sampled request draws
                from its own generator seeded with ``sampling.seed``.
            forced_tokens: teacher forcing: feed these tokens (and report them) instead of sampled
                ones; the step logits are still the model's. ``max_new_tokens`` defaults to their count.
            ignore_eos: keep decoding past EOS (benchmarks: every row runs ``max_new_tokens`` steps).
            logprobs: None (default: nothing extra is computed), or k ≥ 0: every ``StepOutput`` of this
                request carries the log-probability of its token and the k most likely tokens of the
                step's raw distribution (``StepOutput.logprob`` / ``top_logprobs``; computed for the
                rows that ask only).
        Returns:
            the request id.
        Raises:
            CapacityError: no free slot (``max_batch``) or ``k + max_new_tokens > max_tail_tokens``.
            ConfigError: a released or foreign handle, an unknown decoder, a row out of range, the row's
                prompt (prefix + handoff + ``suffix_ids``) + ``max_new_tokens`` beyond ``max_positions``, a
                decoder trained with another k, ``max_new_tokens`` < 1 or beyond the forced tokens, forced
                ids outside the vocabulary, a
                packed full-weight decoder edited in place since registration.
            FingerprintMismatchError: the handle holds another decoder's own K/V (no-share prefill, K5),
                or this decoder's K/V from before an in-place edit of its weights.
        """
        if params is not None:
            if (max_new_tokens, stop, sampling, ignore_eos, logprobs) != (None, None, None, False, None):
                raise ConfigError(
                    "pass the decoding settings as params=DecodeParams(...) or as keywords "
                    "(max_new_tokens, stop, sampling, ignore_eos, logprobs), not both"
                )
            max_new_tokens, stop, sampling = params.max_new_tokens, params.stop, params.sampling
            ignore_eos, logprobs = params.ignore_eos, params.logprobs
        entry = self._check_reader(handle, decoder)
        if not 0 <= row < handle.batch_size:
            raise ConfigError(f"row={row} but the handle has {handle.batch_size} prompts")
        if forced_tokens is not None:
            forced_tokens = [int(t) for t in forced_tokens]
            vocab = entry.lane.weights.embed.shape[0]
            if any(not 0 <= t < vocab for t in forced_tokens):
                raise ConfigError(f"forced_tokens hold ids outside 0..{vocab - 1} (the vocabulary)")
            if max_new_tokens is not None and max_new_tokens > len(forced_tokens):
                raise ConfigError(
                    f"max_new_tokens={max_new_tokens} but only {len(forced_tokens)} forced tokens"
                )
        if max_new_tokens is None:
            max_new_tokens = len(forced_tokens) if forced_tokens is not None else 256
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens}; it must be ≥ 1")
        if logprobs is not None and not 0 <= int(logprobs) <= entry.lane.weights.embed.shape[0]:
            raise ConfigError(
                f"logprobs={logprobs}; it must be in 0..{entry.lane.weights.embed.shape[0]} (or None)"
            )
        limit = self.max_positions
        prompt = handle.lengths[row] + len(handle.tail_ids[row]) + len(suffix_ids or [])
        if limit is not None and prompt + max_new_tokens > limit:
            raise ConfigError(
                f"row {row}: a prompt of {prompt} tokens + max_new_tokens={max_new_tokens} is more than the "
                f"base model's {limit} positions ({self.max_positions_field}); lower max_new_tokens or "
                "shorten the prompt"
            )
        lane = entry.lane
        if len(lane.rows) >= self.max_batch:
            raise CapacityError(
                f"{len(lane.rows)} rows are active on lane {lane.key!r} (max_batch={self.max_batch}); "
                "step until some finish, abort some, or raise max_batch"
            )
        if suffix_ids and entry.cache_format != "native" and handle.producer == BASE:
            raise ConfigError(
                f"decoder {decoder!r} reads C_base in cache_format={entry.cache_format}, whose key scales "
                "cover a row's whole prefix, so a request's suffix_ids cannot extend it; prefill the whole "
                "prompt (handle prompt + suffix) instead"
            )
        handle = self._read_handle(handle, decoder)
        own = self._own_prefix(handle, decoder)
        tail = list(handle.tail_ids[row]) + [int(t) for t in (suffix_ids or [])]
        lane.pool.ensure(len(lane.rows) + 1, len(tail) + max_new_tokens)
        slot = len(lane.rows)
        lane.pool.clear_slot(slot)
        sampling = sampling or SamplingParams()
        gen = None
        if sampling.do_sample:
            gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        req = Request(
            next(self._rid),
            handle,
            row,
            decoder,
            entry.adapter_index,
            entry.eos,
            self.tokenizer,
            int(max_new_tokens),
            StopMatcher(stop),
            sampling,
            gen,
            forced_tokens,
            bool(ignore_eos),
            next_token=int(tail[-1]),
            tail_written=len(tail) - 1,
            logprobs=None if logprobs is None else int(logprobs),
            own=own,
        )
        # the handle's producer is the base or this decoder (checked above); the tail is written by the next
        # step, batched with the other requests admitted until then (prefill.write_tails)
        lane.pending.append(
            PendingTail(
                req,
                handle,
                row,
                tail,
                self._registry.producer(handle.producer),
                entry.lora_plan(),
                own,
            )
        )
        handle.acquire()
        lane.rows.append(req)
        self._requests[req.id] = req
        return req.id

    @property
    def active(self) -> int:
        """Number of active requests."""
        return len(self._requests)

    @property
    def max_positions(self) -> int | None:
        """The base model's positions: the most tokens one row's prompt and generation may span together
        (``prefill`` and ``add_request`` refuse more, as vLLM's ``max_model_len``; ``ccft serve`` answers
        ``context_length_exceeded``): ``config.max_position_embeddings``, or less where the engine's
        forward is exact only below a smaller bound (``sliding_window``, longrope's
        ``original_max_position_embeddings``; ``architectures.Architecture.max_positions``). None when the
        config names none (no limit is checked)."""
        return self._arch.max_positions

    @property
    def max_positions_field(self) -> str:
        """The config field that sets ``max_positions`` (``"config.max_position_embeddings"``,
        ``"config.sliding_window"``, ...), named in every refusal."""
        return f"config.{self._arch.max_positions_field}"

    def free_slots(self, decoder: str = BASE) -> int:
        """How many more requests ``decoder``'s lane can take now."""
        return self.max_batch - len(self.decoders[decoder].lane.rows)

    @_inference
    def step(self, *, return_logits: bool = False, request_ids=None) -> list[StepOutput]:
        """One decode step for every active row (all lanes); returns one ``StepOutput`` per row.

        ``request_ids``: step only these active requests (a preemptive scheduler pauses the others:
        they keep their slot, K/V and state untouched and resume at a later step with the same
        tokens). A lane stepped in part moves the chosen rows to its first slots and runs them
        eagerly (the static step's padded rows would write into the paused rows' slots). Ids that
        are not active are ignored. None (default): every active row.

        Rows whose request ends (EOS, stop string, ``max_new_tokens``) leave the batch at the end of
        the step; their ``StepOutput.generation`` holds the result.

        A failing request fails alone: when a lane's batched forward (or token choice) raises, the
        lane's rows are stepped again in parts (by decoder, then halves of a part that still
        raises; each part moved to the front of the tail pool and decoded eagerly) until the error
        is confined to the rows that cause it. Those requests are removed; every other row is
        stepped as usual. A re-run part rewrites the K/V it wrote before (same positions, same
        values), so nothing of the failed attempt is read. An error no part reproduces (e.g. one of
        the static step only) fails no request; ``step_errors`` / ``last_step_error`` keep count.

        Raises:
            StepError: some requests failed (``.failed``: request id -> exception); ``.outputs``
                holds the step's outputs of all the others.
        """
        outputs: list[StepOutput] = []
        failed: dict[int, BaseException] = {}
        only = None if request_ids is None else {int(r) for r in request_ids}
        for lane in list(self.lanes.values()):
            if lane.pending:
                self._write_pending(lane, failed)
            if not lane.rows:
                continue
            if only is None or all(r.id in only for r in lane.rows):
                outputs += self._step_lane(lane, return_logits, failed)
                continue
            chosen = [r for r in lane.rows if r.id in only]
            if chosen:
                self._to_front(lane, chosen)
                outputs += self._step_lane(lane, return_logits, failed, rows=chosen)
        if failed:
            raise StepError(outputs, failed)
        return outputs

    def _write_pending(self, lane: Lane, failed: dict[int, BaseException]) -> None:
        """Write the tails of the lane's newly admitted requests (``prefill.write_tails``: one forward per
        handle for their suffixes); a request whose tail cannot be written is removed, into ``failed``."""
        pending, lane.pending = lane.pending, []
        errors = write_tails(pending, lane.weights, lane.rows, lane.pool.k, lane.pool.v)
        for p in pending:
            error = errors.get(id(p.request))
            if error is not None:
                failed[p.request.id] = error
                self._remove(p.request)

    def _forward(self, lane: Lane, n: int, eager: bool = False) -> torch.Tensor:
        """Logits ``(n, V)`` of one decode step of the lane's first ``n`` rows (slots 0..n-1)."""
        rows = lane.rows[:n]
        tokens = [r.next_token for r in rows]
        write = [r.tail_written for r in rows]
        positions = [r.prefix_len + r.tail_written for r in rows]
        if lane.runner is not None and not eager:
            return lane.runner.run(rows, tokens, positions, write)
        # eager: reads and writes slots 0..n-1 only (the static step's padded rows write into slots n..,
        # which hold other live rows while a part of the lane is stepped)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        write_t = t(write)
        return M.decode_step_eager(
            lane.weights,
            t(tokens),
            t(positions),
            lane.pool.k,
            lane.pool.v,
            write_t,
            write_t + 1,
            max(write) + 1,
            planner.prefix_groups(rows, self.device),
            planner.lora_plan(lane.weights, rows, self.device),
        )

    def _to_front(self, lane: Lane, rows: list[Request]) -> None:
        """Move ``rows`` (in order) into the lane's first slots, the others after them."""
        index = {id(r): i for i, r in enumerate(lane.rows)}
        order = [index[id(r)] for r in rows]
        chosen = set(order)
        order += [i for i in range(len(lane.rows)) if i not in chosen]
        if order != list(range(len(lane.rows))):
            lane.pool.permute(order)
            lane.rows[:] = [lane.rows[i] for i in order]

    def _isolate(
        self,
        lane: Lane,
        rows: list[Request],
        error: BaseException,
        parts: list,
        failed: dict[int, BaseException],
    ) -> None:
        """``rows`` raised ``error`` together: step them in parts (by decoder, else halves); the rows
        of a part that still raises alone get its error in ``failed``; the others go to ``parts``."""
        if len(rows) == 1:
            failed[rows[0].id] = error
            return
        by_decoder: dict[str, list[Request]] = {}
        for r in rows:
            by_decoder.setdefault(r.decoder, []).append(r)
        groups = (
            list(by_decoder.values())
            if len(by_decoder) > 1
            else [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        )
        for group in groups:
            self._to_front(lane, group)
            try:
                logits = self._forward(lane, len(group), eager=True)
                parts.append((group, logits, choose_tokens(logits, group)))
            except Exception as e:  # noqa: BLE001 - confined to this group's rows below
                self._isolate(lane, group, e, parts, failed)

    def _step_lane(
        self,
        lane: Lane,
        return_logits: bool,
        failed: dict[int, BaseException],
        rows: list[Request] | None = None,
    ) -> list[StepOutput]:
        """Step ``rows`` (default: all the lane's rows; a part must be in the first slots, run eagerly)."""
        part_only = rows is not None and len(rows) < len(lane.rows)
        rows = list(lane.rows) if rows is None else list(rows)
        parts: list[tuple[list[Request], torch.Tensor, list[int]]] = []
        bad: dict[int, BaseException] = {}
        try:
            logits = self._forward(lane, len(rows), eager=part_only)
            parts.append((rows, logits, choose_tokens(logits, rows)))
        except Exception as e:  # noqa: BLE001 - a failing request fails alone (K12)
            self.step_errors += 1
            self.last_step_error = e
            self._isolate(lane, rows, e, parts, bad)
            failed.update(bad)
        outputs = []
        # removed after the others advanced: compaction moves a row's first tail_written positions,
        # which must include the K/V this step wrote
        done = [req for req in rows if req.id in bad]
        for part, logits, chosen in parts:
            chosen = [req.token_to_feed(tok) for req, tok in zip(part, chosen, strict=True)]
            lps = token_logprobs(logits, part, chosen)  # {} unless a row asked for logprobs
            for i, (req, tok) in enumerate(zip(part, chosen, strict=True)):
                req.tail_written += 1
                finished = req.advance(tok)
                out = StepOutput(req.id, tok, finished, logits=logits[i] if return_logits else None)
                if i in lps:
                    out.logprob, out.top_logprobs = lps[i]
                if finished:
                    out.generation = req.generation()
                    done.append(req)
                outputs.append(out)
        for req in done:
            self._remove(req)
        return outputs

    @_inference
    def finish(self, request_id: int) -> Generation:
        """End an active request now and return what it generated (``finish_reason="stop"``).

        Raises:
            ConfigError: the request is not active.
        """
        req = self._get(request_id)
        req.reason = req.reason or "stop"
        gen = req.generation()
        self._remove(req)
        return gen

    @_inference
    def abort(self, request_id: int) -> None:
        """Drop an active request and its output.

        Raises:
            ConfigError: the request is not active.
        """
        self._remove(self._get(request_id))

    def _get(self, request_id: int) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ConfigError(f"request {request_id} is not active (finished, aborted or unknown)") from None

    def _remove(self, req: Request) -> None:
        lane = self.decoders[req.decoder].lane
        lane.pending = [p for p in lane.pending if p.request is not req]  # never stepped: nothing to write
        slot = lane.rows.index(req)
        last = len(lane.rows) - 1
        if slot != last:  # compaction: the last row moves into the freed slot
            moved = lane.rows[last]
            lane.pool.move(last, slot, moved.tail_written)
            lane.rows[slot] = moved
        lane.rows.pop()
        del self._requests[req.id]
        req.handle.unref()

    # ------------------------------------------------------------------ generate
    @_inference
    def generate(
        self,
        handle: PrefixHandle,
        *,
        decoder: str = BASE,
        max_new_tokens: int = 256,
        stop: Sequence[str] | str | None = None,
        sampling: SamplingParams | None = None,
        rows: Sequence[int] | None = None,
        ignore_eos: bool = False,
        params: DecodeParams | None = None,
    ) -> list[Generation]:
        """Decode every prompt row of ``handle`` (or ``rows``) with ``decoder``; one ``Generation`` per row.

        ``params``: the decoding settings whole (``DecodeParams``), or the separate keywords (not both);
        row r samples with seed + r. Built on the step API: rows are admitted as slots free up (continuous
        batching). Requests added by a scheduler are stepped too; their outputs are not returned here.
        """
        rows = list(range(handle.batch_size)) if rows is None else list(rows)
        if params is None:
            params = DecodeParams(
                max_new_tokens=max_new_tokens, stop=stop, sampling=sampling, ignore_eos=ignore_eos
            )
        elif (max_new_tokens, stop, sampling, ignore_eos) != (256, None, None, False):
            raise ConfigError(
                "pass the decoding settings as params=DecodeParams(...) or as keywords, not both"
            )
        sampling = params.sampling
        pending = list(rows)
        mine: dict[int, int] = {}
        results: dict[int, Generation] = {}
        while pending or mine:
            while pending and self.free_slots(decoder) > 0:
                row = pending.pop(0)
                s = dataclasses.replace(sampling, seed=sampling.seed + row)
                rid = self.add_request(handle, row, decoder=decoder, params=params.replace(sampling=s))
                mine[rid] = row
            if not mine:
                raise CapacityError(
                    f"decoder {decoder!r} has no free slot (max_batch={self.max_batch} rows are "
                    "active from other requests)"
                )
            try:
                outs = self.step()
            except StepError as e:
                own = [rid for rid in e.failed if rid in mine]
                if own:  # one of these rows failed: end the others of this call too, raise its error
                    for rid in mine:
                        if rid in self._requests:
                            self.abort(rid)
                    raise e.failed[own[0]] from e
                outs = e.outputs
            for out in outs:
                if out.finished and out.request_id in mine:
                    results[mine.pop(out.request_id)] = out.generation
        return [results[r] for r in rows]

    def close(self) -> None:
        """Abort every active request (their handles' references are dropped)."""
        for rid in list(self._requests):
            self.abort(rid)


__all__ = [
    "SharedPrefillEngine",
    "kv_bytes_per_token",
    "PrefillJob",
    "PrefixHandle",
    "SamplingParams",
    "StepOutput",
    "BASE",
    "CapacityError",
]
