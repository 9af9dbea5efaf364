"""Sharing depth m: the decoder's own prompt K/V in layers ``0..m−1``, ``C_base`` in layers ``m..L−1``
(issue 35, item 1; docs/design.md, "Terms": sharing depth m).

PrefillShare (arXiv 2602.12029, §3) shares every layer of the prompt's KV: the decoder reads ``C_base`` in all
L layers (m = 0). At sharing depth m the decoder runs a *partial prefill* — only its first m layers, over
``prompt[:n−k]`` — and reads the base's K/V in the layers above it: the **hybrid prefix cache**. m = L is the
decoder's own prefill (Full-FT's forward). The base still runs all L layers (its layer m needs its own
layers below m), so C_base is the same tensor at every depth.

One rule mixes two prefix caches layer by layer (``mix_layers``); the sharing depth (this module's
``depth_cache``) and the layer sweep of naive sharing (``ccft.evals.sharing.layer_cache``) both use it.

Shape notation: b batch rows, h KV heads, p prefix length (longest ``n − k``), d head dim, L layers, m depth.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ccft.core.cache import BaseCache, allow_readonly_cache_under_checkpointing, cache_kwarg
from ccft.core.compact import read_cache
from ccft.core.decoder import Decoder, check_share_from_layer, num_layers, unwrap_pretrained
from ccft.core.errors import ConfigError
from ccft.core.tokens import left_pad

#: the ``producer`` of a prefix cache that mixes C_base layers with the reading decoder's own layers
MIXED = "mixed"


def mix_layers(
    c_base: BaseCache,
    own_keys: Sequence[torch.Tensor],
    own_values: Sequence[torch.Tensor],
    own_layers: Sequence[int],
) -> BaseCache:
    """The prefix cache whose layers in ``own_layers`` are the reading decoder's own K/V and whose other
    layers are ``C_base``'s: the one rule that mixes the two per layer.

    Args:
        c_base: C_base over ``prompt[:n−k]``, keys/values ``(b, h, p, d)`` per layer.
        own_keys, own_values: the decoder's K/V over the same tokens with the same left padding,
            ``(b, h, p, d)`` for layer i at index i (a partial prefill may hold only the first m layers).
        own_layers: the layer indices that read the decoder's own K/V.
    Returns:
        ``c_base`` itself when ``own_layers`` is empty, else a ``BaseCache`` with producer ``"mixed"`` (a
        decoder of the same base may read it as its prefix; docs/design.md, "C_base"), C_base's mask, tail,
        handoff and fingerprint.
    Raises:
        ConfigError: a layer index outside ``0..L−1`` or beyond the own K/V given; own K/V of another shape.
    """
    L = c_base.num_layers
    own = sorted({int(i) for i in own_layers})
    if not own:
        return c_base
    bad = [i for i in own if not 0 <= i < min(L, len(own_keys))]
    if bad:
        raise ConfigError(
            f"own layers {bad} out of range: C_base has {L} layers and the decoder's own K/V {len(own_keys)}"
        )
    for i in own:
        if own_keys[i].shape != c_base.keys[i].shape or own_values[i].shape != c_base.values[i].shape:
            raise ConfigError(
                f"layer {i}: the decoder's own K/V {tuple(own_keys[i].shape)} does not match C_base's "
                f"{tuple(c_base.keys[i].shape)}; both must cover the same prompt[:n-k] with the same padding"
            )
    keep = set(own)
    keys = tuple(own_keys[i] if i in keep else c_base.keys[i] for i in range(L))
    values = tuple(own_values[i] if i in keep else c_base.values[i] for i in range(L))
    return BaseCache.from_tensors(
        keys,
        values,
        c_base.attention_mask,
        c_base.tail_ids,
        c_base.handoff_tokens,
        c_base.fingerprint,
        MIXED,
    )


class _RecordingLayer(DynamicLayer):
    """A cache layer of a prefill from scratch: ``update`` keeps the new K/V and returns them unchanged.

    Unlike ``DynamicLayer`` it does not grow, so a gradient-checkpoint recompute of the layer replays the
    same computation (the recorded tensors are those of the first forward, which the loss used)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _RecordingCache(DynamicCache):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = [_RecordingLayer() for _ in range(layers)]


def decoder_body(model) -> torch.nn.Module:
    """The transformer body (``get_decoder()``) under every wrapper, with its ``layers`` ModuleList.

    Raises:
        ConfigError: a model whose body keeps no ``layers`` list (a partial prefill cannot run it).
    """
    inner = unwrap_pretrained(model)
    body = inner.get_decoder() if hasattr(inner, "get_decoder") else inner
    if not isinstance(getattr(body, "layers", None), torch.nn.ModuleList):
        raise ConfigError(
            f"{type(inner).__name__} keeps no `layers` list in its body: share_from_layer > 0 needs a "
            "Llama-style decoder (model.model.layers); use share_from_layer=0"
        )
    return body


def partial_prefill(
    model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, layers: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """K/V of the first ``layers`` transformer layers of ``model`` over a left-padded prefix: a partial
    prefill (``layers / L`` of a prefill's work; the layers above are not run).

    Gradients follow ``torch.is_grad_enabled()``: in training they flow into the decoder's first ``layers``
    layers through these K/V. The same positions and pad handling as ``ccft.core.cache.prefill_tensors``
    (per-row positions, pad slots zeroed), so for ``layers = L`` they equal a full prefill's K/V.

    Args:
        model: the decoder (``Decoder``, ``PeftModel``, ``PreTrainedModel``, or under DDP/DeepSpeed wrappers);
            a ``Decoder``'s adapter is activated.
        prefix_ids, prefix_mask: ``(b, p)``, left-padded, 1 on real tokens.
        layers: m, ``0 ≤ m ≤ L``.
    Returns:
        ``(keys, values)``: m tensors each, ``(b, h, p, d)``.
    """
    if isinstance(model, Decoder):
        model = model.activate()
    if layers <= 0:
        return (), ()
    body = decoder_body(model)
    positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    cache = _RecordingCache(layers)
    # The recording cache is replay-safe, so checkpointed layers may keep it (see _RecordingLayer).
    allow_readonly_cache_under_checkpointing(model)
    kwargs = {cache_kwarg(body): cache}
    full = body.layers
    # Run only the first m layers: the body iterates ``self.layers``; the layers above m are not needed.
    body.layers = torch.nn.ModuleList(list(full)[:layers])
    try:
        body(
            input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions, use_cache=True, **kwargs
        )
    finally:
        body.layers = full
    pad = (prefix_mask == 0)[:, None, :, None]
    keys = tuple(layer.keys.masked_fill(pad, 0.0) for layer in cache.layers)
    values = tuple(layer.values.masked_fill(pad, 0.0) for layer in cache.layers)
    return keys, values


def depth_cache(
    model,
    c_base: BaseCache,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    share_from_layer: int,
) -> BaseCache:
    """The hybrid prefix cache at sharing depth m = ``share_from_layer`` (issue 35; arXiv 2602.12029 §3 is
    m = 0): the decoder's own K/V (``partial_prefill``) in layers ``0..m−1``, ``C_base`` in ``m..L−1``.

    Args:
        model: the reading decoder (as ``partial_prefill`` takes it).
        c_base: C_base over the same ``prompt[:n−k]``, keys/values ``(b, h, p, d)`` per layer.
        prefix_ids, prefix_mask: ``(b, p)`` those prefixes left-padded (``c_base.attention_mask`` layout).
        share_from_layer: m, ``0 ≤ m ≤ L``.
    Returns:
        ``c_base`` itself at m = 0 (today's PrefillShare, bit for bit); else a ``"mixed"`` ``BaseCache`` whose
        first m layers carry gradient when grad is enabled (training) and whose other layers are C_base's
        tensors (constant).
    Raises:
        ConfigError: m outside ``0..L``; prefixes whose padding is not C_base's (another batch).
    """
    m = check_share_from_layer(share_from_layer, c_base.num_layers)
    if m == 0:
        return c_base
    if tuple(prefix_mask.shape) != tuple(c_base.attention_mask.shape) or not torch.equal(
        prefix_mask.to(c_base.attention_mask.device), c_base.attention_mask
    ):
        raise ConfigError(
            f"the prefixes {tuple(prefix_mask.shape)} are not those C_base "
            f"{tuple(c_base.attention_mask.shape)} was computed over (another batch or handoff); compute "
            "C_base for these prompts"
        )
    keys, values = partial_prefill(model, prefix_ids, prefix_mask, m)
    return mix_layers(c_base, keys, values, range(m))


def decoder_prefix(
    model,
    c_base: BaseCache,
    prefix_ids: torch.Tensor | None,
    prefix_mask: torch.Tensor | None,
    *,
    share_from_layer: int = 0,
    cache_format: str = "native",
) -> BaseCache:
    """The prefix cache a decoder reads on top of C_base, in one order everywhere (``ccft.generate``,
    teacher-forced NLL, the CCFT trainer): C_base in ``cache_format`` first (``ccft.core.compact.read_cache``:
    the compact C_base dequantised), then the decoder's own K/V in layers ``0..m−1`` (``depth_cache``). So at
    depth m > 0 only the shared layers ``m..L−1`` are compact; the decoder's own layers are its own prefill.

    Args:
        model, c_base, prefix_ids, prefix_mask, share_from_layer: as ``depth_cache`` (the prefixes may be None
            at m = 0).
        cache_format: ``native`` or ``int8`` (``ccft.core.compact.CACHE_FORMATS``).
    Returns:
        ``c_base`` itself for ``native`` at m = 0 (today's PrefillShare, bit for bit).
    Raises:
        ConfigError: an unknown format; m outside ``0..L``; prefixes of another batch.
    """
    return depth_cache(model, read_cache(c_base, cache_format), prefix_ids, prefix_mask, share_from_layer)


def prompt_prefixes(
    prompts: Sequence[Sequence[int]], handoff_tokens: int, pad_token_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix_ids, prefix_mask)``, ``(b, p)``: ``prompt[:n−k]`` of every row left-padded as C_base lays
    them out (``ccft.core.cache.prefill``)."""
    ids, mask = left_pad([list(p[: len(p) - handoff_tokens]) for p in prompts], pad_token_id)
    return ids.to(device), mask.to(device)


__all__ = [
    "MIXED",
    "check_share_from_layer",
    "decoder_body",
    "decoder_prefix",
    "depth_cache",
    "mix_layers",
    "num_layers",
    "partial_prefill",
    "prompt_prefixes",
]
