"""Process logs: one size-rotated file per data dir, and per-peer rate limits on lines peers can trigger.

Retention: a log file rotates past its size cap (`log_max_mb`, LOG_MAX_MB by default) and `log_backups` old files
are kept (hub.log, hub.log.1, ...), so a hub's or node's logs never take more than (backups + 1) x the cap of its
data dir. A process's own output captured to a file (a local node's node.out, a dashboard node's node.err) gets the
same rule through `CappedOutput`.

A warning the operator must act on is logged with `extra=for_operator(kind)`: besides the log file, an `OperatorLines`
handler prints it on the process's terminal and keeps the newest ones for its status (the hub's progress line and
dashboard), so it is never in hub.log only.
"""

from __future__ import annotations

import functools
import io
import logging
import logging.handlers
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOG_MAX_MB = 50.0
LOG_BACKUPS = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Lines a peer can cause (its refused requests): at most one per PEER_LOG_WINDOW_S each, with a count of the rest.
PEER_LOG_WINDOW_S = 10.0
PEER_LOG_KEYS = 10_000
# The record attribute `for_operator` sets: the kind of a line the operator must see.
OPERATOR_ATTR = "echo2_operator"
# Operator lines a process keeps for its status (the newest), each cut to OPERATOR_LINE_CHARS.
OPERATOR_LINES_KEPT = 20
OPERATOR_LINE_CHARS = 500


def log_bytes(max_mb: float) -> int:
    """A log size cap in MB (the config's unit) as bytes."""
    return int(max_mb * 1024 * 1024)


def setup_logging(
    path: Path, level: str, stderr_level: int | None = None, max_mb: float = LOG_MAX_MB, backups: int = LOG_BACKUPS
) -> None:
    """Log to `path` (rotated past `max_mb`, `backups` old files kept) at `level`; also to stderr from `stderr_level`
    when given. py-libp2p logs ordinary peer churn at ERROR: it goes to the file only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=log_bytes(max_mb), backupCount=backups)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    if stderr_level is not None:
        stderr = logging.StreamHandler()
        stderr.setLevel(stderr_level)
        root.addHandler(stderr)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)


# torchao's warnings that its wheel's GPU parts are missing: its CUDA kernels ("Failed to load <kernel>.so", logger
# torchao) and triton (torch's CPU wheel has none; logger torchao.kernel.intmm, which transformers imports).
CPU_WHEEL_NOISE = {"torchao": "Failed to load ", "torchao.kernel.intmm": "Warning: Detected no triton"}


class CpuWheelNoise(logging.Filter):
    """Drops one of torchao's CPU_WHEEL_NOISE warnings on a machine without CUDA, where those parts cannot load and
    nothing of ours uses them (adamw8bit's optimizer is plain torch); with CUDA they are kept."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        torch = sys.modules.get("torch")  # imported before torchao logs anything: torchao imports it first
        return torch is None or torch.cuda.is_available()


class TorchaoEnumNoise(logging.Filter):
    """Drops torch's deprecation warning about torchao registering its own enums as pytree constants (torchao 0.18
    under torch 2.13: a line per enum, two on a hub's start, on any device); the same warning about anyone else's enum
    is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        subject = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (
            isinstance(record.msg, str)
            and "is an Enum subclass" in record.msg
            and isinstance(subject, type)
            and subject.__module__.partition(".")[0] == "torchao"
        )


@functools.cache  # once per process, however many entry points call it
def quiet_wheel_noise() -> None:
    """Before torch or transformers is imported: every start printed torchao's warnings (transformers imports it)."""
    for logger, prefix in CPU_WHEEL_NOISE.items():
        logging.getLogger(logger).addFilter(CpuWheelNoise(prefix))
    logging.getLogger("torch.utils._pytree").addFilter(TorchaoEnumNoise())


def rotate_files(path: Path, backups: int) -> None:
    """path -> path.1 -> ... -> path.<backups>, the oldest one dropped (RotatingFileHandler's naming)."""
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.1"))


class RotatingFile:
    """Bytes appended to `path`, rotated as the logs are once the next write would pass the cap; any thread."""

    def __init__(self, path: Path, max_mb: float, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = log_bytes(max_mb)
        self.backups = backups
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")

    def write(self, data: bytes) -> None:
        with self._lock:
            size = self._file.tell()
            if size > 0 and size + len(data) > self.max_bytes:
                self._file.close()
                rotate_files(self.path, self.backups)
                self._file = open(self.path, "ab")
            self._file.write(data)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class RotatingTextStream(io.TextIOBase):
    """A text stream (sys.stdout, sys.stderr) whose every write lands in a RotatingFile at once."""

    def __init__(self, target: RotatingFile, fd: int) -> None:
        super().__init__()
        self.target = target
        self._fd = fd

    encoding = "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.target.write(text.encode("utf-8", "replace"))
        return len(text)

    def fileno(self) -> int:  # faulthandler and the like write below Python, to the file opened at start
        return self._fd


def capture_output(path: Path, max_mb: float = LOG_MAX_MB, backups: int = LOG_BACKUPS) -> None:
    """This process's stdout and stderr appended to `path`, rotated as the logs are. Python's writes go through a
    RotatingTextStream; what is written below Python (a C library, a fatal error's dump) goes to the file as it was
    at start, so it may land in a rotated one."""
    out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    target = RotatingFile(path, max_mb, backups)
    sys.stdout, sys.stderr = RotatingTextStream(target, 1), RotatingTextStream(target, 2)


class PeerLogLimiter:
    """Whether a peer-triggered line may be logged now: one per key per window; the next one allowed says how
    many were held back. The table forgets keys past their window once it holds PEER_LOG_KEYS."""

    def __init__(self, window_s: float = PEER_LOG_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock  # seconds, for `tail` (a test passes its own)
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last logged, lines held back since)

    def allow(self, key: str, now: float, count: int = 1) -> tuple[bool, int]:
        """(log it?, lines held back since the last one logged). `count`: how many things this line reports (a line
        of 3 refused groups held back adds 3), so what was held back is counted in the things it is about."""
        last, held = self._last.get(key, (-self.window_s, 0))
        if now - last < self.window_s:
            self._last[key] = (last, held + count)
            return False, held + count
        self._last[key] = (now, 0)
        if len(self._last) > PEER_LOG_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.window_s}
        return True, held

    def tail(self, key: str, count: int = 1) -> str | None:
        """None when `key`'s line is held back now; else the end of the line to log: how many like it were held
        back since the last one ("" for none; `count` as `allow` takes it)."""
        logged, held = self.allow(key, self.clock(), count)
        if not logged:
            return None
        return f" ({held} more since the last such line)" if held else ""


def for_operator(kind: str) -> dict[str, str]:
    """The `extra` of a warning the operator must see (a short `kind`: "reward_flat", "steps_lost"...)."""
    return {OPERATOR_ATTR: kind}


@dataclass(frozen=True)
class OperatorLine:
    at: float  # Unix time it was logged
    kind: str
    text: str


class OperatorLines(logging.Handler):
    """Lines logged `for_operator` at WARNING or above, from any thread: each printed once as "<prefix>: warning: ...",
    and the newest OPERATOR_LINES_KEPT kept for the process's status."""

    def __init__(self, prefix: str) -> None:
        super().__init__(logging.WARNING)
        self.prefix = prefix
        self._lines: deque[OperatorLine] = deque(maxlen=OPERATOR_LINES_KEPT)

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, OPERATOR_ATTR, None)
        if not isinstance(kind, str):
            return
        text = record.getMessage()[:OPERATOR_LINE_CHARS]
        self._lines.append(OperatorLine(record.created, kind, text))  # under the handler's lock (Handler.handle)
        # sys.stdout as it is now: a live progress display replaces it while it runs.
        print(f"{self.prefix}: warning: {text}", flush=True)

    def newest(self) -> tuple[OperatorLine, ...]:
        """The lines kept, oldest first."""
        self.acquire()
        try:
            return tuple(self._lines)
        finally:
            self.release()
