"""Allocator policy for a long-running server (``ccft serve --malloc``; docs/serving.md, "Allocator").

glibc's malloc serves requests below its mmap threshold from per-thread arenas, and raises that
threshold dynamically (up to 32 MiB on 64-bit) each time a large mmapped block is freed. A server
that builds and frees many mid-sized buffers (request bodies, token lists, per-step tensors of
varying shape) from several threads then keeps them in arenas whose free pages are seldom returned:
RSS creeps up under a steady load. Two remedies, measured with ``make soak`` and
``benchmarks/prefix_pool.py`` (docs/serving.md):

* ``trim`` (``ccft serve``'s default): glibc's own thresholds, so a forward's large temporaries are
  reused from the arenas, and ``malloc_trim(0)`` every ``TRIM_INTERVAL_S`` seconds from a daemon thread
  (``MallocTrimmer``), which gives the arenas' free pages back to the OS.
* ``mmap-64k``: the mmap threshold fixed at 64 KiB (``mallopt(M_MMAP_THRESHOLD, 65536)``, which also
  turns the dynamic adjustment off): every block of 64 KiB or more is its own mapping, unmapped when
  freed, so each forward page-faults its large temporaries afresh (slower prefill).

``glibc`` does neither. Elsewhere (musl, macOS, Windows) every policy is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform
import threading

from ccft.core.errors import ConfigError

__all__ = [
    "MALLOC_POLICIES",
    "MMAP_THRESHOLD_BYTES",
    "M_MMAP_THRESHOLD",
    "TRIM_INTERVAL_S",
    "MallocTrimmer",
    "apply_malloc_policy",
    "check_malloc_policy",
    "trim_malloc",
    "tune_malloc",
]

log = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter number for the mmap threshold (``<malloc.h>``)
M_MMAP_THRESHOLD = -3
#: the threshold of the ``mmap-64k`` policy (bytes)
MMAP_THRESHOLD_BYTES = 64 * 1024
#: seconds between two ``malloc_trim(0)`` calls of the ``trim`` policy
TRIM_INTERVAL_S = 10.0
#: ``ccft serve --malloc`` choices, the default first
MALLOC_POLICIES = ("trim", "mmap-64k", "glibc")


@functools.cache
def _glibc():
    """The C library when it is glibc on Linux, else None (looked up once: ``find_library`` runs ldconfig)."""
    try:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return None
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold to ``threshold_bytes`` (bytes) via ``mallopt`` (the ``mmap-64k`` policy).

    Returns:
        True when glibc accepted the setting; False off glibc or when ``mallopt`` refused it (the
        process then runs with the allocator's defaults, nothing else changes). Never raises.
    """
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1


def trim_malloc() -> bool:
    """glibc's ``malloc_trim(0)``: the free pages of every arena go back to the OS (they are faulted in again
    when used). Returns True where it ran (glibc), False elsewhere. Never raises."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


class MallocTrimmer:
    """A daemon thread calling ``trim_malloc()`` every ``interval_s`` seconds (the ``trim`` policy).

    Args:
        interval_s: seconds between two calls (> 0).
    Raises:
        ValueError: ``interval_s`` ≤ 0.
    Attributes:
        trims: calls made so far.
    """

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s}; it must be > 0")
        self.interval_s = float(interval_s)
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start the thread; False (and no thread) off glibc."""
        if _glibc() is None:
            return False
        self._thread = threading.Thread(target=self._run, name="ccft-malloc-trim", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            trim_malloc()
            self.trims += 1

    def stop(self) -> None:
        """Stop the thread (returns once it has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def check_malloc_policy(policy: str) -> str:
    """``policy`` when it is one of ``MALLOC_POLICIES``.

    Raises:
        ConfigError: an unknown policy (named as ``--malloc``, the option that passes it).
    """
    if policy not in MALLOC_POLICIES:
        raise ConfigError(f"--malloc {policy!r}: use one of {', '.join(MALLOC_POLICIES)}")
    return policy


def apply_malloc_policy(policy: str) -> MallocTrimmer | None:
    """Apply one of ``MALLOC_POLICIES`` to this process (module docstring); returns the running trimmer for
    ``trim`` on glibc, else None.

    Raises:
        ConfigError: an unknown policy (named as ``--malloc``, the option that passes it).
    """
    if check_malloc_policy(policy) == "mmap-64k":
        if not tune_malloc():
            log.info("--malloc mmap-64k: not glibc, nothing set")
        return None
    if policy == "trim":
        trimmer = MallocTrimmer()
        return trimmer if trimmer.start() else None
    return None
