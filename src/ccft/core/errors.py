"""Exceptions raised by ccft. Every message names the offending field and the fix."""


class CCFTError(Exception):
    """Base class of every error ccft raises on purpose."""


class ConfigError(CCFTError, ValueError):
    """A recipe or config field is unknown, missing or of the wrong type."""


class DataError(CCFTError, ValueError):
    """A data row cannot be turned into a supervised example (no response, no assistant turn, ...)."""


class IncompatibleModelError(CCFTError, ValueError):
    """Base and decoder disagree on tokenizer, layer count, KV heads, head dim or RoPE settings."""


class FingerprintMismatchError(CCFTError, ValueError):
    """A decoder or a C_base was produced for a different base model (docs/design.md, K5)."""


class CacheMutatedError(CCFTError, RuntimeError):
    """A C_base tensor was modified in place; C_base is a constant (docs/design.md, "Invariants" 2)."""
