"""Prompt log-probabilities of a served model: what ``echo`` with ``logprobs`` returns (``ccft serve``).

``prompt_logprobs(engine, decoder, prompt_ids)`` gives, for every prompt position i ≥ 1, the
log-probability the served model assigns to ``prompt[i]`` as the next token after ``prompt[:i]``,
in the same layout as a request whose prompt is ``prompt[:i]`` (docs/design.md, "Modes"; docs/serving.md,
"Log-probabilities"):

* the base (``"base"``): one causal forward of the base over the prompt;
* a decoder (LoRA or full-weight, decoding on the shared prefill): the frozen base's ``C_base`` of
  ``prompt[:i-k]`` (k = the decoder's ``handoff_tokens``, fewer when i ≤ k) and the decoder over
  ``prompt[i-k:i]`` (``ccft.core.decoder.decoder_forward``) — the distribution of the first token the
  decoder would generate for the prompt ``prompt[:i]``.

For one-token continuations this is exactly the loglikelihood ccft's in-process lm-eval model
(``ccft.evals.lm_eval_model``) returns for (context ``prompt[:i]``, continuation ``prompt[i]``).
A longer continuation is scored there as the decoder *generating* it (its own K/V for the earlier
continuation tokens), which depends on where the context ends; with ``context_tokens=c`` the
positions after ``c`` are scored that way (the decoder over ``prompt[c-k:]`` on ``C_base`` of
``prompt[:c-k]``), equal to the in-process loglikelihood of (``prompt[:c]``, ``prompt[c:]``).
The base's K/V is causal, so ``C_base`` of every ``prompt[:i-k]`` is a slice of one prefill of the
whole prompt: the base runs once, the decoder over k tokens per position (rows batched).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ccft.core.cache import BaseCache, compute_base_cache
from ccft.core.decoder import decoder_forward
from ccft.core.errors import ConfigError
from ccft.inference.requests import logprob_entries

__all__ = ["prompt_logprobs", "PromptLogprob"]

#: one prompt position: (logprob of the prompt token, its top ``(id, logprob)`` pairs); None for position 0
PromptLogprob = tuple[float, list[tuple[int, float]]]


def _slice_rows(full: BaseCache, lens: Sequence[int], k: int) -> BaseCache:
    """A batch ``C_base`` whose row r is the first ``lens[r]`` positions of ``full``'s one row (left-padded;
    the base's K/V is causal, so that is ``C_base`` of the first ``lens[r]`` prompt tokens)."""
    device = full.device
    b, width = (
        len(lens),
        max(max(lens), 1),
    )  # ≥ 1 slot (masked when empty): the cache always has a prefix axis
    mask = torch.zeros((b, width), dtype=torch.long, device=device)
    keys, values = [], []
    for fk, fv in zip(full.keys, full.values, strict=True):
        kb = fk.new_zeros((b, fk.shape[1], width, fk.shape[3]))
        vb = fv.new_zeros((b, fv.shape[1], width, fv.shape[3]))
        for r, L in enumerate(lens):
            if L:
                kb[r, :, width - L :] = fk[0, :, :L]
                vb[r, :, width - L :] = fv[0, :, :L]
        keys.append(kb)
        values.append(vb)
    for r, L in enumerate(lens):
        if L:
            mask[r, width - L :] = 1
    tail = torch.zeros(
        (b, k), dtype=torch.long, device=device
    )  # informational (the callers pass their tails)
    return BaseCache.from_tensors(keys, values, mask, tail, k, full.fingerprint, "base")


@torch.inference_mode()
def prompt_logprobs(
    engine,
    decoder: str,
    prompt_ids: Sequence[int],
    *,
    top: int = 0,
    context_tokens: int | None = None,
    rows_per_batch: int = 32,
) -> list[PromptLogprob | None]:
    """Log-probabilities of the prompt's own tokens under ``decoder`` of ``engine`` (see the module
    docstring).

    Args:
        engine: a ``SharedPrefillEngine`` (its base and registered decoders).
        decoder: a registered decoder name (``"base"``: the base model).
        prompt_ids: n ≥ 1 token ids.
        top: how many most likely ``(id, logprob)`` pairs to report per position (0: none).
        context_tokens: c in 1..n-1: positions c+1.. are scored as the continuation of the context
            ``prompt[:c]`` (see the module docstring; the base is causal over its own prompt, so its
            logprobs do not depend on c). None: every position as the first token after its prefix.
        rows_per_batch: decoder rows (prompt positions) per forward.
    Returns:
        n entries: ``None`` for position 0 (nothing precedes it), then ``(logprob, top pairs)`` for
        positions 1..n-1 (natural log, fp32 log-softmax of the model's logits).
    Raises:
        ConfigError: an unknown decoder, an empty prompt, ``top`` < 0, ``context_tokens`` outside 1..n-1.
    Runs the engine's models on the calling thread (the scheduler's: the LoRA host's active adapter is
    switched here); cost: one base forward over the prompt plus a decoder forward over k tokens per position.
    """
    if decoder not in engine.decoders:
        raise ConfigError(f"unknown decoder {decoder!r}; registered: {', '.join(engine.decoders)}")
    if top < 0:
        raise ConfigError(f"top={top}; it must be ≥ 0")
    ids = [int(t) for t in prompt_ids]
    n = len(ids)
    if n < 1:
        raise ConfigError("prompt_ids is empty")
    if context_tokens is not None and not 1 <= int(context_tokens) <= n - 1:
        raise ConfigError(
            f"context_tokens={context_tokens}; it must be in 1..{n - 1} (the prompt has {n} tokens: "
            "at least one continuation token must follow the context)"
        )
    out: list[PromptLogprob | None] = [None]
    if n == 1:
        return out
    base, dec = engine.base, engine.decoders[decoder].decoder
    device = base.device
    if dec is None:  # the base over its own prompt
        with base.base_weights() as model:
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, :-1]
        return out + logprob_entries(torch.log_softmax(logits.float(), -1), ids[1:], top)
    k = int(dec.handoff_tokens)
    # C_base of prompt[:n-1] once (handoff 1: the base prefills all but the last token); row i reads its first
    # i-k
    full = compute_base_cache(base, [ids], handoff_tokens=1)
    upto = n if context_tokens is None else int(context_tokens) + 1  # later positions: the continuation row
    for s in range(1, upto, rows_per_batch):
        targets = list(range(s, min(upto, s + rows_per_batch)))
        kk = [min(k, i) for i in targets]
        lens = [i - j for i, j in zip(targets, kk, strict=True)]
        b = len(targets)
        cache = _slice_rows(full, lens, k)
        tail = torch.full((b, k), full.tail_ids[0, 0].item(), dtype=torch.long, device=device)
        tail_mask = torch.zeros((b, k), dtype=torch.long, device=device)
        for r, (i, j) in enumerate(zip(targets, kk, strict=True)):
            tail[r, :j] = torch.tensor(ids[i - j : i], device=device)
            tail_mask[r, :j] = 1
        logits = decoder_forward(dec, cache, tail, tail_mask)
        last = logits[torch.arange(b, device=device), torch.tensor(kk, device=device) - 1]
        out += logprob_entries(torch.log_softmax(last.float(), -1), [ids[i] for i in targets], top)
    if context_tokens is not None and int(context_tokens) < n - 1:
        c = int(context_tokens)
        kk = min(k, c)
        cache = _slice_rows(full, [c - kk], k)
        tail = torch.tensor([ids[c - kk :]], device=device)
        logits = decoder_forward(dec, cache, tail)[0, kk - 1 : -1]  # predicts prompt[c], ..., prompt[n-1]
        out[c:] = logprob_entries(torch.log_softmax(logits.float(), -1), ids[c:], top)
    return out
