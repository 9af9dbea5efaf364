"""The package surface: light ``import ccft``, lazy public names, deprecated module paths (docs/design.md,
"Layers")."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import ccft


def test_import_ccft_loads_no_heavy_module():
    code = (
        "import sys, ccft; heavy = [m for m in ('torch', 'transformers', 'ccft.inference.engine', "
        "'ccft.serving', 'ccft.evals', 'ccft.train') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ccft.__all__)
def test_every_public_name_resolves(name):
    assert getattr(ccft, name) is not None
    assert name in dir(ccft)


@pytest.mark.parametrize("old, new", sorted(ccft.MOVED_MODULES.items()))
def test_moved_module_paths_are_the_same_module_with_a_warning(old, new):
    import importlib

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_old_from_import_still_works():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ccft.data import build_dataset, tokenize_prompt  # noqa: F401  (README of ccft 0.1)

        from ccft.train.data import build_dataset as new_build
    assert build_dataset is new_build


def test_subpackages_load_on_attribute_access():
    code = (
        "import ccft; print(ccft.train.data.Collator.__name__, ccft.inference.SharedPrefillEngine.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["Collator", "SharedPrefillEngine"]


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ccft.nope  # noqa: B018
