"""One process per data dir: an flock'd lock file there, holding the holder's pid, refuses a second hub or node."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from shared.checks import UserError


def lock_data_dir(data_dir: Path, lock_file: str, holder: str) -> IO[str]:
    """Hold DATA_DIR/`lock_file` for as long as the returned file stays open: a second `holder` ("hub", "node")
    on the same data dir is refused (UserError naming the pid that holds it). The lock dies with its process."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / lock_file, "a+")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "unknown"
        handle.close()
        raise UserError(
            f"--data-dir {data_dir}: another {holder} (pid {pid}) is running on it; stop it, or pass another --data-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def live_holder(data_dir: Path, lock_file: str) -> str | None:
    """The pid DATA_DIR/`lock_file` names while its lock is held (its holder runs); None when nobody holds it. The
    lock itself is asked, not the pid: it dies with its process, whatever pid namespace the holder ran in and
    whichever process reuses its pid since."""
    try:
        handle = open(data_dir / lock_file)  # noqa: SIM115 - closed below
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "unknown"
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None
