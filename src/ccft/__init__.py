"""ccft: cache-conditioned fine-tuning of specialist decoders on one shared prefill.

PrefillShare (arXiv 2602.12029): a frozen base model computes the prompt's KV cache once
(``C_base``); each specialist decode module is trained to generate on top of it.

Layers (docs/design.md): ``ccft.core`` <- ``ccft.train`` <- ``ccft.inference`` <- ``ccft.serving`` /
``ccft.evals`` <- ``ccft.cli``. ``import ccft`` is light: every name below loads its module on first use.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings

from ccft.core.version import __version__

#: public name -> module that defines it (loaded on first attribute access, PEP 562)
_EXPORTS = {
    "BaseCache": "ccft.core.cache",
    "compute_base_cache": "ccft.core.cache",
    "load_decoder": "ccft.core.checkpoint",
    "save_decoder": "ccft.core.checkpoint",
    "Decoder": "ccft.core.decoder",
    "decoder_forward": "ccft.core.decoder",
    "full_forward": "ccft.core.decoder",
    "make_decoder": "ccft.core.decoder",
    "CacheMutatedError": "ccft.core.errors",
    "CCFTError": "ccft.core.errors",
    "ConfigError": "ccft.core.errors",
    "DataError": "ccft.core.errors",
    "FingerprintMismatchError": "ccft.core.errors",
    "IncompatibleModelError": "ccft.core.errors",
    "check_compatible": "ccft.core.fingerprint",
    "MODES": "ccft.core.modes",
    "Generation": "ccft.core.generation",
    "generate": "ccft.core.generation",
    "DEFAULT_BASE": "ccft.core.models",
    "Base": "ccft.core.models",
    "load_base": "ccft.core.models",
    "TrainConfig": "ccft.train.config",
    "load_recipe": "ccft.train.config",
    "CacheConditionedTrainer": "ccft.train.trainer",
    "run_training": "ccft.train.run",
    "SharedPrefillEngine": "ccft.inference.engine",
    "SamplingParams": "ccft.core.sampling",
    "DecodeParams": "ccft.core.sampling",
}

#: module paths of ccft 0.1 -> where they live now. Importing an old path still works (same module
#: object) and emits a DeprecationWarning; the aliases go away in ccft 0.3.
MOVED_MODULES = {
    "ccft.errors": "ccft.core.errors",
    "ccft.fingerprint": "ccft.core.fingerprint",
    "ccft.models": "ccft.core.models",
    "ccft.base_cache": "ccft.core.cache",
    "ccft.decoder": "ccft.core.decoder",
    "ccft.generation": "ccft.core.generation",
    "ccft.checkpoint": "ccft.core.checkpoint",
    "ccft.config": "ccft.train.config",
    "ccft.data": "ccft.train.data",
    "ccft.trainer": "ccft.train.trainer",
    "ccft.fastpath": "ccft.train.fastpath",
    "ccft.cache_store": "ccft.train.cache_store",
    "ccft.distributed": "ccft.train.distributed",
    "ccft.evaluate": "ccft.evals.evaluate",
    "ccft.report": "ccft.evals.report",
}

_SUBPACKAGES = ("core", "train", "inference", "serving", "evals", "cli")

__all__ = sorted(_EXPORTS) + ["__version__"]


class _MovedModuleFinder:  # a sys.meta_path finder and its loader (duck-typed: importlib.abc costs ~40 ms)
    """Serves ``import ccft.<old>`` with the module at its new path (one object, two names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path goes away in ccft 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module):  # the module is already executed under its new name
        pass


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if f"ccft.{name}" in MOVED_MODULES or name in _SUBPACKAGES:
        return importlib.import_module(f"ccft.{name}")
    raise AttributeError(f"module 'ccft' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
