"""C_base: the frozen base model's per-layer K/V for the prompt prefix (docs/design.md, "C_base").

``compute_base_cache`` runs the base once, under ``torch.no_grad``, over ``prompt[:n-k]`` of a
left-padded batch with per-row positions (k = ``handoff_tokens``). The result is an immutable
value: each consumer gets its own cache object whose update concatenates into new tensors, and
every read checks the tensors' in-place version counters, so a mutation is an error, not a
silently wrong answer.

Shape notation: b batch rows, l layers, h KV heads, p prefix length (longest ``n - k``), d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ccft.core.errors import CacheMutatedError, FingerprintMismatchError
from ccft.core.tokens import left_pad, pad_token_id


def cache_kwarg(model) -> str:
    """Name of the cache argument of ``model.forward``: ``cache`` (transformers ≥ 5.x) or
    ``past_key_values``."""
    import inspect

    inner = model
    for attr in ("get_base_model",):
        if hasattr(inner, attr):
            inner = inner.get_base_model()
    params = inspect.signature(type(inner).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


#: Producers whose cache a decoder may read as its prefix without ``allow_self`` (docs/design.md, "C_base",
#: K5): ``base`` (C_base) and ``mixed``, C_base layers mixed with the reading decoder's own layers
#: (``ccft.core.depth.mix_layers``: the sharing depth m and the layer-sharing study's
#: ``ccft.evals.sharing.layer_cache``, built from C_base of the same fingerprint).
PREFIX_PRODUCERS = ("base", "mixed")


@dataclass(frozen=True, eq=False)
class BaseCache:
    """An immutable prompt-prefix KV cache produced by one base model.

    Attributes:
        keys, values: per layer, ``(b, h, p, d)``; left-padded, pad slots zeroed.
        attention_mask: ``(b, p)`` long, 1 on real prefix tokens.
        tail_ids: ``(b, k)`` the handoff tokens ``prompt[n-k:]`` the decoder recomputes.
        handoff_tokens: k.
        fingerprint: the base fingerprint of the producer.
        producer: ``"base"`` for C_base; anything else (e.g. ``"self"``) marks a cache a decoder
            wrote for itself, which a decoder must not be handed as C_base (K5).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor
    tail_ids: torch.Tensor
    handoff_tokens: int
    fingerprint: str
    producer: str = "base"
    _versions: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def batch_size(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def lengths(self) -> torch.Tensor:
        """``(b,)`` real prefix length per row: the first decoder position of each row."""
        return self.attention_mask.sum(-1)

    def check_unmodified(self) -> None:
        """Raise CacheMutatedError if any K/V tensor was written in place since creation."""
        now = _versions(self.keys + self.values)
        if self._versions and now != self._versions:
            raise CacheMutatedError(
                "a C_base tensor was modified in place; C_base is a constant. "
                "Give every consumer its own cache (BaseCache.as_dynamic_cache())."
            )

    @classmethod
    def from_tensors(
        cls,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        attention_mask: torch.Tensor,
        tail_ids: torch.Tensor,
        handoff_tokens: int,
        fingerprint: str,
        producer: str = "base",
    ) -> "BaseCache":
        """Wrap existing tensors as a BaseCache and record their version counters (the immutability check).

        Args:
            keys, values: per layer ``(b, h, p, d)``, left-padded with zeroed pad slots.
            attention_mask: ``(b, p)``, 1 on real prefix tokens. tail_ids: ``(b, k)`` handoff tokens.
            fingerprint: the base fingerprint of the model that computed them; producer: ``base``
                (a decoder may read it), ``self`` (a model's own prefill) or another label.
        """
        keys, values = tuple(keys), tuple(values)
        return cls(
            keys,
            values,
            attention_mask,
            tail_ids,
            handoff_tokens,
            fingerprint,
            producer,
            _versions(keys + values),
        )

    def as_dynamic_cache(self):
        """A fresh ``DynamicCache`` over these tensors, for generation (its updates concatenate into new
        tensors)."""
        from transformers import DynamicCache

        self.check_unmodified()
        return DynamicCache(ddp_cache_data=list(zip(self.keys, self.values)))

    def as_prefix_cache(self, shared_layers: Sequence[int] | None = None):
        """A read-only ``PrefixCache`` for teacher-forced forwards (training, scoring); see
        ``PrefixCache``."""
        self.check_unmodified()
        return PrefixCache(self.keys, self.values)

    def select(self, rows: Sequence[int] | torch.Tensor) -> "BaseCache":
        """A BaseCache with only ``rows`` (left padding trimmed to the longest kept row)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        mask = self.attention_mask.index_select(0, idx)
        width = int(mask.sum(-1).max()) if len(idx) else 0
        start = mask.shape[1] - width
        keys = tuple(k.index_select(0, idx.to(k.device))[:, :, start:] for k in self.keys)
        values = tuple(v.index_select(0, idx.to(v.device))[:, :, start:] for v in self.values)
        return BaseCache.from_tensors(
            keys,
            values,
            mask[:, start:],
            self.tail_ids.index_select(0, idx),
            self.handoff_tokens,
            self.fingerprint,
            self.producer,
        )

    def to(self, dtype: torch.dtype | None = None, device=None) -> "BaseCache":
        """An explicit conversion (e.g. bf16 cache for an fp32 reader); the fingerprint is kept."""
        conv = lambda t: t.to(device=device or t.device, dtype=dtype or t.dtype)  # noqa: E731
        return BaseCache.from_tensors(
            tuple(map(conv, self.keys)),
            tuple(map(conv, self.values)),
            self.attention_mask.to(device or self.attention_mask.device),
            self.tail_ids.to(device or self.tail_ids.device),
            self.handoff_tokens,
            self.fingerprint,
            self.producer,
        )

    def clone(self) -> "BaseCache":
        """A deep copy (used by tests to snapshot C_base)."""
        return BaseCache.from_tensors(
            tuple(k.clone() for k in self.keys),
            tuple(v.clone() for v in self.values),
            self.attention_mask.clone(),
            self.tail_ids.clone(),
            self.handoff_tokens,
            self.fingerprint,
            self.producer,
        )

    def equal(self, other: "BaseCache") -> bool:
        """Bit-for-bit equality of every K/V tensor, mask and tail (K1 snapshot check)."""
        return (
            len(self.keys) == len(other.keys)
            and all(torch.equal(a, b) for a, b in zip(self.keys + self.values, other.keys + other.values))
            and torch.equal(self.attention_mask, other.attention_mask)
            and torch.equal(self.tail_ids, other.tail_ids)
        )

    def check_reader(self, fingerprint: str, dtype: torch.dtype, *, allow_self: bool = False) -> None:
        """Refuse a reader conditioned on another base, of another dtype, or a cache a decoder wrote (K5).

        Args:
            fingerprint: the reader's base fingerprint; dtype: the dtype it computes in.
            allow_self: accept producers other than those in ``PREFIX_PRODUCERS`` (a model's own prefill).
        Raises:
            FingerprintMismatchError: naming the producer, both fingerprints or both dtypes, and the fix.
        """
        if self.producer not in PREFIX_PRODUCERS and not allow_self:
            raise FingerprintMismatchError(
                f"this cache was written by {self.producer!r}, not by the base model; decoders read only "
                "C_base (compute it with ccft.compute_base_cache)"
            )
        if fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"C_base was computed by base {self.fingerprint} but the decoder was conditioned on base "
                f"{fingerprint}; recompute C_base with the decoder's base model"
            )
        if dtype != self.dtype:
            raise FingerprintMismatchError(
                f"C_base dtype {self.dtype} differs from the reader's dtype {dtype}; convert explicitly with "
                f"cache.to(dtype={dtype}) or load the decoder in {self.dtype}"
            )


class PrefixLayer(DynamicLayer):
    """A cache layer holding a constant prefix: ``update`` returns ``cat(prefix, new)`` and stores nothing.

    Because it never grows, a forward can be replayed (gradient-checkpoint recompute) and sees the
    same keys, and the prefix tensors are never written (K1).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.device = keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PrefixCache(DynamicCache):
    """Read-only cache over C_base for teacher-forced forwards; see ``PrefixLayer``."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        super().__init__()
        self.layers = [PrefixLayer(k, v) for k, v in zip(keys, values)]


def allow_readonly_cache_under_checkpointing(model) -> None:
    """Let ``model``'s checkpointed layers keep a ``PrefixCache`` argument (it is read-only; see below)."""
    # transformers drops the cache argument of checkpointed layers (a writer would append twice on the
    # backward replay). PrefixCache only reads, so its layers may keep it: without this, a decoder under
    # gradient checkpointing would silently ignore C_base.
    if getattr(model, "_ccft_ckpt_cache_ok", False):
        return
    for m in model.modules():
        if hasattr(type(m), "_can_checkpoint_with_cache"):
            m._can_checkpoint_with_cache = True
    model._ccft_ckpt_cache_ok = True


def _versions(tensors) -> tuple[int, ...]:
    # In-place writes bump a tensor's version counter; inference-mode tensors have none (-1: unchecked).
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


def _accepts(model, name: str) -> bool:
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return name in inspect.signature(type(inner).forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def prefill_tensors(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    tail_ids: torch.Tensor,
    *,
    handoff_tokens: int,
    fingerprint: str = "",
    producer: str = "base",
) -> BaseCache:
    """Prefill a left-padded batch with per-row positions and return its KV cache (no checks).

    Args:
        prefix_ids, prefix_mask: ``(b, p)`` left-padded ids and mask (1 = real token).
        tail_ids: ``(b, k)`` the handoff tokens kept with the cache.
    Returns:
        BaseCache with keys/values ``(b, h, p, d)``, pad slots zeroed.
    """
    positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    # Only the K/V are kept: compute the LM head for one position, not the whole prefix (≈20% of a
    # small model's prefill FLOPs are in the vocabulary projection).
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    # A plain DynamicCache (full layers): a model with sliding-window layers (mistral, gemma, qwen's
    # use_sliding_window) would otherwise make its own cache from its config, whose sliding layers keep only
    # the last ``sliding_window - 1`` K/V of a longer prefix. C_base holds every prefix position; the window
    # is the readers' attention mask (transformers builds it from the positions), as in one forward.
    cache = DynamicCache()
    extra[cache_kwarg(model)] = cache
    out = model(
        input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions, use_cache=True, **extra
    )
    cache = getattr(out, "cache", None) or out.past_key_values or cache
    keys, values = [], []
    pad = (prefix_mask == 0)[:, None, :, None]
    for layer in cache.layers:
        # Pad slots hold values computed from fully masked rows; zero them so nothing non-finite can leak
        # through a masked attention weight (0 * NaN = NaN).
        keys.append(layer.keys.masked_fill(pad, 0.0).contiguous())
        values.append(layer.values.masked_fill(pad, 0.0).contiguous())
    return BaseCache.from_tensors(keys, values, prefix_mask, tail_ids, handoff_tokens, fingerprint, producer)


def prefill(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    handoff_tokens: int = 1,
    pad_token_id: int = 0,
    fingerprint: str = "",
    producer: str = "base",
) -> BaseCache:
    """Run ``model`` over ``prompt[:n-k]`` for every row and return its KV cache (no checks; see
    compute_base_cache).

    Args:
        prompts: b lists of prompt token ids, each with ≥ k+1 ids.
    Returns:
        BaseCache with keys/values ``(b, h, p, d)``, p = max(n - k); ``tail_ids (b, k)``.
    """
    k = handoff_tokens
    if k < 1:
        raise ValueError(f"handoff_tokens={k}; it must be ≥ 1")
    short = [i for i, p in enumerate(prompts) if len(p) < k + 1]
    if short:
        raise ValueError(f"rows {short} have fewer than handoff_tokens+1={k + 1} prompt tokens")
    device = next(model.parameters()).device
    prefix_ids, prefix_mask = left_pad([list(p[:-k]) for p in prompts], pad_token_id)
    tail = torch.tensor([list(p[-k:]) for p in prompts], dtype=torch.long, device=device)
    return prefill_tensors(
        model,
        prefix_ids.to(device),
        prefix_mask.to(device),
        tail,
        handoff_tokens=k,
        fingerprint=fingerprint,
        producer=producer,
    )


def compute_base_cache(base, prompts: Sequence[Sequence[int]], *, handoff_tokens: int = 1) -> BaseCache:
    """Compute ``C_base`` for a batch of prompts with the frozen base model (no gradient).

    Args:
        base: a ``ccft.Base`` (``ccft.load_base``); LoRA adapters attached to it are disabled here.
        prompts: b lists of prompt token ids (as from ``ccft.data.tokenize_prompt``), each ≥ k+1 long.
        handoff_tokens: k ≥ 1; the base prefills ``prompt[:n-k]``, the decoder recomputes the last k.
    Returns:
        BaseCache: keys/values ``(b, kv_heads, max(n) - k, head_dim)`` per layer, with the base fingerprint.
    Raises:
        ValueError: a prompt shorter than k+1 tokens, or k < 1.
    """
    pad = pad_token_id(base.tokenizer)
    with base.base_weights() as model:
        return prefill(
            model,
            prompts,
            handoff_tokens=handoff_tokens,
            pad_token_id=pad,
            fingerprint=base.fingerprint,
            producer="base",
        )


__all__ = [
    "PREFIX_PRODUCERS",
    "BaseCache",
    "PrefixCache",
    "compute_base_cache",
    "prefill",
    "prefill_tensors",
    "cache_kwarg",
]
