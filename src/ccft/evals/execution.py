"""Language toolchains: how a program in each language is built and run in the sandbox, and whether it can be.

One :class:`Language` per language of HumanEval / MultiPL-E / MBXP: the source file name, the
compile and run commands (``{python}``, ``{javatuples}``, ``{rustc}`` are resolved on this machine),
extra environment, memory-limit kind, and a *probe* program that uses the language's test
dependencies (javatuples, luaunit, Test::Deep, test/unit, lodash, ...). A language is
**available** only when its tools are on ``PATH`` and its probe passes inside the sandbox — the
exact environment the generated programs get (docs/design.md K8: a missing toolchain or test library is
reported as unavailable, never scored as 0).

Verdicts follow MultiPL-E's evaluators (exit status 0 = pass; a compile step that fails is
``compile_error``; Perl fails on ``ERROR`` in its output; ``go test`` fails on ``FAIL``).

Usage::

    check_language("cpp")          # Availability(available=True, version="g++ ... 12.2.0", reason="")
    availability_table()           # every language, for reports
    run_program("cpp", source)     # ExecResult(passed=..., status=..., detail=...)
    run_programs([("cpp", src1), ("java", src2)], workers=2)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ccft.evals.sandbox import Limits, RunResult, Sandbox, isolation

__all__ = [
    "LANGUAGES",
    "Availability",
    "ExecResult",
    "Language",
    "availability_table",
    "check_language",
    "run_program",
    "run_programs",
]


@dataclass(frozen=True)
class Language:
    """How to build and run one language.

    ``compile`` and ``run`` are argv templates; placeholders: ``{src}`` (source file name),
    ``{python}`` (this interpreter), ``{javatuples}``, ``{rustc}``, ``{main}`` (Java main class).
    """

    name: str
    display: str
    filename: str
    tools: tuple[str, ...]
    run: tuple[str, ...]
    probe: str
    deps: str = ""
    compile: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    memory_kind: str = "as"
    memory_mb: int = 1024
    compile_memory_mb: int = 2048
    compile_timeout_s: float = 60.0
    max_procs: int = (
        64  # processes/threads of the run step (RLIMIT_NPROC); runtimes with thread pools need more
    )
    fail_markers: tuple[str, ...] = ()  # a run whose stdout/stderr contains one of these fails
    version_cmd: tuple[str, ...] = ()


def _javatuples() -> str:
    for p in (
        os.environ.get("CCFT_JAVATUPLES_JAR", ""),
        "/usr/share/java/javatuples.jar",
        "/usr/multiple/javatuples-1.2.jar",
    ):
        if p and os.path.isfile(p):
            return p
    return ""


def _rustc() -> str:
    """The real rustc of the default toolchain (not the rustup proxy, which needs HOME)."""
    exe = shutil.which("rustc")
    if exe is None:
        return ""
    try:
        root = subprocess.run(
            [exe, "--print", "sysroot"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return exe
    real = os.path.join(root, "bin", "rustc")
    return real if os.path.isfile(real) else exe


#: Node.js runtimes (js, ts): where Debian and npm put global modules (lodash for MBXP); V8 reserves
#: far more address space than it uses, so its memory limit is on the data segment; its thread pool
#: needs more than the default process limit.
_NODE = {
    "env": {"NODE_PATH": "/usr/share/nodejs:/usr/lib/node_modules:/usr/local/lib/node_modules"},
    "memory_kind": "data",
    "memory_mb": 2048,
    "max_procs": 256,
}

LANGUAGES: dict[str, Language] = {
    "python": Language(
        "python",
        "Python",
        "main.py",
        (),
        ("{python}", "{src}"),
        "assert sum([1, 2]) == 3\n",
        version_cmd=("{python}", "--version"),
    ),
    "cpp": Language(
        "cpp",
        "C++",
        "main.cpp",
        ("g++",),
        ("./main",),
        "#include<assert.h>\n#include<bits/stdc++.h>\nint main() { std::vector<long> v{1, 2}; "
        "assert(v.size() == 2); }\n",
        compile=("g++", "-std=c++17", "-O0", "-o", "main", "{src}"),
        version_cmd=("g++", "--version"),
    ),
    "java": Language(
        "java",
        "Java",
        "Problem.java",
        ("javac", "java"),
        ("java", "-ea", "-cp", ".:{javatuples}", "{main}"),
        "import org.javatuples.*;\nclass Problem {\n    public static void main(String[] args) {\n"
        "        Pair<Long, Long> p = Pair.with(1l, 2l);\n        assert(p.getValue0() == 1l);\n    }\n}\n",
        deps="org.javatuples (Debian libjavatuples-java)",
        compile=("javac", "-J-Xmx512m", "-encoding", "UTF8", "-cp", "{javatuples}", "-d", ".", "{src}"),
        env={"JAVA_TOOL_OPTIONS": "-Xmx512m -XX:-UsePerfData -Xss8m"},
        memory_kind="data",
        memory_mb=2048,
        compile_memory_mb=3072,
        max_procs=256,
        version_cmd=("java", "-version"),
    ),
    "js": Language(
        "js",
        "JavaScript",
        "main.js",
        ("node",),
        ("node", "{src}"),
        "const assert = require('node:assert');\nconst _ = require('lodash');\n"
        "assert.deepEqual(_.isEqual([1], [1]), true);\n",
        deps="lodash for MBXP tests (Debian node-lodash)",
        version_cmd=("node", "--version"),
        **_NODE,
    ),
    "ts": Language(
        "ts",
        "TypeScript",
        "main.ts",
        ("tsc", "node"),
        ("node", "main.js"),
        "declare var require: any;\nconst assert = require('node:assert');\n"
        "assert.deepEqual([1, 2].length, 2);\n",
        deps="tsc (Debian node-typescript)",
        compile=("tsc", "--target", "esnext", "--lib", "esnext", "{src}"),
        compile_memory_mb=3072,
        version_cmd=("tsc", "--version"),
        **_NODE,
    ),
    "go": Language(
        "go",
        "Go",
        "main_test.go",
        ("go",),
        ("go", "test", "{src}"),
        'package probe_test\n\nimport "testing"\n\nfunc TestProbe(t *testing.T) {\n\tif 1+1 != 2 {\n'
        '\t\tt.Errorf("x")\n\t}\n}\n',
        env={
            "GOCACHE": "{workdir}/.gocache",
            "GOPATH": "{workdir}/go",
            "GOPROXY": "off",
            "GOFLAGS": "-mod=mod",
            "GOTELEMETRY": "off",
            "CGO_ENABLED": "0",
        },
        memory_kind="data",
        memory_mb=2048,
        max_procs=256,
        fail_markers=("FAIL",),
        version_cmd=("go", "version"),
    ),
    "rs": Language(
        "rs",
        "Rust",
        "main.rs",
        ("rustc",),
        ("./main",),
        "fn main() {\n    let v: Vec<isize> = vec![1, 2];\n    assert_eq!(v.len(), 2);\n}\n",
        compile=("{rustc}", "--edition", "2021", "-o", "main", "{src}"),
        version_cmd=("{rustc}", "--version"),
    ),
    "php": Language(
        "php",
        "PHP",
        "main.php",
        ("php",),
        ("php", "{src}"),
        '<?php\nfunction f($x) { return $x + 1; }\nif (f(1) !== 2) { throw new Exception("x"); }\n',
        version_cmd=("php", "--version"),
    ),
    "rb": Language(
        "rb",
        "Ruby",
        "main.rb",
        ("ruby",),
        ("ruby", "{src}"),
        "require 'test/unit'\nclass TestProbe < Test::Unit::TestCase\n  def test_probe\n    assert_equal(2, "
        "1 + 1)\n  end\nend\n",
        deps="test/unit (Debian ruby-test-unit)",
        version_cmd=("ruby", "--version"),
    ),
    "pl": Language(
        "pl",
        "Perl",
        "main.pl",
        ("perl",),
        ("perl", "{src}"),
        "use Test::Deep;\nuse Data::Compare;\nexit(eq_deeply([1, 2], [1, 2]) && Compare(1, 1) ? 0 : 1);\n",
        deps="Test::Deep (libtest-deep-perl); Data::Compare for MBXP (libdata-compare-perl)",
        fail_markers=("ERROR",),
        version_cmd=("perl", "-e", "print $^V"),
    ),
    "lua": Language(
        "lua",
        "Lua",
        "main.lua",
        ("lua",),
        ("lua", "{src}"),
        "lu = require('luaunit')\nfunction test_probe()\n    lu.assertEquals(1 + 1, 2)\nend\n"
        "os.exit(lu.LuaUnit.run())\n",
        deps="luaunit (Debian lua-unit)",
        version_cmd=("lua", "-v"),
    ),
    "r": Language(
        "r",
        "R",
        "main.r",
        ("Rscript",),
        ("Rscript", "{src}"),
        "stopifnot(isTRUE(all.equal(1 + 1, 2)))\n",
        version_cmd=("Rscript", "--version"),
    ),
    "sh": Language(
        "sh",
        "Bash",
        "main.sh",
        ("bash",),
        ("bash", "{src}"),
        'set -e\n[[ $((1 + 1)) = "2" ]]\n',
        version_cmd=("bash", "--version"),
    ),
}

#: MultiPL-E / MBXP language names -> ours.
ALIASES = {
    "py": "python",
    "c++": "cpp",
    "javascript": "js",
    "typescript": "ts",
    "go_test.go": "go",
    "rust": "rs",
    "ruby": "rb",
    "perl": "pl",
    "bash": "sh",
}


def language(name: str) -> Language:
    """The :class:`Language` for a name or alias; ValueError naming the known ones."""
    key = ALIASES.get(name, name)
    if key not in LANGUAGES:
        raise ValueError(f"unknown language {name!r}; known: {', '.join(LANGUAGES)}")
    return LANGUAGES[key]


@dataclass
class ExecResult:
    """Verdict on one program: ``passed`` and a ``status`` among ``passed``, ``failed``,
    ``compile_error``, ``timeout``, ``output_limit``, ``unavailable``; ``detail`` is the output tail."""

    passed: bool
    status: str
    detail: str = ""
    language: str = ""
    steps: list[dict] = field(default_factory=list)
    stdout: str = ""  # last 4,000 characters of the run step's stdout

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "status": self.status,
            "detail": self.detail,
            "language": self.language,
        }


@dataclass(frozen=True)
class Availability:
    language: str
    available: bool
    version: str = ""
    reason: str = ""
    isolation: str = ""

    def to_dict(self) -> dict:
        return {
            "language": self.language,
            "available": self.available,
            "version": self.version,
            "reason": self.reason,
            "isolation": self.isolation,
        }


def _fill(template: tuple[str, ...], subs: dict[str, str]) -> list[str]:
    return [t.format(**subs) for t in template]


def _subs(lang: Language, workdir: str = "", main: str = "Problem") -> dict[str, str]:
    return {
        "src": lang.filename,
        "python": sys.executable,
        "javatuples": _javatuples(),
        "rustc": _rustc(),
        "main": main,
        "workdir": workdir,
    }


def _verdict(lang: Language, res: RunResult) -> str:
    if res.timed_out:
        return "timeout"
    if res.output_truncated:
        return "output_limit"
    if res.returncode != 0:
        return "failed"
    if any(m in res.stdout or m in res.stderr for m in lang.fail_markers):
        return "failed"
    return "passed"


def _expose(lang: Language) -> list[str]:
    if lang.name == "rs":
        rustc = _rustc()
        return [os.path.dirname(os.path.dirname(rustc))] if rustc else []
    return []


def run_program(
    lang_name: str,
    source: str,
    *,
    timeout_s: float = 10.0,
    main_class: str = "Problem",
    extra_files: dict[str, str | bytes] | None = None,
    check: bool = True,
) -> ExecResult:
    """Compile (if the language has a compile step) and run ``source`` in a fresh sandbox.

    ``timeout_s`` bounds the run step; compile steps get ``Language.compile_timeout_s``. With
    ``check`` (default) an unavailable language returns status ``unavailable`` without running.
    Never raises for a failing program; raises :class:`ccft.evals.sandbox.SandboxUnavailableError`
    when this machine gives no isolation and the user did not opt in (docs/design.md K10,
    docs/sandbox.md).
    """
    lang = language(lang_name)
    if check:
        av = check_language(lang.name)
        if not av.available:
            return ExecResult(False, "unavailable", av.reason, lang.name)
    steps: list[dict] = []
    with Sandbox(expose=_expose(lang)) as sb:
        sb.write(lang.filename, source)
        for name, content in (extra_files or {}).items():
            sb.write(name, content)
        subs = _subs(lang, str(sb.path), main_class)
        env = {k: v.format(**subs) for k, v in lang.env.items()}
        if lang.compile is not None:
            lim = Limits(
                timeout_s=lang.compile_timeout_s,
                memory_mb=lang.compile_memory_mb,
                memory_kind=lang.memory_kind,
                max_procs=256,
            )
            res = sb.run(_fill(lang.compile, subs), limits=lim, env=env)
            steps.append({"step": "compile", "status": res.status, "returncode": res.returncode})
            if not res.ok:
                status = "timeout" if res.timed_out else "compile_error"
                return ExecResult(False, status, res.tail(), lang.name, steps)
        lim = Limits(
            timeout_s=timeout_s,
            memory_mb=lang.memory_mb,
            memory_kind=lang.memory_kind,
            max_procs=lang.max_procs,
        )
        res = sb.run(_fill(lang.run, subs), limits=lim, env=env)
        steps.append({"step": "run", "status": res.status, "returncode": res.returncode})
        verdict = _verdict(lang, res)
        return ExecResult(verdict == "passed", verdict, res.tail(), lang.name, steps, res.stdout[-4000:])


def run_programs(
    jobs: list[tuple[str, str]] | list[dict], *, workers: int | None = None, timeout_s: float = 10.0
) -> list[ExecResult]:
    """Run many programs in parallel (threads; each program is its own sandboxed process tree).

    ``jobs``: ``(language, source)`` pairs or dicts of :func:`run_program` keyword arguments
    (``lang_name``, ``source``, ...). Results come back in input order.
    """
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    norm = [j if isinstance(j, dict) else {"lang_name": j[0], "source": j[1]} for j in jobs]
    for j in norm:
        j.setdefault("timeout_s", timeout_s)
    if workers == 1 or len(norm) <= 1:
        return [run_program(**j) for j in norm]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(lambda j: run_program(**j), norm))


_AVAIL: dict[str, Availability] = {}
_AVAIL_LOCK = threading.Lock()


def _version(lang: Language) -> str:
    if not lang.version_cmd:
        return ""
    cmd = _fill(lang.version_cmd, _subs(lang))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    text = (r.stdout.strip() or r.stderr.strip()).splitlines()
    return text[0].strip() if text else ""


def check_language(name: str, refresh: bool = False) -> Availability:
    """Is ``name`` runnable here? Tools on PATH, then the probe program must pass in the sandbox.

    ``Availability.isolation`` is the sandbox level the probe (and every program) runs under. Raises
    :class:`ccft.evals.sandbox.SandboxUnavailableError` like :func:`run_program`: no isolation is not
    an unavailable language but a refusal to run generated code at all.
    """
    lang = language(name)
    with _AVAIL_LOCK:
        if lang.name in _AVAIL and not refresh:
            return _AVAIL[lang.name]
    level = str(isolation()["level"])
    missing = [t for t in lang.tools if shutil.which(t) is None]
    if lang.name == "java" and not _javatuples():
        missing.append("javatuples.jar (Debian libjavatuples-java or CCFT_JAVATUPLES_JAR)")
    if missing:
        av = Availability(lang.name, False, "", f"missing: {', '.join(missing)}", level)
    else:
        res = run_program(lang.name, lang.probe, timeout_s=60, check=False)
        reason = (
            ""
            if res.passed
            else f"probe program {res.status}"
            + (f" (needs {lang.deps})" if lang.deps else "")
            + f": {res.detail[-300:]}"
        )
        av = Availability(lang.name, res.passed, _version(lang), reason, level)
    with _AVAIL_LOCK:
        _AVAIL[lang.name] = av
    return av


def availability_table(names: list[str] | None = None, workers: int | None = None) -> list[Availability]:
    """:func:`check_language` for every language (or ``names``), in a stable order."""
    names = list(names or LANGUAGES)
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(check_language, names))
