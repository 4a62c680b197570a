"""A process whose stop hangs: it ignores Ctrl-C and sleeps in a function named for where a stop would wait (the
test bed's hung-process stack dump is tested with it, tests/test_hub_stops.py)."""

from __future__ import annotations

import signal
import sys
import time


def held_where_the_stop_waits() -> None:
    time.sleep(120)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    held_where_the_stop_waits()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
