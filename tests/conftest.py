from __future__ import annotations

import fcntl
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from shared.logs import OperatorLines


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, built once per cache (ECHO2_CACHE or ~/.cache/echo2)."""
    from shared.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture
def hub_warnings() -> Iterator[OperatorLines]:
    """The hub's warnings for its operator, printed and kept as `echo-hub start` does (shared.logs.OperatorLines)."""
    handler = OperatorLines("echo-hub")
    logging.getLogger("echo2.hub").addHandler(handler)
    yield handler
    logging.getLogger("echo2.hub").removeHandler(handler)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal delivers it. A suite started as a background job of a script (`cmd &`, nohup) inherits
    SIGINT ignored, and so would every process its tests start: the tests of what Ctrl-C does to echo-hub and
    echo-node would see their SIGINT vanish (hub and node keep an inherited SIG_IGN, as a shell's background job
    asks). Here in pytest and in each xdist worker: a Python handler, which a child resets to the default on exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _is_timing(item: pytest.Item) -> bool:
    return item.get_closest_marker("timing") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Timing tests first, together (the sort is stable): xdist hands each worker a chunk of consecutive tests, so
    one worker runs them all in one exclusive turn, instead of waiting for the other worker's current test before
    each of them (on 2 cores those waits cost the suite over a minute)."""
    items.sort(key=lambda item: not _is_timing(item))


class _Turn:
    """This worker's hold on the run's lock: the open lock file, and whether it holds it alone."""

    lock: IO[str] | None = None
    exclusive = False


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """The suite runs on two pytest-xdist workers; a test marked `timing` (it measures a real rate or delay, where no
    mock clock can stand in) runs alone. Every test holds a shared lock while it runs, a timing test an exclusive
    one, kept into the next test where that one is a timing test too; the turnstile lets a waiting timing test in
    before the other worker starts its next test. Around the whole protocol (a skipped or erroring test lets go as
    well) and outside pytest-timeout's timer, which starts inside: waiting for the turn is not a test's time."""
    exclusive = _is_timing(item)
    if not (exclusive and _Turn.exclusive):
        # pytest's own base temp dir (gw0's, gw1's) sits in one directory per run, shared by its workers.
        root = item.config._tmp_path_factory.getbasetemp().parent
        _Turn.lock = _Turn.lock or open(root / "echo2-timing.lock", "a")  # held across tests
        with open(root / "echo2-turnstile.lock", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(_Turn.lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        return (yield)
    finally:
        _Turn.exclusive = exclusive and nextitem is not None and _is_timing(nextitem)
        if not _Turn.exclusive:
            fcntl.flock(_Turn.lock, fcntl.LOCK_UN)
