"""The skip guard of tests/conftest.py (``CCFT_FORBID_SKIPS``): CI fails when a test group its machine can run
skipped, and says which tests and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import forbidden_skips, skip_group

ROOT = Path(__file__).resolve().parents[1]


def test_skip_reasons_map_to_their_groups():
    assert skip_group("no C++ compiler builds the block kernel here") == "kernel"
    assert skip_group("go unavailable here: go not found") == "toolchains"
    assert skip_group("BFCL checker env absent (python -m ccft.evals.bfcl setup)") == "toolchains"
    assert skip_group("no redis-server binary on this machine") == "redis"
    assert skip_group("needs a CUDA device") is None


def test_only_the_forbidden_groups_fail():
    skips = [
        ("a::k", "no C++ compiler: x"),
        ("b::go", "go unavailable here"),
        ("c::gpu", "needs a CUDA device"),
    ]
    assert forbidden_skips(skips, "kernel") == ["a::k: no C++ compiler: x"]
    assert forbidden_skips(skips, "kernel, toolchains") == [
        "a::k: no C++ compiler: x",
        "b::go: go unavailable here",
    ]
    assert forbidden_skips(skips, "") == []
    with pytest.raises(ValueError, match="unknown group"):
        forbidden_skips(skips, "kernels")


def _run(tmp_path, forbid: str | None) -> subprocess.CompletedProcess:
    test = tmp_path / "test_probe.py"
    test.write_text(
        "import pytest\n"
        "def test_kernel():\n    pytest.skip('no C++ compiler builds the block kernel here')\n"
        "def test_ok():\n    assert True\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CCFT_FORBID_SKIPS"}
    if forbid is not None:
        env["CCFT_FORBID_SKIPS"] = forbid
    # the probe runs under the project's conftest (rootdir tests/), as `make test` does
    probe = ROOT / "tests" / f"_probe_{os.getpid()}_{tmp_path.name}.py"
    probe.write_text(test.read_text())
    try:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:randomly",
                "-p",
                "no:cacheprovider",
                str(probe),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        probe.unlink()


def test_a_forbidden_skip_fails_the_run_and_names_the_test(tmp_path):
    out = _run(tmp_path, "kernel")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 test(s) skipped that this machine should run" in out.stdout
    assert "test_kernel: no C++ compiler builds the block kernel here" in out.stdout
    assert "1 passed, 1 skipped" in out.stdout


def test_an_allowed_skip_passes(tmp_path):
    out = _run(tmp_path, "toolchains")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SKIPPED" in out.stdout  # -rs: the reason is printed
    assert _run(tmp_path, None).returncode == 0
