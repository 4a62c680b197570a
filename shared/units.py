"""Units: link bandwidth (flags and configs give Mbit/s, as link speeds are quoted; every rate in code is bytes/s),
and durations as people read them."""

from __future__ import annotations

BYTES_PER_MBIT = 1e6 / 8


def duration(seconds: float) -> str:
    """3 s, 4 min 05 s, 2 h 03 min: readable at any scale (busy time, waits)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
