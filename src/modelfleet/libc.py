"""glibc, where the process has it: the C heap's controls, for every kind of process.

A runtime fixes its allocator's thresholds and trims after evictions
(``runtime/memory.py``); every process trims once after start-up (``launch.py``). On a
system without glibc (musl, macOS) ``LIBC`` is None and these do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None  # not glibc (musl has no gnu_get_libc_version)
    return libc


LIBC = _glibc()


def trim() -> bool:
    """Give freed heap pages back to the system (``malloc_trim(0)``); False if none or
    not glibc."""
    return LIBC is not None and bool(LIBC.malloc_trim(ctypes.c_size_t(0)))
