"""Units of link bandwidth: flags and configs give Mbit/s (as link speeds are quoted); every rate in code is bytes/s."""

from __future__ import annotations

BYTES_PER_MBIT = 1e6 / 8
