"""Peer and ccft servers as child processes for the benchmarks: a free loopback port, a server started in its
own session and waited for, and the whole process group stopped afterwards (``ccft bench peers``, ``soak``,
the vLLM and llama.cpp wrappers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

from ccft.core.errors import ConfigError

__all__ = ["free_port", "server_process", "stop_process_group"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group (a server and the workers it started), SIGKILL after 30 s, and
    SIGKILL the group once more for workers left behind by a leader that exited first."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def server_process(
    cmd: list[str],
    url: str,
    health: str,
    *,
    log=print,
    ready_timeout: float,
    env: dict | None = None,
    error: type[Exception] = ConfigError,
):
    """Run the server ``cmd`` in its own session (stdout and stderr to a temporary file) and yield its
    ``Popen`` once ``url + health`` answers 200; on exit stop its process group (``stop_process_group``).

    Raises:
        error (default ConfigError): the process exits before it is ready (the message has the last 3000
            characters of its output), or it is not ready after ``ready_timeout`` seconds.
    """
    cmd = [str(c) for c in cmd]
    name = os.path.basename(cmd[0])
    log("[ccft] $ " + " ".join(cmd))
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    out.seek(0)
                    raise error(
                        f"{name} exited with {proc.returncode}:\n"
                        f"{out.read().decode(errors='replace')[-3000:]}"
                    )
                with contextlib.suppress(OSError), urllib.request.urlopen(url + health, timeout=5):
                    break
                if time.monotonic() > deadline:
                    raise error(f"{name} not ready after {ready_timeout:.0f} s: {' '.join(cmd)}")
                time.sleep(0.5)
            yield proc
        finally:
            stop_process_group(proc)
