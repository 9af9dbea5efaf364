"""Eq. 9 of PrefillShare (arXiv 2602.12029): prompt KV tokens with and without a shared prefill.

For one session-turn with N agents, shared context ``L_shared`` and unique length ``L_unique``, a
shared prefill computes and keeps ``L_shared + N·L_unique`` prompt KV tokens; per-model serving
computes ``N·(L_shared + L_unique)``. These are theoretical counts: they ignore prefix reuse across
turns (a prefix store adds it) and the decoders' generated tokens (docs/serving.md, "Eq. 9").
"""

from __future__ import annotations

from dataclasses import dataclass

from ccft.core.errors import ConfigError

__all__ = ["KVTokens", "kv_tokens"]


@dataclass(frozen=True)
class KVTokens:
    """Prompt KV tokens computed and held (Eq. 9 of PrefillShare), summed over session-turns.

    ``shared``: one shared prefill per session-turn, ``L_shared + N·L_unique``; ``no_share``:
    every agent prefills its own prompt, ``N·(L_shared + L_unique)``.
    """

    shared: int
    no_share: int

    @property
    def ratio(self) -> float:
        """``no_share / shared`` (how many times more prompt KV without sharing)."""
        return self.no_share / self.shared if self.shared else 1.0

    @property
    def saving(self) -> float:
        """``1 - shared / no_share``: the fraction of prompt KV a shared prefill saves."""
        return 1.0 - self.shared / self.no_share if self.no_share else 0.0

    def __add__(self, other: KVTokens) -> KVTokens:
        return KVTokens(self.shared + other.shared, self.no_share + other.no_share)


def kv_tokens(n_agents: int, shared_len: int, unique_len: int) -> KVTokens:
    """Eq. 9 for one session-turn of ``n_agents`` agents: ``(L_s + N·L_u, N·(L_s + L_u))`` tokens.

    Raises:
        ConfigError: ``n_agents < 1`` or a negative length.
    """
    if n_agents < 1 or shared_len < 0 or unique_len < 0:
        raise ConfigError(
            f"kv_tokens: need n_agents >= 1 and lengths >= 0, got n_agents={n_agents}, "
            f"shared_len={shared_len}, unique_len={unique_len}"
        )
    return KVTokens(shared_len + n_agents * unique_len, n_agents * (shared_len + unique_len))
