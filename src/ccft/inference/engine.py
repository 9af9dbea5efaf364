"""``SharedPrefillEngine``: one shared prefill, many decoders, static caches, step-level API.

Life cycle::

    engine = ccft.SharedPrefillEngine(base, decoders={"math": "runs/math", "code": "runs/code"})
    with engine.prefill(prompts) as handle:            # the base runs once; C_base in the arena
        math = engine.generate(handle, decoder="math", max_new_tokens=256)
        code = engine.generate(handle, decoder="code", max_new_tokens=256, stop=["\\nclass"])

Scheduler view (continuous batching): ``add_request(handle, row, decoder=...)`` admits a row,
``step()`` runs one decode step for every active row of every decoder and returns the new tokens,
``finish(rid)`` / ``abort(rid)`` end a request early; requests join and leave between steps.
``generate`` is built on these.

Decoders are grouped into *lanes* by weights: the base and every LoRA decoder on it form one lane
(one matmul over all their rows, each row adding its own adapter's ``B A x``); each full-weight
decoder is a lane of its own. Every active row of a lane has a slot in the lane's static tail
pool; its decode attention reads its prompt's prefix from the shared arena (read once for all rows
and decoders sharing it) and its own tail (``attention.py``).

Decode modes (``decode=``):
  * ``eager`` (CPU default): host-side grouping of rows by prefix, exact-width views, no copies.
  * ``static``: the static-shape step (``model.decode_step_static``) run eagerly; what is captured.
  * ``cuda_graph`` (CUDA default): that step captured once per (lane, batch bucket, tail bucket,
    prefix bucket, adapter count) and replayed; outputs copied out before the next replay.
  * ``compile``: that step through ``torch.compile`` (CPU or CUDA), same buckets, bounded recompiles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ccft.core.cache import BaseCache
from ccft.core.decoder import Decoder
from ccft.core.errors import ConfigError, FingerprintMismatchError, IncompatibleModelError
from ccft.core.fingerprint import check_compatible, tokenizer_digest
from ccft.core.generation import Generation
from ccft.core.sampling import SamplingParams, select_tokens
from ccft.core.tokens import eos_token_ids, left_pad
from ccft.inference import model as M
from ccft.inference.attention import PrefixGroup, build_prefix_meta
from ccft.inference.graphs import StaticRunner
from ccft.inference.kv import CapacityError, PrefixArena, TailPool
from ccft.inference.weights import LaneWeights, check_supported, lane_weights, lora_adapter, pack


def _inference(fn):
    """Run an engine entry point under ``torch.inference_mode()``: no autograd bookkeeping (version
    counters, view tracking) on the thousands of small ops of a decode step (about 8% of a batch-1
    CPU step). Every method that writes the engine's buffers is wrapped, so buffers (re)allocated
    inside are only ever written inside inference mode; returned tensors are inference tensors
    (read them freely, clone them to modify them)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


BASE = "base"  #: decoder name of the base model itself (decodes on its own C_base: ``mode="base"``)
DECODE_MODES = ("eager", "static", "cuda_graph", "compile")


@dataclass
class StepOutput:
    """One row's result of ``step()``: the token chosen this step (an EOS token too), and, when the
    request ended with it, its ``Generation``. ``logits (V,)`` when ``step(return_logits=True)``."""

    request_id: int
    token_id: int
    finished: bool
    generation: Generation | None = None
    logits: torch.Tensor | None = None


class PrefixHandle:
    """A batch of prompts prefilled by the base into the engine's prefix arena (read-only).

    Attributes:
        batch_size: b prompts.  lengths: real prefix length per row (``n - k``; the first decoder
            position).  tail_ids: per row the k handoff tokens the decoder recomputes.
        handoff_tokens: k.  fingerprint: the base fingerprint.
        producer: who wrote the K/V: ``"base"`` (C_base, shared mode; any decoder may read it) or a
            decoder's name (the no-share baseline: that decoder prefilled its own prompt; only it may
            read it).  producer_key: the producer's key (``engine.producer_key``).
    The region is refcounted: the user's reference (dropped by ``release()`` or leaving a ``with``
    block) plus one per active request; it is freed when the count reaches 0 (and then drops its
    references on prefix-store blocks, ``prefill_cached(hold=True)``).
    """

    _ids = itertools.count()

    def __init__(self, engine: "SharedPrefillEngine", start: int, width: int, lengths: list[int],
                 tail_ids: list[list[int]], handoff_tokens: int, fingerprint: str, producer: str = BASE,
                 producer_key: str | None = None):
        self.engine, self.start, self.width = engine, start, width
        self.lengths, self.tail_ids, self.handoff_tokens = lengths, tail_ids, handoff_tokens
        self.fingerprint = fingerprint
        self.producer = producer
        self.producer_key = producer_key if producer_key is not None else fingerprint
        self._held: tuple = ()  # (store, blocks) whose references this handle holds until it is freed
        self.id = next(self._ids)
        self.refs = 1
        self.released = False
        self.freed = False
        self.key_start = torch.tensor([width - n for n in lengths], dtype=torch.long, device=engine.device)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def keys(self, layer: int) -> torch.Tensor:
        """``(b, h, p, d)`` view of this handle's prefix keys in ``layer`` (left-padded; pads are 0)."""
        self._check_alive()
        return self.engine.arena.view("k", layer, self.start, self.batch_size, self.width)

    def values(self, layer: int) -> torch.Tensor:
        self._check_alive()
        return self.engine.arena.view("v", layer, self.start, self.batch_size, self.width)

    def snapshot(self) -> list[torch.Tensor]:
        """Clones of every layer's keys then values (tests compare them bit for bit, K1)."""
        n = self.engine.num_layers
        return [self.keys(i).clone() for i in range(n)] + [self.values(i).clone() for i in range(n)]

    def to_base_cache(self) -> BaseCache:
        """A ``BaseCache`` copy of this prefix (for the reference path ``ccft.generate(cache=...)``)."""
        n = self.engine.num_layers
        mask = (torch.arange(self.width, device=self.key_start.device)[None, :] >= self.key_start[:, None]).long()
        tail = torch.tensor(self.tail_ids, dtype=torch.long, device=self.key_start.device)
        return BaseCache.from_tensors([self.keys(i).clone() for i in range(n)], [self.values(i).clone() for i in range(n)], mask,
                     tail, self.handoff_tokens, self.fingerprint, self.producer)

    def _check_alive(self) -> None:
        if self.freed:
            raise ConfigError(f"PrefixHandle {self.id} was released and its prefix freed; prefill the prompts again")

    def release(self) -> None:
        """Drop the user's reference; the prefix is freed once no active request reads it."""
        if not self.released:
            self.released = True
            self.engine._unref(self)

    def __enter__(self) -> "PrefixHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("released" if self.released else "live")
        who = "" if self.producer == BASE else f", producer={self.producer!r}"
        return (f"PrefixHandle(id={self.id}, rows={self.batch_size}, width={self.width}, refs={self.refs}{who}, "
                f"{state})")


@dataclass
class _DecoderEntry:
    name: str
    lane: "_Lane"
    adapter_index: int | None  # index in lane.weights.adapters, None: the lane's own weights
    eos: set[int]
    decoder: Decoder | None
    key: str | None = None  # producer key (no-share prefill by this decoder), computed on first use


@dataclass
class _Lane:
    key: str
    weights: LaneWeights
    pool: TailPool
    rows: list["_Request"] = field(default_factory=list)  # slot order: rows[i] is in slot i
    runner: StaticRunner | None = None


@dataclass(eq=False)
class _Request:
    id: int
    handle: PrefixHandle
    row: int
    entry: _DecoderEntry
    max_new_tokens: int
    stop: list[str]
    sampling: SamplingParams
    generator: torch.Generator | None
    forced: list[int] | None
    ignore_eos: bool
    next_token: int
    tail_written: int
    out_ids: list[int] = field(default_factory=list)
    reason: str | None = None
    text: str | None = None

    @property
    def prefix_len(self) -> int:
        return self.handle.lengths[self.row]

    def generation(self, tokenizer) -> Generation:
        text = self.text if self.text is not None else tokenizer.decode(self.out_ids, skip_special_tokens=True)
        return Generation(text=text, token_ids=list(self.out_ids), finish_reason=self.reason or "length")


class SharedPrefillEngine:
    """One base model's shared prefill and N decoders decoding on it (see the module docstring).

    Args:
        base: the ``ccft.Base`` that runs prefill (and the lane of every LoRA decoder on it).
        decoders: name -> ``ccft.Decoder`` or decoder folder (loaded onto ``base``).
        max_batch: active rows per lane (tail-pool slots).
        max_tail_tokens: per-request tail capacity limit (handoff tokens + max_new_tokens).
        max_prefix_tokens: prefix-arena limit in token slots (b·p per handle); None: grows as needed.
        decode: ``"auto"`` (CUDA: ``cuda_graph``; else ``eager``), ``"eager"``, ``"static"``,
            ``"cuda_graph"`` or ``"compile"``.
        attention: prefix attention of the static step: ``"auto"`` (Triton on CUDA when available,
            else ``"gather"``), ``"gather"`` or ``"triton"``.
        pack_weights: keep each lane's weights packed ([q;k;v], [gate;up]) and prepacked for oneDNN
            (about 2x faster CPU decode; one extra copy of the lane's weights, taken at registration,
            so later in-place edits of the model's weights are not seen). Default: True on CPU
            unless ``decode="compile"``.
        fill: value of never-written cache memory (0; tests use NaN to catch reads of it, K3).
    Raises:
        IncompatibleModelError: a model the engine cannot run, or a decoder that cannot read the base's KV.
        FingerprintMismatchError: a decoder conditioned on another base.
    """

    def __init__(self, base, decoders: dict | None = None, *, max_batch: int = 16, max_tail_tokens: int = 4096,
                 max_prefix_tokens: int | None = None, decode: str = "auto", attention: str = "auto",
                 pack_weights: bool | None = None, fill: float = 0.0):
        self.base = base
        self.tokenizer = base.tokenizer
        check_supported(base.config)
        device = base.device
        self.device = device
        if decode == "auto":
            decode = "cuda_graph" if device.type == "cuda" else "eager"
        if decode not in DECODE_MODES:
            raise ConfigError(f"decode={decode!r}; use one of auto, {', '.join(DECODE_MODES)}")
        if decode == "cuda_graph" and device.type != "cuda":
            raise ConfigError("decode='cuda_graph' needs the model on a CUDA device; use 'eager' or 'static' on CPU")
        from ccft.inference.triton_kernels import kernel_supports, triton_available

        bw = lane_weights(base.model)
        if attention == "auto":
            attention = "triton" if (device.type == "cuda" and triton_available(device)
                                     and kernel_supports(bw.head_dim)) else "gather"
        if attention not in ("gather", "triton"):
            raise ConfigError(f"attention={attention!r}; use auto, gather or triton")
        if attention == "triton" and not (triton_available(device) and kernel_supports(bw.head_dim)):
            raise ConfigError(f"attention='triton' needs triton on a CUDA device (or TRITON_INTERPRET=1 on CPU) and a "
                              f"power-of-two head_dim ≥ 16 (this model: {bw.head_dim}); use attention='gather'")
        self.decode_mode, self.attention = decode, attention
        if pack_weights is None:
            pack_weights = device.type == "cpu" and decode != "compile"
        if pack_weights and decode == "compile":
            raise ConfigError("pack_weights=True cannot be combined with decode='compile' (torch.compile does its own "
                              "weight handling); leave pack_weights unset")
        self.pack_weights = bool(pack_weights)
        self.max_batch, self.max_tail_tokens = int(max_batch), int(max_tail_tokens)
        self.fill = float(fill)
        self.num_layers = bw.num_layers
        #: bytes of K and V per token over all layers: layers × 2 × kv_heads × head_dim × dtype bytes
        self.kv_bytes_per_token = bw.num_layers * 2 * bw.kv_heads * bw.head_dim * bw.dtype.itemsize
        self.arena = PrefixArena(bw.num_layers, bw.kv_heads, bw.head_dim, bw.dtype, device,
                                 capacity_tokens=1024 if max_prefix_tokens is None else max_prefix_tokens,
                                 max_tokens=max_prefix_tokens, fill=self.fill)
        self._base_lane = self._new_lane(BASE, bw)
        self.lanes: dict[str, _Lane] = {BASE: self._base_lane}
        self.decoders: dict[str, _DecoderEntry] = {
            BASE: _DecoderEntry(BASE, self._base_lane, None, eos_token_ids(self.tokenizer, base.model), None)}
        self._requests: dict[int, _Request] = {}
        self._rid = itertools.count()
        for name, dec in (decoders or {}).items():
            self.add_decoder(name, dec)

    # ------------------------------------------------------------------ decoders
    def _new_lane(self, key: str, weights: LaneWeights) -> _Lane:
        if self.pack_weights:
            pack(weights)
        pool = TailPool(weights.num_layers, weights.kv_heads, weights.head_dim, weights.dtype, self.device,
                        slots=1, capacity=64, max_slots=self.max_batch, max_capacity=self.max_tail_tokens,
                        fill=self.fill)
        lane = _Lane(key, weights, pool)
        if self.decode_mode != "eager":
            lane.runner = StaticRunner(self, lane, self.decode_mode, self.attention)
        return lane

    def add_decoder(self, name: str, decoder: Decoder | str | Path, *, tokenizer=None) -> None:
        """Register a decoder under ``name`` (a ``ccft.Decoder``, or a decoder folder loaded onto the base).

        Raises:
            FingerprintMismatchError: the decoder was conditioned on another base.
            IncompatibleModelError: its tokenizer, layer count, KV geometry or RoPE differ from the base's,
                or it is a model / LoRA variant the engine does not run.
            ConfigError: ``name`` already used.
        """
        if name in self.decoders:
            raise ConfigError(f"a decoder named {name!r} is already registered; pick another name")
        if isinstance(decoder, (str, Path)):
            from transformers import AutoTokenizer

            from ccft.core.checkpoint import load_decoder, read_meta

            meta = read_meta(decoder)
            want = meta.get("base_fingerprint")
            if want and want != self.base.fingerprint:
                raise FingerprintMismatchError(
                    f"decoder {decoder} was trained on base {want} but this engine's base is {self.base.fingerprint} "
                    f"({self.base.name}); serve it with the base it was trained on")
            if tokenizer is None and (Path(decoder) / "tokenizer_config.json").is_file():
                tokenizer = AutoTokenizer.from_pretrained(str(decoder))
            self._check_tokenizer(name, tokenizer)
            decoder = load_decoder(decoder, base=self.base, adapter_name=name)
        if not isinstance(decoder, Decoder):
            raise ConfigError(f"decoder {name!r}: expected a ccft.Decoder or a decoder folder, got {type(decoder)}")
        if decoder.fingerprint != self.base.fingerprint:
            raise FingerprintMismatchError(
                f"decoder {name!r} was conditioned on base {decoder.fingerprint} but this engine's base is "
                f"{self.base.fingerprint} ({self.base.name}); use the base it was trained on")
        self._check_tokenizer(name, tokenizer)
        check_compatible(self.base.config, decoder.model.config)
        if decoder.dtype != self.base.dtype:
            raise IncompatibleModelError(f"decoder {name!r} is {decoder.dtype} but the base is {self.base.dtype}; "
                                         "load both in one dtype (C_base is read as is)")
        eos = eos_token_ids(self.tokenizer, decoder.model)
        if decoder.kind == "lora":
            if decoder.model.get_base_model() is not self.base.model:
                raise IncompatibleModelError(f"LoRA decoder {name!r} is attached to another copy of the base model; "
                                             "load it with ccft.load_decoder(path, base=engine.base)")
            adapter = lora_adapter(decoder.model, decoder.meta.get("adapter_name", "default"))
            lane = self._base_lane
            lane.weights.adapters.append(adapter)
            self.decoders[name] = _DecoderEntry(name, lane, len(lane.weights.adapters) - 1, eos, decoder)
        else:
            check_supported(decoder.model.config)
            lane = self._new_lane(name, lane_weights(decoder.model, allow_adapters=False))
            self.lanes[name] = lane
            self.decoders[name] = _DecoderEntry(name, lane, None, eos, decoder)

    def _check_tokenizer(self, name: str, tokenizer) -> None:
        if tokenizer is not None and tokenizer_digest(tokenizer) != tokenizer_digest(self.tokenizer):
            raise IncompatibleModelError(
                f"decoder {name!r} uses a different tokenizer (vocabulary, special tokens or chat template) than "
                "the base; a decoder must read the base's token ids")

    # ------------------------------------------------------------------ prefill
    @_inference
    def prefill(self, prompts: Sequence[Sequence[int]], *, handoff_tokens: int | None = None,
                producer: str | None = None) -> PrefixHandle:
        """Run the base once over ``prompt[:n-k]`` of every prompt into a new arena region.

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
            ConfigError: no prompt, a prompt shorter than k+1 tokens, k < 1, an unknown producer.
        """
        k = self._handoff(handoff_tokens, producer)
        if not prompts:
            raise ConfigError("prefill needs at least one prompt")
        short = [i for i, p in enumerate(prompts) if len(p) < k + 1]
        if short:
            raise ConfigError(f"prompts {short} have fewer than handoff_tokens+1={k + 1} tokens")
        lw, lora, pname, pkey = self._producer(producer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids, mask = left_pad([list(p[:-k]) for p in prompts], pad or 0)
        handle = self._new_handle(mask.sum(-1).tolist(), ids.shape[1], [list(p[-k:]) for p in prompts], k, pname,
                                  pkey)
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Rows in chunks so the (rows, heads, p, p) attention scores stay below ~256 MB.
        per = max(1, int(2 ** 26 // max(1, lw.heads * ids.shape[1] ** 2)))
        for r0 in range(0, ids.shape[0], per):
            rs = slice(r0, min(ids.shape[0], r0 + per))
            M.prefill(lw, ids[rs], mask[rs], lambda i, rs=rs: handle.keys(i)[rs],
                      lambda i, rs=rs: handle.values(i)[rs], lora)
        return handle

    @_inference
    def prefill_cached(self, prompt: Sequence[int], store, *, producer: str | None = None,
                       handoff_tokens: int | None = None, hold: bool = True,
                       chunk_tokens: int | None = None) -> tuple[PrefixHandle, int]:
        """Prefill ONE prompt's ``prompt[:n-k]`` into a new batch-1 handle, reusing K/V from a prefix store.

        The longest chain of full blocks of ``prompt[:n-k]`` cached in ``store`` under this producer and
        dtype is copied into the handle's region; only the remaining tokens are computed (chunked
        prefill attending to the copied prefix, ``model.prefill_chunk``); the newly completed full
        blocks are then inserted into the store. Equal to ``prefill([prompt], producer=producer)``
        (K/V within fp32 rounding; tested with greedy decodes).

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
        k = self._handoff(handoff_tokens, producer)
        prompt = [int(t) for t in prompt]
        if len(prompt) < k + 1:
            raise ConfigError(f"the prompt has {len(prompt)} tokens, fewer than handoff_tokens+1={k + 1}")
        lw, lora, pname, pkey = self._producer(producer)
        prefix = prompt[:-k]
        n = len(prefix)
        bt = int(store.block_tokens)
        blocks = store.match(pkey, lw.dtype, prefix)
        new: list = []
        handle = None
        try:
            handle = self._new_handle([n], n, [prompt[-k:]], k, pname, pkey)
            rk = self.arena.view_layers("k", handle.start, 1, n)[:, 0]  # (L, h, n, d)
            rv = self.arena.view_layers("v", handle.start, 1, n)[:, 0]
            for j, blk in enumerate(blocks):
                rk[:, :, j * bt:(j + 1) * bt].copy_(blk.k)
                rv[:, :, j * bt:(j + 1) * bt].copy_(blk.v)
            hit = len(blocks) * bt
            if hit < n:
                ids = torch.tensor(prefix[hit:], dtype=torch.long, device=self.device)
                # query chunks so the (heads, chunk, n) attention scores stay below ~256 MB
                chunk = int(chunk_tokens) if chunk_tokens else max(64, 2 ** 26 // max(1, lw.heads * n))
                for s in range(hit, n, chunk):
                    M.prefill_chunk(lw, ids[s - hit: s - hit + chunk], s, rk, rv, lora)
            new = store.insert(pkey, lw.dtype, prefix, rk, rv, start_block=len(blocks))
        except BaseException:
            store.release(blocks)
            if handle is not None:
                handle.release()
            raise
        if hold:
            handle._held = (store, blocks + new)
        else:
            store.release(blocks + new)
        return handle, hit

    def producer_key(self, producer: str | None = None) -> str:
        """The key K/V written by ``producer`` is stored under (prefix store, ``PrefixHandle.producer_key``).

        None / ``"base"``: the base fingerprint. A decoder's name: ``"{base fingerprint}+{name}/{weights id}"``,
        weights id = 16 hex digits of a digest of the decoder's own weights (its LoRA A/B and scalings,
        or a full-weight decoder's parameters), computed on first use (weights edited in place later
        are not seen: register the edited decoder under a new name).
        """
        return self._producer(producer)[3]

    def _producer(self, producer: str | None):
        """(lane weights, LoRA plan, producer name, producer key) of the model that prefills."""
        if producer is None or producer == BASE:
            return self._base_lane.weights, M.NO_LORA, BASE, self.base.fingerprint
        entry = self.decoders.get(producer)
        if entry is None:
            raise ConfigError(f"unknown producer {producer!r}; use None (the base) or a registered decoder: "
                              f"{', '.join(n for n in self.decoders if n != BASE) or '(none)'}")
        if entry.key is None:
            entry.key = f"{self.base.fingerprint}+{producer}/{self._weights_id(entry)}"
        return entry.lane.weights, self._lora_plan_single(entry), producer, entry.key

    def _weights_id(self, entry: _DecoderEntry) -> str:
        import hashlib

        from ccft.core.fingerprint import weights_digest_module

        if entry.adapter_index is None:
            model = entry.decoder.model if entry.decoder is not None else entry.lane.weights.owner
            return weights_digest_module(model)[:16]
        h = hashlib.sha256()
        for i, layer in enumerate(entry.lane.weights.adapters[entry.adapter_index].layers):
            for name, lw in sorted(layer.items()):
                h.update(f"{i}.{name}:{lw.scaling!r}".encode())
                for t in (lw.a, lw.b):
                    h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def _handoff(self, handoff_tokens: int | None, producer: str | None = None) -> int:
        if handoff_tokens is None:
            entry = self.decoders.get(producer) if producer not in (None, BASE) else None
            if entry is not None and entry.decoder is not None:
                handoff_tokens = entry.decoder.handoff_tokens
            else:
                ks = {e.decoder.handoff_tokens for e in self.decoders.values() if e.decoder is not None}
                handoff_tokens = ks.pop() if len(ks) == 1 else 1
        k = int(handoff_tokens)
        if k < 1:
            raise ConfigError(f"handoff_tokens={k}; it must be ≥ 1")
        return k

    @_inference
    def prefill_cache(self, cache: BaseCache) -> PrefixHandle:
        """Import a precomputed ``C_base`` (``ccft.compute_base_cache``) into a new arena region (a copy).

        Raises:
            FingerprintMismatchError: the cache was written by another base, another dtype, or not by a base.
        """
        cache.check_reader(self.base.fingerprint, self.base.dtype)
        lengths = cache.lengths.tolist()
        handle = self._new_handle(lengths, cache.attention_mask.shape[1], cache.tail_ids.tolist(),
                                  cache.handoff_tokens)
        for i in range(self.num_layers):
            handle.keys(i).copy_(cache.keys[i])
            handle.values(i).copy_(cache.values[i])
        cache.check_unmodified()
        return handle

    def _new_handle(self, lengths: list[int], width: int, tail_ids: list[list[int]], k: int, producer: str = BASE,
                    producer_key: str | None = None) -> PrefixHandle:
        start = self.arena.allocate(len(lengths) * width)
        return PrefixHandle(self, start, width, [int(n) for n in lengths], tail_ids, k, self.base.fingerprint,
                            producer, producer_key)

    def _unref(self, handle: PrefixHandle) -> None:
        handle.refs -= 1
        if handle.refs == 0 and not handle.freed:
            self.arena.free(handle.start)
            handle.freed = True
            if handle._held:
                store, blocks = handle._held
                handle._held = ()
                store.release(blocks)

    # ------------------------------------------------------------------ step API
    @_inference
    def add_request(self, handle: PrefixHandle, row: int = 0, *, decoder: str = BASE, max_new_tokens: int | None = None,
                    stop: Sequence[str] | str | None = None, sampling: SamplingParams | None = None,
                    forced_tokens: Sequence[int] | None = None, ignore_eos: bool = False,
                    suffix_ids: Sequence[int] | None = None) -> int:
        """Admit one prompt row of ``handle`` for ``decoder``; it decodes from the next ``step()``.

        Args:
            row: the prompt's index in the handle.
            suffix_ids: prompt tokens that follow the handle's prompt for this request only (an
                agent's own instruction after a shared context). The request's prompt is
                ``handle prompt + suffix_ids``: the handle's producer (the base) computes the KV of
                all but its last k tokens into this request's tail slot (so the shared prefix is
                stored once for every request that reads it), the decoder recomputes the last k
                (the handoff). Equal to prefilling the whole prompt (tested).
            max_new_tokens: default 256 (with ``forced_tokens``: their count).
            stop: stop strings (the text is cut before the first one); EOS always stops.
            forced_tokens: teacher forcing: feed these tokens (and report them) instead of sampled
                ones; the step logits are still the model's. ``max_new_tokens`` defaults to their count.
            ignore_eos: keep decoding past EOS (benchmarks: every row runs ``max_new_tokens`` steps).
        Returns:
            the request id.
        Raises:
            CapacityError: no free slot (``max_batch``) or ``k + max_new_tokens > max_tail_tokens``.
        """
        if handle.engine is not self:
            raise ConfigError("this PrefixHandle belongs to another engine")
        if handle.released or handle.freed:
            raise ConfigError(f"PrefixHandle {handle.id} was released; prefill again (or add requests before release)")
        if decoder not in self.decoders:
            raise ConfigError(f"unknown decoder {decoder!r}; registered: {', '.join(self.decoders)}")
        if not 0 <= row < handle.batch_size:
            raise ConfigError(f"row={row} but the handle has {handle.batch_size} prompts")
        if handle.producer != BASE and handle.producer != decoder:
            raise FingerprintMismatchError(
                f"PrefixHandle {handle.id} holds K/V written by decoder {handle.producer!r} with its own weights "
                f"(no-share prefill), but decoder {decoder!r} was asked to read it; a decoder reads only C_base "
                f"written by the base (prefill with producer=None) or K/V it wrote itself (prefill with "
                f"producer={decoder!r})")
        entry = self.decoders[decoder]
        if entry.decoder is not None and entry.decoder.handoff_tokens != handle.handoff_tokens:
            raise ConfigError(f"decoder {decoder!r} was trained with handoff_tokens={entry.decoder.handoff_tokens} "
                              f"but the handle was prefilled with {handle.handoff_tokens}; prefill with "
                              f"handoff_tokens={entry.decoder.handoff_tokens}")
        if forced_tokens is not None:
            forced_tokens = [int(t) for t in forced_tokens]
            if max_new_tokens is not None and max_new_tokens > len(forced_tokens):
                raise ConfigError(f"max_new_tokens={max_new_tokens} but only {len(forced_tokens)} forced tokens")
        if max_new_tokens is None:
            max_new_tokens = len(forced_tokens) if forced_tokens is not None else 256
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens}; it must be ≥ 1")
        k = handle.handoff_tokens
        lane = entry.lane
        if len(lane.rows) >= self.max_batch:
            raise CapacityError(f"{len(lane.rows)} rows are active on lane {lane.key!r} (max_batch={self.max_batch}); "
                                "step until some finish, abort some, or raise max_batch")
        tail = list(handle.tail_ids[row]) + [int(t) for t in (suffix_ids or [])]
        lane.pool.ensure(len(lane.rows) + 1, len(tail) + max_new_tokens)
        slot = len(lane.rows)
        lane.pool.clear_slot(slot)
        sampling = sampling or SamplingParams()
        gen = None
        if sampling.do_sample:
            gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        if isinstance(stop, str):
            stop = [stop]
        n_pre = len(tail) - k  # suffix tokens the producer computes (C_base of the suffix)
        req = _Request(next(self._rid), handle, row, entry, int(max_new_tokens), [s for s in (stop or []) if s],
                       sampling, gen, forced_tokens, bool(ignore_eos), next_token=int(tail[-1]),
                       tail_written=len(tail) - 1)
        kf, vf = (lambda i: handle.keys(i)[row]), (lambda i: handle.values(i)[row])
        if n_pre > 0:
            pw, plora = self._producer(handle.producer)[:2]  # checked above: the base, or this decoder
            M.extend(pw, torch.tensor(tail[:n_pre], device=self.device), req.prefix_len, kf, vf,
                     int(handle.key_start[row]), lane.pool.k[:, slot], lane.pool.v[:, slot], 0, plora)
        if k > 1:  # the first k-1 handoff tokens: one small forward for this row now
            lora = self._lora_plan_single(entry)
            M.extend(lane.weights, torch.tensor(tail[n_pre:-1], device=self.device), req.prefix_len + n_pre, kf, vf,
                     int(handle.key_start[row]), lane.pool.k[:, slot], lane.pool.v[:, slot], n_pre, lora)
        handle.refs += 1
        lane.rows.append(req)
        self._requests[req.id] = req
        return req.id

    @property
    def active(self) -> int:
        """Number of active requests."""
        return len(self._requests)

    def free_slots(self, decoder: str = BASE) -> int:
        """How many more requests ``decoder``'s lane can take now."""
        return self.max_batch - len(self.decoders[decoder].lane.rows)

    @_inference
    def step(self, *, return_logits: bool = False) -> list[StepOutput]:
        """One decode step for every active row (all lanes); returns one ``StepOutput`` per row.

        Rows whose request ends (EOS, stop string, ``max_new_tokens``) leave the batch at the end of
        the step; their ``StepOutput.generation`` holds the result.
        """
        outputs: list[StepOutput] = []
        for lane in list(self.lanes.values()):
            if lane.rows:
                outputs += self._step_lane(lane, return_logits)
        return outputs

    def _step_lane(self, lane: _Lane, return_logits: bool) -> list[StepOutput]:
        rows = lane.rows
        dev = self.device
        tokens = [r.next_token for r in rows]
        write = [r.tail_written for r in rows]
        positions = [r.prefix_len + r.tail_written for r in rows]
        if lane.runner is None:
            t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
            write_t = t(write)
            logits = M.decode_step_eager(lane.weights, t(tokens), t(positions), lane.pool.k, lane.pool.v, write_t,
                                         write_t + 1, max(write) + 1, self._prefix_groups(rows),
                                         self._lora_plan(lane, rows))
        else:
            logits = lane.runner.run(rows, tokens, positions, write)
        chosen = self._select(logits, rows)
        outputs = []
        done = []
        for i, (req, tok) in enumerate(zip(rows, chosen, strict=True)):
            if req.forced is not None:
                tok = req.forced[len(req.out_ids)]
            req.tail_written += 1
            finished = self._advance(req, tok)
            out = StepOutput(req.id, tok, finished, logits=logits[i] if return_logits else None)
            if finished:
                out.generation = req.generation(self.tokenizer)
                done.append(req)
            outputs.append(out)
        for req in done:
            self._remove(req)
        return outputs

    def _advance(self, req: _Request, tok: int) -> bool:
        """Record token ``tok`` for ``req``; True when the request is finished."""
        if tok in req.entry.eos and not req.ignore_eos:
            req.reason = "eos"
            return True
        req.out_ids.append(tok)
        if req.stop:
            text = self.tokenizer.decode(req.out_ids, skip_special_tokens=True)
            cut = min((text.find(s) for s in req.stop if s in text), default=-1)
            if cut >= 0:
                req.reason, req.text = "stop", text[:cut]
                return True
        if len(req.out_ids) >= req.max_new_tokens:
            req.reason = "length"
            return True
        req.next_token = tok
        return False

    def _select(self, logits: torch.Tensor, rows: list[_Request]) -> list[int]:
        greedy = logits.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if r.sampling.do_sample and r.forced is None]
        if sampled:
            greedy = greedy.clone()
            for i in sampled:
                greedy[i] = select_tokens(logits[i:i + 1], rows[i].sampling, rows[i].generator)[0]
        return greedy.tolist()

    @_inference
    def finish(self, request_id: int) -> Generation:
        """End an active request now and return what it generated (``finish_reason="stop"``)."""
        req = self._get(request_id)
        req.reason = req.reason or "stop"
        gen = req.generation(self.tokenizer)
        self._remove(req)
        return gen

    @_inference
    def abort(self, request_id: int) -> None:
        """Drop an active request and its output."""
        self._remove(self._get(request_id))

    def _get(self, request_id: int) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ConfigError(f"request {request_id} is not active (finished, aborted or unknown)") from None

    def _remove(self, req: _Request) -> None:
        lane = req.entry.lane
        slot = lane.rows.index(req)
        last = len(lane.rows) - 1
        if slot != last:  # compaction: the last row moves into the freed slot
            moved = lane.rows[last]
            lane.pool.move(last, slot, moved.tail_written)
            lane.rows[slot] = moved
        lane.rows.pop()
        del self._requests[req.id]
        self._unref(req.handle)

    # ------------------------------------------------------------------ plans
    def _prefix_groups(self, rows: list[_Request]) -> list[PrefixGroup]:
        by_handle: dict[int, list[tuple[int, _Request]]] = {}
        for i, r in enumerate(rows):
            by_handle.setdefault(r.handle.id, []).append((i, r))
        groups = []
        for members in by_handle.values():
            h = members[0][1].handle
            kf = (lambda hh: lambda i: hh.keys(i))(h)
            vf = (lambda hh: lambda i: hh.values(i))(h)
            first = members[0][0]
            if len(members) == h.batch_size and all(i == first + r.row for i, r in members):
                groups.append(PrefixGroup(kf, vf, h.key_start, None, first))
                continue
            per: dict[int, list[int]] = {}
            for i, r in members:
                per.setdefault(r.row, []).append(i)
            used = sorted(per)
            m = max(len(v) for v in per.values())
            table = torch.full((len(used), m), -1, dtype=torch.long)
            for j, u in enumerate(used):
                table[j, : len(per[u])] = torch.tensor(per[u])
            used_t = None if len(used) == h.batch_size else torch.tensor(used, device=self.device)
            groups.append(PrefixGroup(kf, vf, h.key_start, table.to(self.device), 0, used_t))
        return groups

    def _lora_plan(self, lane: _Lane, rows: list[_Request]) -> M.LoraPlan:
        if not lane.weights.adapters:
            return M.NO_LORA
        by_adapter: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if r.entry.adapter_index is not None:
                by_adapter.setdefault(r.entry.adapter_index, []).append(i)
        entries = []
        for a, idx in by_adapter.items():
            sel = None if len(idx) == len(rows) else torch.tensor(idx, dtype=torch.long, device=self.device)
            entries.append((lane.weights.adapters[a], sel))
        return M.LoraPlan(entries)

    def _lora_plan_single(self, entry: _DecoderEntry) -> M.LoraPlan:
        if entry.adapter_index is None:
            return M.NO_LORA
        return M.LoraPlan([(entry.lane.weights.adapters[entry.adapter_index], None)])

    def static_inputs(self, lane: _Lane, rows: list[_Request], tokens, positions, write, batch: int):
        """Host-built ``StaticInputs`` for ``rows`` padded to ``batch`` (used by ``StaticRunner``)."""
        n = len(rows)
        pad = batch - n
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        tokens = t(list(tokens) + [0] * pad)
        positions = t(list(positions) + [0] * pad)
        write_pos = t(list(write) + [0] * pad)
        tail_len = write_pos + 1
        n_ad = len(lane.weights.adapters)
        masks = torch.zeros((n_ad, batch, 1), dtype=lane.weights.dtype, device=self.device)
        for i, r in enumerate(rows):
            if r.entry.adapter_index is not None:
                masks[r.entry.adapter_index, i] = 1
        meta = build_prefix_meta([(r.handle.start, r.row, r.handle.width, r.prefix_len) for r in rows], batch,
                                 lane.weights.kv_heads, self.device)
        return M.StaticInputs(tokens, positions, write_pos, tail_len, masks, meta)

    # ------------------------------------------------------------------ generate
    @_inference
    def generate(self, handle: PrefixHandle, *, decoder: str = BASE, max_new_tokens: int = 256,
                 stop: Sequence[str] | str | None = None, sampling: SamplingParams | None = None,
                 rows: Sequence[int] | None = None, ignore_eos: bool = False) -> list[Generation]:
        """Decode every prompt row of ``handle`` (or ``rows``) with ``decoder``; one ``Generation`` per row.

        Built on the step API: rows are admitted as slots free up (continuous batching). Requests
        added by a scheduler are stepped too; their outputs are not returned here.
        """
        rows = list(range(handle.batch_size)) if rows is None else list(rows)
        sampling = sampling or SamplingParams()
        pending = list(rows)
        mine: dict[int, int] = {}
        results: dict[int, Generation] = {}
        while pending or mine:
            while pending and self.free_slots(decoder) > 0:
                row = pending.pop(0)
                s = SamplingParams(sampling.do_sample, sampling.temperature, sampling.top_p, sampling.seed + row)
                rid = self.add_request(handle, row, decoder=decoder, max_new_tokens=max_new_tokens, stop=stop,
                                       sampling=s, ignore_eos=ignore_eos)
                mine[rid] = row
            if not mine:
                raise CapacityError(f"decoder {decoder!r} has no free slot (max_batch={self.max_batch} rows are "
                                    "active from other requests)")
            for out in self.step():
                if out.finished and out.request_id in mine:
                    results[mine.pop(out.request_id)] = out.generation
        return [results[r] for r in rows]

    def close(self) -> None:
        """Abort every active request (their handles' references are dropped)."""
        for rid in list(self._requests):
            self.abort(rid)


__all__ = ["SharedPrefillEngine", "PrefixHandle", "SamplingParams", "StepOutput", "BASE", "CapacityError"]
