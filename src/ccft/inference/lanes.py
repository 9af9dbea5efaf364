"""The engine's decoders and the lanes they run in; who may write a prefix (producers).

Decoders are grouped into *lanes* by weights: the base and every LoRA decoder on it form one lane
(one matmul over all their rows, each row adding its own adapter's ``B A x``); each full-weight
decoder is a lane of its own. A lane owns a static tail pool (one slot per active row, ``kv.TailPool``)
and, outside eager decode, a ``graphs.StaticRunner``.

``LaneRegistry.add`` checks a decoder against the base before it is registered: same base
fingerprint (a decoder reads only the C_base of the base it was conditioned on), same tokenizer,
layer count, KV geometry, RoPE and dtype, and a model / LoRA variant the engine runs
(docs/design.md, "C_base"; fault class K5). The dtype is read from the weights the engine
multiplies: every floating parameter of a full-weight decoder; a LoRA adapter's ``lora_A`` /
``lora_B``, which PEFT keeps in fp32 on a bf16 base, are cast to the base dtype in place at
registration (``weights.cast_adapter``; fault class K11).

A *producer* is the model that writes a prefix: the base (C_base, shared mode) or, for the no-share
baseline, one decoder with its own weights. Its key names whose K/V a prefix store holds
(``Producer.key``). A decoder's key follows its weights: the version counters of the tensors it
was computed from are re-read whenever the key is asked for (each prefill, ``prefill_cached`` and
admission), and an in-place edit (``with torch.no_grad(): p.copy_(...)``, an optimizer step) gives
a new key, so blocks stored under the old one are never matched again (and the next
``prefill_cached`` drops them from its store: ``PrefixKVStore.forget``). A full-weight decoder whose
lane decodes from a packed copy taken at registration (``pack_weights``) cannot follow an edit:
it is refused (``ConfigError``). Writes through ``.data`` bypass version counters and are not seen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ccft.core.compact import check_cache_format
from ccft.core.decoder import Decoder, check_share_from_layer, resolve_handoff
from ccft.core.errors import ConfigError, FingerprintMismatchError, IncompatibleModelError
from ccft.core.fingerprint import check_compatible, tokenizer_digest, weights_digest_module
from ccft.core.tokens import eos_token_ids
from ccft.inference import model as M
from ccft.inference.graphs import StaticRunner
from ccft.inference.handles import BASE
from ccft.inference.kv import PrefixArena, TailPool
from ccft.inference.planner import single_lora_plan
from ccft.inference.requests import Request
from ccft.inference.weights import (
    LaneWeights,
    adapter_tensors,
    cast_adapter,
    check_supported,
    lane_weights,
    lora_adapter,
    pack,
)


@dataclass
class Lane:
    """One set of weights and its active rows.

    Attributes:
        key: the lane's name (``"base"``, or the full-weight decoder's name).
        weights: what the forward reads (the base lane also holds every LoRA adapter on the base).
        pool: the tail pool; ``rows[i]`` is in slot i (compacted when a request leaves).
        rows: the active requests, in slot order.  runner: the static-step runner (None: eager decode).
        pending: requests admitted since the last step whose tails are not written yet
            (``prefill.PendingTail``; ``SharedPrefillEngine.step`` writes them first, batched).
    """

    key: str
    weights: LaneWeights
    pool: TailPool
    rows: list[Request] = field(default_factory=list)
    runner: StaticRunner | None = None
    pending: list = field(default_factory=list)


@dataclass
class DecoderEntry:
    """A registered decoder.

    Attributes:
        name: its name.  lane: the lane it runs in.
        adapter_index: its adapter in ``lane.weights.adapters``; None: the lane's own weights.
        eos: the ids that end its generations (``ccft.core.tokens.eos_token_ids``).
        decoder: the ``ccft.Decoder`` (None for the base).
        key: its producer key, computed on first use and again after its weights change
            (``LaneRegistry.producer``).  key_versions: the weights' version counters ``key`` was computed at.
        watched: the tensors its key is computed from (``weights_id``).
        packed: its lane decodes a copy of its weights taken at registration (packed full-weight lane).
        versions_at_registration: the version counters when registered (packed lanes refuse later edits).
        stale_keys: its keys from before in-place edits, not yet forgotten by a prefix store.
        depth: its sharing depth m (``Decoder.share_from_layer``): on C_base it reads its own prompt K/V in
            layers ``0..m-1`` (``handles.OwnPrefix``), C_base above; 0 for the base and PrefillShare.
        cache_format: the format it reads C_base in (``Decoder.cache_format``, or the one it was registered
            with): ``native`` or ``int8`` (``handles.PrefixHandle.formats``).
    """

    name: str
    lane: Lane
    adapter_index: int | None
    eos: set[int]
    decoder: Decoder | None
    key: str | None = None
    key_versions: tuple[int, ...] | None = None
    watched: list[torch.Tensor] = field(default_factory=list)
    packed: bool = False
    versions_at_registration: tuple[int, ...] | None = None
    stale_keys: list[str] = field(default_factory=list)
    depth: int = 0
    cache_format: str = "native"

    def versions(self) -> tuple[int, ...]:
        """The version counters of ``watched`` (bumped by every in-place write outside ``.data``)."""
        return tuple(-1 if t.is_inference() else t._version for t in self.watched)

    def lora_plan(self) -> M.LoraPlan:
        """Its adapter over every row of a batch (none for the lane's own weights)."""
        return single_lora_plan(self.lane.weights, self.adapter_index)

    def weights_id(self) -> str:
        """16 hex digits of a SHA-256 of its own weights: its LoRA A/B and scalings, or a full-weight
        decoder's parameters and buffers (``ccft.core.fingerprint.weights_digest_module``)."""
        if self.adapter_index is None:
            model = self.decoder.model if self.decoder is not None else self.lane.weights.owner
            return weights_digest_module(model)[:16]
        h = hashlib.sha256()
        for i, layer in enumerate(self.lane.weights.adapters[self.adapter_index].layers):
            for name, lw in sorted(layer.items()):
                h.update(f"{i}.{name}:{lw.scaling!r}".encode())
                for t in (lw.a, lw.b):
                    h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
        return h.hexdigest()[:16]


class Producer(NamedTuple):
    """The model that writes a prefix: its lane weights, its LoRA plan, its name and key."""

    weights: LaneWeights
    lora: M.LoraPlan
    name: str
    key: str


class LaneRegistry:
    """The decoders of one engine and their lanes (see the module docstring).

    Args:
        base: the ``ccft.Base``.  base_weights: its ``LaneWeights`` (the base lane).
        arena: the engine's prefix arena (read by static runners).
        own_arena: the engine's own-layer arena (``handles.OwnPrefix``); it holds as many layers as the
            deepest sharing depth registered (``add`` grows it).
        compact_arenas: the engine's code, value-scale and key-scale arenas (``handles.CompactHandle``); given
            every layer when the first decoder reading the int8 format is registered.
        max_batch: slots per tail pool.  max_tail_tokens: per-slot capacity limit.
        fill: value of never-written tail memory (K3).  pack_weights: pack each lane's weights.
        decode_mode: ``"eager"`` (no runner) or a static mode of ``graphs.StaticRunner``.
        attention: prefix attention of the static step.
    Attributes:
        lanes: lane key -> ``Lane``.  decoders: decoder name -> ``DecoderEntry`` (``"base"`` included).
    """

    def __init__(
        self,
        base,
        base_weights: LaneWeights,
        arena: PrefixArena,
        *,
        max_batch: int,
        max_tail_tokens: int,
        fill: float,
        pack_weights: bool,
        decode_mode: str,
        attention: str,
        own_arena: PrefixArena | None = None,
        compact_arenas: tuple = (),
    ):
        self.base, self.tokenizer, self.device, self.arena = base, base.tokenizer, base.device, arena
        self.own_arena, self.compact_arenas = own_arena, tuple(compact_arenas)
        self.max_batch, self.max_tail_tokens, self.fill = max_batch, max_tail_tokens, fill
        self.pack_weights, self.decode_mode, self.attention = pack_weights, decode_mode, attention
        self.base_lane = self.new_lane(BASE, base_weights)
        self.lanes: dict[str, Lane] = {BASE: self.base_lane}
        self.decoders: dict[str, DecoderEntry] = {
            BASE: DecoderEntry(BASE, self.base_lane, None, eos_token_ids(self.tokenizer, base.model), None)
        }

    def new_lane(self, key: str, weights: LaneWeights) -> Lane:
        """A lane over ``weights`` (packed first when ``pack_weights``) with a one-slot tail pool that
        grows."""
        if self.pack_weights:
            pack(weights)
        pool = TailPool(
            weights.num_layers,
            weights.kv_heads,
            weights.head_dim,
            weights.dtype,
            self.device,
            slots=1,
            capacity=64,
            max_slots=self.max_batch,
            max_capacity=self.max_tail_tokens,
            fill=self.fill,
        )
        lane = Lane(key, weights, pool)
        if self.decode_mode != "eager":
            lane.runner = StaticRunner(
                weights,
                pool,
                self.arena,
                self.decode_mode,
                self.attention,
                self.device,
                self.own_arena,
                self.compact_arenas,
            )
        return lane

    def add(
        self, name: str, decoder: Decoder | str | Path, *, tokenizer=None, cache_format: str | None = None
    ) -> DecoderEntry:
        """Register ``decoder`` (a ``ccft.Decoder``, or a decoder folder loaded onto the base) as ``name``,
        reading C_base in ``cache_format`` (default: the decoder's own, ``Decoder.cache_format``; ``int8``
        serves a decoder trained on the native cache on the compact one).

        A LoRA decoder joins the base lane as one more adapter; a full-weight decoder gets its own lane.

        Raises:
            FingerprintMismatchError: the decoder was conditioned on another base.
            IncompatibleModelError: its tokenizer, layer count, KV geometry, RoPE or dtype differ from
                the base's, or it is a model / LoRA variant the engine does not run.
            ConfigError: ``name`` already used, or not a decoder; an unknown ``cache_format``.
        A decoder trained at sharing depth m > 0 (``share_from_layer``) is registered with that depth, and the
        own-layer arena grows to m layers when it holds fewer.
        """
        if name in self.decoders:
            raise ConfigError(f"a decoder named {name!r} is already registered; pick another name")
        if cache_format is not None:
            check_cache_format(cache_format, where=f"decoder {name!r}: cache_format")
        if isinstance(decoder, (str, Path)):
            decoder, tokenizer = self._load(name, decoder, tokenizer)
        if not isinstance(decoder, Decoder):
            raise ConfigError(
                f"decoder {name!r}: expected a ccft.Decoder or a decoder folder, got {type(decoder)}"
            )
        depth = check_share_from_layer(int(decoder.share_from_layer or 0), self.arena.num_layers)
        base = self.base
        if decoder.fingerprint != base.fingerprint:
            raise FingerprintMismatchError(
                f"decoder {name!r} was conditioned on base {decoder.fingerprint} but this engine's base is "
                f"{base.fingerprint} ({base.name}); use the base it was trained on"
            )
        self._check_tokenizer(name, tokenizer)
        check_compatible(base.config, decoder.model.config)
        eos = eos_token_ids(self.tokenizer, decoder.model)
        if decoder.kind == "lora":
            if decoder.model.get_base_model() is not base.model:
                raise IncompatibleModelError(
                    f"LoRA decoder {name!r} is attached to another copy of the base model; "
                    "load it with ccft.load_decoder(path, base=engine.base)"
                )
            adapter = lora_adapter(decoder.model, decoder.meta.get("adapter_name", "default"))
            watched = adapter_tensors(cast_adapter(adapter, base.dtype))  # PEFT keeps adapters in fp32 (K11)
            lane = self.base_lane
            lane.weights.adapters.append(adapter)
            entry = DecoderEntry(name, lane, len(lane.weights.adapters) - 1, eos, decoder, watched=watched)
        else:
            dtypes = {p.dtype for p in decoder.model.parameters() if p.is_floating_point()}
            if dtypes != {base.dtype}:
                raise IncompatibleModelError(
                    f"decoder {name!r} has {', '.join(sorted(map(str, dtypes)))} weights but the base is "
                    f"{base.dtype}; load both in one dtype (C_base is read as is): e.g. "
                    f"decoder.model.to({base.dtype})"
                )
            check_supported(decoder.model.config)
            lane = self.new_lane(name, lane_weights(decoder.model, allow_adapters=False))
            self.lanes[name] = lane
            watched = [*decoder.model.parameters(), *decoder.model.buffers()]
            entry = DecoderEntry(name, lane, None, eos, decoder, watched=watched, packed=self.pack_weights)
        entry.versions_at_registration = entry.versions()
        entry.depth = depth
        entry.cache_format = check_cache_format(cache_format or decoder.cache_format or "native")
        if depth and self.own_arena is not None:
            self.own_arena.set_layers(depth)
        if entry.cache_format != "native":
            for arena in self.compact_arenas:
                arena.set_layers(self.arena.num_layers)
        self.decoders[name] = entry
        return entry

    def check_unchanged(self, entry: DecoderEntry) -> None:
        """Refuse a decoder whose lane decodes a packed copy of weights that were since edited in place.

        Raises:
            ConfigError: ``entry`` is packed and its weights' version counters moved since registration.
        """
        if entry.packed and entry.versions() != entry.versions_at_registration:
            raise ConfigError(
                f"the weights of decoder {entry.name!r} were changed in place after it was registered, but "
                "its lane decodes the packed copy taken at registration (pack_weights=True); register the "
                "edited decoder under a new name (add_decoder), or build the engine with pack_weights=False "
                "to read weights live"
            )

    def _load(self, name: str, folder: str | Path, tokenizer):
        from transformers import AutoTokenizer

        from ccft.core.checkpoint import load_decoder, read_meta

        meta = read_meta(folder)
        want = meta.get("base_fingerprint")
        if want and want != self.base.fingerprint:
            raise FingerprintMismatchError(
                f"decoder {folder} was trained on base {want} but this engine's base is "
                f"{self.base.fingerprint} ({self.base.name}); serve it with the base it was trained on"
            )
        if tokenizer is None and (Path(folder) / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self._check_tokenizer(name, tokenizer)
        return load_decoder(folder, base=self.base, adapter_name=name), tokenizer

    def _check_tokenizer(self, name: str, tokenizer) -> None:
        if tokenizer is not None and tokenizer_digest(tokenizer) != tokenizer_digest(self.tokenizer):
            raise IncompatibleModelError(
                f"decoder {name!r} uses a different tokenizer (vocabulary, special tokens or chat template) "
                "than the base; a decoder must read the base's token ids"
            )

    def producer(self, producer: str | None) -> Producer:
        """The model that prefills for ``producer``: None / ``"base"``: the base, keyed by its fingerprint;
        a decoder's name: that decoder, keyed ``"{base fingerprint}+{name}/{weights id}"``
        (``DecoderEntry.weights_id``), recomputed whenever the version counters of its weights moved
        since the key was computed (an in-place edit gets a new key: the store's blocks of the old
        weights are not matched again).

        Raises:
            ConfigError: an unknown producer, or a packed decoder edited in place (``check_unchanged``).
        """
        if producer is None or producer == BASE:
            return Producer(self.base_lane.weights, M.NO_LORA, BASE, self.base.fingerprint)
        entry = self.decoders.get(producer)
        if entry is None:
            raise ConfigError(
                f"unknown producer {producer!r}; use None (the base) or a registered decoder: "
                f"{', '.join(n for n in self.decoders if n != BASE) or '(none)'}"
            )
        self.check_unchanged(entry)
        versions = entry.versions()
        if entry.key is None or versions != entry.key_versions:
            key = f"{self.base.fingerprint}+{producer}/{entry.weights_id()}"
            if entry.key is not None and key != entry.key:
                entry.stale_keys.append(entry.key)
            entry.key, entry.key_versions = key, versions
        return Producer(entry.lane.weights, entry.lora_plan(), producer, entry.key)

    def handoff(self, handoff_tokens: int | None, producer: str | None = None) -> int:
        """k: ``handoff_tokens``, else the producer decoder's k (its own prefill), else the k the
        registered decoders share (``ccft.core.decoder.resolve_handoff``: 1 without decoders).

        Raises:
            ConfigError: k < 1; no k given and the registered decoders were trained with different ones
                (which of them will read the prefill is not known here: pass ``handoff_tokens``).
        """
        if handoff_tokens is None:
            entry = self.decoders.get(producer) if producer not in (None, BASE) else None
            if entry is not None and entry.decoder is not None:
                return resolve_handoff([entry.decoder.handoff_tokens], what=f"decoder {producer!r}")
            try:
                return resolve_handoff(
                    (e.decoder.handoff_tokens for e in self.decoders.values() if e.decoder is not None),
                    what="the registered decoders",
                )
            except ConfigError as e:
                raise ConfigError(
                    f"{e}; or pass handoff_tokens= (the k of the decoders that will read this prefill)"
                ) from None
        return resolve_handoff([], handoff_tokens)


__all__ = ["Lane", "DecoderEntry", "Producer", "LaneRegistry"]
