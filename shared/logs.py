"""Process logs: one size-rotated file per data dir, and per-peer rate limits on lines peers can trigger.

Retention: a log file rotates at LOG_MAX_BYTES and LOG_BACKUPS old files are kept (hub.log, hub.log.1, ...),
so a hub's or node's logs never take more than (LOG_BACKUPS + 1) * LOG_MAX_BYTES of its data dir.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

LOG_MAX_BYTES = 50 * 1024 * 1024
LOG_BACKUPS = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Lines a peer can cause (its refused requests): at most one per PEER_LOG_WINDOW_S each, with a count of the rest.
PEER_LOG_WINDOW_S = 10.0
PEER_LOG_KEYS = 10_000


def setup_logging(path: Path, level: str, stderr_level: int | None = None) -> None:
    """Log to `path` (rotated by size) at `level`; also to stderr from `stderr_level` when given. py-libp2p logs
    ordinary peer churn at ERROR: it goes to the file only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    if stderr_level is not None:
        stderr = logging.StreamHandler()
        stderr.setLevel(stderr_level)
        root.addHandler(stderr)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)


class PeerLogLimiter:
    """Whether a peer-triggered line may be logged now: one per key per window; the next one allowed says how
    many were held back. The table forgets keys past their window once it holds PEER_LOG_KEYS."""

    def __init__(self, window_s: float = PEER_LOG_WINDOW_S) -> None:
        self.window_s = window_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last logged, lines held back since)

    def allow(self, key: str, now: float) -> tuple[bool, int]:
        """(log it?, lines held back since the last one logged)."""
        last, held = self._last.get(key, (-self.window_s, 0))
        if now - last < self.window_s:
            self._last[key] = (last, held + 1)
            return False, held + 1
        self._last[key] = (now, 0)
        if len(self._last) > PEER_LOG_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.window_s}
        return True, held
