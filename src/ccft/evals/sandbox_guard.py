"""The ``basic`` sandbox level's guard for Python programs: an audit hook installed as ``sitecustomize``.

:class:`ccft.evals.sandbox.Sandbox` copies this file as ``sitecustomize.py`` into a folder on the
program's ``PYTHONPATH``, so Python imports it at start-up, before the program (PEP 578 audit hooks,
which cannot be removed once added). The hook refuses, with ``PermissionError``: opening a file for
writing, and removing, creating, renaming, linking or changing files, outside the working directory
(``/dev/null``, ``/dev/stdout`` and ``/dev/stderr`` excepted); sockets other than ``AF_UNIX`` and
every connect/bind/send/name lookup; process creation, ``exec`` and signals to other processes
(docs/design.md K10). It is not isolation: a program that calls the C library through ``ctypes``
gets past every check, which is why the ``basic`` level runs generated code only on an explicit
opt-in (docs/sandbox.md). Standard library only. Imported under any other name (as
``ccft.evals.sandbox_guard``) it installs nothing.
"""

from __future__ import annotations

import os
import sys

_CWD = os.path.realpath(os.getcwd())
_OK_DEV = ("/dev/null", "/dev/stdout", "/dev/stderr")
_FILE_EVENTS = (
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.rename",
    "os.chmod",
    "os.chown",
    "os.link",
    "os.symlink",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
)
_NET_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo")
_PROCESS_EVENTS = (
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
    "os.kill",
    "os.killpg",
)


def _inside(p) -> bool:
    try:
        p = os.path.realpath(os.fsdecode(p) if not isinstance(p, int) else "/proc/self/fd/%d" % p)
    except Exception:  # noqa: BLE001 - an unreadable path is outside
        return False
    return p == _CWD or p.startswith(_CWD + os.sep) or p in _OK_DEV


def _hook(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags or 0) & (
            os.O_WRONLY | os.O_RDWR | os.O_CREAT
        )
        if writing and not _inside(path):
            raise PermissionError(
                "sandbox: writing outside the working directory is not allowed: %r" % (path,)
            )
    elif event in _FILE_EVENTS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError("sandbox: %s outside the working directory is not allowed" % event)
    elif event == "socket.__new__":
        if args[1] != getattr(__import__("socket"), "AF_UNIX", 1):
            raise PermissionError("sandbox: network sockets are not allowed")
    elif event in _NET_EVENTS:
        raise PermissionError("sandbox: network access is not allowed")
    elif event in _PROCESS_EVENTS:
        raise PermissionError("sandbox: %s is not allowed" % event)


if __name__ == "sitecustomize":
    sys.addaudithook(_hook)
