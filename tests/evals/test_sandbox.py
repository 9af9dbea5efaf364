"""Sandbox: hostile programs are contained and scored as failed; well-behaved ones pass.

Runs at the level this machine gives (``namespaces`` as root in CI) and, for the Python guards,
at the ``basic`` level too. Timeouts here are the sandbox's mechanism, never assertions on time.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from ccft.evals.sandbox import GUARD, LAUNCHER, UID_BASE, Limits, Sandbox, isolation, run_once
from ccft.evals.sandbox_launcher import DEFAULT_PATH, decode_exit, encode_exit, uid_processes
from ccft.evals.tasks import get_task

LEVEL = str(isolation()["level"])
LEVELS = ["basic"] + (["namespaces"] if LEVEL == "namespaces" else [])
FAST = Limits(timeout_s=30.0, max_output_bytes=64 * 1024)  # generous: CI machines may be loaded


def run_py(source: str, level: str, limits: Limits = FAST):
    return run_once({"main.py": source}, [sys.executable, "main.py"], limits=limits, level=level)


@pytest.mark.parametrize("level", LEVELS)
def test_well_behaved_program_passes(level):
    res = run_py("import os\nopen('out.txt', 'w').write('hi')\nprint(open('out.txt').read(), os.getcwd())", level)
    assert res.ok and res.status == "ok"
    assert res.stdout.split()[0] == "hi"
    assert Path(res.stdout.split()[1]).name.startswith("ccft-sbx-")  # a fresh temporary directory


def test_isolation_report_names_every_guarantee():
    info = isolation()
    assert info["level"] in ("namespaces", "basic")
    for key in ("network", "filesystem", "processes", "identity", "per_language", "limits"):
        assert isinstance(info[key], str) and info[key]


@pytest.mark.parametrize("level", LEVELS)
def test_infinite_loop_is_killed(level):
    res = run_py("while True:\n    pass\n", level, Limits(timeout_s=1.5))
    assert res.timed_out and not res.ok and res.status == "timeout"


@pytest.mark.parametrize("level", LEVELS)
def test_huge_output_is_capped(level):
    res = run_py("while True:\n    print('x' * 10000)\n", level)
    assert res.output_truncated and not res.ok
    assert len(res.stdout) <= FAST.max_output_bytes


@pytest.mark.parametrize("level", LEVELS)
def test_memory_limit(level):
    res = run_py("x = bytearray(3 * 1024 ** 3)\nprint(len(x))\n", level, Limits(timeout_s=10, memory_mb=512))
    assert not res.ok and "MemoryError" in res.stderr


def _sandbox_processes() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                uid = os.stat(f"/proc/{d}").st_uid
            except OSError:
                continue
            if uid >= UID_BASE:
                pids.append(int(d))
    return pids


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb_is_contained(level):
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = run_py(src, level, Limits(timeout_s=2.0, max_procs=32))
    assert not res.ok
    if level == "namespaces":  # the PID namespace died with its init: nothing of the bomb is left
        assert _sandbox_processes() == []


class _Listener:
    """A TCP server on 127.0.0.1 that counts accepted connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self._stop = True
        self.thread.join()
        self.sock.close()


@pytest.mark.parametrize("level", LEVELS)
def test_socket_cannot_reach_a_local_server(level):
    server = _Listener()
    try:
        src = f"import socket\ns = socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\nprint('connected')\n"
        res = run_py(src, level)
    finally:
        server.close()
    assert not res.ok and "connected" not in res.stdout
    assert server.accepted == 0


@pytest.mark.parametrize("level", LEVELS)
def test_writing_outside_the_working_directory_fails(level, tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable folder is out of reach
    res = run_py(f"open({str(target)!r}, 'w').write('pwned')\n", level)
    assert not res.ok
    assert not target.exists()


@pytest.mark.parametrize("level", LEVELS)
def test_environment_secrets_are_not_inherited(level, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-456")
    res = run_py("import os\nprint(sorted(os.environ.items()))\n", level)
    assert res.ok
    assert "secret" not in res.stdout
    assert "HF_TOKEN" not in res.stdout and "OPENAI_API_KEY" not in res.stdout


@pytest.mark.skipif(LEVEL != "namespaces", reason="needs the namespaces level (root with unshare)")
def test_parent_environment_unreadable_through_proc(monkeypatch):
    monkeypatch.setenv("CCFT_TEST_SECRET", "topsecret789")
    src = (f"import os\nfor pid in ({os.getpid()}, os.getppid(), 1):\n    try:\n"
           "        print(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError as e:\n        print('denied', e)\n")
    res = run_py(src, "namespaces")
    assert "topsecret789" not in res.stdout
    assert [line.split()[0] for line in res.stdout.splitlines()] == ["denied"] * 3


@pytest.mark.skipif(LEVEL != "namespaces", reason="needs the namespaces level (root with unshare)")
def test_shell_escape_is_contained_too(tmp_path):
    target = tmp_path / "shell.txt"
    os.chmod(tmp_path, 0o777)
    res = run_once({"main.sh": f"ls -a /root\necho pwned > /tmp/ccft-shell-escape || exit 3\n"
                                f"echo pwned > {target}\n"}, ["bash", "main.sh"], limits=FAST, level="namespaces")
    assert res.returncode == 3 and not res.ok
    assert not target.exists() and not os.path.exists("/tmp/ccft-shell-escape")
    assert "Read-only file system" in res.stderr
    # the hidden home shows only re-exposed toolchain folders (this interpreter's, if it lives there)
    assert set(res.stdout.split()) - {".", ".."} <= {".pyenv", ".rustup", ".cargo"}


def test_sandbox_write_refuses_escaping_names():
    with Sandbox() as sb:
        with pytest.raises(ValueError, match="escapes"):
            sb.write("../evil.txt", "x")


HOSTILE_COMPLETIONS = {
    "infinite loop": "    while True:\n        pass\n",
    "fork bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
    "huge output": "    while True:\n        print('x' * 100000)\n",
    "socket": "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    return False\n",
    "write outside": "    open('/tmp/ccft-hostile-write', 'w').write('x')\n    return False\n",
    "early exit(0)": "    import sys\n    sys.exit(0)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE_COMPLETIONS))
def test_hostile_humaneval_completions_score_as_failed(name):
    task = get_task("humaneval", timeout_s=2.0)
    item = task.load(1)[0]  # HumanEval/0 has_close_elements
    assert task.score(item, HOSTILE_COMPLETIONS[name]) == {"passed": 0.0}
    assert not os.path.exists("/tmp/ccft-hostile-write")


# ------------------------------------------------------------------ the launcher and the guard

def _imported_modules(path: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", [LAUNCHER, GUARD], ids=["launcher", "guard"])
def test_child_side_files_use_only_the_standard_library(path):
    """They run as ``python -I -S FILE`` / as ``sitecustomize``: the ccft package is not importable there."""
    mods = _imported_modules(path)
    assert "os" in mods and mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_launcher_runs_by_path_without_the_package(tmp_path):
    cfg = {"workdir": str(tmp_path), "level": "basic", "limits": asdict(Limits()),
           "env": {"PATH": DEFAULT_PATH}, "argv": [sys.executable, "-c", "import os; print(6 * 7, os.getcwd())"],
           "expose": {}}
    r = subprocess.run([sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg)], capture_output=True, text=True,
                       env={"PATH": DEFAULT_PATH}, cwd="/", timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["42", str(tmp_path)]), r.stderr


def test_exit_status_of_a_signal_death_round_trips():
    assert (encode_exit(0), encode_exit(3), encode_exit(-9)) == (0, 3, 137)
    assert all(decode_exit(encode_exit(-s)) == -s for s in range(1, 65))
    assert [decode_exit(c) for c in (0, 1, 126, 127, 128, 193, 255)] == [0, 1, 126, 127, 128, 193, 255]


def test_uid_processes_finds_this_process():
    assert os.getpid() in uid_processes(os.getuid())


def test_guard_installs_nothing_when_imported_as_a_module():
    src = ("import ccft.evals.sandbox_guard, socket, subprocess, sys\n"
           "socket.socket().close()\n"
           "subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
           "print('unguarded')\n")
    env = {"PATH": DEFAULT_PATH, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.strip() == "unguarded", r.stderr
