"""Names vulture (``make lint``) cannot see used: pytest calls these hooks of tests/conftest.py, and reads the
exit status the skip guard sets. Not a test module (never imported)."""

from types import SimpleNamespace

from conftest import pytest_runtest_logreport, pytest_sessionfinish

pytest_runtest_logreport  # noqa: B018
pytest_sessionfinish  # noqa: B018

_ = SimpleNamespace()
_.exitstatus  # noqa: B018 - pytest.Session.exitstatus, set by pytest_sessionfinish
