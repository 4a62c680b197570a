"""glibc's allocator, kept from hoarding what a long-running process frees: few arenas, free pages handed back.

A process that runs for weeks (the hub) allocates from many threads: trio's worker threads, torch's, SQLite's
callers. glibc gives each contending thread an arena of its own (up to 8 per core) and returns freed memory to the
system only from the top of a heap, so a fragmented arena keeps its pages. In bench/soak.py's 20 minutes the hub sat
at 830-950 MB and climbed 63 MB per thousand steps, Python's own objects growing by ~4. With two arenas and a trim
after each learner step it rests at ~440 MB: in-use heap ~175 MB, the ~250 MB a step frees handed back. Fixing the
mmap threshold (below) took its peak from ~580 MB to ~550. A trim costs ~5 ms after a step of the soak's model and
left the step's time unchanged (0.068 vs 0.069 s, side by side). Other C libraries (macOS, musl) manage memory their
own way; there both calls say so by returning False.

`echo-hub start` also puts Python's own objects in glibc's heap (use_c_allocator), where that trim reaches them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers in glibc's malloc.h
M_ARENA_MAX = -8
HUB_MALLOC_ARENAS = 2  # the learner's thread and the event loop's workers: more only fragments
# Blocks from this size up are mapped and unmapped on their own, never left in an arena. Setting it also stops glibc
# from raising the threshold each time a mapped block is freed (up to 32 MB): after such a raise, blocks of a few MB
# that were mapped before come from the arena and stay there, and the hub's resting RSS stepped up by ~20 MB.
HUB_MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if ctypes.util.find_library("c") is None:
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def tune_malloc(arenas: int = HUB_MALLOC_ARENAS, mmap_threshold_bytes: int = HUB_MMAP_THRESHOLD_BYTES) -> bool:
    """Cap glibc's arenas from now on (threads started later share them) and fix its mmap threshold; False where the C
    library is not glibc."""
    libc = _glibc()
    if libc is None:
        log.info("malloc not tuned: the C library is not glibc")
        return False
    return bool(
        libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas))
        and libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(mmap_threshold_bytes))
    )


def release_free_memory() -> bool:
    """Hand every arena's free pages back to the system (malloc_trim); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


# Set, with PYTHONMALLOC, by the re-execution below: the process that sees it takes both out of its environment, so
# that what it starts (local nodes, tokenizer workers) gets the user's.
REEXEC_MARK_ENV = "ECHO2_PYTHONMALLOC_SET"


def use_c_allocator() -> None:
    """Run this command line again with Python's objects in glibc's heap (PYTHONMALLOC=malloc); returns only where it
    already runs so, where the user chose an allocator (PYTHONMALLOC set, or -E / -I), where the C library is not glibc,
    or where there is no command line or interpreter to run again (embedded; said on stderr).

    Python's own allocator (pymalloc) serves objects up to 512 bytes from 1 MiB arenas and hands an arena back only
    once every object in it is freed. A process that lives for weeks and keeps a few objects from each burst of
    short-lived ones (a submission decodes thousands of ints and floats) keeps whole arenas for them: in bench/soak.py
    the hub's resting RSS grew by 14-16 MB per thousand steps while its live Python objects grew by ~2. In glibc's heap,
    the trim after each learner step (release_free_memory) hands back every free 4 KiB page wherever it lies: the same
    bench's last hub life then stayed within 539-545 MB over 900 steps. The cost, in one side-by-side pair of 6-minute
    soaks: learner steps 8% longer on this CPU (0.453 s median against 0.418), 6% fewer steps. A user who would rather
    keep pymalloc sets PYTHONMALLOC=pymalloc.
    """
    if REEXEC_MARK_ENV in os.environ:
        os.environ.pop(REEXEC_MARK_ENV)
        os.environ.pop("PYTHONMALLOC", None)
        return
    # -E and -I ignore PYTHONMALLOC: running again would change nothing.
    if _glibc() is None or "PYTHONMALLOC" in os.environ or sys.flags.ignore_environment or not sys.orig_argv:
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when started with the stream closed
            stream.flush()
    # sys.orig_argv is the command line as typed (`echo-hub start ...`, `python -m hub.cli.main start ...`): the
    # same script, flags and import path again.
    try:
        os.execve(
            sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONMALLOC": "malloc", REEXEC_MARK_ENV: "1"}
        )
    except OSError as exc:  # no interpreter to run again (sys.executable empty or gone): say so and go on
        print(
            f"note: Python's own allocator kept ({sys.executable or 'no interpreter path'} could not be run again: "
            f"{exc.strerror}); the hub's resting memory may grow over a long run",
            file=sys.stderr,
        )
