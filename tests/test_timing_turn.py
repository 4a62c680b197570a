"""The suite's wall-clock turn (tests/conftest.py): a `timing` test holds the lock alone, others share it; timing
tests come first, in one turn."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _try(tmp_path_factory: pytest.TempPathFactory, mode: int) -> bool:
    """Whether another open file description could take the run's lock in `mode` right now."""
    with open(tmp_path_factory.getbasetemp().parent / "echo2-timing.lock", "a") as other:
        try:
            fcntl.flock(other, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(other, fcntl.LOCK_UN)
        return True


def test_an_ordinary_test_shares_the_turn(tmp_path_factory):
    assert _try(tmp_path_factory, fcntl.LOCK_SH)
    assert not _try(tmp_path_factory, fcntl.LOCK_EX)


@pytest.mark.timing
def test_a_timing_test_holds_the_turn_alone(tmp_path_factory):
    assert not _try(tmp_path_factory, fcntl.LOCK_SH)


def test_timing_tests_are_collected_first_so_one_turn_runs_them_all(request):
    timing = [item.get_closest_marker("timing") is not None for item in request.session.items]
    if not any(timing):
        pytest.skip("no timing test collected in this run")
    assert timing == sorted(timing, reverse=True)


def test_a_skipped_timing_test_after_a_timing_test_lets_the_turn_go(tmp_path):
    """The turn kept for the next timing test is let go when that test is skipped before its fixtures run: the
    other worker, waiting at the turnstile meanwhile, is not left there (a deadlock until pytest-timeout fired)."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems, pytest_runtest_protocol\n")
    (tmp_path / "test_turns.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.timing\ndef test_t1(): time.sleep(2)\n"  # long enough for the other worker to wait for it
        "@pytest.mark.timing\n@pytest.mark.skip(reason='skipped before its fixtures')\ndef test_t2(): pass\n"
        + "".join(f"def test_plain_{i}(): time.sleep(0.05)\n" for i in range(20))
    )
    argv = ["-n", "2", "-p", "no:cacheprovider", "--timeout", "20", "-o", "markers=timing", "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *argv, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and "21 passed, 1 skipped" in done.stdout, done.stdout[-3000:]
