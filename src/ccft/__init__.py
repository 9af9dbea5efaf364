"""ccft: cache-conditioned fine-tuning of specialist decoders on one shared prefill.

PrefillShare (arXiv 2602.12029): a frozen base model computes the prompt's KV cache once
(``C_base``); each specialist decode module is trained to generate on top of it.
"""

__version__ = "0.1.0"

from .base_cache import BaseCache, compute_base_cache  # noqa: E402
from .checkpoint import load_decoder, save_decoder  # noqa: E402
from .decoder import Decoder, decoder_forward, full_forward, make_decoder  # noqa: E402
from .errors import (  # noqa: E402
    CacheMutatedError,
    CCFTError,
    ConfigError,
    DataError,
    FingerprintMismatchError,
    IncompatibleModelError,
)
from .fingerprint import check_compatible  # noqa: E402
from .generation import MODES, Generation, generate  # noqa: E402
from .inference import SharedPrefillEngine  # noqa: E402
from .models import DEFAULT_BASE, Base, load_base  # noqa: E402

__all__ = [
    "BaseCache", "compute_base_cache", "load_decoder", "save_decoder", "Decoder", "decoder_forward",
    "full_forward", "make_decoder", "CacheMutatedError", "CCFTError", "ConfigError", "DataError",
    "FingerprintMismatchError", "IncompatibleModelError", "check_compatible", "MODES", "Generation", "generate",
    "DEFAULT_BASE", "Base", "load_base", "SharedPrefillEngine",
]
