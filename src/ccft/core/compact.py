"""The compact C_base: the shared prefix's K/V stored in 8 bits (issue 35, item 3; docs/design.md, "Terms").

Format ``int8`` (KIVI: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv 2402.02750, §3): **keys per channel, values per token**. Keys carry a few channels of large magnitude
that persist across tokens, so each key channel gets its own scale over the row's prefix tokens; values have
no such channels, and each token's value vector (per KV head) gets its own scale. KIVI groups keys by
tokens and keeps a full-precision residual of recent tokens because it quantises a cache that grows while
decoding; C_base is computed once over the whole ``prompt[:n−k]`` and then constant, so here a key channel's
scale covers the row's whole prefix and there is no residual.

Symmetric (KIVI is asymmetric), chosen for three reasons: (1) a zero stays exactly zero, so C_base's zeroed
pad slots stay zeroed after dequantisation (docs/design.md, "C_base"); (2) a key channel's scale is the
max |x| over the row's tokens, which the zeros of left padding do not change, so a row's compact cache does
not depend on the batch it was prefilled in (no mask needed); (3) no zero-point to store, and dequantisation
is one multiply. The price: a key channel whose values sit far from 0 (all in [5, 6], say) uses less of the
int8 range than an asymmetric code would. Codes are in ``[−127, 127]`` (−128 unused, so the range is
symmetric); scales are stored in bfloat16 (fp32's range, so no scale underflows to 0) and the codes are
rounded with the stored scale, so ``|x − dequantize(q, s)| ≤ s / 2`` holds for every element with the scale
actually stored.

``native`` (the default cache format) is C_base as the base computed it (its dtype: fp32 or bf16), untouched.
``read_cache`` is the one rule that turns C_base into what a reader of a format sees: every reference reader
(``ccft.generate``, teacher-forced NLL, the CCFT trainer and its cache store) goes through it; the attention
then runs on the dequantised tensors (the reference path dequantises before the attention).

Shape notation: b batch rows, h KV heads, p prefix length (longest ``n − k``), d head dim, L layers.
Units: codes are int8 (1 byte each); scales bfloat16 (2 bytes each); sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ccft.core.cache import BaseCache
from ccft.core.errors import ConfigError

#: the cache formats a decoder can be trained on and served on: ``native`` (C_base as computed) and ``int8``
CACHE_FORMATS = ("native", "int8")
#: the largest int8 code; codes are symmetric in ``[−INT8_MAX, INT8_MAX]``
INT8_MAX = 127
#: the dtype scales are stored in
SCALE_DTYPE = torch.bfloat16


def check_cache_format(fmt, *, where: str = "cache_format") -> str:
    """``fmt`` after checking it is one of ``CACHE_FORMATS`` (docs/training.md, ``cache_format``).

    Raises:
        ConfigError: naming ``where`` (the recipe key by default), the value and the formats to use.
    """
    if fmt not in CACHE_FORMATS:
        raise ConfigError(
            f"{where}={fmt!r}: use one of {', '.join(CACHE_FORMATS)} (native: C_base as the base computed "
            "it; int8: the compact C_base, keys per channel and values per token in 8 bits)"
        )
    return fmt


def quantize_symmetric(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``x`` with one scale per slice along ``dim`` reduced (``keepdim``).

    ``scale = max |x| / 127`` over ``dim`` (stored in ``SCALE_DTYPE``; 1 where the slice is all zeros),
    ``q = clamp(round(x / scale), −127, 127)`` with the stored scale, so ``|x − q · scale| ≤ scale / 2``.

    Args:
        x: a float tensor (any dtype; computed in fp32).
        dim: the dimension one scale covers.
    Returns:
        ``(q, scale)``: ``q`` int8 of ``x``'s shape; ``scale`` ``SCALE_DTYPE`` of ``x``'s shape with ``dim``
        of size 1.
    """
    with torch.no_grad():
        xf = x.detach().float()
        amax = xf.abs().amax(dim=dim, keepdim=True)
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(SCALE_DTYPE)
        q = torch.round(xf / scale.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 keys (KIVI §3): one scale per (row, head, channel) over the row's prefix tokens.

    Args:
        keys: ``(b, h, p, d)`` one layer of C_base's keys, left-padded with zeroed pad slots.
    Returns:
        ``(q, scale)``: ``q`` int8 ``(b, h, p, d)``; ``scale`` bfloat16 ``(b, h, 1, d)``.
    """
    return quantize_symmetric(keys, dim=-2)


def quantize_values(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 values (KIVI §3): one scale per (row, head, token) over the head's d channels.

    Args:
        values: ``(b, h, p, d)`` one layer of C_base's values.
    Returns:
        ``(q, scale)``: ``q`` int8 ``(b, h, p, d)``; ``scale`` bfloat16 ``(b, h, p, 1)``.
    """
    return quantize_symmetric(values, dim=-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale`` (computed in fp32, then cast to ``dtype``): the inverse of ``quantize_keys`` /
    ``quantize_values`` up to ``scale / 2`` per element.

    Args:
        q: int8 codes ``(b, h, p, d)``; scale: broadcastable to it (``(b, h, 1, d)`` or ``(b, h, p, 1)``).
        dtype: the dtype of the result (the dtype of the C_base that was quantised).
    """
    return (q.float() * scale.float()).to(dtype)


@dataclass(frozen=True, eq=False)
class CompactCache:
    """C_base in the ``int8`` format: what a compact store holds (codes and scales) and how to read it back.

    Attributes:
        key_codes, value_codes: per layer int8 ``(b, h, p, d)``.
        key_scales: per layer bfloat16 ``(b, h, 1, d)`` (per channel); value_scales: ``(b, h, p, 1)``
            (per token).
        attention_mask, tail_ids, handoff_tokens, fingerprint, producer: C_base's (``BaseCache``).
        dtype: the dtype of the C_base it was made from (``dequantize`` returns it).
    """

    key_codes: tuple[torch.Tensor, ...]
    key_scales: tuple[torch.Tensor, ...]
    value_codes: tuple[torch.Tensor, ...]
    value_scales: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor
    tail_ids: torch.Tensor
    handoff_tokens: int
    fingerprint: str
    producer: str
    dtype: torch.dtype

    @classmethod
    def from_base(cls, cache: BaseCache) -> "CompactCache":
        """Quantise every layer of ``cache`` (keys per channel, values per token); ``cache`` is not
        written."""
        cache.check_unmodified()
        keys = [quantize_keys(k) for k in cache.keys]
        values = [quantize_values(v) for v in cache.values]
        return cls(
            tuple(q for q, _ in keys),
            tuple(s for _, s in keys),
            tuple(q for q, _ in values),
            tuple(s for _, s in values),
            cache.attention_mask,
            cache.tail_ids,
            cache.handoff_tokens,
            cache.fingerprint,
            cache.producer,
            cache.dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.key_codes)

    def dequantize(self) -> BaseCache:
        """The ``BaseCache`` a reader attends to: ``codes · scales`` per layer in ``self.dtype``, C_base's
        mask, tail, fingerprint and producer (pad slots stay zero: their codes are 0)."""
        keys = tuple(dequantize(q, s, self.dtype) for q, s in zip(self.key_codes, self.key_scales))
        values = tuple(dequantize(q, s, self.dtype) for q, s in zip(self.value_codes, self.value_scales))
        return BaseCache.from_tensors(
            keys,
            values,
            self.attention_mask,
            self.tail_ids,
            self.handoff_tokens,
            self.fingerprint,
            self.producer,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V codes and their scales (the attention mask and handoff tokens, which the native
        format keeps too, are not counted)."""
        tensors = self.key_codes + self.key_scales + self.value_codes + self.value_scales
        return sum(t.numel() * t.element_size() for t in tensors)


def kv_nbytes(
    cache_format: str,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    rows: int = 1,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of C_base's K/V for ``rows`` rows of ``tokens`` prefix tokens each, in ``cache_format``.

    ``native``: ``2 · L · rows · h · p · d`` elements of ``dtype``. ``int8``: the same count of 1-byte codes,
    plus bfloat16 scales: ``L · rows · h · d`` key scales (per channel, once per row) and ``L · rows · h · p``
    value scales (per token). Equals ``CompactCache.nbytes`` / the tensors' bytes for a batch of that shape.
    """
    check_cache_format(cache_format)
    elements = 2 * layers * rows * kv_heads * tokens * head_dim
    if cache_format == "native":
        return elements * torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size()
    scales = layers * rows * kv_heads * (head_dim + tokens)
    return elements + scales * scale


def read_cache(cache: BaseCache | CompactCache, cache_format: str) -> BaseCache:
    """C_base as a reader of ``cache_format`` sees it: the one rule every reference reader applies.

    Args:
        cache: C_base (or any prefix cache) with keys/values ``(b, h, p, d)`` per layer, or C_base already in
            the ``int8`` format (a ``CompactCache``: a C_base store written with ``cache_format: int8``,
            ``ccft.train.cache_store``), which is dequantised as it is (its codes and scales are those
            ``CompactCache.from_base`` makes of the native C_base).
        cache_format: ``native``: ``cache`` itself (today's path, bit for bit); ``int8``:
            ``CompactCache.from_base(cache).dequantize()`` (same dtype, mask, fingerprint and producer).
    Raises:
        ConfigError: an unknown format (``check_cache_format``), or a ``CompactCache`` read as ``native`` (its
            native values are gone).
    """
    fmt = check_cache_format(cache_format)
    if isinstance(cache, CompactCache):
        if fmt != "int8":
            raise ConfigError(
                f"a C_base held as int8 codes and scales was read with cache_format={fmt}; its native values "
                "are not kept: read it with cache_format=int8, or give the native C_base"
            )
        return cache.dequantize()
    if fmt == "native":
        return cache
    return CompactCache.from_base(cache).dequantize()


__all__ = [
    "CACHE_FORMATS",
    "INT8_MAX",
    "SCALE_DTYPE",
    "CompactCache",
    "check_cache_format",
    "dequantize",
    "kv_nbytes",
    "quantize_keys",
    "quantize_symmetric",
    "quantize_values",
    "read_cache",
]
