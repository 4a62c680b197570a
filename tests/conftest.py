from __future__ import annotations

import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, built once per cache (ECHO2_CACHE or ~/.cache/echo2)."""
    from shared.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(autouse=True)
def _wall_clock_turn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite runs on two pytest-xdist workers; a test marked `timing` (it measures a real rate or delay,
    where no mock clock can stand in) runs alone. Every test holds a shared lock while it runs, a timing test an exclusive one;
    the turnstile lets a waiting timing test in before the other worker starts its next test."""
    root = tmp_path_factory.getbasetemp().parent  # shared by the workers of one run
    exclusive = request.node.get_closest_marker("timing") is not None
    with open(root / "echo2-turnstile.lock", "a") as turnstile, open(root / "echo2-timing.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
