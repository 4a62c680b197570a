"""Adaptive staleness (hub/control/staleness.py) against hand-computed costs and moves."""

from __future__ import annotations

import pytest

from hub.control.staleness import HOLD_PERIODS, StalenessCost, StalenessHold, choose_staleness, staleness_costs
from hub.method.capacity import NodeOffer
from hub.method.drift import DRIFT_WINDOW_STEPS, DriftMeter, expected_age
from shared.staleness import StalenessReason

# R = 10 rollouts/step, T_train = 1 s, T_bcast = 0.5 s, gamma 1, learner $3.6/h (0.001 $/s).
# S=1 (kappa 1): stall 0.5 s, mu_min = 10 / 0.5 = 20: both nodes, $14.4/h for 1 s = 0.004.
# S=2 (kappa 1) and S=3 (kappa 2): no stall, mu_min = 10: node a alone, $7.2/h for 1 s = 0.002.
HEALTHY = (NodeOffer("a", 3.6, 10.0), NodeOffer("b", 7.2, 10.0))
# Node a alone at 5 rollouts/s: short everywhere. S=1: idle 10/5 + 0.5 - 1 = 1.5 s, $7.2/h for 2.5 s = 0.005;
# S=2: idle 1 s, 2 s = 0.004.
SHORT = (NodeOffer("a", 3.6, 5.0),)


def costs_of(offers, staleness_max=3):
    return staleness_costs(offers, staleness_max, 10.0, 1.0, 0.5, 1.0, 3.6)


def test_costs_per_staleness_by_hand():
    costs = costs_of(HEALTHY)
    assert {s: round(c.cost_per_step, 9) for s, c in costs.items()} == {1: 0.004, 2: 0.002, 3: 0.002}
    assert not any(c.pool_short for c in costs.values())
    short = costs_of(SHORT, 2)
    assert {s: round(c.cost_per_step, 9) for s, c in short.items()} == {1: 0.005, 2: 0.004}
    assert all(c.pool_short for c in short.values())


def test_raise_when_cheaper_and_drift_low():
    choice = choose_staleness(1, 3, 0.01, 0.5, costs_of(HEALTHY))
    assert (choice.staleness, choice.reason) == (2, StalenessReason.BROADCAST)
    short = choose_staleness(1, 2, 0.01, 0.5, costs_of(SHORT, 2))
    assert (short.staleness, short.reason) == (2, StalenessReason.POOL_SHORT)


def test_stays_at_smallest_of_equal_costs():
    # S=2 and S=3 cost the same: the fresher one stays.
    assert choose_staleness(2, 3, 0.01, 0.5, costs_of(HEALTHY)).reason is None
    assert choose_staleness(2, 3, 0.01, 0.5, costs_of(HEALTHY)).staleness == 2


def test_lower_when_as_cheap_for_the_hold():
    # S=2 costs what S=3 does: S stays until that has held HOLD_PERIODS periods on end, this one included.
    stay = choose_staleness(3, 3, 0.01, 0.5, costs_of(HEALTHY), hold=StalenessHold(HOLD_PERIODS - 2))
    assert (stay.staleness, stay.reason, stay.lower_as_cheap) == (3, None, True)
    choice = choose_staleness(3, 3, 0.01, 0.5, costs_of(HEALTHY), hold=StalenessHold(HOLD_PERIODS - 1))
    assert (choice.staleness, choice.reason) == (2, StalenessReason.CHEAPER_LOWER)


# T_bcast 0.95 s against T_train 1 s +- 5%, node a alone at 5 rollouts/s (short at every S), gamma 1.1: the broadcast
# is planned 1.1 x 0.95 = 1.045 s. Short, all of the pool is bought ($7.2/h = 0.002 $/s) and a step lasts
# R / mu + stall / kappa = 2 s + stall / kappa; the stall is max(0, 1.045 - (S - kappa) * T_train), S - kappa = 1
# for S = 2, 3 (kappa 1, 2), 0 for S = 1.
# T_train 0.95: S=1: 2 + 1.045 = 3.045 s, 0.00609; S=2: 2 + 0.095 = 2.095 s, 0.00419; S=3: 2 + 0.0475 = 2.0475 s,
# 0.004095: S=2 is 2.3% dearer than S=3. T_train 1.05: no stall at S=2, 3: 0.004 each (S=1: 3.045 s again).
def noisy_costs(t_train_s):
    return staleness_costs(SHORT, 3, 10.0, t_train_s, 0.95, 1.1, 3.6)


def test_broadcast_planned_with_gamma_headroom_by_hand():
    assert {s: round(c.cost_per_step, 9) for s, c in noisy_costs(0.95).items()} == {1: 0.00609, 2: 0.00419, 3: 0.004095}
    assert {s: round(c.cost_per_step, 9) for s, c in noisy_costs(1.05).items()} == {1: 0.00609, 2: 0.004, 3: 0.004}
    # Without headroom (gamma 1) the 0.95 s broadcast hides behind both step times at S = 2: no stall to pay.
    assert round(staleness_costs(SHORT, 2, 10.0, 0.95, 0.95, 1.0, 3.6)[2].cost_per_step, 9) == 0.004


def test_no_flapping_under_noisy_t_train_near_the_broadcast():
    # One period's costs raise S 2 -> 3 (2.3% > COST_TOLERANCE), the next one's make S=2 as cheap: on single periods
    # S would go 3 -> 2 -> 3 -> ... every period. Counting the periods on end as the scheduler does, it stays at 3.
    current, hold, moves = 2, StalenessHold(), []
    for period in range(4 * HOLD_PERIODS):
        choice = choose_staleness(current, 3, 0.0, 0.5, noisy_costs(0.95 if period % 2 == 0 else 1.05), hold=hold)
        hold = hold.after(choice)
        if choice.staleness != current:
            current = choice.staleness
            moves.append((period, current, choice.reason))
    assert moves == [(0, 3, StalenessReason.POOL_SHORT)]
    assert choose_staleness(3, 3, 0.0, 0.5, noisy_costs(1.05)).lower_as_cheap  # each odd period counted one


def test_short_pool_still_raises_and_drift_still_lowers_at_once():
    # However long S - 1 has looked as cheap, a short pool raises; and right after a raise the drift guard lowers.
    raised = choose_staleness(2, 3, 0.0, 0.5, noisy_costs(0.95), hold=StalenessHold(10 * HOLD_PERIODS))
    assert (raised.staleness, raised.reason) == (3, StalenessReason.POOL_SHORT)
    lowered = choose_staleness(3, 3, 0.4, 0.5, noisy_costs(0.95), hold=StalenessHold(0, None))
    assert (lowered.staleness, lowered.reason) == (2, StalenessReason.DRIFT)


def test_no_raise_for_the_hold_after_the_drift_guard_lowered():
    # At S=2 the drift (0.1) extrapolates to 0.15 < 0.4 at S=3 and S=3 is 2.3% cheaper: a raise, unless the guard
    # lowered S within HOLD_PERIODS periods; the guard itself lowers again at once.
    hold = StalenessHold().after(choose_staleness(3, 3, 0.4, 0.5, noisy_costs(0.95)))
    assert hold.periods_since_drift == 0
    for _ in range(HOLD_PERIODS):
        choice = choose_staleness(2, 3, 0.1, 0.5, noisy_costs(0.95), hold=hold)
        assert choice.staleness == 2
        hold = hold.after(choice)
    assert choose_staleness(2, 3, 0.1, 0.5, noisy_costs(0.95), hold=hold).staleness == 3
    assert choose_staleness(2, 3, 0.4, 0.5, noisy_costs(0.95), hold=StalenessHold(0, 0)).reason is StalenessReason.DRIFT


def test_drift_guard_lowers_whatever_the_cost():
    # 0.4 = 0.8 x 0.5 reaches the lowering threshold.
    choice = choose_staleness(2, 3, 0.4, 0.5, costs_of(HEALTHY))
    assert (choice.staleness, choice.reason) == (1, StalenessReason.DRIFT)
    assert choose_staleness(1, 3, 0.9, 0.5, costs_of(HEALTHY)).staleness == 1  # never below 1


@pytest.mark.parametrize(("drift", "raised"), [(0.133, True), (0.134, False), (None, False)])
def test_raise_blocked_by_extrapolated_drift(drift, raised):
    # At S=1 the mean age triples at S=2 (0.5 -> 1.5) and the drift with it: a raise needs 3 x drift < 0.4.
    choice = choose_staleness(1, 3, drift, 0.5, costs_of(HEALTHY))
    assert choice.staleness == (2 if raised else 1)


def test_measured_drift_per_version_blocks_a_raise_from_fresh_rollouts():
    # Fresh rollouts show no drift, but the run saw drift per version of age: 0 + 0.3 < 0.4 allows a raise, 0.45 not.
    assert choose_staleness(1, 3, 0.0, 0.5, costs_of(HEALTHY), drift_per_version=0.3).staleness == 2
    assert choose_staleness(1, 3, 0.0, 0.5, costs_of(HEALTHY), drift_per_version=0.45).staleness == 1


def test_cost_tolerance_prefers_fresher():
    # 1% cheaper at S=2 is within the 2% tolerance: S stays 1; 3% cheaper is not.
    near = {1: StalenessCost(1.0, False), 2: StalenessCost(0.99, False)}
    assert choose_staleness(1, 2, 0.0, 0.5, near).staleness == 1
    far = {1: StalenessCost(1.0, False), 2: StalenessCost(0.97, False)}
    assert choose_staleness(1, 2, 0.0, 0.5, far).staleness == 2


def test_no_costs_no_move_but_guard_still_acts():
    assert choose_staleness(2, 4, 0.01, 0.5, {}).staleness == 2
    assert choose_staleness(2, 4, 0.45, 0.5, {}).staleness == 1


def test_never_above_max():
    costs = {1: StalenessCost(2.0, True), 2: StalenessCost(1.0, True)}
    assert choose_staleness(2, 2, 0.0, 0.5, costs).staleness == 2


def test_scheduler_counts_the_periods_s_minus_1_is_as_cheap():
    # The scheduler over the noisy periods above (one node at 5 rollouts/s, $3.6/h, R = 10, gamma 1.1): raised to 3
    # once, S stays there while S=2 is as cheap only every other period; once it is as cheap for HOLD_PERIODS
    # periods on end (step 12's T_train of 1.05 s the first of them) S lowers.
    from hub.config import SchedulerConfig
    from hub.control.scheduler import Scheduler, StalenessBounds
    from hub.records.fleet import Fleet
    from tests.test_scheduler import FakeTiming, Transitions, measured

    fleet = Fleet()
    measured(fleet, "a", 3.6, 5.0).state = "active"
    timing = FakeTiming(t_train_s=0.95, t_bcast_s=0.95, staleness=2)
    scheduler = Scheduler(
        SchedulerConfig(gamma=1.1),
        fleet,
        timing.timing(),
        Transitions(),
        StalenessBounds(staleness_max=3, drift_max=0.5, learner_price_per_hour=3.6),
    )
    moves = []
    for step, t_train_s in enumerate([0.95, 1.05] * 6 + [1.05] * HOLD_PERIODS, start=1):
        timing.t_train_s = t_train_s
        move = scheduler.adapt_staleness(step, 0.0)
        if move is not None:
            moves.append((step, move.staleness, move.reason))
    assert moves == [(1, 3, StalenessReason.POOL_SHORT), (11 + HOLD_PERIODS, 2, StalenessReason.CHEAPER_LOWER)]


def test_a_raise_spans_the_versions_the_drift_allows():
    # S=3 is cheapest by far; mean ages 0.5, 1.5, 2.0 at S=1, 2, 3. From S=1 at drift 0.01, 0.01 per version of age
    # measured: 0.01 + 1.5 x 0.01 < 0.4, so S=3 at once; 0.3 per version: 0.01 + 1.0 x 0.3 < 0.4 but 0.01 + 1.5 x 0.3
    # is not, so S=2, the cheapest up to that ceiling.
    costs = {1: StalenessCost(1.0, True), 2: StalenessCost(0.9, True), 3: StalenessCost(0.5, False)}
    choice = choose_staleness(1, 3, 0.01, 0.5, costs, drift_per_version=0.01)
    assert (choice.staleness, choice.reason, choice.detail) == (3, StalenessReason.POOL_SHORT, "$1/step at S=1, $0.5 at S=3")
    assert choose_staleness(1, 3, 0.01, 0.5, costs, drift_per_version=0.3).staleness == 2
    # from S=2 one version adds half a version of age: 0.1 + 0.5 x 0.5 < 0.4
    assert choose_staleness(2, 3, 0.1, 0.5, costs, drift_per_version=0.5).staleness == 3
    # unmeasured, drift / 0.5 = 0.02 would allow S=3 too, but stands in for one version of S only
    assert choose_staleness(1, 3, 0.01, 0.5, costs).staleness == 2
    # groups twice as old as the model's at S=2 (age 3.0): S=3 adds 1.0 of age, not 0.5: 0.1 + 1.0 x 0.5 >= 0.4
    assert choose_staleness(2, 3, 0.1, 0.5, costs, drift_per_version=0.5, age=3.0).staleness == 2
    # a younger age than the model's (steps just after a raise, groups of the old S) is not trusted: at 0.75 S=3
    # would add 0.25 (0.1 + 0.25 x 0.7 < 0.4), but it adds the model's 0.5 (0.1 + 0.5 x 0.7 >= 0.4)
    assert choose_staleness(2, 3, 0.1, 0.5, costs, drift_per_version=0.7, age=0.75).staleness == 2
    assert choose_staleness(2, 3, 0.1, 0.5, costs, drift_per_version=0.5, age=0.75).staleness == 3
    # a lowering stays one version at a time
    assert choose_staleness(3, 3, 0.45, 0.5, costs).staleness == 2


def test_expected_age_by_hand():
    # S - kappa / 2, kappa = max(1, S - 1): what the embedded default's fixed-S runs trained at (hub/method/drift.py)
    assert [expected_age(s) for s in (1, 2, 3, 4, 8)] == [0.5, 1.5, 2.0, 2.5, 4.5]
    with pytest.raises(ValueError):
        expected_age(0)


def test_drift_meter_by_hand():
    """hub/method/drift.py: readings over at least MIN_DRIFT_STEPS steps, none before that many at the S in force;
    the drift per version over the recent stale steps only."""
    meter = DriftMeter()
    for drift, age in [(0.0, 0.0), (0.3, 1.0), (0.1, 0.5)]:
        meter.add(drift, age)
    assert meter.read() == (None, pytest.approx(0.4 / 1.5), None)  # 3 steps < 4: no drift yet
    meter.add(0.2, 1.0)
    # a one-step period reads the last 4 steps: drift (0 + 0.3 + 0.1 + 0.2) / 4, age (0 + 1 + 0.5 + 1) / 4
    assert meter.read() == (pytest.approx(0.15), pytest.approx(0.6 / 2.5), pytest.approx(0.625))
    for _ in range(5):  # a period of 5 steps reads its own
        meter.add(0.05, 1.0)
    assert meter.read()[0::2] == (pytest.approx(0.05), pytest.approx(1.0))
    meter.moved()
    meter.add(0.4, 2.0)
    assert meter.read()[0] is None  # one step at the new S
    for _ in range(DRIFT_WINDOW_STEPS):  # the window forgets the early steps' larger drift per version
        meter.add(0.1, 2.0)
    assert meter.read() == (pytest.approx(0.1), pytest.approx(0.05), pytest.approx(2.0))
    fresh = DriftMeter()
    fresh.add(0.2, 1.0)
    fresh.add(0.0, 0.0)
    assert fresh.drift_per_version() is None  # one stale step < MIN_STALE_STEPS
