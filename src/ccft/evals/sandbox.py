"""Sandboxed execution of untrusted programs: one process tree per program, limits, no network.

Every call of :meth:`Sandbox.run` starts a small launcher (this file run as a script with
``python -I -S``, standard library only) that applies the limits and then ``exec``s the program, so
nothing runs between ``fork`` and ``exec`` in the evaluating process (which has torch threads).

What is enforced depends on what the machine allows; :func:`isolation` reports it and every
:class:`RunResult` carries the level it ran under (``"namespaces"`` or ``"basic"``).

``namespaces`` (running as root with ``unshare(2)`` available — CI and containers):
  * network: a new network namespace with no interfaces up — every language, no socket reaches
    anything;
  * filesystem: a new mount namespace in which every mount is remounted read-only except the fresh
    working directory (the only writable place; ``HOME`` and ``TMPDIR`` point into it), plus a
    fresh ``/proc`` that shows only the sandbox's own processes;
  * identity: the program runs as a dedicated unprivileged uid/gid (no supplementary groups,
    ``no_new_privs``), so it cannot read root-only files and ``RLIMIT_NPROC`` applies to it alone;
  * processes: a new PID namespace — when the wall-time limit kills the launcher, the kernel kills
    every process the program started (fork bombs, daemons, ``setsid`` escapes), plus
    ``RLIMIT_NPROC``.
``basic`` (anything else, e.g. a non-root user; or forced with ``CCFT_SANDBOX_LEVEL=basic``):
  * the program runs as the evaluating user; limits below, a new session killed as a whole at the
    wall-time limit, ``RLIMIT_NPROC`` relative to the user's current process count (the kernel
    ignores it for root);
  * Python programs only: an audit hook (``sitecustomize``) that refuses sockets, process creation
    and writes outside the working directory. Other languages get no network or filesystem
    isolation in this mode: :func:`isolation` says so and the eval reports it.

Always, both levels: a fresh temporary working directory (deleted afterwards), a scrubbed
environment (only ``PATH``, locale, ``HOME``/``TMPDIR`` in the working directory and what the
caller passes explicitly — never the evaluator's variables, so no tokens or keys), wall-time limit
(SIGKILL of the whole tree), ``RLIMIT_AS`` or ``RLIMIT_DATA`` memory limit (``Limits.memory_kind``;
``data`` for runtimes that reserve large address ranges: JVM, V8, Go), ``RLIMIT_FSIZE``,
``RLIMIT_CORE = 0``, ``RLIMIT_CPU``, and an output cap (the run is killed and marked
``output_truncated`` once stdout + stderr exceed ``Limits.max_output_bytes``).

A run that hits any limit is a failure (:attr:`RunResult.ok` is False); nothing here raises for a
misbehaving program.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Limits", "RunResult", "Sandbox", "isolation", "run_once"]

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h).
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_MNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
              "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME, "strictatime": _MS_STRICTATIME}

#: First uid/gid of the sandbox range (one uid per concurrent run, so RLIMIT_NPROC is per run).
UID_BASE = 1_500_000
_UID_SPAN = 400_000

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
    isolation: str = "basic"

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


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return False
    d = os.path.realpath(tempfile.mkdtemp(prefix="ccft-probe-"))
    try:  # a throwaway process tries the exact namespaces and mounts the launcher uses
        r = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__), "--probe", d],
                           capture_output=True, timeout=20, env={"PATH": _DEFAULT_PATH})
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return r.returncode == 0 and r.stdout.strip() == b"probe-ok"


def isolation(refresh: bool = False) -> dict[str, object]:
    """What the sandbox enforces on this machine (also written into eval results).

    Returns ``{"level": "namespaces"|"basic", "network": ..., "filesystem": ..., "processes": ...,
    "identity": ..., "per_language": ...}`` with one plain-words line per guarantee.
    """
    global _ISOLATION_CACHE
    if _ISOLATION_CACHE is not None and not refresh:
        return _ISOLATION_CACHE
    if os.environ.get("CCFT_SANDBOX_LEVEL", "").lower() != "basic" and _can_unshare():
        info: dict[str, object] = {
            "level": "namespaces",
            "network": "new network namespace without interfaces (all languages)",
            "filesystem": "all mounts read-only except the fresh working directory; private /proc",
            "processes": "PID namespace (whole tree killed at the limit) + RLIMIT_NPROC",
            "identity": "dedicated unprivileged uid/gid, no_new_privs",
            "per_language": "same guarantees for every language",
        }
    else:
        info = {
            "level": "basic",
            "network": "Python only: audit hook refuses sockets; other languages: NOT isolated",
            "filesystem": "Python only: audit hook refuses writes outside the working directory; "
                          "other languages: NOT isolated",
            "processes": "session killed at the limit + RLIMIT_NPROC (ignored for root); "
                         "Python: audit hook refuses fork/exec",
            "identity": "the evaluating user (NOT isolated)",
            "per_language": "python: network/fs/process guards; others: limits only",
        }
    info["limits"] = "wall time, RLIMIT_AS/DATA, RLIMIT_FSIZE, RLIMIT_CPU, core 0, output cap, scrubbed env"
    _ISOLATION_CACHE = info
    return info


# ------------------------------------------------------------------ the sandbox

_PY_GUARD = r'''
import os, sys
_CWD = os.path.realpath(os.getcwd())
_OK_DEV = ("/dev/null", "/dev/stdout", "/dev/stderr")
def _inside(p):
    try:
        p = os.path.realpath(os.fsdecode(p) if not isinstance(p, int) else "/proc/self/fd/%d" % p)
    except Exception:
        return False
    return p == _CWD or p.startswith(_CWD + os.sep) or p in _OK_DEV
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writing and not _inside(path):
            raise PermissionError("sandbox: writing outside the working directory is not allowed: %r" % (path,))
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree"):
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError("sandbox: %s outside the working directory is not allowed" % event)
    elif event == "socket.__new__":
        fam = args[1]
        if fam not in (getattr(__import__("socket"), "AF_UNIX", 1),):
            raise PermissionError("sandbox: network sockets are not allowed")
    elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo"):
        raise PermissionError("sandbox: network access is not allowed")
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg"):
        raise PermissionError("sandbox: %s is not allowed" % event)
sys.addaudithook(_hook)
'''


class Sandbox:
    """A fresh temporary working directory in which several commands run (compile, then run).

    Usage::

        with Sandbox() as sb:
            sb.write("main.py", source)
            res = sb.run([sys.executable, "main.py"], limits=Limits(timeout_s=5))

    ``expose`` lists toolchain folders the program needs besides its executable and this Python
    (see :func:`exposed_paths`). The directory is deleted on exit. ``run`` never raises for a failing or hostile program;
    it raises ``FileNotFoundError`` only when the command's executable does not exist.
    """

    def __init__(self, level: str | None = None, root: str | os.PathLike | None = None,
                 expose: list[str] | None = None):
        self.level = level or str(isolation()["level"])
        self.expose = list(expose or [])  # extra toolchain paths the program must reach (e.g. a rust sysroot)
        if self.level not in ("namespaces", "basic"):
            raise ValueError(f"sandbox level {self.level!r}; use 'namespaces' or 'basic'")
        self._root = root
        self.path: Path | None = None
        self._guard_dir: Path | None = None

    def __enter__(self) -> Sandbox:
        self.path = Path(tempfile.mkdtemp(prefix="ccft-sbx-", dir=self._root)).resolve()
        os.chmod(self.path, 0o755)
        (self.path / "tmp").mkdir()
        (self.path / "home").mkdir()
        if self.level == "basic":
            self._guard_dir = Path(tempfile.mkdtemp(prefix="ccft-guard-"))
            (self._guard_dir / "sitecustomize.py").write_text(_PY_GUARD)
            os.chmod(self._guard_dir, 0o755)
            os.chmod(self._guard_dir / "sitecustomize.py", 0o644)
        return self

    def __exit__(self, *exc) -> None:
        for p in (self.path, self._guard_dir):
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
        env = {"PATH": _DEFAULT_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(self.path / "home"),
               "TMPDIR": str(self.path / "tmp"), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
               "PYTHONIOENCODING": "utf-8"}
        if self._guard_dir is not None:
            env["PYTHONPATH"] = str(self._guard_dir)
        env.update(extra or {})
        return env

    def run(self, argv: list[str], *, limits: Limits = Limits(), env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> RunResult:
        """Run ``argv`` in the working directory under ``limits``; see the module docstring."""
        assert self.path is not None, "use Sandbox as a context manager"
        if "/" not in argv[0] and shutil.which(argv[0], path=(env or {}).get("PATH", _DEFAULT_PATH)) is None:
            raise FileNotFoundError(f"sandbox: executable {argv[0]!r} not found on PATH")
        run_env = self.env(env)
        exe = shutil.which(argv[0], path=run_env["PATH"]) or argv[0]
        needs = [exe, sys.executable, sys.prefix, sys.base_prefix, *self.expose]
        cfg = {"workdir": str(self.path), "level": self.level, "limits": asdict(limits),
               "env": run_env, "argv": list(argv), "root": os.geteuid() == 0,
               "expose": exposed_paths(needs)}
        launcher = [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(cfg)]
        t0 = time.monotonic()
        proc = subprocess.Popen(launcher, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": _DEFAULT_PATH}, cwd=str(self.path))
        out, err, timed_out, truncated = _collect(proc, limits, stdin)
        if self.level == "namespaces":
            _reap_uid(UID_BASE + proc.pid % _UID_SPAN)
        rc = proc.returncode
        if rc is not None and rc >= 128 + 1 and rc <= 128 + 64 and self.level == "namespaces":
            rc = -(rc - 128)  # the launcher reports a signal death of the program as 128 + signal
        return RunResult(argv=list(argv), returncode=rc, stdout=out.decode("utf-8", "replace"),
                         stderr=err.decode("utf-8", "replace"), timed_out=timed_out, output_truncated=truncated,
                         duration_s=time.monotonic() - t0, isolation=self.level)


def _hidden_ancestor(path: str) -> tuple[str, str] | None:
    """(first ancestor of ``path`` that others cannot traverse, its child on the way), or None."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        anc = str(Path(*parts[:i]))
        try:
            if not os.stat(anc).st_mode & 0o001:
                return anc, parts[i]
        except OSError:
            return None
    return None


def exposed_paths(paths: list[str]) -> dict[str, list[str]]:
    """Which folders to re-expose (read-only) so the sandbox uid can reach ``paths``.

    Toolchains are often installed under a home directory others cannot enter (``/root/.pyenv``,
    ``/root/.rustup``). In the ``namespaces`` level such a home is replaced by an empty read-only
    tmpfs in which only the needed top-level folders reappear, so the rest of it (tokens, keys,
    caches) stays invisible. Returns ``{hidden ancestor: [child names]}``.
    """
    out: dict[str, set[str]] = {}
    for p in paths:
        if not p:
            continue
        hit = _hidden_ancestor(os.path.realpath(p))
        if hit is not None:
            out.setdefault(hit[0], set()).add(hit[1])
    return {k: sorted(v) for k, v in out.items()}


def _reap_uid(uid: int, wait_s: float = 10.0) -> None:
    """Return once no process of the run's uid is left (the PID namespace tears down asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid == uid:
                        left.append(int(d))
                except OSError:
                    pass
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


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _collect(proc: subprocess.Popen, limits: Limits, stdin: bytes | None) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr with the output cap and the wall-time limit; kill the tree on either."""
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
        _kill_tree(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
    proc.wait()
    _kill_tree(proc)  # anything left in the session (basic level) goes too
    sel.close()
    for f in bufs:
        f.close()
    cap = limits.max_output_bytes
    return bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap]), timed_out, truncated


def run_once(files: dict[str, str | bytes], argv: list[str], *, limits: Limits = Limits(),
             env: dict[str, str] | None = None, level: str | None = None) -> RunResult:
    """Write ``files`` into a fresh sandbox, run ``argv`` once, clean up, return the result."""
    with Sandbox(level=level) as sb:
        for name, content in files.items():
            sb.write(name, content)
        return sb.run(argv, limits=limits, env=env)


# ------------------------------------------------------------------ the launcher (runs as a script)

def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _hide_homes(libc, workdir: str, expose: dict[str, list[str]]) -> None:
    """Cover each hidden ancestor with an empty tmpfs and bind back only its exposed children."""
    for i, (anc, children) in enumerate(sorted(expose.items())):
        stage = os.path.join(workdir, f".ccft-stage-{i}")
        os.mkdir(stage)
        _check(libc.mount(anc.encode(), stage.encode(), None, _MS_BIND | _MS_REC, None), f"stage {anc}")
        _check(libc.mount(b"tmpfs", anc.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=755,size=64k"),
               f"cover {anc}")
        for child in children:
            src, dst = os.path.join(stage, child), os.path.join(anc, child)
            if os.path.isdir(src):
                os.mkdir(dst)
            else:
                open(dst, "w").close()
            _check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"expose {dst}")
        _check(libc.umount2(stage.encode(), 2), f"unstage {anc}")  # MNT_DETACH
        os.rmdir(stage)


def _readonly_everything_but(libc, workdir: str, expose: dict[str, list[str]] | None = None) -> None:
    """In a private mount namespace: hide restricted homes, keep ``workdir`` writable, all else read-only."""
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND | _MS_REC, None), "bind workdir")
    _hide_homes(libc, workdir, expose or {})
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for parts in mounts:
        point = _unescape(parts[4])
        if point == workdir or point.startswith("/proc"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for opt in parts[5].split(","):
            flags |= _MNT_FLAGS.get(opt, 0)
        if libc.mount(None, point.encode(), None, flags, None) != 0 and point in ("/", "/tmp", "/dev/shm"):
            _check(-1, f"remount {point} read-only")


def _set_limits(limits: dict, root: bool) -> None:
    import resource

    mem = int(limits["memory_mb"]) * 1024 * 1024
    kind = resource.RLIMIT_AS if limits["memory_kind"] == "as" else resource.RLIMIT_DATA
    resource.setrlimit(kind, (mem, mem))
    fsize = int(limits["max_file_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = int(limits["timeout_s"]) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    nofile = int(limits["max_open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    nproc = int(limits["max_procs"])
    if not root:  # RLIMIT_NPROC counts all of the user's processes: allow the ones already running
        uid = os.getuid()
        mine = 0
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid == uid:
                        mine += 1
                except OSError:
                    pass
        nproc += mine
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def _drop_privileges(libc, uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    import signal as _signal

    libc.prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)  # cleared by setuid: set it afterwards
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _exec(cfg: dict) -> None:
    os.chdir(cfg["workdir"])
    argv = cfg["argv"]
    exe = shutil.which(argv[0], path=cfg["env"].get("PATH", _DEFAULT_PATH)) or argv[0]
    os.execve(exe, argv, cfg["env"])


def _launch(cfg: dict) -> int:
    import signal as _signal

    uid = gid = UID_BASE + os.getpid() % _UID_SPAN
    if cfg["level"] != "namespaces":  # basic: same user (toolchains may live in its home), limits only
        _set_limits(cfg["limits"], root=False)
        _exec(cfg)
        return 127  # not reached
    libc = _libc()
    _chown_tree(cfg["workdir"], uid, gid)
    _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS), "unshare")
    init = os.fork()
    if init == 0:  # PID 1 of the new PID namespace
        try:
            libc.prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
            _readonly_everything_but(libc, cfg["workdir"], cfg.get("expose"))
            _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount /proc")
            child = os.fork()
            if child == 0:
                try:
                    _set_limits(cfg["limits"], root=True)
                    _drop_privileges(libc, uid, gid)
                    _exec(cfg)
                except BaseException as e:  # noqa: BLE001 - report and fail the run
                    os.write(2, f"sandbox: cannot start {cfg['argv'][0]!r}: {e}\n".encode())
                os._exit(127)
            status = 0
            while True:  # reap everything; leave when the program itself has exited
                pid, st = os.wait()
                if pid == child:
                    status = st
                    break
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox: setup failed: {e}\n".encode())
            os._exit(126)
    _, st = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(st)
    return code if code >= 0 else 128 - code


def _probe(d: str) -> int:
    """Can this machine give the ``namespaces`` level? (run by ``isolation()`` in a throwaway process)"""
    libc = _libc()
    try:
        _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS), "unshare")
        pid = os.fork()
        if pid == 0:
            try:
                _readonly_everything_but(libc, d, exposed_paths([sys.executable]))
                _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "proc")
                os._exit(0)
            except BaseException:  # noqa: BLE001
                os._exit(1)
        _, st = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(st) != 0:
            return 1
    except OSError:
        return 1
    print("probe-ok")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(_probe(sys.argv[2]))
    sys.exit(_launch(json.loads(sys.argv[1])))
