"""The hub's measurements (hub/records/measurements.py): fed by the step commit and the learner's window, read by
the scheduler, Leasing and the status board; the version floor and a resumed run's S by hand."""

from __future__ import annotations

import pytest

from hub.config import HubConfig, LearnerConfig
from hub.records.buffer import usable_from
from hub.records.measurements import (
    LearnerWindow,
    grace_after_lowering,
    grace_staleness,
    oldest_useful_version,
    read_step_figures,
    resumed_staleness,
    takes_served,
)
from hub.records.schema import StepRecord
from hub.records.store import Store
from hub.service.state import HubState
from shared.tasks.reverse import ReverseTask
from tests.test_store import make_group, make_record


def step(n: int, t_train_s: float, budget: int = 2) -> StepRecord:
    return StepRecord(n, n, 0.5, 0.5, 0.0, 0, 0, t_train_s, 0.0, 0.0, 10, 0.0, staleness_budget=budget)


def test_the_version_floor_by_hand():
    # Step 7 done, S = 2: the next take trains v7 -> groups of v5 on; while step 8 trains, v6 on.
    assert oldest_useful_version(7, False, 2) == 5
    assert oldest_useful_version(7, True, 2) == 6
    assert oldest_useful_version(1, False, 4) == 0
    assert LearnerWindow(step=7, training=True, window_staleness=3).min_useful_version() == 5


def test_a_lowered_s_keeps_its_window_for_its_grace_by_hand():
    """S 4 lowered to 2 at version 10: the window stays 4 through the take at step 14 (10 + the old S, the last
    that uses v10 under it), then is 2."""
    grace = grace_after_lowering((4, 0), 4, 10, 4)
    assert grace == (4, 14)
    assert [grace_staleness(2, grace, step) for step in (10, 13, 14, 15, 20)] == [4, 4, 4, 2, 2]
    # Lowered again (to 1) at 12, while the first grace still holds: the window is still 4, now until 14 at least.
    again = grace_after_lowering(grace, grace_staleness(2, grace, 12), 12, 2)
    assert again == (4, 14)
    assert [grace_staleness(1, again, step) for step in (14, 15)] == [4, 1]


def test_the_takes_a_version_still_serves_by_hand():
    """The take at step c uses versions >= c - grace_staleness(S, grace, c)."""
    assert takes_served(7, 5, 3, (3, 0)) == 6  # takes 5..10 (7 + 3)
    assert takes_served(4, 5, 0, (0, 0)) == 0  # S = 0: v4 is no use to the take at 5
    # S lowered 4 -> 1 at v10: the grace holds through take 14. A node on v13 at the take of 14 serves that one
    # (then S = 1 from take 15: 15 - 13 > 1); on v12 from take 12, takes 12-14; with no grace, 12-13.
    grace = grace_after_lowering((4, 0), 4, 10, 4)
    assert takes_served(13, 14, 1, grace) == 1
    assert takes_served(12, 12, 1, grace) == 3 and takes_served(12, 12, 1, (1, 0)) == 2
    # Every take the count names uses the version, and the next one does not (the buffer's own rule).
    for held, first in ((13, 14), (12, 12), (11, 11)):
        n = takes_served(held, first, 1, grace)
        assert all(held >= usable_from(c, grace_staleness(1, grace, c)) for c in range(first, first + n))
        assert held < usable_from(first + n, grace_staleness(1, grace, first + n))
    # No lowering in force: the S in force.
    assert grace_staleness(3, (3, 0), 5) == 3


def test_a_resumed_run_goes_on_at_the_s_its_newest_step_trained_under(tmp_path):
    assert resumed_staleness(None, 4) is None
    assert resumed_staleness(step(3, 1.0, budget=6), 4) == 4  # within staleness_max
    assert resumed_staleness(step(3, 1.0, budget=0), 4) == 1
    store = Store(tmp_path / "hub.db")
    store.training.commit_step(step(1, 1.0, budget=3), [])
    window = LearnerWindow.at_start(store, staleness=1, kappa=1, staleness_max=4)
    assert (window.step, window.staleness, window.window_staleness, window.kappa) == (1, 3, 3, 2)
    assert LearnerWindow.at_start(store, staleness=1, kappa=1, staleness_max=None).staleness == 1  # S fixed
    store.close()


@pytest.mark.trio
async def test_the_step_commit_feeds_t_train_and_leasing_reads_the_learners_window(tmp_path):
    state = HubState(Store(tmp_path / "hub.db"), HubConfig(learner=LearnerConfig(staleness=2)), ReverseTask())
    assert state.measurements.t_train_recent_s is None and state.measurements.usable_fraction == 1.0
    await state.commit_step(step(1, 1.0), [], [])
    await state.commit_step(step(2, 3.0), [], [])
    assert state.measurements.t_train_recent_s == pytest.approx(2.0)
    window = state.measurements.learner
    window.step, window.training, window.window_staleness = 5, True, 2
    assert state.leasing.min_useful_version() == 4 and state.leasing.window().oldest == 4
    state.store.close()
    again = HubState(Store(tmp_path / "hub.db"), HubConfig(learner=LearnerConfig(staleness=2)), ReverseTask())
    assert again.measurements.t_train_recent_s == pytest.approx(2.0)  # read back at start
    assert again.measurements.learner.step == 2
    again.store.close()


def test_the_step_commit_reads_stale_drops_apart_from_other_losses(tmp_path):
    """A real store: 8 accepted groups, 2 trained, 2 dropped as stale, 4 with equal rewards. The learner trained on
    2 of 8; the fleet is sized by (2 + 2) / 8; the reward is not saturated until equal rewards dominate."""
    store = Store(tmp_path / "hub.db")
    ids = [store.groups.record_trajectory(make_group(f"p{i}", 0), None, "", "accepted") for i in range(8)]
    store.training.commit_step(make_record(1), ids[:2], dropped_stale_ids=ids[2:4])
    store.groups.discard_trajectories(ids[4:], "zero reward variance")
    reading = read_step_figures(store)
    assert (reading.usable_fraction, reading.fresh_usable_fraction, reading.saturated) == (0.25, 0.5, None)
    more = [store.groups.record_trajectory(make_group(f"q{i}", 0), None, "", "accepted") for i in range(16)]
    store.groups.discard_trajectories(more, "zero reward variance")
    reading = read_step_figures(store)
    assert reading.fresh_usable_fraction == pytest.approx(4 / 24)
    assert reading.saturated is not None and "same score in 83% of recent groups" in reading.saturated
