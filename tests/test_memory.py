"""shared.memory against glibc itself: a fragmented heap keeps its freed pages until release_free_memory hands them
back; the arena cap is accepted. In a child process, so the figures are that process's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.memory import _glibc

CHILD = textwrap.dedent("""
    import json, sys
    from shared.memory import tune_malloc, release_free_memory

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    capped = tune_malloc()
    # 2 KB blocks come from malloc (Python's own allocator takes 512 bytes at most); every 50th one kept pins
    # the heap's top, so free() cannot shrink it and the freed pages stay resident.
    size = int(sys.argv[1])  # not a literal: the compiler would fold b"x" * 2048 into one shared constant
    blocks = [b"x" * size for _ in range(100_000)]
    kept = blocks[::50]
    before = rss_mb()
    del blocks
    freed = rss_mb()
    released = release_free_memory()
    after = rss_mb()
    print(json.dumps({"capped": capped, "released": released, "before": before, "freed": freed, "after": after,
                      "kept": len(kept)}))
""")


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_freed_pages_stay_resident_until_released() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, "2048"], capture_output=True, text=True, check=True, timeout=60)
    figures = json.loads(out.stdout)
    assert figures["capped"] and figures["released"]
    # ~200 MB allocated; free() alone hands back little of it, the trim nearly all
    assert figures["freed"] > figures["before"] - 50, figures
    assert figures["after"] < figures["freed"] - 150, figures


THRESHOLD_CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from shared.memory import tune_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "tuned":
        tune_malloc()
    # glibc's own rule: freeing a mapped block raises the threshold to its size, so the next block a little
    # smaller comes from the arena; a threshold set by mallopt stays where it was put
    libc.free(libc.malloc(8 << 20))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(2 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    print(json.dumps({"mapped": mapped}))
""")


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_a_tuned_threshold_keeps_mapping_blocks_of_a_few_mb() -> None:
    def mapped(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", THRESHOLD_CHILD, mode], capture_output=True, text=True, check=True, timeout=60
        )
        return json.loads(out.stdout)["mapped"]

    assert mapped("default") == 0  # glibc raised its threshold past 2 MB: the block came from the arena
    assert mapped("tuned") >= 2 << 20


PINNING_CHILD = textwrap.dedent("""
    import json, os, sys
    from shared.memory import release_free_memory, tune_malloc, use_c_allocator

    use_c_allocator()  # re-runs this very command line unless PYTHONMALLOC is set
    tune_malloc()

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    base = rss_mb()
    # A burst of short-lived small objects (a submission's decoded ints and floats), one in 200 kept for long (a
    # cache entry made meanwhile): each kept one pins the 1 MiB arena it sits in, under Python's own allocator.
    burst = [(float(i), float(-i)) for i in range(2_000_000)]
    kept = burst[::200]
    del burst
    release_free_memory()
    print(json.dumps({"pymalloc_blocks": sys.getallocatedblocks(), "kept_mb": rss_mb() - base, "kept": len(kept),
                      "env": [k for k in os.environ if k in ("PYTHONMALLOC", "ECHO2_PYTHONMALLOC_SET")]}))
""")


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_the_c_allocator_hands_back_what_a_few_survivors_of_a_burst_pin() -> None:
    def run(env: dict[str, str]) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", PINNING_CHILD], capture_output=True, text=True, check=True, timeout=120, env=env
        )
        return json.loads(out.stdout)

    chosen = run({**os.environ, "PYTHONMALLOC": "pymalloc"})  # the user's choice stands
    c_heap = run({k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"})
    assert chosen["pymalloc_blocks"] > 0 and chosen["env"] == ["PYTHONMALLOC"]
    # Re-run under glibc's allocator, whose marks are gone from what it would hand its own children.
    assert c_heap["pymalloc_blocks"] == 0 and c_heap["env"] == []
    # 10,000 survivors of a ~270 MB burst: pymalloc keeps nearly every arena (~245 MB measured), the trimmed C heap
    # the 4 KiB page each survivor sits on (~40 MB).
    assert chosen["kept_mb"] > 150, chosen
    assert c_heap["kept_mb"] < chosen["kept_mb"] / 3, (c_heap, chosen)


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_a_hub_started_with_stdout_closed_or_python_E_still_starts() -> None:
    probe = (
        "import sys; from shared.memory import use_c_allocator; use_c_allocator(); "
        "print(sys.getallocatedblocks() == 0, file=sys.stderr)"
    )
    closed = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{probe}" >&-'], capture_output=True, text=True, timeout=60)
    assert closed.returncode == 0 and closed.stderr.strip() == "True", closed.stderr
    # -E ignores PYTHONMALLOC: no second start, Python's allocator kept.
    ignoring = subprocess.run(
        [sys.executable, "-E", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert ignoring.returncode == 0 and ignoring.stderr.strip() == "False", ignoring.stderr
