"""Next-token selection, one rule for reference generation and the inference engine.

Greedy (argmax) by default; with ``do_sample``: multinomial over ``softmax(logits / temperature)``
restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling,
Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """Greedy by default. ``do_sample``: multinomial over ``softmax(logits / temperature)`` cut to ``top_p``.

    ``seed`` seeds a per-request ``torch.Generator`` (CPU), so sampled outputs do not depend on batching.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0



def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` with the tail beyond ``top_p`` zeroed (not renormalised).

    Args: logits ``(..., v)``. Returns float32 probabilities ``(..., v)``.
    """
    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs


def select_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """Next token per row. ``logits`` ``(b, v)`` -> ids ``(b,)`` (long)."""
    if not params.do_sample:
        return logits.argmax(-1)
    probs = nucleus_probs(logits, params.temperature, params.top_p)
    return torch.multinomial(probs.cpu() if generator is not None and generator.device.type == "cpu" else probs,
                             1, generator=generator).squeeze(-1).to(logits.device)
