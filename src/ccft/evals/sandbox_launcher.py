"""The sandbox launcher: the code that runs inside the child process, between the evaluator and the program.

:meth:`ccft.evals.sandbox.Sandbox.run` starts this file as a script, ``python -I -S
sandbox_launcher.py CONFIG_JSON``, so it must import nothing but the standard library (``-I`` drops
the script's folder and the user's site from ``sys.path``, ``-S`` skips ``site``; it is also
importable as ``ccft.evals.sandbox_launcher`` for the shared constants below). It applies the
limits and isolation, then ``exec``s the program, so nothing runs between ``fork`` and ``exec`` in
the evaluating process (which has torch threads). The guarantees of each level are listed in
``ccft.evals.sandbox`` (docs/design.md K10).

``CONFIG_JSON`` (built by the host):

* ``workdir``: the fresh working directory (absolute); the program runs there;
* ``level``: ``"namespaces"``, ``"userns"`` or ``"basic"``;
* ``rootdir`` (``userns`` only): an empty folder outside ``workdir`` on which the new root is built;
* ``limits``: ``dataclasses.asdict(ccft.evals.sandbox.Limits)`` (``timeout_s`` in s, ``memory_mb``
  in MiB, ``memory_kind`` ``as``/``data``, ``max_procs``, ``max_file_mb`` in MiB,
  ``max_open_files``);
* ``argv`` and ``env``: the program's command and its complete (scrubbed) environment;
* ``expose``: ``{hidden ancestor: [child names]}`` from :func:`exposed_paths`;
* ``needs`` (``userns``): :func:`root_paths` of the executable, the interpreter and the toolchain;
* ``nproc_base`` (``basic`` inside bubblewrap): the user's process count outside, for ``RLIMIT_NPROC``.

Exit status: the program's own, or :func:`encode_exit` of it (``128 + signal`` for a signal death),
126 when the isolation could not be set up, 127 when the program could not be started.
``python -I -S sandbox_launcher.py --probe LEVEL DIR`` tries the namespaces and mounts of ``LEVEL``
(``namespaces`` or ``userns``) in a throwaway process and prints ``probe-ok`` when this machine can
give that level. SIGTERM to the launcher kills the namespace's init and returns once every process
of the namespace is gone (the host's wall-time and output limits use it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

__all__ = [
    "DEFAULT_PATH",
    "SYSTEM_DIRS",
    "UID_BASE",
    "UID_SPAN",
    "decode_exit",
    "encode_exit",
    "exposed_paths",
    "launch",
    "probe",
    "root_layout",
    "root_paths",
    "sandbox_uid",
    "uid_processes",
]

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h).
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWUSER = 0x20000000, 0x40000000, 0x10000000
_NAMESPACES = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MNT_DETACH = 2
#: pivot_root(2) has no glibc wrapper: its system call number per architecture (arch/*/unistd).
_SYS_PIVOT_ROOT = {
    "x86_64": 155,
    "aarch64": 41,
    "riscv64": 41,
    "loongarch64": 41,
    "ppc64le": 203,
    "ppc64": 203,
    "s390x": 217,
    "i686": 217,
    "i386": 217,
    "armv7l": 218,
}
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_MNT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}

#: First uid/gid of the sandbox range (one uid per concurrent run, so RLIMIT_NPROC is per run).
UID_BASE = 1_500_000
#: Size of the uid range: a run's uid is ``UID_BASE + launcher pid % UID_SPAN``.
UID_SPAN = 400_000

#: ``PATH`` of the launcher and of every program (the evaluator's own ``PATH`` is never passed on).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Read-only system folders of the ``userns`` level's new root (besides the toolchain's own folders).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
#: Device nodes bound into the new root's ``/dev``.
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

_SIGNAL_BASE = 128


def sandbox_uid(launcher_pid: int) -> int:
    """The uid (and gid) the program of the launcher with pid ``launcher_pid`` runs as (namespaces level)."""
    return UID_BASE + launcher_pid % UID_SPAN


def encode_exit(code: int) -> int:
    """``os.waitstatus_to_exitcode`` result -> an exit status: a death by signal ``s`` (``-s``) is
    ``128 + s``."""
    return code if code >= 0 else _SIGNAL_BASE - code


def decode_exit(status: int) -> int:
    """Inverse of :func:`encode_exit` for the launcher's exit status: ``128 + s`` (1 ≤ s ≤ 64) is ``-s``."""
    return -(status - _SIGNAL_BASE) if _SIGNAL_BASE + 1 <= status <= _SIGNAL_BASE + 64 else status


def uid_processes(uid: int) -> list[int]:
    """Pids of the processes that ``uid`` owns, read from ``/proc`` (Linux)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


# ------------------------------------------------------------------ which hidden folders to re-expose


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
    caches) stays invisible. Returns ``{hidden ancestor: [child names]}`` (sorted names).
    """
    out: dict[str, set[str]] = {}
    for p in paths:
        if not p:
            continue
        hit = _hidden_ancestor(os.path.realpath(p))
        if hit is not None:
            out.setdefault(hit[0], set()).add(hit[1])
    return {k: sorted(v) for k, v in out.items()}


# ------------------------------------------------------------------ system calls (ctypes, Linux)


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
        _check(
            libc.mount(b"tmpfs", anc.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=755,size=64k"),
            f"cover {anc}",
        )
        for child in children:
            src, dst = os.path.join(stage, child), os.path.join(anc, child)
            if os.path.isdir(src):
                os.mkdir(dst)
            else:
                open(dst, "w").close()
            _check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"expose {dst}")
        _check(libc.umount2(stage.encode(), _MNT_DETACH), f"unstage {anc}")
        os.rmdir(stage)


def _remount_readonly(libc, keep: str, required: tuple[str, ...] | None) -> None:
    """Remount every mount but ``keep`` and ``/proc`` read-only, keeping each mount's own flags.

    A failure is fatal for the mount points in ``required`` (``None``: for every mount point).
    """
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for parts in mounts:
        point = _unescape(parts[4])
        if point == keep or point == "/proc" or point.startswith("/proc/"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for opt in parts[5].split(","):
            flags |= _MNT_FLAGS.get(opt, 0)
        if libc.mount(None, point.encode(), None, flags, None) != 0 and (
            required is None or point in required
        ):
            _check(-1, f"remount {point} read-only")


def _readonly_everything_but(libc, workdir: str, expose: dict[str, list[str]] | None = None) -> None:
    """In a private mount namespace: hide restricted homes, keep ``workdir`` writable, all else read-only."""
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND | _MS_REC, None), "bind workdir")
    _hide_homes(libc, workdir, expose or {})
    _remount_readonly(libc, workdir, ("/", "/tmp", "/dev/shm"))


def _mount_proc(libc, target: str = "/proc") -> None:
    _check(
        libc.mount(b"proc", target.encode(), b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None),
        "mount /proc",
    )


def root_paths(paths: list[str]) -> list[str]:
    """The folders and files the ``userns`` level's new root must show besides :data:`SYSTEM_DIRS`.

    Each of ``paths`` (the program's executable, the interpreter, its prefixes, toolchain folders)
    as given and resolved (symbolic links followed), absolute, without duplicates, shortest first
    (so a folder is bound before anything inside it).
    """
    out: set[str] = set()
    for p in paths:
        if p:
            out.add(os.path.abspath(p))
            out.add(os.path.realpath(p))
    return sorted(out, key=lambda q: (len(q), q))


def root_layout(needs: list[str]) -> list[tuple[str, str | None]]:
    """What the new root of the ``userns`` and ``bwrap`` levels shows read-only: ``[(path, link)]``.

    :data:`SYSTEM_DIRS` and ``needs`` (:func:`root_paths`) that exist, each once (nothing inside a
    path already shown); ``link`` is the target of a system folder that is a symbolic link (merged
    ``/usr``: ``/bin -> usr/bin``), re-created as a link; ``None`` means bind the path.
    """
    shown: list[tuple[str, str | None]] = []
    for src in [*SYSTEM_DIRS, *needs]:
        if not os.path.lexists(src) or any(src == d or src.startswith(d + "/") for d, _ in shown):
            continue
        shown.append((src, os.readlink(src) if src in SYSTEM_DIRS and os.path.islink(src) else None))
    return shown


def _bind(libc, src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"bind {src}")


def _build_root(libc, newroot: str, workdir: str, needs: list[str]) -> None:
    """An empty tmpfs at ``newroot`` showing only the system folders, ``needs``, ``workdir``, a
    minimal /dev."""
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    _check(
        libc.mount(b"tmpfs", newroot.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=755,size=16m"),
        "mount the new root",
    )
    for src, link in root_layout(needs):
        if link is not None:
            os.symlink(link, newroot + src)
        else:
            _bind(libc, src, newroot + src)
    dev = newroot + "/dev"
    os.makedirs(dev, exist_ok=True)
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            try:
                _bind(libc, "/dev/" + name, f"{dev}/{name}")
            except OSError:
                if name != "tty":  # no terminal is fine; the others are not
                    raise
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.makedirs(newroot + "/proc", exist_ok=True)
    os.makedirs(newroot + "/tmp", exist_ok=True)
    _bind(libc, workdir, newroot + workdir)


def _pivot(libc, newroot: str) -> None:
    """Make ``newroot`` the root and detach the old one entirely (pivot_root(2), "new_root == put_old")."""
    import ctypes
    import platform

    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(38, f"pivot_root: unknown system call number on {platform.machine()}")
    os.chdir(newroot)
    _check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    _check(libc.umount2(b".", _MNT_DETACH), "detach the old root")
    os.chdir("/")


def _enter_userns(libc) -> None:
    """unshare(2) a new user namespace (this uid/gid mapped to itself) with the other namespaces."""
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(_CLONE_NEWUSER | _NAMESPACES), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _set_limits(limits: dict, nproc_base: int) -> None:
    """setrlimit for the program; ``nproc_base`` processes of the user are allowed on top of ``max_procs``."""
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
    nproc = int(limits["max_procs"]) + nproc_base
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def _no_new_privs(libc) -> None:
    import signal

    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid: set it afterwards
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _drop_privileges(libc, uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    _no_new_privs(libc)


def _exec(cfg: dict) -> None:
    os.chdir(cfg["workdir"])
    argv = cfg["argv"]
    exe = shutil.which(argv[0], path=cfg["env"].get("PATH", DEFAULT_PATH)) or argv[0]
    os.execve(exe, argv, cfg["env"])


def _run_namespace(libc, cfg: dict, setup, become) -> int:
    """Fork the new PID namespace's init (``setup()``: mounts), which forks the program (``become()``,
    then ``exec``) and reaps every process until the program exits. SIGTERM kills init (the kernel then
    kills every process of the namespace); returns the program's exit status (:func:`encode_exit`)."""
    import signal

    inits: list[int] = []

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        for pid in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not inits:
            os._exit(_SIGNAL_BASE + signum)

    signal.signal(signal.SIGTERM, stop)
    init = os.fork()
    if init == 0:  # PID 1 of the new PID namespace
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            setup()
            child = os.fork()
            if child == 0:
                try:
                    become()
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
            os._exit(encode_exit(os.waitstatus_to_exitcode(status)))
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox: setup failed: {e}\n".encode())
            os._exit(126)
    inits.append(init)
    # waitpid returns once init is gone, and init is gone only after every process of its namespace
    _, st = os.waitpid(init, 0)
    return encode_exit(os.waitstatus_to_exitcode(st))


# ------------------------------------------------------------------ entry points


def launch(cfg: dict) -> int:
    """Run the program of ``cfg`` (see the module docstring) under its level; returns the exit status.

    ``basic``: limits, then ``exec`` in this process (never returns). ``namespaces`` (root): chown
    the working directory to :func:`sandbox_uid`, unshare mount/network/PID/IPC/UTS namespaces,
    fork the namespace's init (read-only mounts, hidden homes, private ``/proc``), which forks the
    program (limits, unprivileged uid, ``no_new_privs``, ``exec``) and reaps every process until the
    program exits. ``userns`` (non-root): the same namespaces inside a new user namespace that maps
    the user's own uid/gid to themselves; init builds a new root (an empty tmpfs with
    :data:`SYSTEM_DIRS` and the toolchain read-only, the working directory writable, a minimal
    ``/dev``, a private ``/proc``), ``pivot_root``s into it and detaches the old root, so the user's
    home, other users' files and the evaluator's ``/proc`` are not there at all; the program keeps
    the uid and ``exec`` drops every capability (``no_new_privs``). Raises ``OSError`` when the
    namespaces cannot be created.
    """
    level = cfg["level"]
    if level == "basic":  # same user (toolchains may live in its home), limits only
        nproc_base = cfg.get("nproc_base")  # set by the host when this runs inside bubblewrap
        _set_limits(cfg["limits"], len(uid_processes(os.getuid())) if nproc_base is None else int(nproc_base))
        _exec(cfg)
        return 127  # not reached
    libc = _libc()
    workdir = cfg["workdir"]
    if level == "namespaces":
        uid = gid = sandbox_uid(os.getpid())
        _chown_tree(workdir, uid, gid)
        _check(libc.unshare(_NAMESPACES), "unshare")

        def setup():
            _readonly_everything_but(libc, workdir, cfg.get("expose"))
            _mount_proc(libc)

        def become():
            _set_limits(cfg["limits"], 0)  # the uid is this run's alone
            _drop_privileges(libc, uid, gid)

    elif level == "userns":
        if os.getuid() == 0:
            raise OSError(1, "the userns level is for non-root users (as root the level is 'namespaces')")
        nproc_base = len(uid_processes(os.getuid()))  # RLIMIT_NPROC may count them (kernels before 5.14)
        _enter_userns(libc)
        root = cfg["rootdir"]

        def setup():
            _build_root(libc, root, workdir, cfg.get("needs", []))
            _mount_proc(libc, root + "/proc")  # while the old /proc is visible (the kernel requires it)
            _pivot(libc, root)
            _remount_readonly(libc, workdir, None)

        def become():
            _set_limits(cfg["limits"], nproc_base)
            _no_new_privs(libc)

    else:
        raise ValueError(f"sandbox level {level!r}")
    return _run_namespace(libc, cfg, setup, become)


_PROBE_LIMITS = {
    "timeout_s": 30,
    "memory_mb": 1024,
    "memory_kind": "as",
    "max_procs": 64,
    "max_output_bytes": 1 << 16,
    "max_file_mb": 16,
    "max_open_files": 256,
}


def probe(level: str, tmp: str) -> int:
    """Can this machine give ``level`` (``namespaces`` or ``userns``)? Prints ``probe-ok`` and returns 0 if
    so.

    Runs, in this (throwaway) process, :func:`launch` of a Python program that checks it is the
    second process of a new PID namespace, with ``tmp/work`` as the working directory.
    """
    work, root = os.path.join(tmp, "work"), os.path.join(tmp, "root")
    os.chmod(tmp, 0o755)  # the namespaces level's uid must reach the working directory
    for d in (work, root):
        os.mkdir(d)
        os.chmod(d, 0o755)
    exe = os.path.realpath(sys.executable)
    cfg = {
        "workdir": work,
        "rootdir": root,
        "level": level,
        "limits": _PROBE_LIMITS,
        "env": {"PATH": DEFAULT_PATH},
        "argv": [exe, "-I", "-S", "-c", "import os; assert os.getpid() == 2"],
        "expose": exposed_paths([exe, sys.prefix, sys.base_prefix]),
        "needs": root_paths([exe, sys.prefix, sys.base_prefix]),
    }
    try:
        rc = launch(cfg)
    except OSError:
        return 1
    if rc != 0:
        return 1
    print("probe-ok")
    return 0


USAGE = """usage: python -I -S sandbox_launcher.py CONFIG_JSON | --probe ARG ARG

The in-child side of ccft.evals.sandbox: started by Sandbox.run with one JSON argument (the run's
configuration), never by hand. --probe is the isolation probe the host runs once per level."""

if __name__ == "__main__":
    if sys.argv[1:2] in (["--help"], ["-h"], []):
        print(USAGE)
        sys.exit(0 if sys.argv[1:] else 2)
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(probe(sys.argv[2], sys.argv[3]))
    sys.exit(launch(json.loads(sys.argv[1])))
