"""Durable file writes: temp file, fsync, rename, fsync of the directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never a mix."""
    path = Path(path)
    # One temp file per writing thread: the hub's status board and its final refresh write status.json from
    # two worker threads, and a shared temp name let one rename the other's file away (FileNotFoundError).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk fails the write: leave no half-written temp file behind
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, durable: bool = False) -> None:
    """Atomic replace of a small text file (status files: atomic, not necessarily durable)."""
    atomic_write_bytes(path, text.encode(), durable=durable)
