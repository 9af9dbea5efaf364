"""The response NLL without full-vocabulary logits: the LM head and the cross-entropy in chunks of tokens.

The training loss needs ``log p(r_t | ...)`` at the supervised positions only (the response and the final
EOS, both methods). Computing the logits of every tail position, ``(b, t, v)`` in fp32, and letting autograd
keep the copies cross-entropy makes (the shifted view, log-softmax, their gradients) costs
``b·t·v·4`` bytes several times over: 0.8 GB per copy for 4 rows of 1,037 tail tokens and SmolLM2's
49,152-token vocabulary. This module instead

1. runs the model with ``logits_to_keep`` set to no position (the LM head projects nothing) and takes the
   final hidden states ``(b, s, h)`` from the model's body (``capture_final_hidden``);
2. keeps the rows of the supervised positions only, ``(n, h)``;
3. in ``LinearCrossEntropy`` (a custom ``torch.autograd.Function``, the fused / chunked linear
   cross-entropy of Liger-Kernel, arXiv 2410.10989, §3.2, written for any device), projects ``chunk``
   tokens at a time onto the vocabulary, adds their NLL to the sum and, when gradients are needed, turns
   the chunk's log-probabilities in place into ``softmax − onehot`` and multiplies it into the gradients of
   the hidden states (``(n, h)``) and of the LM head's weight (``(v, h)``, only when it trains) right away.
   No logits outlive their chunk; the backward scales the stored gradients by the incoming one.

FLOPs equal the unfused path's (forward 2·n·h·v, backward 2·n·h·v per gradient taken); peak memory of the
loss drops from several ``b·t·v`` tensors to ``chunk·v``. Values and gradients equal
``F.cross_entropy`` over full logits to fp32 rounding (tests/train/test_chunked_loss.py).

Used when ``chunked_loss_unsupported(model)`` is None: a causal LM whose logits are exactly
``lm_head(final hidden state)``, or that soft-capped as Gemma 2 / 3 do, ``c · tanh(lm_head(h) / c)`` with
``c = config.final_logit_softcapping`` (``CHUNKED_LOSS_MODEL_TYPES``, ``logit_softcap``: the chunks cap their
logits the same way, in the same order, and their gradient carries the cap's derivative ``1 − tanh²``), with
a plain ``nn.Linear`` LM head whose weight is materialised (not a LoRA-wrapped head, not a ZeRO-3 shard).
Anything else (logit scaling as Cohere / Granite do, ...) takes the full-logits path (``response_nll_rows``
in ``ccft.train.trainer``).

Shape notation: b batch, s sequence, n supervised tokens, h hidden size, v vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ccft.core.decoder import unwrap_distributed, unwrap_pretrained
from ccft.core.tokens import IGNORE_INDEX

#: Model types whose ``ForCausalLM.forward`` computes ``logits = lm_head(last_hidden_state)`` and nothing
#: more (transformers 5.x), or that and then Gemma's final-logit soft-capping (``SOFTCAP_MODEL_TYPES``:
#: ``final_logit_softcapping``, which the chunked loss applies too); others (Cohere/Granite logit scaling,
#: ...) take the full-logits path.
CHUNKED_LOSS_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3_text"}
)
#: Model types whose logits are ``c · tanh(lm_head(h) / c)`` when ``config.final_logit_softcapping`` = c
SOFTCAP_MODEL_TYPES = frozenset({"gemma2", "gemma3_text"})

#: ``logits_to_keep`` that keeps no position: the model returns logits ``(b, 0, v)``.
NO_LOGITS = torch.zeros(0, dtype=torch.long)


def chunked_loss_unsupported(model) -> str | None:
    """Why the chunked loss would not equal the full-logits loss for ``model`` (any wrapper), or None."""
    inner = unwrap_pretrained(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in CHUNKED_LOSS_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(CHUNKED_LOSS_MODEL_TYPES)}"
    peft_config = getattr(unwrap_distributed(model), "peft_config", None)
    if isinstance(peft_config, dict):
        for name, cfg in peft_config.items():
            if getattr(cfg, "alora_invocation_tokens", None):
                return f"adapter {name!r} is an aLoRA adapter (its forward hooks run in PeftModel.forward)"
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear (e.g. LoRA on lm_head)"
    if head.weight.numel() == 0 or hasattr(head.weight, "ds_id"):
        return "the LM head's weight is partitioned (DeepSpeed ZeRO-3)"
    if not hasattr(inner, "get_decoder"):
        return f"{type(inner).__name__} has no get_decoder() to read the final hidden states from"
    return None


def lm_head(model) -> torch.nn.Linear:
    """The output projection of ``model`` (any wrapper); check ``chunked_loss_unsupported`` first."""
    return unwrap_pretrained(model).get_output_embeddings()


def logit_softcap(model) -> float | None:
    """``c`` of the final-logit soft-capping ``c · tanh(z / c)`` ``model`` (any wrapper) applies to its LM
    head's output (Gemma 2 / 3: ``config.final_logit_softcapping``), or None."""
    config = getattr(unwrap_pretrained(model), "config", None)
    if getattr(config, "model_type", None) not in SOFTCAP_MODEL_TYPES:
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


@contextlib.contextmanager
def capture_final_hidden(model) -> Iterator[dict]:
    """While entered, every forward of ``model``'s body stores its ``last_hidden_state`` ``(b, s, h)`` (after
    the final norm: what the LM head projects) under ``"hidden"`` of the yielded dict.

    The hook sits on the body module (``get_decoder()``), so the call still goes through every wrapper
    (DDP, DeepSpeed, PEFT) and gradient checkpointing works as usual."""
    holder: dict = {}
    body = unwrap_pretrained(model).get_decoder()

    def hook(module, args, output):
        holder["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = body.register_forward_hook(hook)
    try:
        yield holder
    finally:
        handle.remove()


class LinearCrossEntropy(torch.autograd.Function):
    """``Σ_i CE(cap(hidden[i] @ weightᵀ + bias), targets[i])`` computed ``chunk`` rows at a time.

    forward(hidden ``(n, h)``, weight ``(v, h)``, bias ``(v,)`` or None, targets ``(n,)`` long, chunk int,
    softcap float or None) returns ``(total () fp32, per_token (n,) fp32)``; ``per_token`` carries no
    gradient. Logits are computed in the weight's dtype, soft-capped there when ``softcap`` = c is given
    (``c · tanh(z / c)``, the order of transformers' Gemma heads; cap: identity otherwise) and upcast to fp32
    (as ``response_nll_rows`` does). Gradients of the inputs that require them are computed during the
    forward, chunk by chunk; the backward multiplies them by the incoming gradient of ``total``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, softcap=None):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        per_token = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end]
            t = targets[start:end]
            logits = h @ weight.t()
            if bias is not None:
                logits = logits + bias
            if softcap:  # transformers' order: z / c, tanh, · c
                capped = torch.tanh(logits / softcap)  # kept for the cap's derivative 1 − tanh²
                logits = capped * softcap
                if not (need_h or need_w or need_b):
                    del capped
            # log_softmax, as F.cross_entropy computes it (torch.logsumexp rounds differently: ~5e-6 relative
            # on SmolLM2's peaked distributions)
            logp = torch.log_softmax(logits.float(), dim=-1)
            del logits
            nll = -logp.gather(1, t[:, None]).squeeze(1)
            per_token[start:end] = nll
            total += nll.sum()
            if need_h or need_w or need_b:
                # d nll / d logits = softmax − onehot, written over the log-probabilities.
                g = logp.exp_()
                g[torch.arange(end - start, device=g.device), t] -= 1.0
                if softcap:  # through c · tanh(z / c): times 1 − tanh²(z / c)
                    g.mul_(1.0 - capped.float().square())
                    del capped
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[start:end] = g @ weight
                if need_w:
                    grad_w += (g.t() @ h).float()
        ctx.mark_non_differentiable(per_token)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w, grad_b) if x is not None))
        ctx.have = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total, per_token

    @staticmethod
    def backward(ctx, grad_total, grad_per_token):
        saved = iter(ctx.saved_tensors)
        out = []
        for have, dtype in zip(ctx.have, ctx.dtypes):
            out.append((next(saved) * grad_total).to(dtype) if have else None)
        return out[0], out[1], out[2], None, None, None


def chunked_nll(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: torch.nn.Linear,
    chunk: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token NLL of the supervised positions without full logits.

    Args:
        hidden: final hidden states ``(b, t, h)`` of the tail (what the LM head would project).
        labels: ``(b, t)``; position j predicts ``labels[:, j + 1]``, ``IGNORE_INDEX`` is skipped.
        head: the LM head (``nn.Linear``: weight ``(v, h)``, optional bias).
        chunk: supervised tokens projected at a time (≥ 1).
        softcap: the model's final-logit soft-capping ``c`` (``logit_softcap``), or None.
    Returns:
        ``(total, nll_rows, count_rows)``: the NLL summed over the batch (``()`` fp32, differentiable w.r.t.
        ``hidden`` and the head's parameters), and per row the summed NLL ``(b,)`` fp32 (no gradient) and
        the supervised-token count ``(b,)``.
    """
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(targets)[keep]
    h = hidden[:, :-1][keep]
    total, per_token = LinearCrossEntropy.apply(h, head.weight, head.bias, targets[keep], int(chunk), softcap)
    nll_rows = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add_(
        0, rows, per_token.detach()
    )
    return total, nll_rows, keep.sum(-1)


__all__ = [
    "CHUNKED_LOSS_MODEL_TYPES",
    "NO_LOGITS",
    "LinearCrossEntropy",
    "capture_final_hidden",
    "chunked_loss_unsupported",
    "chunked_nll",
    "lm_head",
    "logit_softcap",
]
