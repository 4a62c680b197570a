"""glibc's allocator, kept from hoarding what a long-running process frees: few arenas, free pages handed back.

A process that runs for weeks (the hub) allocates from many threads: trio's worker threads, torch's, SQLite's
callers. glibc gives each contending thread an arena of its own (up to 8 per core) and returns freed memory to the
system only from the top of a heap, so a fragmented arena keeps its pages. In bench/soak.py's 20 minutes the hub sat
at 830-950 MB and climbed 63 MB per thousand steps with Python's own objects growing by ~4; with two arenas and a
trim after each learner step it rests at ~440 MB and climbs ~16. Other C libraries (macOS, musl) manage memory their
own way; there both calls say so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
HUB_MALLOC_ARENAS = 2  # the learner's thread and the event loop's workers: more only fragments


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if ctypes.util.find_library("c") is None:
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def limit_malloc_arenas(arenas: int = HUB_MALLOC_ARENAS) -> bool:
    """Cap glibc's arenas from now on (threads started later share them); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        log.info("malloc arenas not capped: the C library is not glibc")
        return False
    return bool(libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas)))


def release_free_memory() -> bool:
    """Hand every arena's free pages back to the system (malloc_trim); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True
