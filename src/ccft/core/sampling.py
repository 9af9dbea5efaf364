"""Next-token selection, one rule for reference generation and the inference engine.

Greedy (argmax) by default; with ``do_sample``: multinomial over ``softmax(logits / temperature)``
restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling,
Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ccft.core.errors import ConfigError


@dataclass
class SamplingParams:
    """Greedy by default. ``do_sample``: multinomial over ``softmax(logits / temperature)`` cut to ``top_p``.

    ``seed`` seeds a per-request ``torch.Generator`` (CPU), so sampled outputs do not depend on batching.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class DecodeParams:
    """One request's decoding settings, passed whole from the HTTP schema through the scheduler to the engine
    (``SharedPrefillEngine.add_request(params=...)``, ``ServeRequest(params=...)``): a setting added here
    reaches every path without being copied field by field.

    Attributes:
        max_new_tokens: tokens to generate at most (≥ 1; 0 only where a path scores the prompt alone).
        stop: stop strings; the text is cut before the earliest one (``ccft.core.text.StopMatcher``).
        ignore_eos: keep decoding past EOS (benchmarks: every row runs ``max_new_tokens`` steps).
        sampling: ``SamplingParams`` (greedy by default; ``seed`` seeds the request's own generator).
        logprobs: None, or k ≥ 0: each generated token's log-probability and the k most likely tokens.
        n: choices per prompt; choice j samples with ``sampling.seed + j`` (``for_choice``).
    Raises (at construction):
        ConfigError: a negative ``max_new_tokens`` or ``logprobs``, ``n`` < 1.
    """

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        # keyword callers pass None for "default"; the fields hold plain values
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "sampling", self.sampling or SamplingParams())
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        object.__setattr__(self, "logprobs", None if self.logprobs is None else int(self.logprobs))
        if int(self.max_new_tokens) < 0:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}; it must be ≥ 0")
        if self.logprobs is not None and int(self.logprobs) < 0:
            raise ConfigError(f"logprobs={self.logprobs}; it must be ≥ 0 (or None)")
        if int(self.n) < 1:
            raise ConfigError(f"n={self.n}; it must be ≥ 1")

    def replace(self, **changes) -> "DecodeParams":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def for_choice(self, j: int) -> "DecodeParams":
        """Choice j of ``n``: sampling seeded with ``seed + j`` (mod 2**63), ``n`` = 1."""
        s = self.sampling
        seed = (s.seed + j) % 2**63 if s.do_sample else s.seed
        return dataclasses.replace(self, sampling=dataclasses.replace(s, seed=seed), n=1)


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


def select_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token per row. ``logits`` ``(b, v)`` -> ids ``(b,)`` (long)."""
    if not params.do_sample:
        return logits.argmax(-1)
    probs = nucleus_probs(logits, params.temperature, params.top_p)
    return (
        torch.multinomial(
            probs.cpu() if generator is not None and generator.device.type == "cpu" else probs,
            1,
            generator=generator,
        )
        .squeeze(-1)
        .to(logits.device)
    )
