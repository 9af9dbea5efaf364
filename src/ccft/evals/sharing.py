"""Partial prefill sharing: the sharing ratio ρ over prompt positions and over layers (docs/design.md,
"Terms").

Built only on the public primitives of ``ccft.core.cache`` / ``ccft.core.decoder`` (``prefill``,
``compute_base_cache``, ``BaseCache.from_tensors``, ``decoder_forward``); nothing here changes how
PrefillShare itself runs.

* **Over prompt positions**: per row the decoder recomputes ``k = max(h, ⌈(1−ρ)·n⌉)`` prompt tokens
  (``h`` = ``handoff_tokens``, so ρ=1 gives ``k = h``) on ``C_base`` of the first ``n−k``; ρ=0
  gives ``k = n``: the decoder prefills the whole prompt itself (an empty ``C_base``).
* **Over layers** (``shared_layers``): the listed layers read the base's K/V of ``prompt[:n−h]``, the
  other layers read the decoder's own prefill K/V of the same tokens (the decoder prefills the prompt
  itself); ρ of L layers = the first ⌈ρL⌉ layers from the input side unless a list is given.

ρ=1 on either axis is PrefillShare and goes through exactly ``decoder_forward`` on ``C_base``.

Shape notation: b batch rows, p longest prefix, t longest tail (recomputed prompt tokens + response), v vocab.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ccft.core.cache import BaseCache, compute_base_cache, prefill
from ccft.core.decoder import Decoder, check_base_reader, decoder_forward
from ccft.core.depth import mix_layers
from ccft.core.errors import ConfigError
from ccft.core.tokens import IGNORE_INDEX, pad_token_id, right_pad

AXES = ("positions", "layers")


def recompute_tokens(n: int, rho: float, handoff_tokens: int = 1) -> int:
    """k, the prompt tokens a decoder recomputes at sharing ratio ``rho`` over positions (``1 ≤ k ≤ n``).

    ``k = max(handoff_tokens, ⌈(1−ρ)·n⌉)`` capped at ``n``: ρ=1 → ``handoff_tokens``, ρ=0 → ``n``.
    Raises ConfigError for ρ outside [0, 1].
    """
    if not 0.0 <= float(rho) <= 1.0:
        raise ConfigError(f"sharing ratio rho={rho}; it must be in [0, 1]")
    # round() absorbs float noise such as (1 - 0.7) * 10 = 3.0000000000000004
    k = max(int(handoff_tokens), math.ceil(round((1.0 - float(rho)) * n, 9)))
    return min(k, n)


def shared_layer_list(rho: float, num_layers: int) -> list[int]:
    """The first ⌈ρ·L⌉ layers (from the input side): the layers that read C_base at sharing ratio ρ."""
    if not 0.0 <= float(rho) <= 1.0:
        raise ConfigError(f"sharing ratio rho={rho}; it must be in [0, 1]")
    return list(range(min(num_layers, math.ceil(round(float(rho) * num_layers, 9)))))


@torch.no_grad()
def ragged_prefill(
    model,
    prefixes: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    fingerprint: str = "",
    producer: str = "base",
    tails: Sequence[Sequence[int]] | None = None,
) -> BaseCache:
    """KV cache of ``model`` over per-row prefixes of any length, including empty ones.

    Unlike ``ccft.core.cache.prefill`` (one handoff k for the batch) each row keeps its own split.
    A batch whose prefixes are all empty gets zero-length K/V ``(b, h, 0, d)``.

    Args:
        prefixes: b lists of token ids (left-padded here).
        tails: what each row's decoder recomputes (stored right-padded as ``tail_ids``; informational).
    Returns:
        BaseCache with keys/values ``(b, h, p, d)``, ``attention_mask (b, p)``.
    """
    device = next(model.parameters()).device
    b = len(prefixes)
    tails = tails if tails is not None else [[pad_token_id]] * b
    tail_ids, _ = right_pad([list(t) or [pad_token_id] for t in tails], pad_token_id)
    width = max((len(p) for p in prefixes), default=0)
    if width == 0:
        # No row has a prefix: run one dummy token to learn the K/V shapes, keep zero positions of it.
        probe = prefill(
            model, [[pad_token_id, pad_token_id]] * b, handoff_tokens=1, pad_token_id=pad_token_id
        )
        keys = tuple(k[:, :, :0].contiguous() for k in probe.keys)
        values = tuple(v[:, :, :0].contiguous() for v in probe.values)
        mask = torch.zeros((b, 0), dtype=torch.long, device=device)
        return BaseCache.from_tensors(keys, values, mask, tail_ids.to(device), 1, fingerprint, producer)
    # prefill() splits prompt[:-1] | prompt[-1:]; a dummy last token makes the prefix exactly ``p``.
    rows = [list(p) + [pad_token_id] for p in prefixes]
    cache = prefill(
        model, rows, handoff_tokens=1, pad_token_id=pad_token_id, fingerprint=fingerprint, producer=producer
    )
    return BaseCache.from_tensors(
        cache.keys, cache.values, cache.attention_mask, tail_ids.to(device), 1, fingerprint, producer
    )


def _tail_batch(tails: Sequence[Sequence[int]], recomputed: Sequence[int], pad: int, device):
    tail_ids, tail_mask = right_pad(tails, pad)
    labels = tail_ids.clone()
    labels[tail_mask == 0] = IGNORE_INDEX
    for i, k in enumerate(recomputed):
        labels[i, :k] = IGNORE_INDEX
    return tail_ids.to(device), tail_mask.to(device), labels.to(device)


def position_cache(
    base,
    prompts: Sequence[Sequence[int]],
    rho: float,
    *,
    handoff_tokens: int = 1,
    ks: Sequence[int] | None = None,
) -> tuple[BaseCache, list[int]]:
    """C_base over ``prompt[:n−k]`` per row at sharing ratio ρ over positions; returns (cache, ks)."""
    ks = list(ks) if ks is not None else [recompute_tokens(len(p), rho, handoff_tokens) for p in prompts]
    pad = pad_token_id(base.tokenizer)
    prefixes = [list(p[: len(p) - k]) for p, k in zip(prompts, ks, strict=True)]
    tails = [list(p[len(p) - k :]) for p, k in zip(prompts, ks, strict=True)]
    with base.base_weights() as model:
        cache = ragged_prefill(
            model, prefixes, pad_token_id=pad, fingerprint=base.fingerprint, producer="base", tails=tails
        )
    return cache, ks


def layer_cache(
    base,
    decoder: Decoder,
    prompts: Sequence[Sequence[int]],
    *,
    rho: float | None = None,
    shared_layers: Sequence[int] | None = None,
) -> BaseCache:
    """A prefix cache whose ``shared_layers`` come from C_base and whose other layers are the decoder's own.

    Both caches cover ``prompt[:n−h]`` (h = ``decoder.handoff_tokens``) with the same left padding, so
    they can be mixed layer by layer (``ccft.core.depth.mix_layers``). With every layer shared the result is
    C_base itself. Sharing depth m (issue 35: the decoder's own K/V below layer m) is
    ``shared_layers=range(m, L)``.
    """
    k = decoder.handoff_tokens
    c_base = compute_base_cache(base, prompts, handoff_tokens=k)
    L = c_base.num_layers
    if shared_layers is None:
        if rho is None:
            raise ConfigError("layer sharing needs rho or an explicit shared_layers list")
        shared_layers = shared_layer_list(rho, L)
    shared = set(int(i) for i in shared_layers)
    bad = sorted(i for i in shared if not 0 <= i < L)
    if bad:
        raise ConfigError(f"shared_layers {bad} out of range for a {L}-layer model (0..{L - 1})")
    if len(shared) == L:
        return c_base
    own = prefill(
        decoder.activate(),
        prompts,
        handoff_tokens=k,
        pad_token_id=pad_token_id(base.tokenizer),
        fingerprint=c_base.fingerprint,
        producer="self",
    )
    # One rule mixes C_base and the decoder's own K/V per layer (ccft.core.depth; the sharing depth uses it).
    return mix_layers(c_base, own.keys, own.values, [i for i in range(L) if i not in shared])


@torch.no_grad()
def shared_forward(
    base,
    decoder: Decoder,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    over: str,
    rho: float = 1.0,
    shared_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits of ``decoder`` over its recomputed prompt tokens + response at sharing ratio ρ.

    Args:
        prompts: b prompt id lists; responses: b response id lists (the response + EOS, as supervised).
        over: ``"positions"`` or ``"layers"``.
        rho: sharing ratio in [0, 1]; shared_layers: explicit layer list (``over="layers"`` only).
    Returns:
        ``logits (b, t, v)`` and ``labels (b, t)`` in ``decoder_forward``'s layout: logit j predicts label
        j+1; labels are -100 on recomputed prompt tokens and padding (only response tokens count).
    """
    if over not in AXES:
        raise ConfigError(f"over={over!r}; use one of {', '.join(AXES)}")
    check_base_reader(base, decoder)  # K5: refuse another base or dtype before any compute
    device = next(decoder.model.parameters()).device
    pad = pad_token_id(base.tokenizer)
    if over == "positions":
        if shared_layers is not None:
            raise ConfigError("shared_layers applies to over='layers' only")
        cache, ks = position_cache(base, prompts, rho, handoff_tokens=decoder.handoff_tokens)
        cache.check_reader(decoder.fingerprint, decoder.dtype)
    else:
        cache = layer_cache(base, decoder, prompts, rho=rho, shared_layers=shared_layers)
        cache.check_reader(decoder.fingerprint, decoder.dtype, allow_self=True)
        ks = [decoder.handoff_tokens] * len(prompts)
    tails = [list(p[len(p) - k :]) + list(r) for p, k, r in zip(prompts, ks, responses, strict=True)]
    tail_ids, tail_mask, labels = _tail_batch(tails, ks, pad, device)
    logits = decoder_forward(decoder, cache, tail_ids, tail_mask)
    return logits, labels


def row_nlls(logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[float, int]]:
    """Per row (summed NLL, token count) of ``labels[:, 1:]`` under ``logits[:, :-1]`` (``kept_row_nlls`` of
    the scored positions' logits)."""
    labels = labels.to(logits.device)
    return kept_row_nlls(logits[scored_positions(labels)], labels)


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(b, t)`` bool: the positions whose logits predict a scored label (``labels[:, j + 1]`` is not
    ``IGNORE_INDEX``); the ``keep`` of ``SharedPrefillEngine.tail_logits`` for ``kept_row_nlls``."""
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def kept_row_nlls(kept_logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[float, int]]:
    """``row_nlls`` from the logits of the ``scored_positions(labels)`` only (``(n_kept, V)``, row-major):
    the same per-position NLLs, summed per row in the same order, without a log-softmax over the vocabulary
    at the padded and prompt positions."""
    tgt = labels[:, 1:]
    scored = tgt != IGNORE_INDEX
    nll = torch.zeros(tgt.shape, dtype=torch.float32, device=kept_logits.device)
    nll[scored] = torch.nn.functional.cross_entropy(kept_logits.float(), tgt[scored], reduction="none")
    count = scored.sum(-1)
    return [(float(nll[i].sum()), int(count[i])) for i in range(tgt.shape[0])]


@torch.no_grad()
def shared_generate(
    base,
    decoder: Decoder,
    prompts: Sequence[Sequence[int]],
    *,
    over: str,
    rho: float = 1.0,
    shared_layers: Sequence[int] | None = None,
    **gen_kwargs,
):
    """Greedy/sampled generation by ``decoder`` at sharing ratio ρ (``gen_kwargs`` of ``decode_on_cache``).

    Over positions, rows with the same k are decoded together (the recomputed tokens form the first step).
    Returns one ``ccft.Generation`` per prompt, in order.
    """
    from ccft.core.generation import decode_on_cache

    check_base_reader(base, decoder)  # K5: refuse another base or dtype before any compute
    model = decoder.activate()
    tok = base.tokenizer
    if over == "layers":
        cache = layer_cache(base, decoder, prompts, rho=rho, shared_layers=shared_layers)
        return decode_on_cache(model, tok, cache, **gen_kwargs)
    if over != "positions":
        raise ConfigError(f"over={over!r}; use one of {', '.join(AXES)}")
    ks = [recompute_tokens(len(p), rho, decoder.handoff_tokens) for p in prompts]
    out: list = [None] * len(prompts)
    for k in sorted(set(ks)):
        rows = [i for i, x in enumerate(ks) if x == k]
        cache, _ = position_cache(base, [prompts[i] for i in rows], rho, ks=[k] * len(rows))
        cache.check_reader(decoder.fingerprint, decoder.dtype)
        fixed = BaseCache.from_tensors(
            cache.keys,
            cache.values,
            cache.attention_mask,
            torch.tensor(
                [list(prompts[i][len(prompts[i]) - k :]) for i in rows], dtype=torch.long, device=cache.device
            ),
            k,
            cache.fingerprint,
            cache.producer,
        )
        for i, g in zip(rows, decode_on_cache(decoder.activate(), tok, fixed, **gen_kwargs), strict=True):
            out[i] = g
    return out


__all__ = [
    "AXES",
    "layer_cache",
    "position_cache",
    "ragged_prefill",
    "recompute_tokens",
    "row_nlls",
    "scored_positions",
    "kept_row_nlls",
    "shared_forward",
    "shared_generate",
    "shared_layer_list",
]
