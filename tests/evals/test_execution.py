"""K8: per-language availability, hand-written fixtures, MBXP canonical solutions, no doubled stop token."""

from __future__ import annotations

import sys

import pytest

from ccft.evals import execution
from ccft.evals.execution import LANGUAGES, check_language, run_program
from ccft.evals.multipl_e import (
    FIXTURE_PROBLEM,
    FIXTURES,
    MBXP_FILES,
    MULTIPL_E_LANGUAGES,
    mbxp_canonical_jobs,
)
from ccft.evals.tasks import get_task


def test_every_multipl_e_language_has_a_toolchain_and_fixtures():
    assert set(MULTIPL_E_LANGUAGES) <= set(LANGUAGES)
    assert set(FIXTURES) == set(MULTIPL_E_LANGUAGES)


def test_runtimes_with_thread_pools_get_more_processes():
    """Declared per language: JVM, Go and Node (js, ts) run with 256 processes, the rest with 64."""
    assert {n for n, lang in LANGUAGES.items() if lang.max_procs == 256} == {"java", "go", "js", "ts"}
    assert {lang.max_procs for lang in LANGUAGES.values()} == {64, 256}
    node = [LANGUAGES["js"], LANGUAGES["ts"]]
    assert all(lang.memory_kind == "data" and "NODE_PATH" in lang.env for lang in node)


@pytest.mark.parametrize("lang", MULTIPL_E_LANGUAGES)
def test_availability_is_reported_never_silent(lang):
    av = check_language(lang)
    assert av.language == lang
    if av.available:
        assert av.version and av.reason == ""
    else:
        assert av.reason  # says what is missing


@pytest.mark.parametrize("lang", MULTIPL_E_LANGUAGES)
def test_fixtures_pass_and_fail_as_written(lang):
    """Correct add() passes, wrong add() fails, raw generation with the stop string passes after
    truncation."""
    if not check_language(lang).available:
        pytest.skip(f"{lang} unavailable here: {check_language(lang).reason}")
    task = get_task(f"multipl-e-{lang}")
    item = next(it for it in task.load() if it.id == FIXTURE_PROBLEM)
    good, bad, raw = FIXTURES[lang]
    assert [s["passed"] for s in task.score_many([(item, good), (item, bad), (item, raw)], workers=3)] == [
        1.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize("lang", ["cpp", "rs", "sh", "java"])
def test_stop_token_is_not_appended_twice_for_brace_languages(lang):
    task = get_task(f"multipl-e-{lang}")
    item = next(it for it in task.load() if it.id == FIXTURE_PROBLEM)
    stop = item.metadata["stop"][0]
    raw = FIXTURES[lang][2]
    assert stop in raw
    completion = task.postprocess(item, raw)
    assert stop not in completion and completion == raw[: raw.index(stop)]
    program, _ = task.build_program(item, completion)
    assert program == item.prompt + completion + "\n" + item.metadata["tests"]
    # the closing brace comes from the tests, once: braces balance in the assembled program
    assert program.count("{") == program.count("}")


@pytest.mark.parametrize("lang", sorted(MBXP_FILES))
def test_mbxp_canonical_solutions_pass_here(lang):
    if not check_language(lang).available:
        pytest.skip(f"{lang} unavailable here")
    jobs = mbxp_canonical_jobs(lang, limit=2)
    assert len(jobs) == 2
    results = execution.run_programs([kw for _, kw in jobs], workers=2)
    assert [r.status for r in results] == ["passed", "passed"], [r.detail for r in results]


def test_missing_toolchain_is_unavailable_not_zero(monkeypatch):
    fake = execution.Language("cobol", "COBOL", "main.cob", ("cobc-not-installed",), ("./main",), "")
    monkeypatch.setitem(execution.LANGUAGES, "cobol", fake)
    av = check_language("cobol", refresh=True)
    assert not av.available and "cobc-not-installed" in av.reason
    res = run_program("cobol", "IDENTIFICATION DIVISION.")
    assert res.status == "unavailable" and not res.passed

    item = get_task("multipl-e-cpp").load(1)[0]
    task = get_task("multipl-e-cpp", language="cobol")
    scores = task.score_many([(item, "x")])
    assert scores == [{"available": 0.0}]
    agg = task.aggregate({item.id: scores})
    assert "pass@1" not in agg and agg["unavailable_items"] == 1.0
    report = task.check_environment()
    assert report["available"] is False and report["ok"] is True and "cobc-not-installed" in report["reason"]


@pytest.fixture
def real_toolchain_hidden(monkeypatch, tmp_path):
    """An installed toolchain (g++ or rustc) hidden from PATH: PATH holds only this interpreter. The cached
    availability is refreshed on both sides, so later tests see the real machine again."""
    import os
    import shutil

    lang = next((name for name in ("cpp", "rs") if check_language(name).available), None)
    if lang is None:
        pytest.skip("neither g++ nor rustc is installed here (make toolchains)")
    tools = LANGUAGES[lang].tools
    assert all(shutil.which(t) for t in tools)
    (tmp_path / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not any(shutil.which(t) for t in tools)
    yield lang, tools
    monkeypatch.undo()
    assert check_language(lang, refresh=True).available and os.environ["PATH"] != str(tmp_path)


def test_real_toolchain_hidden_from_path_is_unavailable_not_zero(real_toolchain_hidden):
    """The "missing toolchain" promise with a real compiler (not a fake language): reported as unavailable
    with the missing tool named, never scored 0."""
    lang, tools = real_toolchain_hidden
    av = check_language(lang, refresh=True)
    assert not av.available and all(t in av.reason for t in tools), av.reason
    res = run_program(lang, "int main() { return 0; }" if lang == "cpp" else "fn main() {}")
    assert res.status == "unavailable" and not res.passed
    task = get_task(f"multipl-e-{lang}")
    item = next(it for it in task.load() if it.id == FIXTURE_PROBLEM)
    good = FIXTURES[lang][0]
    assert task.score_many([(item, good)]) == [{"available": 0.0}]
    agg = task.aggregate({item.id: [{"available": 0.0}]})
    assert "pass@1" not in agg and agg["unavailable_items"] == 1.0


def test_compile_error_and_runtime_error_statuses():
    if not check_language("cpp").available:
        pytest.skip("g++ unavailable")
    assert run_program("cpp", "int main() { return }").status == "compile_error"
    assert run_program("cpp", "#include <cstdlib>\nint main() { abort(); }").status == "failed"
    assert run_program("cpp", "int main() { return 0; }").status == "passed"


def test_perl_error_marker_fails_even_with_exit_zero():
    if not check_language("pl").available:
        pytest.skip("perl unavailable")
    assert run_program("pl", 'print "ERROR: boom\\n"; exit 0;').status == "failed"
    assert run_program("pl", 'print "ok\\n"; exit 0;').status == "passed"


# ----------------------------------------------------------------- no isolation: refuse unless opted in (K10)


def test_no_isolation_refuses_generated_code_unless_opted_in(monkeypatch):
    """Where neither namespaces nor user namespaces work, running generated code needs an explicit opt-in
    (like HF_ALLOW_CODE_EVAL); the error names the variable, and the result says the level it ran under."""
    from ccft.evals import sandbox

    monkeypatch.setattr(sandbox, "_probe", lambda level: False)  # a machine without namespaces
    monkeypatch.setattr(sandbox, "_ISOLATION_CACHE", None)
    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    monkeypatch.delenv(sandbox.LEVEL_ENV, raising=False)
    info = sandbox.isolation()
    assert (info["level"], info["runs_code"]) == ("basic", False) and sandbox.ALLOW_ENV in str(info["note"])
    with pytest.raises(sandbox.SandboxUnavailableError, match=sandbox.ALLOW_ENV):
        run_program("python", "print(6 * 7)", check=False)
    with pytest.raises(sandbox.SandboxUnavailableError, match=sandbox.ALLOW_ENV):
        sandbox.run_once({"main.sh": "echo hi"}, ["bash", "main.sh"])

    for var, value in ((sandbox.ALLOW_ENV, "1"), (sandbox.LEVEL_ENV, "basic")):
        monkeypatch.setenv(var, value)
        info = sandbox.isolation(refresh=True)
        assert (info["level"], info["runs_code"]) == ("basic", True)
        res = run_program("python", "print(6 * 7)", check=False)
        assert (res.status, res.stdout.strip()) == ("passed", "42")
        assert sandbox.run_once({"main.py": "pass"}, [sys.executable, "main.py"]).isolation == "basic"
        monkeypatch.delenv(var)


def test_results_name_the_level_they_ran_under():
    """RunResult.isolation and Availability.isolation are the machine's level (namespaces as root, else
    userns)."""
    from ccft.evals import sandbox

    info = sandbox.isolation()
    if not info["runs_code"]:
        pytest.skip(f"no isolation here and no opt-in: {info['note']}")
    res = sandbox.run_once({"main.py": "pass"}, [sys.executable, "main.py"])
    assert res.isolation == info["level"] == check_language("python").isolation
    assert info["level"] in ("namespaces", "userns", "basic")


def test_forced_level_is_probed_and_named(monkeypatch):
    """CCFT_SANDBOX_LEVEL names the one level to try; a level that does not work here is a refusal, not
    basic."""
    from ccft.evals import sandbox

    monkeypatch.setattr(sandbox, "_ISOLATION_CACHE", None)
    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    monkeypatch.setenv(sandbox.LEVEL_ENV, "chroot")
    with pytest.raises(ValueError, match="namespaces, userns, bwrap, basic"):
        sandbox.isolation(refresh=True)
    tried = []
    monkeypatch.setattr(sandbox, "_probe", lambda level: tried.append(level) or False)
    monkeypatch.setenv(sandbox.LEVEL_ENV, "bwrap")
    info = sandbox.isolation(refresh=True)
    assert tried == ["bwrap"] and (info["level"], info["runs_code"]) == ("basic", False)
    with pytest.raises(sandbox.SandboxUnavailableError, match="tried: bwrap"):
        sandbox.Sandbox()
