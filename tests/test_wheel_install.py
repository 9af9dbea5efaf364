"""Wheel-first install: build the wheel, install it into a fresh venv, run ccft from an empty folder.

The environment (offline, no registry): a venv made with ``--without-pip`` from the project venv's base
interpreter, whose ``_deps.pth`` puts the project venv's ``site-packages`` on ``sys.path`` *after* the
venv's own. Only plain path lines of a ``.pth`` are followed, not the ``.pth`` files inside the
folder it names, so the project's editable ccft (``__editable__.ccft-*.pth`` -> the checkout's
``src``) stays invisible: the one ccft importable there is the wheel's, installed ``--no-deps`` with
the project venv's pip (``pip --python VENV/bin/python``). Every command runs with ``PYTHONPATH``
removed, from an empty temporary folder, and the test checks that ``ccft`` and its data resolve
inside the new venv, not the checkout.

Then: ``ccft eval`` on one item of every registered task (base mode, the tiny random model),
``ccft bench decode`` on the tiny model, ``ccft report`` over the eval folder, ``ccft serve --help``; and,
as a new user would start (issue 54), ``ccft recipes cp demo .`` and ``ccft demo demo.yaml --dry-run`` in an
empty folder, on the packaged recipe and suite.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from conftest import make_tiny_folder

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=None):
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_data_dir_rule(monkeypatch, tmp_path):
    """One rule: CCFT_EVAL_DATA, then the deprecated CCFT_EVALS_DIR, then the package data folder."""
    from ccft.core.errors import DataError
    from ccft.evals.task_base import data_dir

    monkeypatch.delenv("CCFT_EVAL_DATA", raising=False)
    monkeypatch.delenv("CCFT_EVALS_DIR", raising=False)
    assert data_dir() == ROOT / "src" / "ccft" / "evals" / "data"
    assert (data_dir() / "gsm_plus" / "gsmplus_testmini.jsonl").is_file()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("CCFT_EVALS_DIR", str(tmp_path / "b"))
    assert data_dir() == tmp_path / "b"
    monkeypatch.setenv("CCFT_EVAL_DATA", str(tmp_path / "a"))
    assert data_dir() == tmp_path / "a"
    monkeypatch.setenv("CCFT_EVAL_DATA", str(tmp_path / "missing"))
    with pytest.raises(DataError, match=r"missing \(from \$CCFT_EVAL_DATA\) does not exist"):
        data_dir()


@pytest.fixture
def open_tmp():
    """A temporary folder other users can traverse: the code sandbox runs generated programs (and this
    venv's python) as an unprivileged uid when the evaluator is root, and pytest's own tmp_path
    (``/tmp/pytest-of-root``, mode 0700) would hide the venv from it."""
    path = Path(tempfile.mkdtemp(prefix="ccft-wheel-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel built from a copy of the sources (the checkout gets no build/ or egg-info)."""
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            dist,
            src,
        ],
        cwd=tmp_path,
        env=os.environ.copy(),
    )
    (wheel,) = dist.glob("ccft-*.whl")
    return wheel


def _install(tmp_path: Path, wheel: Path) -> tuple[Path, Path, dict]:
    """(venv python, its purelib, the environment to run it in): a fresh venv seeing the project venv's
    packages but not its editable ccft, with the wheel installed."""
    venv = tmp_path / "venv"
    _run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv],
        cwd=tmp_path,
        env=os.environ.copy(),
    )
    py = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    (purelib / "_deps.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(deps)))
    _run(
        [sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=tmp_path,
        env=os.environ.copy(),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, purelib, env


@pytest.mark.slow
def test_wheel_installs_and_runs_from_an_empty_folder(open_tmp, tokenizer):
    tmp_path = open_tmp
    # 1. Build from a copy of the sources.
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (
        "ccft/evals/data/README.md",
        "ccft/evals/data/gsm_plus/gsmplus_testmini.jsonl",
        "ccft/evals/data/gsm_plus/LICENSE-NOTE.txt",
        "ccft/evals/data/multipl_e_humaneval/LICENSE.MultiPL-E",
        "ccft/evals/data/humaneval/HumanEval.jsonl.gz",
        "ccft/evals/data/bfcl/BFCL_v4_multiple.json",
        "ccft/evals/data/mbxp/metadata.json",
        "ccft/bench/decode.py",
        "ccft/resources/gsm8k/test.jsonl",
    ):
        assert f in names, f
    # the packaged recipes and suites (ccft recipes list / cp): every file of src/ccft/recipes/
    shipped = sorted(
        p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src/ccft/recipes").rglob("*.yaml")
    )
    assert len(shipped) >= 13 and "ccft/recipes/evals/demo.yaml" in shipped
    assert [n for n in shipped if n not in names] == []

    # 2. A fresh venv seeing the project venv's packages but not its editable ccft; install the wheel.
    py, purelib, env = _install(tmp_path, wheel)
    venv = py.parent.parent
    work = tmp_path / "empty"
    work.mkdir()
    where = json.loads(
        _run(
            [
                py,
                "-c",
                "import json, ccft, ccft.evals.task_base as t; "
                "print(json.dumps([ccft.__file__, str(t.data_dir())]))",
            ],
            cwd=work,
            env=env,
        ).stdout
    )
    for p in where:
        assert Path(p).is_relative_to(purelib) and not Path(p).is_relative_to(ROOT), where

    # 3. Every task, one item, on the tiny model; bench; report; serve's parser.
    from ccft.evals.tasks import TASKS

    tiny = make_tiny_folder(tmp_path / "tiny", tokenizer)
    ccft_bin = venv / "bin" / "ccft"
    cmd = [
        ccft_bin,
        "eval",
        "--mode",
        "base",
        "--base",
        tiny,
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--bootstrap",
        "10",
        "--out",
        "eval",
    ]
    for task in TASKS:
        cmd += ["--task", task]
    _run(cmd, cwd=work, env=env)
    for task in TASKS:
        summary = json.loads((work / "eval" / task / "summary.json").read_text())
        assert summary["task"] == task and summary["modes"]["base"]["n"] == 1, task
    _run(
        [
            ccft_bin,
            "bench",
            "decode",
            "--model",
            tiny,
            "--batch-sizes",
            "1",
            "--new-tokens",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--out",
            "bench/decode.json",
        ],
        cwd=work,
        env=env,
    )
    bench = json.loads((work / "bench" / "decode.json").read_text())
    assert set(bench["batches"]) == {"1"}
    _run([ccft_bin, "report", "eval", "-o", "report"], cwd=work, env=env)
    report = json.loads((work / "report" / "report.json").read_text())
    assert len(report["tasks"]) == len(TASKS)
    assert _run([ccft_bin, "serve", "--help"], cwd=work, env=env).stdout.startswith("usage: ccft serve")
    assert sorted(p.name for p in work.iterdir()) == ["bench", "eval", "report"]


@pytest.mark.slow
def test_a_new_user_copies_the_demo_and_dry_runs_it_from_the_wheel(open_tmp):
    """Issue 54: from an installed wheel, in an empty folder, ``ccft recipes cp demo .`` then ``ccft demo
    demo.yaml --dry-run`` (the packaged recipe and its suite, the embedded base's tokenizer) succeed."""
    tmp_path = open_tmp
    py, purelib, env = _install(tmp_path, _build_wheel(tmp_path))
    ccft_bin = py.parent / "ccft"
    work = tmp_path / "empty"
    work.mkdir()
    listed = _run([ccft_bin, "recipes", "list"], cwd=work, env=env).stdout
    assert "  demo " in listed and "The main job at CPU scale" in listed
    out = _run([ccft_bin, "recipes", "cp", "demo", "."], cwd=work, env=env).stdout
    assert out.splitlines()[0] == "[ccft] copied demo: demo.yaml, evals/demo.yaml"
    packaged = purelib / "ccft" / "recipes"
    assert (work / "demo.yaml").read_bytes() == (packaged / "demo.yaml").read_bytes()
    assert (work / "demo.yaml").read_bytes() == (ROOT / "recipes" / "demo.yaml").read_bytes()
    assert (work / "evals" / "demo.yaml").read_bytes() == (packaged / "evals" / "demo.yaml").read_bytes()
    proc = subprocess.run(
        [ccft_bin, "recipes", "cp", "demo", "."], cwd=work, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "already exist(s); nothing copied (add --force" in proc.stderr
    out = _run([ccft_bin, "demo", "demo.yaml", "--dry-run"], cwd=work, env=env).stdout
    assert out.startswith("[ccft demo] recipe OK: base=smollm2-135m-instruct decoder=lora train rows=160/160")
    assert "eval task=gsm8k nll_rows=100 em_rows=50 modes=base,full-ft,naive,prefillshare" in out
    out = _run([ccft_bin, "train", "demo.yaml", "--dry-run"], cwd=work, env=env).stdout
    assert out.startswith(
        "[ccft] recipe OK: method=ccft decoder=lora base=smollm2-135m-instruct train rows=160"
    )
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == [
        "demo.yaml",
        "evals",
        "evals/demo.yaml",
    ]
    # and a tiny real demo from the copy: both decoders trained, four modes evaluated, the report written
    tiny = ["max_steps=2", "train_rows=8", "save_steps=2", "eval.nll_rows=4", "eval.em_rows=2"]
    tiny += ["eval.max_new_tokens=16", "eval.batch_size=4", "eval.bootstrap=50"]
    _run([ccft_bin, "demo", "demo.yaml", *tiny], cwd=work, env=env, timeout=1800)
    results = json.loads((work / "reports" / "demo" / "results.json").read_text())
    assert set(results["eval"]["modes"]) == {"base", "full-ft", "naive", "prefillshare"}
    assert (work / "runs" / "demo" / "ccft" / "ccft.json").is_file()
    assert (work / "reports" / "demo" / "README.md").is_file()
