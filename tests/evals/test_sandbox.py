"""Sandbox: hostile programs are contained and scored as failed; well-behaved ones pass.

Runs at the level this machine gives (``namespaces`` as root in CI) and, for the Python guards,
at the ``basic`` level too. Timeouts here are the sandbox's mechanism, never assertions on time.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from ccft.evals.sandbox import GUARD, LAUNCHER, Limits, Sandbox, isolation, run_once
from ccft.evals.sandbox_launcher import (
    DEFAULT_PATH,
    decode_exit,
    encode_exit,
    root_layout,
    root_paths,
    uid_processes,
)
from ccft.evals.tasks import get_task

LEVEL = str(isolation()["level"])
LEVELS = ["basic"] + ([LEVEL] if LEVEL != "basic" else [])  # basic, and namespaces (root) or userns (others)
FAST = Limits(timeout_s=30.0, max_output_bytes=64 * 1024)  # generous: CI machines may be loaded


def run_py(source: str, level: str, limits: Limits = FAST):
    return run_once({"main.py": source}, [sys.executable, "main.py"], limits=limits, level=level)


@pytest.mark.parametrize("level", LEVELS)
def test_well_behaved_program_passes(level):
    res = run_py(
        "import os\nopen('out.txt', 'w').write('hi')\nprint(open('out.txt').read(), os.getcwd())", level
    )
    assert res.ok and res.status == "ok"
    assert res.stdout.split()[0] == "hi"
    assert Path(res.stdout.split()[1]).name.startswith("ccft-sbx-")  # a fresh temporary directory


def test_isolation_report_names_every_guarantee():
    info = isolation()
    assert info["level"] in ("namespaces", "userns", "basic")
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


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb_is_contained(level):
    import secrets

    name = (
        f"bomb_{secrets.token_hex(8)}.py"  # in every bomb process's command line (other runs may be going on)
    )
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = run_once(
        {name: src}, [sys.executable, name], limits=Limits(timeout_s=2.0, max_procs=32), level=level
    )
    assert not res.ok
    if level != "basic":  # the PID namespace died with its init: nothing of the bomb is left
        assert _processes_with(name) == []


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
        src = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "print('connected')\n"
        )
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
    src = (
        f"import os\nfor pid in ({os.getpid()}, os.getppid(), 1):\n    try:\n        "
        "print(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError as e:\n        "
        "print('denied', e)\n"
    )
    res = run_py(src, "namespaces")
    assert "topsecret789" not in res.stdout
    assert [line.split()[0] for line in res.stdout.splitlines()] == ["denied"] * 3


@pytest.mark.skipif(LEVEL != "namespaces", reason="needs the namespaces level (root with unshare)")
def test_shell_escape_is_contained_too(tmp_path):
    target = tmp_path / "shell.txt"
    os.chmod(tmp_path, 0o777)
    res = run_once(
        {"main.sh": f"ls -a /root\necho pwned > /tmp/ccft-shell-escape || exit 3\necho pwned > {target}\n"},
        ["bash", "main.sh"],
        limits=FAST,
        level="namespaces",
    )
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
    "fork bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except "
    "OSError:\n            pass\n",
    "huge output": "    while True:\n        print('x' * 100000)\n",
    "write outside": "    open('/tmp/ccft-hostile-write', 'w').write('x')\n    return False\n",
    "early exit(0)": "    import sys\n    sys.exit(0)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE_COMPLETIONS))
def test_hostile_humaneval_completions_score_as_failed(name):
    task = get_task("humaneval", timeout_s=2.0)
    item = task.load(1)[0]  # HumanEval/0 has_close_elements
    assert task.score(item, HOSTILE_COMPLETIONS[name])["passed"] == 0.0
    assert not os.path.exists("/tmp/ccft-hostile-write")


# A correct has_close_elements body: scores 1.0 when it runs (the control below).
CLOSE_ELEMENTS = (
    "    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
    "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n"
)


def test_socket_completion_fails_only_because_the_network_is_blocked():
    """A completion that is correct once it has reached a server on loopback: it scores 0.0 and the server
    accepts nothing; without the connection the same body scores 1.0 (so the 0.0 is the network block)."""
    task = get_task("humaneval", timeout_s=10.0)
    item = task.load(1)[0]  # HumanEval/0 has_close_elements
    assert task.score(item, CLOSE_ELEMENTS) == {"passed": 1.0, "compiles": 1.0}
    server = _Listener()
    try:
        connect = (
            f"    import socket\n    socket.create_connection(('127.0.0.1', {server.port}), "
            "timeout=2).close()\n"
        )
        scored = task.score(item, connect + CLOSE_ELEMENTS)
    finally:
        server.close()
    assert scored == {"passed": 0.0, "compiles": 1.0}
    assert server.accepted == 0


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
    cfg = {
        "workdir": str(tmp_path),
        "level": "basic",
        "limits": asdict(Limits()),
        "env": {"PATH": DEFAULT_PATH},
        "argv": [sys.executable, "-c", "import os; print(6 * 7, os.getcwd())"],
        "expose": {},
    }
    r = subprocess.run(
        [sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg)],
        capture_output=True,
        text=True,
        env={"PATH": DEFAULT_PATH},
        cwd="/",
        timeout=60,
    )
    assert (r.returncode, r.stdout.split()) == (0, ["42", str(tmp_path)]), r.stderr


def test_exit_status_of_a_signal_death_round_trips():
    assert (encode_exit(0), encode_exit(3), encode_exit(-9)) == (0, 3, 137)
    assert all(decode_exit(encode_exit(-s)) == -s for s in range(1, 65))
    assert [decode_exit(c) for c in (0, 1, 126, 127, 128, 193, 255)] == [0, 1, 126, 127, 128, 193, 255]


def test_root_layout_shows_each_path_once():
    """The userns/bwrap root: system folders, then the interpreter's folders, nothing inside a folder already
    shown."""
    needs = root_paths([sys.executable, sys.prefix, sys.base_prefix, "/usr/bin/env"])
    assert os.path.realpath(sys.executable) in needs and needs == sorted(needs, key=lambda p: (len(p), p))
    layout = root_layout(needs)
    paths = [p for p, _ in layout]
    assert "/usr" in paths and "/usr/bin/env" not in paths and len(set(paths)) == len(paths)
    assert all(not (a != b and b.startswith(a + "/")) for a in paths for b in paths)
    assert all(link is None or os.readlink(p) == link for p, link in layout)
    real = os.path.realpath(sys.executable)
    assert any(real == p or real.startswith(p + "/") for p in paths)


def test_uid_processes_finds_this_process():
    assert os.getpid() in uid_processes(os.getuid())


def test_guard_installs_nothing_when_imported_as_a_module():
    src = (
        "import ccft.evals.sandbox_guard, socket, subprocess, sys\n"
        "socket.socket().close()\n"
        "subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
        "print('unguarded')\n"
    )
    env = {"PATH": DEFAULT_PATH, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.strip() == "unguarded", r.stderr


# ------------------------------------------------- hostile programs, as root and as an unprivileged uid (K10)

#: Run by an interpreter as the user under test: ``HARNESS SRC TOKEN PORT``. It scores hostile
#: programs with ``ccft.evals.execution.run_program`` (the level this user gets), checks right after
#: each run that nothing of it is left, and prints one JSON report line.
HARNESS = r'''
import json, os, shutil, socket, sys, tempfile, threading
sys.path.insert(0, sys.argv[1])
from ccft.evals.execution import run_program
from ccft.evals.sandbox import SandboxUnavailableError, isolation

token, port = sys.argv[2], int(sys.argv[3])
secret = os.environ["CCFT_TEST_SECRET"]
home = tempfile.mkdtemp(prefix="ccft-home-")        # a file only this user may read, like ~/.netrc
os.chmod(home, 0o755)
secret_file = os.path.join(home, "token.txt")
with open(secret_file, "w") as f:
    f.write(secret)
os.chmod(secret_file, 0o600)
outside = tempfile.mkdtemp(prefix="ccft-outside-")  # even a world-writable folder is out of reach
os.chmod(outside, 0o777)
target = os.path.join(outside, "escaped.txt")

listener = socket.socket()
listener.bind(("127.0.0.1", port))
listener.listen(8)
listener.settimeout(0.2)
accepted, stop = [], []
def serve():
    while not stop:
        try:
            listener.accept()[0].close()
            accepted.append(1)
        except OSError:
            pass
thread = threading.Thread(target=serve, daemon=True)
thread.start()

def survivors():
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids

CHECK = "\ndef add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"
DAEMON = """import ctypes, os, sys
libc = ctypes.CDLL(None)
r, w = os.pipe()
os.set_inheritable(w, True)
if libc.fork() == 0:
    libc.setsid()
    if libc.fork() == 0:
        exe = sys.executable.encode()
        script = ('import os, signal, time\\nfor s in (1, 15):\\n    signal.signal(s, signal.SIG_IGN)\\n'
                  'os.write(%d, b"1")\\ntime.sleep(600)\\n' % w).encode()
        argv = (ctypes.c_char_p * 5)(exe, b'-c', script, b'TOKEN', None)
        libc.execv(exe, argv)
    libc._exit(0)
os.close(w)
print('daemon started' if os.read(r, 1) == b'1' else 'no daemon')
"""
PROGRAMS = {
    "good": (CHECK, 30),
    "daemon": (DAEMON.replace("TOKEN", token) + CHECK, 30),
    "secrets": ("import os\nseen = []\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                f"for p in pids + [{os.getpid()!r}, {os.getppid()!r}]:\n"
                "    try:\n        seen.append(open(f'/proc/{p}/environ', 'rb').read())\n    except OSError:\n        pass\n"
                f"for path in ({secret_file!r}, os.path.expanduser('~/.netrc')):\n"
                "    try:\n        seen.append(open(path, 'rb').read())\n    except OSError:\n        pass\n"
                "seen.append(repr(sorted(os.environ.items())).encode())\n"
                "print('pids', len(pids), 'leaks', [s for s in seen if b'ccft-secret-' in s])\n" + CHECK, 30),
    "write outside": (f"for path in ({target!r}, {secret_file!r}):\n"
                      "    try:\n        open(path, 'w').write('pwned')\n        print('wrote', path)\n"
                      "    except OSError as e:\n        print('refused', e)\n" + CHECK, 30),
    "network": ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
                "except OSError as e:\n    print('refused', e)\n" + CHECK, 30),
    "fork bomb": ("import ctypes, os, sys\n"
                  "bomb = 'import ctypes\\nlibc = ctypes.CDLL(None)\\nwhile True:\\n    libc.fork()\\n'\n"
                  f"os.execv(sys.executable, [sys.executable, '-c', bomb, {token!r}])\n", 3),
    "memory bomb": ("x = bytearray(16 * 1024 ** 3)\n" + CHECK, 30),
    "output flood": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", 30),
}
report = {"uid": os.getuid(), "level": isolation()["level"], "results": {}, "survivors": {}}
try:
    for name, (source, timeout_s) in PROGRAMS.items():
        res = run_program("python", source, timeout_s=timeout_s)
        report["results"][name] = {"status": res.status, "detail": res.detail, "stdout": res.stdout}
        report["survivors"][name] = survivors()
except SandboxUnavailableError as e:
    report["refused"] = str(e)
stop.append(1)
thread.join()
listener.close()
report["accepted"] = len(accepted)
report["outside_written"] = os.path.exists(target)
report["secret_file"] = open(secret_file).read()
report["secret"] = secret
shutil.rmtree(home)
shutil.rmtree(outside)
print(json.dumps(report))
'''  # noqa: E501 (harness program text, kept byte for byte)

NOBODY = 65534


def _python_for(uid: int) -> str | None:
    """An interpreter (3.9+) that ``uid`` can execute: this one, else the system's."""
    for py in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if not os.path.isfile(py):
            continue
        try:
            r = subprocess.run(
                [py, "-c", "import sys; print(sys.version_info >= (3, 9))"],
                user=uid,
                group=uid,
                extra_groups=[],
                capture_output=True,
                text=True,
                env={"PATH": DEFAULT_PATH},
                cwd="/",
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if r.stdout.strip() == "True":
            return py
    return None


def _readable_copy_of_ccft() -> str:
    """The ccft sources copied where any uid can read them (the checkout may sit in a private home)."""
    import tempfile

    import ccft

    root = tempfile.mkdtemp(prefix="ccft-src-")
    shutil.copytree(
        os.path.dirname(ccft.__file__),
        os.path.join(root, "ccft"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o644)
    return root


def _processes_with(token: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if token.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    pids.append(int(d))
            except OSError:
                pass
    return pids


USERS = ["root", "nobody"] if os.geteuid() == 0 else ["user"]
#: (user, forced level): each user at the level the machine gives it; the unprivileged one also
#: through bubblewrap (CCFT_SANDBOX_LEVEL=bwrap) where bwrap is installed.
RUNS = [(u, None) for u in USERS] + [(USERS[-1], "bwrap")] * bool(shutil.which("bwrap", path=DEFAULT_PATH))


@pytest.fixture(scope="module", params=RUNS, ids=[u + (f"-{lv}" if lv else "") for u, lv in RUNS])
def hostile(request):
    """The harness's report for one user: ``root`` (namespaces level), ``nobody`` (uid 65534, dropped to from
    root: userns, else bwrap) or, when the tests themselves run unprivileged, the current ``user``."""
    import secrets

    user, forced = request.param
    py = sys.executable
    kwargs: dict = {}
    if user == "nobody":
        py = _python_for(NOBODY)
        if py is None:
            pytest.skip(
                "no Python 3.9+ interpreter that uid 65534 can execute (tried this one and /usr/bin/python3)"
            )
        kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    src = _readable_copy_of_ccft()
    token = "ccft-hostile-" + secrets.token_hex(8)
    env = {"PATH": DEFAULT_PATH, "CCFT_TEST_SECRET": "ccft-secret-" + secrets.token_hex(8)}
    if forced:
        env["CCFT_SANDBOX_LEVEL"] = forced
    harness = os.path.join(src, "harness.py")
    Path(harness).write_text(HARNESS, encoding="utf-8")
    os.chmod(harness, 0o644)
    port = _free_port()
    try:
        r = subprocess.run(
            [py, harness, src, token, str(port)],
            capture_output=True,
            text=True,
            env=env,
            cwd="/",
            timeout=900,
            **kwargs,
        )
    finally:
        shutil.rmtree(src, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    report["user"], report["forced"], report["left_after"] = user, forced, _processes_with(token)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _contained(report) -> dict:
    """The results, or a skip where the machine has no isolation for this user (the refusal is tested
    below)."""
    if "refused" in report:
        assert report["user"] != "root" and "CCFT_ALLOW_UNISOLATED_CODE" in report["refused"]
        pytest.skip(
            f"no isolation for {report['user']} here; generated code is refused: {report['refused'][:200]}"
        )
    return report["results"]


def test_hostile_level_is_isolated_for_every_user(hostile):
    """Root gets namespaces, any other user userns or bwrap (the one forced) or a refusal (never basic
    unasked)."""
    if "refused" in hostile:
        assert hostile["level"] == "basic" and "CCFT_ALLOW_UNISOLATED_CODE" in hostile["refused"]
    elif hostile["uid"] == 0:
        assert hostile["level"] == "namespaces"
    else:
        assert hostile["level"] in ([hostile["forced"]] if hostile["forced"] else ["userns", "bwrap"])


def test_hostile_harness_still_scores_items(hostile):
    results = _contained(hostile)
    statuses = {name: r["status"] for name, r in results.items()}
    assert statuses == {
        "good": "passed",
        "daemon": "passed",
        "secrets": "passed",
        "write outside": "passed",
        "network": "passed",
        "fork bomb": "timeout",
        "memory bomb": "failed",
        "output flood": "output_limit",
    }, {n: r["detail"][-300:] for n, r in results.items()}
    assert "MemoryError" in results["memory bomb"]["detail"]


def test_hostile_processes_do_not_survive_the_run(hostile):
    """A daemon started by raw fork + setsid + execv (ctypes) and a raw fork bomb are gone when run()
    returns."""
    results = _contained(hostile)
    assert "daemon started" in results["daemon"]["stdout"]  # it did run, ignoring SIGHUP and SIGTERM
    assert hostile["survivors"] == {name: [] for name in hostile["results"]}
    assert hostile["left_after"] == []


def test_hostile_program_reads_no_secret(hostile):
    """Neither the evaluator's environment (/proc/PID/environ) nor a file only the evaluating user can
    read."""
    results = _contained(hostile)
    out = results["secrets"]["stdout"]
    assert "leaks []" in out and hostile["secret"] not in json.dumps(results)
    assert int(out.split()[1]) <= 3  # its own /proc: init, the program (and at most one helper)


def test_hostile_program_writes_nothing_outside_its_directory(hostile):
    results = _contained(hostile)
    assert not hostile["outside_written"] and hostile["secret_file"] == hostile["secret"]
    assert "wrote" not in results["write outside"]["stdout"]


def test_hostile_program_reaches_no_local_server(hostile):
    results = _contained(hostile)
    assert hostile["accepted"] == 0 and "connected" not in results["network"]["stdout"]
