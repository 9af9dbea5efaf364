"""ccft.bench.provenance: the commit, dirty tree, CPU, load and settings every benchmark JSON records, and the
refusal to resume a JSON written by other code (issue 53)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import types
from datetime import datetime
from pathlib import Path

import pytest

from ccft.bench import provenance
from ccft.bench.provenance import ProvenanceMismatch, check_resume, collect, settings_of

ROOT = Path(__file__).resolve().parents[2]
#: the test's own git, isolated from the user's and the system's config and from a hook's GIT_DIR
GIT_ENV = {
    **{k: v for k, v in os.environ.items() if k not in provenance.GIT_LOCATION_VARS},
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}
IDENTITY = ["-c", "user.email=bench@example.com", "-c", "user.name=bench", "-c", "commit.gpgsign=false"]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *IDENTITY, *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository with one committed file, ``a.txt``."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "-c", "init.defaultBranch=main", "init", "-q")
    (r / "a.txt").write_text("one\n")
    git(r, "add", "a.txt")
    git(r, "commit", "-q", "-m", "first")
    return r


def test_the_checkout_records_its_head_and_the_machine():
    head = subprocess.run(
        ["git", "-c", f"safe.directory={ROOT}", "rev-parse", "HEAD"],
        cwd=ROOT,
        env=GIT_ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    p = collect({"repeats": 3})
    assert p["git_commit"] == head and len(head) == 40
    assert p["source"] == "checkout"
    assert isinstance(p["git_dirty"], bool)
    assert (p["git_diff_sha256"] is not None) == p["git_dirty"]
    assert p["started_utc"].endswith("Z")
    started = datetime.fromisoformat(p["started_utc"].replace("Z", "+00:00"))
    assert abs((datetime.now(started.tzinfo) - started).total_seconds()) < 60
    assert p["cpus"] == os.cpu_count()
    assert f"{os.cpu_count()} logical cores" in p["hardware"]
    assert p["load_average_1m"] == pytest.approx(os.getloadavg()[0], abs=5)
    assert p["python"] == ".".join(map(str, sys.version_info[:3]))
    import torch

    import ccft

    assert p["torch"] == str(torch.__version__) and p["ccft"] == ccft.__version__
    assert p["argv"] == sys.argv and p["settings"] == {"repeats": 3}
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()  # x86 Linux: "model name" and "flags"
    model = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    flags = [set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith(("flags", "Features"))]
    assert p["cpu_model"] == (model[0] if model else (platform.processor() or None))
    if model:
        assert p["hardware"].startswith(p["cpu_model"])
    assert p["isa"] and set(p["isa"]) <= flags[0]  # x86: the vector extensions of blocks.ISA_MACROS it has
    assert ("avx2" in p["isa"]) == ("avx2" in flags[0])
    assert json.loads(json.dumps(p)) == p


def test_a_repository_clean_dirty_and_untracked(repo):
    head = git(repo, "rev-parse", "HEAD")
    p = collect(root=repo)
    assert (p["source"], p["git_commit"], p["git_dirty"], p["git_diff_sha256"]) == (
        "checkout",
        head,
        False,
        None,
    )

    (repo / "new.txt").write_text("untracked\n")  # untracked files do not count
    assert collect(root=repo)["git_dirty"] is False

    (repo / "a.txt").write_text("two\n")
    dirty = collect(root=repo)
    assert dirty["git_commit"] == head and dirty["git_dirty"] is True
    diff = subprocess.run(
        ["git", "diff", "HEAD", "--binary"], cwd=repo, env=GIT_ENV, capture_output=True
    ).stdout
    import hashlib

    assert dirty["git_diff_sha256"] == hashlib.sha256(diff).hexdigest()
    (repo / "a.txt").write_text("three\n")
    assert collect(root=repo)["git_diff_sha256"] not in (None, dirty["git_diff_sha256"])

    sub = repo / "deep" / "er"  # a folder inside the checkout describes the checkout
    sub.mkdir(parents=True)
    assert collect(root=sub)["git_commit"] == head


def test_outside_any_checkout_and_without_git(tmp_path, monkeypatch):
    p = collect({"x": 1}, root=tmp_path)
    assert (p["source"], p["git_commit"], p["git_dirty"], p["git_diff_sha256"]) == (
        "installed",
        None,
        None,
        None,
    )
    assert p["settings"] == {"x": 1}

    (
        tmp_path / ".git"
    ).mkdir()  # looks like a checkout, but git cannot read it (or is missing): None, no error
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    p = collect(root=tmp_path)
    assert (p["source"], p["git_commit"], p["git_dirty"]) == ("checkout", None, None)


def test_an_installed_wheel_inside_a_checkout_is_installed(repo, monkeypatch):
    import ccft

    site = repo / ".venv" / "site-packages" / "ccft"  # not a tracked file of the checkout around it
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setattr(ccft, "__file__", str(site / "__init__.py"))
    p = collect()
    assert (p["source"], p["git_commit"]) == ("installed", None)


def test_settings_of_drops_the_wiring():
    ns = argparse.Namespace(
        out=Path("/tmp/x.json"),
        batch_sizes=(1, 16),
        func=print,
        bench_module="ccft.bench.decode",
        _private=1,
        mod=types,
        benchmark="decode",
        plots=None,
    )
    got = settings_of(ns)
    assert got == {"out": "/tmp/x.json", "batch_sizes": [1, 16], "benchmark": "decode", "plots": None}
    assert settings_of({"a": {Path("p"): {3, 1}}, "f": len}) == {"a": {"p": [1, 3]}}


def test_the_real_parser_gives_settings():
    from ccft.cli.main import build_parser

    args = build_parser().parse_args(["bench", "decode", "--batch-sizes", "1", "4", "--out", "o.json"])
    got = settings_of(args)
    assert got["batch_sizes"] == [1, 4] and got["out"] == "o.json" and got["benchmark"] == "decode"
    assert "func" not in got and "bench_module" not in got
    json.dumps(got)


def test_check_resume(repo):
    clean = collect(root=repo)
    check_resume(clean, dict(clean), path="r.json")  # same commit, both clean

    (repo / "a.txt").write_text("two\n")
    dirty = collect(root=repo)
    check_resume(dirty, collect(root=repo))  # same uncommitted changes
    with pytest.raises(ProvenanceMismatch, match="uncommitted changes") as e:
        check_resume(clean, dirty, path="r.json")
    assert "r.json" in str(e.value) and "pass a new --out" in str(e.value)
    with pytest.raises(ProvenanceMismatch, match="other uncommitted changes"):
        (repo / "a.txt").write_text("three\n")
        check_resume(dirty, collect(root=repo))

    git(repo, "commit", "-q", "-am", "second")
    later = collect(root=repo)
    assert later["git_commit"] != clean["git_commit"] and later["git_dirty"] is False
    with pytest.raises(ProvenanceMismatch) as e:
        check_resume(clean, later, path="benchmarks/results/x.json")
    msg = str(e.value)
    assert "benchmarks/results/x.json" in msg
    assert clean["git_commit"][:12] in msg and later["git_commit"][:12] in msg
    assert "pass a new --out, or rerun from the commit that wrote it" in msg
    assert isinstance(e.value, ValueError)


def test_check_resume_refuses_a_file_without_provenance(repo):
    current = collect(root=repo)
    for saved in (None, {}, {"settings": {}}):
        with pytest.raises(ProvenanceMismatch, match="records no provenance") as e:
            check_resume(saved, current, path="old.json")
        assert "old.json" in str(e.value) and "--out" in str(e.value)
        assert current["git_commit"][:12] in str(e.value)


def test_check_resume_without_commits_compares_versions(tmp_path):
    wheel = collect(root=tmp_path)
    check_resume(wheel, dict(wheel))
    with pytest.raises(ProvenanceMismatch, match="another ccft version"):
        check_resume({**wheel, "ccft": "0.0.1"}, wheel)
    with pytest.raises(ProvenanceMismatch, match="another commit"):
        check_resume(wheel, {**wheel, "git_commit": "a" * 40})


def fake_bench(monkeypatch, result: dict):
    """A ``ccft bench`` module whose run returns ``result`` and whose report writes it to ``out``."""
    from ccft.core.io import atomic_write_json

    mod = types.ModuleType("fake_bench_for_provenance")
    mod.run = lambda args: result
    mod.report = lambda res, out: atomic_write_json(out, res) and 0
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_the_cli_writes_provenance_to_out(tmp_path, monkeypatch):
    from ccft.cli import bench

    fake_bench(monkeypatch, {"speedup": 2.0})
    out = tmp_path / "r.json"
    args = argparse.Namespace(
        command="bench",
        benchmark="fake",
        func=bench.run,
        bench_module="fake_bench_for_provenance",
        repeats=3,
        model=tmp_path / "m",
        out=str(out),
    )
    assert bench.run(args) == 0
    written = json.loads(out.read_text())
    assert written["speedup"] == 2.0
    p = written["provenance"]
    assert p["settings"] == {
        "command": "bench",
        "benchmark": "fake",
        "repeats": 3,
        "model": str(tmp_path / "m"),
        "out": str(out),
    }
    assert p["git_commit"] == collect()["git_commit"] and p["git_commit"] is not None
    assert p["started_utc"].endswith("Z") and p["cpus"] == os.cpu_count()


def test_the_cli_keeps_a_resumed_runs_provenance(tmp_path, monkeypatch):
    from ccft.cli import bench

    fake_bench(monkeypatch, {"provenance": {"git_commit": "b" * 40, "settings": {"kept": True}}})
    out = tmp_path / "r.json"
    args = argparse.Namespace(bench_module="fake_bench_for_provenance", out=str(out))
    bench.run(args)
    assert json.loads(out.read_text())["provenance"] == {"git_commit": "b" * 40, "settings": {"kept": True}}


@pytest.mark.parametrize("name", ["decode", "serve", "soak", "train"])
def test_python_m_bench_records_provenance(name, monkeypatch):
    """``python -m ccft.bench.X`` (and ``python -m benchmarks.X``) record it as ``ccft bench X`` does."""
    import importlib

    mod = importlib.import_module(f"ccft.bench.{name}")
    seen = {}
    monkeypatch.setattr(mod, "run", lambda args: {"ran": True})
    monkeypatch.setattr(mod, "report", lambda result, out: seen.update(result=result, out=out) or 0)
    assert mod.main(["--out", "x.json"]) == 0
    assert seen["out"] == "x.json" and seen["result"]["ran"] is True
    assert seen["result"]["provenance"]["settings"]["out"] == "x.json"
    assert seen["result"]["provenance"]["git_commit"] == collect()["git_commit"]
