"""Every ``python -m ccft...`` entry point answers ``--help`` with exit status 0 (K12: every entry point).

The modules are found, not listed: any module of the package with an ``if __name__ == "__main__":`` block.
Each ``ccft`` subcommand's ``--help`` is checked in-process through the real parser.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def entry_modules() -> list[str]:
    found = []
    for path in sorted((SRC / "ccft").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if 'if __name__ == "__main__":' in text or "if __name__ == '__main__':" in text:
            rel = path.relative_to(SRC).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__main__":
                parts = parts[:-1]
            found.append(".".join(parts))
    return found


def test_entry_points_are_found():
    mods = entry_modules()
    assert "ccft.cli.main" in mods and "ccft.evals.bfcl" in mods


@pytest.mark.parametrize("args", [["--help"], ["setup", "--help"]], ids=["top", "setup"])
def test_bfcl_setup_help_is_help_not_a_folder(args, tmp_path):
    """``python -m ccft.evals.bfcl setup --help`` used to create a virtual environment named ``--help``."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run(
        [sys.executable, "-m", "ccft.evals.bfcl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m ccft.evals.bfcl") and not list(tmp_path.iterdir())


@pytest.mark.parametrize("module", entry_modules())
def test_module_help_exits_0(module, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # --help writes nothing


def test_every_ccft_subcommand_has_help(capsys):
    from ccft.cli.main import build_parser, main

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001 - argparse API
    assert {
        "train",
        "eval",
        "precompute",
        "demo",
        "study",
        "sweep",
        "report",
        "serve",
        "bench",
        "export",
    } <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0, name
        assert capsys.readouterr().out.startswith(f"usage: ccft {name}")
