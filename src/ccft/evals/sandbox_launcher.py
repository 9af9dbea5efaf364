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
* ``level``: ``"namespaces"`` or ``"basic"``;
* ``limits``: ``dataclasses.asdict(ccft.evals.sandbox.Limits)`` (``timeout_s`` in s, ``memory_mb``
  in MiB, ``memory_kind`` ``as``/``data``, ``max_procs``, ``max_file_mb`` in MiB,
  ``max_open_files``);
* ``argv`` and ``env``: the program's command and its complete (scrubbed) environment;
* ``expose``: ``{hidden ancestor: [child names]}`` from :func:`exposed_paths`.

Exit status: the program's own, or :func:`encode_exit` of it (``128 + signal`` for a signal death),
126 when the isolation could not be set up, 127 when the program could not be started.
``python -I -S sandbox_launcher.py --probe DIR`` tries the namespaces and mounts in a throwaway
process and prints ``probe-ok`` when this machine can give the ``namespaces`` level.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["DEFAULT_PATH", "UID_BASE", "UID_SPAN", "decode_exit", "encode_exit", "exposed_paths", "launch", "probe",
           "sandbox_uid", "uid_processes"]

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h).
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_NAMESPACES = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_MNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
              "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME, "strictatime": _MS_STRICTATIME}

#: First uid/gid of the sandbox range (one uid per concurrent run, so RLIMIT_NPROC is per run).
UID_BASE = 1_500_000
#: Size of the uid range: a run's uid is ``UID_BASE + launcher pid % UID_SPAN``.
UID_SPAN = 400_000

#: ``PATH`` of the launcher and of every program (the evaluator's own ``PATH`` is never passed on).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_SIGNAL_BASE = 128


def sandbox_uid(launcher_pid: int) -> int:
    """The uid (and gid) the program of the launcher with pid ``launcher_pid`` runs as (namespaces level)."""
    return UID_BASE + launcher_pid % UID_SPAN


def encode_exit(code: int) -> int:
    """``os.waitstatus_to_exitcode`` result -> an exit status: a death by signal ``s`` (``-s``) is ``128 + s``."""
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
        _check(libc.mount(b"tmpfs", anc.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=755,size=64k"),
               f"cover {anc}")
        for child in children:
            src, dst = os.path.join(stage, child), os.path.join(anc, child)
            if os.path.isdir(src):
                os.mkdir(dst)
            else:
                open(dst, "w").close()
            _check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"expose {dst}")
        _check(libc.umount2(stage.encode(), _MNT_DETACH), f"unstage {anc}")
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


def _mount_proc(libc) -> None:
    _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount /proc")


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
        nproc += len(uid_processes(os.getuid()))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def _drop_privileges(libc, uid: int, gid: int) -> None:
    import signal

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid: set it afterwards
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _exec(cfg: dict) -> None:
    os.chdir(cfg["workdir"])
    argv = cfg["argv"]
    exe = shutil.which(argv[0], path=cfg["env"].get("PATH", DEFAULT_PATH)) or argv[0]
    os.execve(exe, argv, cfg["env"])


# ------------------------------------------------------------------ entry points

def launch(cfg: dict) -> int:
    """Run the program of ``cfg`` (see the module docstring) under its level; returns the exit status.

    ``basic``: limits, then ``exec`` in this process (never returns). ``namespaces`` (root): chown
    the working directory to :func:`sandbox_uid`, unshare mount/network/PID/IPC/UTS namespaces,
    fork the namespace's init (read-only mounts, hidden homes, private ``/proc``), which forks the
    program (limits, unprivileged uid, ``no_new_privs``, ``exec``) and reaps every process until the
    program exits. Raises ``OSError`` when the namespaces cannot be created.
    """
    import signal

    uid = gid = sandbox_uid(os.getpid())
    if cfg["level"] != "namespaces":  # basic: same user (toolchains may live in its home), limits only
        _set_limits(cfg["limits"], root=False)
        _exec(cfg)
        return 127  # not reached
    libc = _libc()
    _chown_tree(cfg["workdir"], uid, gid)
    _check(libc.unshare(_NAMESPACES), "unshare")
    init = os.fork()
    if init == 0:  # PID 1 of the new PID namespace
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _readonly_everything_but(libc, cfg["workdir"], cfg.get("expose"))
            _mount_proc(libc)
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
            os._exit(encode_exit(os.waitstatus_to_exitcode(status)))
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox: setup failed: {e}\n".encode())
            os._exit(126)
    _, st = os.waitpid(init, 0)
    return encode_exit(os.waitstatus_to_exitcode(st))


def probe(workdir: str) -> int:
    """Can this machine give the ``namespaces`` level? Prints ``probe-ok`` and returns 0 if so, else 1.

    Tries, in this (throwaway) process, exactly the namespaces and mounts :func:`launch` uses, with
    ``workdir`` as the writable folder.
    """
    libc = _libc()
    try:
        _check(libc.unshare(_NAMESPACES), "unshare")
        pid = os.fork()
        if pid == 0:
            try:
                _readonly_everything_but(libc, workdir, exposed_paths([sys.executable]))
                _mount_proc(libc)
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
        sys.exit(probe(sys.argv[2]))
    sys.exit(launch(json.loads(sys.argv[1])))
