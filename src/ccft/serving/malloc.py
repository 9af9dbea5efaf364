"""Allocator setting for a long-running server: glibc's mmap threshold (``ccft serve`` sets it at start).

glibc's malloc serves requests below its mmap threshold from per-thread arenas, and raises that
threshold dynamically (up to 32 MiB on 64-bit) each time a large mmapped block is freed. A server
that builds and frees many mid-sized buffers (request bodies, token lists, per-step tensors of
varying shape) from several threads then keeps them in arenas whose free pages are seldom returned:
RSS creeps up under a steady load. Fixing the threshold at 64 KiB (``mallopt(M_MMAP_THRESHOLD,
65536)``, which also turns the dynamic adjustment off) makes every block of 64 KiB or more its own
mapping, unmapped when freed. Measured with ``make soak`` (docs/serving.md, "Soak").

Elsewhere (musl, macOS, Windows) ``tune_malloc`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["tune_malloc", "MMAP_THRESHOLD_BYTES", "M_MMAP_THRESHOLD"]

#: glibc's ``mallopt`` parameter number for the mmap threshold (``<malloc.h>``)
M_MMAP_THRESHOLD = -3
#: the threshold ``ccft serve`` sets (bytes)
MMAP_THRESHOLD_BYTES = 64 * 1024


def tune_malloc(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold to ``threshold_bytes`` (bytes) via ``mallopt``; no-op off glibc.

    Returns:
        True when glibc accepted the setting; False off glibc or when ``mallopt`` refused it (the
        process then runs with the allocator's defaults, nothing else changes). Never raises.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
