"""Names the ccft 0.1 modules exported that live elsewhere now: one table, read by each module's
``__getattr__``.

``ccft.MOVED_MODULES`` maps the 0.1 module paths to their new homes (``import ccft.evaluate`` is
``ccft.evals.evaluate``); the redesign also moved names out of those modules and out of the old
``ccft.train`` module (now a package). ``MOVED_NAMES`` says where each went: reading it from the old place
still works, once per name with a ``DeprecationWarning`` that names the new import; ``REMOVED_NAMES``
raises ``AttributeError`` naming what replaces it. Both go away in ccft ``REMOVED_IN``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

__all__ = ["MOVED_NAMES", "REMOVED_IN", "REMOVED_NAMES", "moved_name_getattr"]

REMOVED_IN = "0.3"

#: module (its current path) -> {0.1 name: module that defines it now}
MOVED_NAMES: dict[str, dict[str, str]] = {
    "ccft.train": {  # the 0.1 module ccft/train.py, now the package ccft.train
        "Base": "ccft.core.models",
        "load_base": "ccft.core.models",
        "Decoder": "ccft.core.decoder",
        "make_decoder": "ccft.core.decoder",
        "save_decoder": "ccft.core.checkpoint",
        "TrainConfig": "ccft.train.config",
        "resolve_data": "ccft.train.config",
        "Collator": "ccft.train.data",
        "TokenizedDataset": "ccft.train.data",
        "build_dataset": "ccft.train.data",
        "load_rows": "ccft.train.data",
        "CacheConditionedTrainer": "ccft.train.trainer",
        "check_process_group": "ccft.train.run",
    },
    "ccft.core.decoder": {
        "PrefixCache": "ccft.core.cache",
        "PrefixLayer": "ccft.core.cache",
    },  # 0.1 ccft.decoder
    "ccft.core.generation": {"ConfigError": "ccft.core.errors"},  # 0.1 ccft.generation
    "ccft.evals.evaluate": {  # 0.1 ccft.evaluate
        "Collator": "ccft.train.data",
        "TokenizedDataset": "ccft.train.data",
        "check_mode": "ccft.core.modes",
        "decoder_for_mode": "ccft.core.modes",
        "compute_base_cache": "ccft.core.cache",
        "decoder_forward": "ccft.core.decoder",
        "full_forward": "ccft.core.decoder",
        "exact_match": "ccft.evals.extract",
        "extract_flexible": "ccft.evals.extract",
        "extract_reference": "ccft.evals.extract",
        "extract_strict": "ccft.evals.extract",
        "generate": "ccft.core.generation",
        "mean_ci": "ccft.evals.stats",
        "paired_bootstrap_delta": "ccft.evals.stats",
        "response_nll_sum": "ccft.train.trainer",
    },
    "ccft.evals.report": {"MODE_ORDER": "ccft.core.modes:MODES"},  # 0.1 ccft.report
}

#: module -> {0.1 name: what replaces it} for names with no one-to-one successor
REMOVED_NAMES: dict[str, dict[str, str]] = {
    "ccft.evals.evaluate": {
        "SELF_PREFILL": "ccft.core.modes.get_mode(mode).shared_prefill (False for base and full-ft)",
        "row_nll": "ccft.evals.scoring.batch_nll",
        "ExactMatch": "ccft.evals.evaluate.evaluate_decoders (per-item records with exact-match scores)",
        "gsm8k_exact_match": "ccft.evals.evaluate.evaluate_decoders with the gsm8k task",
        "summarize_mode": "ccft.evals.records.summarize_records",
        "paired_deltas": "ccft.evals.records.paired_deltas_by_id",
    },
    "ccft.evals.report": {"MODE_NOTE": "ccft.core.modes.get_mode(mode).note"},
}


def moved_name_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) serving ``module``'s moved names from ``MOVED_NAMES`` (with a
    ``DeprecationWarning``) and explaining its ``REMOVED_NAMES``; anything else is an ``AttributeError``."""
    moved, removed = MOVED_NAMES.get(module, {}), REMOVED_NAMES.get(module, {})

    def __getattr__(name: str) -> Any:
        if name in moved:
            where, _, attr = moved[name].partition(":")
            attr = attr or name
            warnings.warn(
                f"{module}.{name} moved: import it from {where} ({where}.{attr}); the old name goes away "
                f"in ccft {REMOVED_IN}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(where), attr)
        if name in removed:
            raise AttributeError(f"{module}.{name} was removed in ccft 0.2; use {removed[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
