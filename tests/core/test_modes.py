"""ccft.core.modes: the one table of who prefills and who decodes (docs/design.md, "Modes")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ccft.core.errors import ConfigError
from ccft.core.modes import MODES, check_mode, decoder_for_mode, get_mode


def test_table():
    assert MODES == ("base", "full-ft", "naive", "prefillshare")
    got = {m: (get_mode(m).shared_prefill, get_mode(m).decoder_method) for m in MODES}
    assert got == {
        "base": (False, None),
        "full-ft": (False, "full-ft"),
        "naive": (True, "full-ft"),
        "prefillshare": (True, "ccft"),
    }


def test_check_mode_errors_name_the_fix():
    ccft_dec, ft_dec = SimpleNamespace(method="ccft"), SimpleNamespace(method="full-ft")
    with pytest.raises(ConfigError, match="use one of base, full-ft, naive, prefillshare"):
        check_mode("shared", None)
    with pytest.raises(ConfigError, match="needs a decoder"):
        check_mode("naive", None)
    with pytest.raises(ConfigError, match="use mode=prefillshare"):
        check_mode("naive", ccft_dec)
    with pytest.raises(ConfigError, match="use mode=full-ft or naive"):
        check_mode("prefillshare", ft_dec)
    assert check_mode("prefillshare", ccft_dec).name == "prefillshare"
    assert check_mode("base", None).name == "base"
    assert check_mode("full-ft", SimpleNamespace(method=None)).name == "full-ft"  # unknown method: allowed


def test_decoder_for_mode():
    decs = {"ccft": "C", "full-ft": "F"}
    assert [decoder_for_mode(m, decs) for m in MODES] == [None, "F", "F", "C"]
    with pytest.raises(ConfigError, match="needs a ccft decoder"):
        decoder_for_mode("prefillshare", {"full-ft": "F"})
