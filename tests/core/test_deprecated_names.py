"""Every name a ccft 0.1 module exported resolves from its old place with a DeprecationWarning
(``ccft.core.deprecation.MOVED_NAMES``), or says what replaces it (``REMOVED_NAMES``)."""

import importlib
import warnings

import pytest

from ccft.core.deprecation import MOVED_NAMES, REMOVED_IN, REMOVED_NAMES

MOVED = [(m, n, w) for m, names in MOVED_NAMES.items() for n, w in names.items()]
REMOVED = [(m, n, w) for m, names in REMOVED_NAMES.items() for n, w in names.items()]


@pytest.mark.parametrize("module, name, where", MOVED, ids=[f"{m}.{n}" for m, n, _ in MOVED])
def test_moved_name_resolves_with_a_warning(module, name, where):
    mod = importlib.import_module(module)
    home, _, attr = where.partition(":")
    with pytest.warns(
        DeprecationWarning, match=rf"{module}\.{name} moved: import it from {home}.*{REMOVED_IN}"
    ):
        got = getattr(mod, name)
    assert got is getattr(importlib.import_module(home), attr or name)


@pytest.mark.parametrize("module, name, instead", REMOVED, ids=[f"{m}.{n}" for m, n, _ in REMOVED])
def test_removed_name_says_what_replaces_it(module, name, instead):
    with pytest.raises(AttributeError, match="removed in ccft 0.2; use") as e:
        getattr(importlib.import_module(module), name)
    assert instead in str(e.value)


def test_the_old_train_module_and_old_module_paths():
    """The issue's case: code written against ccft 0.1's ccft.train module, and an old module path."""
    import ccft.train as T
    from ccft.train.trainer import CacheConditionedTrainer

    with pytest.warns(DeprecationWarning):
        assert T.CacheConditionedTrainer is CacheConditionedTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        evaluate = importlib.import_module("ccft.evaluate")  # MOVED_MODULES alias of ccft.evals.evaluate
    from ccft.evals.extract import exact_match

    with pytest.warns(DeprecationWarning, match="ccft.evals.extract"):
        assert evaluate.exact_match is exact_match
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        T.no_such_name  # noqa: B018
