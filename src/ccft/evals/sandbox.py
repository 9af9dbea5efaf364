"""Sandboxed execution of untrusted programs: one process tree per program, limits, no network (docs/design.md
K10).

This module is the host side (:class:`Sandbox`, :class:`Limits`, :class:`RunResult`,
:func:`isolation`). Every call of :meth:`Sandbox.run` starts the launcher
(``ccft.evals.sandbox_launcher`` run as a script with ``python -I -S``, standard library only) that
applies the limits and then ``exec``s the program, so nothing runs between ``fork`` and ``exec`` in
the evaluating process (which has torch threads). ``docs/sandbox.md`` describes the levels, how to
check them and what the tests try.

What is enforced depends on what the machine allows; :func:`isolation` reports it and every
:class:`RunResult` carries the level it ran under (``"namespaces"``, ``"userns"``, ``"bwrap"`` or
``"basic"``).

``namespaces`` (running as root with ``unshare(2)`` available — CI and containers):
  * network: a new network namespace with no interfaces up — every language, no socket reaches
    anything;
  * filesystem: a new mount namespace in which every mount is remounted read-only except the fresh
    working directory (the only writable place; ``HOME`` and ``TMPDIR`` point into it), plus a
    fresh ``/proc`` that shows only the sandbox's own processes;
  * identity: the program runs as a dedicated unprivileged uid/gid (no supplementary groups,
    ``no_new_privs``), so it cannot read root-only files and ``RLIMIT_NPROC`` applies to it alone;
  * processes: a new PID namespace — when the run ends or the wall-time limit kills it, the kernel
    kills every process the program started (fork bombs, daemons, ``setsid`` escapes, raw
    ``fork`` through ctypes), plus ``RLIMIT_NPROC``.
``userns`` (a non-root user where the kernel allows unprivileged user namespaces):
  * the same new network, PID, mount, IPC and UTS namespaces, inside a new user namespace that maps
    the user's own uid to itself (the program keeps no capability: ``exec`` drops them,
    ``no_new_privs``);
  * filesystem: a new root (``pivot_root``; the old root is detached, not hidden) that holds only
    the system folders (``/usr``, ``/bin``, ``/lib*``, ``/etc``, ``/opt``) and the toolchain's own
    folders read-only, a minimal ``/dev``, a private ``/proc`` and the working directory, the only
    writable place. The user's home, ``/tmp``, other projects and the evaluator's ``/proc`` (its
    environment) are not there at all;
  * processes: the PID namespace as above (nothing the program starts outlives the run).
``bwrap`` (a non-root user where ``userns`` fails but bubblewrap, ``bwrap``, is installed and works, e.g.
setuid or allowed by an AppArmor profile; or forced with ``CCFT_SANDBOX_LEVEL=bwrap``):
  * the same namespaces and the same new root, built by bubblewrap (``--unshare-all``,
    ``--ro-bind`` of the system folders and the toolchain, ``--bind`` of the working directory,
    ``--dev``, ``--proc``, ``--remount-ro /``, ``--die-with-parent``, ``--new-session``); the
    launcher runs inside it and applies the limits.
``basic`` (only on explicit request: ``Sandbox(level="basic")``, ``CCFT_SANDBOX_LEVEL=basic`` or
``CCFT_ALLOW_UNISOLATED_CODE=1``):
  * the program runs as the evaluating user; limits below, a new session killed as a whole at the
    wall-time limit, ``RLIMIT_NPROC`` relative to the user's current process count (the kernel
    ignores it for root);
  * Python programs only: an audit hook (``ccft.evals.sandbox_guard`` as ``sitecustomize``) that
    refuses sockets, process creation and writes outside the working directory. A program that
    calls the C library directly (ctypes) gets past it, and other languages get no network or
    filesystem isolation: :func:`isolation` says so and the eval reports it.

When no isolated level (``namespaces``, ``userns``, ``bwrap``) is available, :class:`Sandbox` refuses to run
generated code (:class:`SandboxUnavailableError`, naming ``CCFT_ALLOW_UNISOLATED_CODE``), as human-eval's
and lm-eval's ``code_eval`` (``HF_ALLOW_CODE_EVAL``) do.

Always, every level: a fresh temporary working directory (deleted afterwards), a scrubbed
environment (only ``PATH``, locale, ``HOME``/``TMPDIR`` in the working directory and what the
caller passes explicitly — never the evaluator's variables, so no tokens or keys), wall-time limit
(the whole tree is killed), ``RLIMIT_AS`` or ``RLIMIT_DATA`` memory limit (``Limits.memory_kind``;
``data`` for runtimes that reserve large address ranges: JVM, V8, Go), ``RLIMIT_FSIZE``,
``RLIMIT_CORE = 0``, ``RLIMIT_CPU``, and an output cap (the run is killed and marked
``output_truncated`` once stdout + stderr exceed ``Limits.max_output_bytes``).

A run that hits any limit is a failure (:attr:`RunResult.ok` is False); nothing here raises for a
misbehaving program.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ccft.core.errors import CCFTError
from ccft.evals import sandbox_launcher
from ccft.evals.sandbox_launcher import (
    DEFAULT_PATH,
    UID_BASE,
    decode_exit,
    exposed_paths,
    root_layout,
    root_paths,
    sandbox_uid,
    uid_processes,
)

__all__ = [
    "ALLOW_ENV",
    "GUARD",
    "LAUNCHER",
    "LEVELS",
    "LEVEL_ENV",
    "UID_BASE",
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxUnavailableError",
    "exposed_paths",
    "isolation",
    "run_once",
    "unisolated_allowed",
]

#: The launcher script, run as ``python -I -S LAUNCHER CONFIG_JSON``.
LAUNCHER = os.path.abspath(sandbox_launcher.__file__)
#: The ``basic`` level's Python guard, copied as ``sitecustomize.py`` (a file, never imported here).
GUARD = os.path.join(os.path.dirname(LAUNCHER), "sandbox_guard.py")
#: The sandbox levels, most isolated first (see the module docstring).
LEVELS = ("namespaces", "userns", "bwrap", "basic")
#: The levels that need a non-root user (as root the level is ``namespaces``).
_USER_LEVELS = ("userns", "bwrap")
#: Set to 1 to run generated code at the ``basic`` level where no isolation is available (an opt-in).
ALLOW_ENV = "CCFT_ALLOW_UNISOLATED_CODE"
#: Set to a level to use that one (``basic`` is also an opt-in; another level is probed first).
LEVEL_ENV = "CCFT_SANDBOX_LEVEL"


class SandboxUnavailableError(CCFTError, RuntimeError):
    """Generated code would run without isolation (no user namespaces here) and nobody opted in."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    Attributes:
        timeout_s: wall-clock seconds before the whole process tree is killed (SIGKILL).
        memory_mb: address-space (``memory_kind="as"``) or data-segment (``"data"``) limit.
        memory_kind: ``as`` (RLIMIT_AS) or ``data`` (RLIMIT_DATA; for JVM / V8 / Go, which reserve
            far more address space than they use).
        max_procs: processes/threads the program may have at once (RLIMIT_NPROC).
        max_output_bytes: stdout + stderr cap; beyond it the run is killed and fails.
        max_file_mb: largest file the program may write (RLIMIT_FSIZE).
        max_open_files: RLIMIT_NOFILE.
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    memory_kind: str = "as"
    max_procs: int = 64
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 256
    max_open_files: int = 1024

    def __post_init__(self):
        if self.memory_kind not in ("as", "data"):
            raise ValueError(f"Limits.memory_kind={self.memory_kind!r}; use 'as' or 'data'")
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.max_procs < 1 or self.max_output_bytes < 1:
            raise ValueError(f"Limits must be positive, got {self}")


@dataclass
class RunResult:
    """Outcome of one sandboxed command.

    ``ok`` is True only for exit status 0 within every limit. ``returncode`` is negative for a
    signal (``-9`` after a kill). ``duration_s`` is informational (never use it in assertions).
    """

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0
    isolation: str = "basic"  # the level it ran under: namespaces | userns | bwrap | basic

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_truncated

    @property
    def status(self) -> str:
        """``ok`` | ``timeout`` | ``output_limit`` | ``killed`` (a signal) | ``error`` (non-zero exit)."""
        if self.timed_out:
            return "timeout"
        if self.output_truncated:
            return "output_limit"
        if self.returncode == 0:
            return "ok"
        if self.returncode is not None and self.returncode < 0:
            return "killed"
        return "error"

    def tail(self, n: int = 600) -> str:
        """Last ``n`` characters of stderr + stdout, for error messages and reports."""
        text = (self.stderr + "\n" + self.stdout).strip()
        return text[-n:]


# ------------------------------------------------------------------ capability detection

_ISOLATION_CACHE: dict[str, object] | None = None

_COMMON = {
    "network": "new network namespace without interfaces (all languages)",
    "processes": "PID namespace (nothing the program starts outlives the run) + RLIMIT_NPROC",
    "per_language": "same guarantees for every language",
}
_LEVEL_INFO: dict[str, dict[str, str]] = {
    "namespaces": {
        **_COMMON,
        "filesystem": "all mounts read-only except the fresh working directory; private /proc",
        "identity": "dedicated unprivileged uid/gid, no_new_privs",
    },
    "userns": {
        **_COMMON,
        "filesystem": "new root: system folders and the toolchain read-only, the fresh working directory the "
        "only writable place, private /proc; the user's home and other files are not visible",
        "identity": "the evaluating user's uid in a new user namespace, no capabilities, no_new_privs",
    },
    "bwrap": {
        **_COMMON,
        "filesystem": "bubblewrap: new root with system folders and the toolchain read-only, the fresh "
        "working directory the only writable place, private /proc; the user's home and other "
        "files are not visible",
        "identity": "the evaluating user's uid in a new user namespace (bubblewrap), no capabilities",
    },
    "basic": {
        "network": "Python only: audit hook refuses sockets; other languages: NOT isolated",
        "filesystem": "Python only: audit hook refuses writes outside the working directory; "
        "other languages: NOT isolated",
        "processes": "session killed at the limit + RLIMIT_NPROC (ignored for root); "
        "Python: audit hook refuses fork/exec (not calls through ctypes)",
        "identity": "the evaluating user (NOT isolated)",
        "per_language": "python: network/fs/process guards; others: limits only",
    },
}


def unisolated_allowed() -> bool:
    """Did the user opt in to running generated code without isolation (``ALLOW_ENV`` or
    ``LEVEL_ENV=basic``)?"""
    return (
        os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")
        or os.environ.get(LEVEL_ENV, "").strip().lower() == "basic"
    )


def _bwrap() -> str | None:
    return shutil.which("bwrap", path=DEFAULT_PATH)


def _probe(level: str) -> bool:
    """Does a program run under ``level`` on this machine (the launcher's ``--probe``; for ``bwrap`` a real
    run)?"""
    if not sys.platform.startswith("linux") or (os.geteuid() == 0) != (level == "namespaces"):
        return False
    if level == "bwrap":
        if _bwrap() is None:
            return False
        try:
            with Sandbox(level="bwrap") as sb:
                res = sb.run(
                    [
                        os.path.realpath(sys.executable),
                        "-I",
                        "-S",
                        "-c",
                        "import os; assert os.getpid() == 2",
                    ],
                    limits=Limits(timeout_s=30),
                )
        except (OSError, ValueError):
            return False
        return res.ok
    d = os.path.realpath(tempfile.mkdtemp(prefix="ccft-probe-"))
    try:  # a throwaway process runs a program under the exact namespaces and mounts the launcher uses
        r = subprocess.run(
            [sys.executable, "-I", "-S", LAUNCHER, "--probe", level, d],
            capture_output=True,
            timeout=60,
            env={"PATH": DEFAULT_PATH},
        )
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return r.returncode == 0 and r.stdout.strip() == b"probe-ok"


def isolation(refresh: bool = False) -> dict[str, object]:
    """What the sandbox enforces on this machine (also written into eval results).

    Returns ``{"level": "namespaces"|"userns"|"bwrap"|"basic", "network": ..., "filesystem": ...,
    "processes": ..., "identity": ..., "per_language": ..., "limits": ..., "runs_code": bool,
    "note": ...}`` with one plain-words line per guarantee. ``namespaces`` as root; for another user
    ``userns``, else ``bwrap``; each only when a program runs under it here (``LEVEL_ENV`` names the
    one level to try). Else ``basic``, where ``runs_code`` is False unless the user opted in
    (:func:`unisolated_allowed`). The result is cached; ``refresh`` probes again.
    """
    global _ISOLATION_CACHE
    if _ISOLATION_CACHE is not None and not refresh:
        return _ISOLATION_CACHE
    forced = os.environ.get(LEVEL_ENV, "").strip().lower()
    if forced and forced not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={forced!r}; use one of {', '.join(LEVELS)}")
    tried = [forced] if forced else ["namespaces"] if os.geteuid() == 0 else list(_USER_LEVELS)
    level = "basic" if forced == "basic" else next((lv for lv in tried if _probe(lv)), "basic")
    info: dict[str, object] = {"level": level, **_LEVEL_INFO[level]}
    info["limits"] = "wall time, RLIMIT_AS/DATA, RLIMIT_FSIZE, RLIMIT_CPU, core 0, output cap, scrubbed env"
    info["runs_code"] = level != "basic" or unisolated_allowed()
    if forced == "basic":
        info["note"] = f"{LEVEL_ENV}=basic forces the basic level"
    elif level == "basic":
        info["note"] = (
            f"no isolation is available here (tried: {', '.join(tried)}; unprivileged user namespaces "
            f"disabled or restricted, unshare(2) refused, no working bwrap); generated code runs only "
            f"with {ALLOW_ENV}=1"
        )
    else:
        info["note"] = ""
    _ISOLATION_CACHE = info
    return info


def _refusal(info: dict[str, object]) -> SandboxUnavailableError:
    return SandboxUnavailableError(
        f"sandbox: refusing to execute generated code without isolation: {info['note']}. The 'basic' level "
        "leaves the program your user's files, environment and processes. Enable unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; on Ubuntu "
        "kernel.apparmor_restrict_unprivileged_userns=0), install a working bubblewrap (bwrap), or run as "
        f"root in a container; or opt in with {ALLOW_ENV}=1 (docs/sandbox.md)."
    )


# ------------------------------------------------------------------ the sandbox


class Sandbox:
    """A fresh temporary working directory in which several commands run (compile, then run).

    Usage::

        with Sandbox() as sb:
            sb.write("main.py", source)
            res = sb.run([sys.executable, "main.py"], limits=Limits(timeout_s=5))

    ``expose`` lists toolchain folders the program needs besides its executable and this Python
    (see :func:`exposed_paths`). The directory is deleted on exit. ``run`` never raises for a failing or
    hostile program; it raises ``FileNotFoundError`` only when the command's executable does not exist.

    ``level=None`` takes :func:`isolation`'s level and raises :class:`SandboxUnavailableError` when
    that is ``basic`` and the user did not opt in (:func:`unisolated_allowed`); an explicit ``level``
    is used as given (``namespaces`` needs root, ``userns`` a non-root user: ``ValueError`` otherwise).
    """

    def __init__(
        self, level: str | None = None, root: str | os.PathLike | None = None, expose: list[str] | None = None
    ):
        if level is None:
            info = isolation()
            if not info["runs_code"]:
                raise _refusal(info)
            level = str(info["level"])
        self.level = level
        self.expose = list(expose or [])  # extra toolchain paths the program must reach (e.g. a rust sysroot)
        if self.level not in LEVELS:
            raise ValueError(f"sandbox level {self.level!r}; use one of {', '.join(LEVELS)}")
        if self.level != "basic" and (os.geteuid() == 0) != (self.level == "namespaces"):
            raise ValueError(
                f"sandbox level {self.level!r} is for "
                f"{'non-root users' if self.level in _USER_LEVELS else 'root'}"
            )
        if self.level == "bwrap" and _bwrap() is None:
            raise ValueError("sandbox level 'bwrap': bubblewrap (bwrap) is not installed")
        self._root = root
        self.path: Path | None = None
        self._guard_dir: Path | None = None
        self._new_root: Path | None = None

    def __enter__(self) -> Sandbox:
        self.path = Path(tempfile.mkdtemp(prefix="ccft-sbx-", dir=self._root)).resolve()
        os.chmod(self.path, 0o755)
        (self.path / "tmp").mkdir()
        (self.path / "home").mkdir()
        if self.level == "basic":
            self._guard_dir = Path(tempfile.mkdtemp(prefix="ccft-guard-"))
            shutil.copyfile(GUARD, self._guard_dir / "sitecustomize.py")
            os.chmod(self._guard_dir, 0o755)
            os.chmod(self._guard_dir / "sitecustomize.py", 0o644)
        if self.level == "userns":  # the mount point of the program's new root (empty out here)
            self._new_root = Path(tempfile.mkdtemp(prefix="ccft-root-", dir=self._root)).resolve()
        return self

    def __exit__(self, *exc) -> None:
        for p in (self.path, self._guard_dir, self._new_root):
            if p is not None:
                shutil.rmtree(p, ignore_errors=True)

    def write(self, name: str, content: str | bytes) -> Path:
        """Write a file inside the working directory (``name`` is relative, no ``..``)."""
        assert self.path is not None, "use Sandbox as a context manager"
        target = (self.path / name).resolve()
        if not str(target).startswith(str(self.path) + os.sep):
            raise ValueError(f"sandbox file {name!r} escapes the working directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")
        return target

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The scrubbed environment of a run: nothing is inherited from the evaluator."""
        assert self.path is not None
        env = {
            "PATH": DEFAULT_PATH,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(self.path / "home"),
            "TMPDIR": str(self.path / "tmp"),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONIOENCODING": "utf-8",
        }
        if self._guard_dir is not None:
            env["PYTHONPATH"] = str(self._guard_dir)
        env.update(extra or {})
        return env

    def run(
        self,
        argv: list[str],
        *,
        limits: Limits = Limits(),
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> RunResult:
        """Run ``argv`` in the working directory under ``limits``; see the module docstring."""
        assert self.path is not None, "use Sandbox as a context manager"
        if "/" not in argv[0] and shutil.which(argv[0], path=(env or {}).get("PATH", DEFAULT_PATH)) is None:
            raise FileNotFoundError(f"sandbox: executable {argv[0]!r} not found on PATH")
        run_env = self.env(env)
        exe = shutil.which(argv[0], path=run_env["PATH"]) or argv[0]
        needs = [exe, sys.executable, sys.prefix, sys.base_prefix, *self.expose]
        cfg = {
            "workdir": str(self.path),
            "level": self.level,
            "limits": asdict(limits),
            "env": run_env,
            "argv": list(argv),
            "expose": exposed_paths(needs),
            "needs": root_paths(needs),
            "rootdir": str(self._new_root or ""),
        }
        launcher = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg)]
        info_r = info_w = -1
        if self.level == "bwrap":  # bubblewrap builds the namespaces; the launcher inside applies the limits
            cfg.update(level="basic", nproc_base=len(uid_processes(os.getuid())))
            info_r, info_w = os.pipe()
            launcher = [
                *_bwrap_argv(str(self.path), cfg["needs"] + [LAUNCHER], info_w),
                os.path.realpath(sys.executable),
                "-I",
                "-S",
                LAUNCHER,
                json.dumps(cfg),
            ]
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                launcher,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env={"PATH": DEFAULT_PATH},
                cwd=str(self.path),
                pass_fds=(info_w,) if info_w >= 0 else (),
            )
        finally:
            if info_w >= 0:
                os.close(info_w)
        init = _bwrap_init(info_r) if info_r >= 0 else None
        out, err, timed_out, truncated = _collect(
            proc, limits, stdin, namespace=self.level in ("namespaces", "userns")
        )
        if self.level == "namespaces":
            _reap_uid(sandbox_uid(proc.pid))
        if init is not None:
            _wait_pidfd(init)
        rc = proc.returncode
        if rc is not None and self.level != "basic":
            rc = decode_exit(rc)  # the launcher reports a signal death of the program as 128 + signal
        return RunResult(
            argv=list(argv),
            returncode=rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out,
            output_truncated=truncated,
            duration_s=time.monotonic() - t0,
            isolation=self.level,
        )


def _bwrap_argv(workdir: str, needs: list[str], info_fd: int) -> list[str]:
    """bubblewrap's command line for the ``bwrap`` level (see the module docstring), up to the command."""
    argv = [str(_bwrap()), "--unshare-all", "--die-with-parent", "--new-session", "--info-fd", str(info_fd)]
    for src, link in root_layout(needs):  # the same layout as the userns level's new root
        argv += ["--symlink", link, src] if link is not None else ["--ro-bind", src, src]
    return argv + [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--bind",
        workdir,
        workdir,
        "--remount-ro",
        "/",
        "--chdir",
        workdir,
        "--",
    ]


def _bwrap_init(info_r: int, wait_s: float = 60.0):
    """A pidfd of the sandbox's PID 1 from bubblewrap's ``--info-fd`` JSON (``child-pid``), or None."""
    data = b""
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(info_r, 4096) if ready else b""
            if not chunk:
                break
            data += chunk
    finally:
        os.close(info_r)
    try:
        return os.pidfd_open(int(json.loads(data)["child-pid"]))
    except (ValueError, KeyError, OSError, AttributeError):  # no info (bwrap failed) or PID 1 already gone
        return None


def _wait_pidfd(pidfd: int, wait_s: float = 30.0) -> None:
    """Wait until the process behind ``pidfd`` has exited: PID 1 of a namespace exits only after the rest of
    it."""
    try:
        select.select([pidfd], [], [], wait_s)
    finally:
        os.close(pidfd)


def _reap_uid(uid: int, wait_s: float = 10.0) -> None:
    """Return once no process of the run's uid is left (the PID namespace tears down asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = uid_processes(uid)
        if not left:
            return
        if time.monotonic() > deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            deadline = time.monotonic() + wait_s
        time.sleep(0.02)


def _kill_tree(proc: subprocess.Popen, namespace: bool = False) -> None:
    """Kill the run. With ``namespace``, SIGTERM first asks the launcher to kill its PID namespace's init and
    to wait until the namespace is empty; then (and at the basic level at once) SIGKILL to the launcher's
    session."""
    if namespace and proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _collect(
    proc: subprocess.Popen, limits: Limits, stdin: bytes | None, namespace: bool = False
) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr with the output cap and the wall-time limit; kill the tree on either
    (:func:`_kill_tree`)."""
    if stdin:
        try:
            proc.stdin.write(stdin)  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for f in bufs:
        sel.register(f, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.timeout_s
    timed_out = truncated = False
    total = 0
    while sel.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fileobj].extend(chunk)
            total += len(chunk)
            if total > limits.max_output_bytes:
                truncated = True
                break
        if truncated:
            break
    if timed_out or truncated:
        _kill_tree(proc, namespace)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc, namespace)
    proc.wait()
    _kill_tree(proc)  # anything left in the session (basic level) goes too
    sel.close()
    for f in bufs:
        f.close()
    cap = limits.max_output_bytes
    return bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap]), timed_out, truncated


def run_once(
    files: dict[str, str | bytes],
    argv: list[str],
    *,
    limits: Limits = Limits(),
    env: dict[str, str] | None = None,
    level: str | None = None,
) -> RunResult:
    """Write ``files`` into a fresh sandbox, run ``argv`` once, clean up, return the result."""
    with Sandbox(level=level) as sb:
        for name, content in files.items():
            sb.write(name, content)
        return sb.run(argv, limits=limits, env=env)
