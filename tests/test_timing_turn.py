"""The suite's wall-clock turn (tests/conftest.py): a `timing` test holds the lock alone, others share it."""

from __future__ import annotations

import fcntl

import pytest


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
    assert any(timing) and timing == sorted(timing, reverse=True)
