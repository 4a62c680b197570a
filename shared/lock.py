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
        raise UserError(f"--data-dir {data_dir}: another {holder} (pid {pid}) is running on it; stop it, or pass "
                        "another --data-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def live_holder(data_dir: Path, lock_file: str) -> int | None:
    """The pid DATA_DIR/`lock_file` names when that process still runs on this machine; None when the file names
    none, or its process is gone (a zombie, killed but not yet reaped, is gone)."""
    try:
        pid = int((data_dir / lock_file).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # another user's process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return pid  # no /proc: the signal check is all there is
    return None if state == "Z" else pid
