"""``resolve_handoff``: the one rule for the handoff k a prefill uses (engine, scheduler, eval, sweep)."""

import pytest

from ccft.core.decoder import resolve_handoff
from ccft.core.errors import ConfigError


def test_agreed_requested_and_default():
    assert resolve_handoff([]) == 1
    assert resolve_handoff([None, None]) == 1  # the base reads with k = 1
    assert resolve_handoff([4, 4, None]) == 4
    assert resolve_handoff([4], 4) == 4
    assert resolve_handoff([], 3) == 3


def test_refusals_name_the_values_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"decoders \['a', 'b'\] were trained with different handoff_tokens \[1, 4\].*separate",
    ):
        resolve_handoff([4, 1], what="decoders ['a', 'b']")
    with pytest.raises(ConfigError, match="handoff_tokens=2 was asked for.*prefill with handoff_tokens=4"):
        resolve_handoff([4], 2)
    with pytest.raises(ConfigError, match="must be ≥ 1"):
        resolve_handoff([], 0)
