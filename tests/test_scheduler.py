"""The closed-loop Scheduler on a real Fleet with fake timing: drops, probes, activation order,
hysteresis, infeasible capacity and the per-step ledger fields, against hand-computed values.

Capacity used throughout: kappa = 2, R = 10, T_train = 1.5 s, T_bcast = 1 s gives
mu_min = 2*10 / (2*1.5 - 1) = 10 rollouts/s and, with gamma = 1.1, mu_target = 11.
"""

from __future__ import annotations

import pytest

from hub.config import SchedulerConfig
from hub.control.policy import RELEASE_HOLD_PERIODS, CapacityView, FleetView, Move, decide, fleet_view
from hub.control.scheduler import LearnerTiming, Scheduler
from hub.method.capacity import NodeOffer, saturation
from hub.records.fleet import Fleet, NodeRecord, heartbeat_period, heartbeat_timeout
from hub.records.measurements import Measurements
from shared.messages import HEARTBEAT_PERIOD_MAX_S, JoinRequest

T0 = 1000.0


class FakeTiming(Measurements):
    """Measurements a test sets by hand, under the names the tests use."""

    def __init__(
        self,
        t_train_s: float | None = 1.5,
        t_bcast_s: float | None = 1.0,
        usable: float = 1.0,
        staleness: int | None = None,
        t_arrive_s: float | None = None,
        fresh_usable: float = 1.0,
    ) -> None:
        super().__init__(
            t_train_recent_s=t_train_s,
            usable_fraction=usable,
            fresh_usable_fraction=fresh_usable,
            t_bcast_s=t_bcast_s,
            t_arrive_s=t_arrive_s,
        )
        self.staleness = staleness

    @property
    def t_train_s(self) -> float | None:
        return self.t_train_recent_s

    @t_train_s.setter
    def t_train_s(self, value: float | None) -> None:
        self.t_train_recent_s = value

    @property
    def usable(self) -> float:
        return self.usable_fraction

    @usable.setter
    def usable(self, value: float) -> None:
        self.usable_fraction = value

    @property
    def fresh_usable(self) -> float:
        return self.fresh_usable_fraction

    @fresh_usable.setter
    def fresh_usable(self, value: float) -> None:
        self.fresh_usable_fraction = value

    def timing(self, rollouts_per_lease: int = 0) -> LearnerTiming:
        return LearnerTiming(2, 10, self, staleness=self.staleness, rollouts_per_lease=rollouts_per_lease)


class Transitions:
    """Stands in for Hub.set_state: applies the state and keeps (node, state, reason)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []

    async def __call__(self, record: NodeRecord, state: str, reason: str) -> None:
        if record.state == state:
            return
        record.state = state
        self.log.append((record.peer_id, state, reason))

    def take(self) -> list[tuple[str, str]]:
        out = [(node, state) for node, state, _ in self.log]
        self.log.clear()
        return out


def join(fleet: Fleet, name: str, price: float, now: float = T0) -> NodeRecord:
    request = JoinRequest(
        price_per_hour=price, hardware="test", link_bps=1e6, backend="hf", dtype="float32", model_config_hash="ab"
    )
    return fleet.join(name, request, "127.0.0.1", now)


def record_work(record: NodeRecord, accepted_rollouts: int, seconds: float) -> None:
    """What HubState does with an answered lease: fold it into the node's measured throughput."""
    record.rollouts_per_s, record.measured = Fleet.throughput_after(record, accepted_rollouts, seconds)


def measured(fleet: Fleet, name: str, price: float, mu: float) -> NodeRecord:
    """A node that joined and answered its probe lease at `mu` rollouts/s."""
    record = join(fleet, name, price)
    record_work(record, int(mu * 10), 10.0)
    return record


def beat(fleet: Fleet, now: float) -> None:
    for record in fleet.live():
        record.last_seen = now


def make(fleet: Fleet, timing: FakeTiming, **config) -> tuple[Scheduler, Transitions]:
    transitions = Transitions()
    cfg = SchedulerConfig(gamma=1.1, control_period_s=1.0, release_margin=0.2, heartbeat_timeout_s=15.0, **config)
    return Scheduler(cfg, fleet, timing.timing(), transitions), transitions


async def settle(scheduler: Scheduler, fleet: Fleet, start: float, periods: int) -> float:
    now = start
    for _ in range(periods):
        beat(fleet, now)
        await scheduler.control_once(now)
        now += scheduler.config.control_period_s
    return now


def states(fleet: Fleet) -> dict[str, str]:
    return {n.peer_id: n.state for n in fleet.nodes.values()}


@pytest.mark.trio
async def test_probe_then_standby_then_active():
    fleet = Fleet()
    scheduler, transitions = make(fleet, FakeTiming())
    record = join(fleet, "a", 0.1)
    await scheduler.control_once(T0)
    assert transitions.take() == []  # probe not answered yet: no measurement, no decision
    assert record.state == "probing"
    record_work(record, 40, 4.0)  # probe lease: 40 accepted rollouts in 4 s of lease time
    assert record.rollouts_per_s == pytest.approx(10.0)
    await scheduler.control_once(T0 + 1)
    assert transitions.log == [("a", "standby", "probe measured 10 rollouts/s"), ("a", "active", "pool 0/s below target 11/s")]
    assert scheduler.view.mu_pool == pytest.approx(10.0)
    assert scheduler.view.mu_target == pytest.approx(11.0)


@pytest.mark.trio
async def test_throughput_is_an_ewma_of_accepted_rollouts_per_lease_second():
    fleet = Fleet()
    record = join(fleet, "a", 0.1)
    record_work(record, 40, 4.0)  # probe: 10/s
    record_work(record, 40, 2.0)  # 20/s: 0.3 * 20 + 0.7 * 10
    assert record.rollouts_per_s == pytest.approx(13.0)
    record_work(record, 0, 2.0)  # everything rejected: 0.7 * 13
    assert record.rollouts_per_s == pytest.approx(9.1)


@pytest.mark.trio
async def test_activation_order_by_rho_then_the_rest_stay_on_standby():
    fleet = Fleet()
    measured(fleet, "b", 0.4, 8.0)  # rho 0.05
    measured(fleet, "c", 0.3, 4.0)  # rho 0.075
    measured(fleet, "a", 0.1, 5.0)  # rho 0.02
    scheduler, transitions = make(fleet, FakeTiming())
    await settle(scheduler, fleet, T0, 6)
    # probed nodes join the standby pool (join order); then, in one move, the cheapest first
    # until 5 + 8 >= 11; c is not needed
    assert transitions.take() == [("b", "standby"), ("c", "standby"), ("a", "standby"), ("a", "active"), ("b", "active")]
    assert states(fleet) == {"a": "active", "b": "active", "c": "standby"}
    assert scheduler.view.mu_pool == pytest.approx(13.0)


@pytest.mark.trio
async def test_silent_node_dropped_and_replaced_by_next_cheapest():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    measured(fleet, "d", 0.9, 10.0)  # rho 0.09: last
    scheduler, transitions = make(fleet, FakeTiming())
    now = await settle(scheduler, fleet, T0, 6)
    assert states(fleet) == {"a": "active", "b": "active", "c": "standby", "d": "standby"}
    transitions.take()
    beat(fleet, now)
    fleet.get("b").last_seen = now - 16.0  # b stopped heartbeating 16 s ago (timeout 15 s)
    await scheduler.control_once(now)
    # dropped, and in the same period the cheapest standby nodes that cover the shortfall take its
    # place: c (rho 0.075), and since 5 + 4 = 9 < 11, d too
    assert transitions.log[0] == ("b", "gone", "no heartbeat for 15s")
    assert [entry[:2] for entry in transitions.log[1:]] == [("c", "active"), ("d", "active")]
    assert all(entry[2] == "pool 5/s below target 11/s" for entry in transitions.log[1:])
    transitions.take()
    await settle(scheduler, fleet, now + 1, 3)
    assert transitions.take() == []
    assert states(fleet) == {"a": "active", "b": "gone", "c": "active", "d": "active"}


@pytest.mark.trio
async def test_release_needs_the_margin_and_the_hold_time():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    timing = FakeTiming()
    scheduler, transitions = make(fleet, timing)
    now = await settle(scheduler, fleet, T0, 4)
    assert states(fleet) == {"a": "active", "b": "active"}
    transitions.take()

    # Target drops to 20/(5.6-1) * 1.1 = 4.78: a alone (5) meets it, but not target*(1+0.2) = 5.74.
    timing.t_train_s = 2.8
    now = await settle(scheduler, fleet, now, 10)
    assert transitions.take() == []

    # Target drops to 20/(8-1) * 1.1 = 3.14 (with margin 3.77 <= 5): b is released, but only
    # after the condition held for RELEASE_HOLD_PERIODS control periods.
    timing.t_train_s = 4.0
    start = now
    for _ in range(RELEASE_HOLD_PERIODS):
        beat(fleet, now)
        await scheduler.control_once(now)
        assert transitions.log == [], f"released after {now - start:g}s"
        now += 1.0
    beat(fleet, now)
    await scheduler.control_once(now)
    assert len(transitions.log) == 1
    node, state, reason = transitions.log[0]
    assert (node, state) == ("b", "standby")
    assert reason == f"pool without it 5/s >= target with margin 3.771/s for {RELEASE_HOLD_PERIODS:g}s"
    assert states(fleet) == {"a": "active", "b": "standby"}


@pytest.mark.trio
async def test_a_thousand_node_fleet_settles_in_a_few_control_periods():
    """All 1,000 work until T_train is known; then one release moves the whole surplus. Moving one node
    per period, the fleet took ~(RELEASE_HOLD_PERIODS + 1) periods per released node: ~4,000 here."""
    fleet = Fleet()
    for i in range(1000):
        measured(fleet, f"n{i:04d}", 0.01 * (1 + i % 7), 0.1)  # 100/s in all
    timing = FakeTiming(t_train_s=None)
    scheduler, transitions = make(fleet, timing)
    now = await settle(scheduler, fleet, T0, 2)
    assert sum(state == "active" for state in states(fleet).values()) == 1000
    timing.t_train_s = 1.45  # target 1.1 * 20 / 1.9 = 11.58/s, with margin 13.89/s: 139 nodes keep 13.9/s
    transitions.take()
    now = await settle(scheduler, fleet, now, RELEASE_HOLD_PERIODS + 1)
    assert sum(state == "active" for state in states(fleet).values()) == 139
    assert scheduler.view.mu_pool == pytest.approx(13.9)
    # the cheapest kept: every released node costs at least as much per unit as every kept one
    kept = [r.price_per_hour for r in fleet.nodes.values() if r.state == "active"]
    released = [r.price_per_hour for r in fleet.nodes.values() if r.state == "standby"]
    assert max(kept) <= min(released)
    transitions.take()
    await settle(scheduler, fleet, now, 10)
    assert transitions.take() == []


@pytest.mark.trio
async def test_release_timer_restarts_when_the_condition_lapses():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    timing = FakeTiming()
    scheduler, transitions = make(fleet, timing)
    now = await settle(scheduler, fleet, T0, 4)
    transitions.take()
    for t_train in (4.0, 4.0, 1.5, 4.0, 4.0, 4.0):  # the release wish lapses in the third period
        beat(fleet, now)
        timing.t_train_s = t_train
        await scheduler.control_once(now)
        now += 1.0
    assert transitions.take() == []
    beat(fleet, now)
    await scheduler.control_once(now)  # 3 periods since the wish came back
    assert transitions.take() == [("b", "standby")]


@pytest.mark.trio
async def test_cheaper_late_joiner_replaces_the_priciest_active_node():
    fleet = Fleet()
    measured(fleet, "x", 2.0, 12.0)  # rho 0.167
    scheduler, transitions = make(fleet, FakeTiming())
    now = await settle(scheduler, fleet, T0, 2)
    assert states(fleet) == {"x": "active"}
    measured(fleet, "y", 0.5, 14.0)  # rho 0.036: joins after the target (11) is met
    transitions.take()
    now = await settle(scheduler, fleet, now, 2 + RELEASE_HOLD_PERIODS + 1)
    log = list(transitions.log)
    assert [(n, s) for n, s, _ in log] == [("y", "standby"), ("y", "active"), ("x", "standby")]
    assert "cheaper nodes can replace it" in log[1][2]
    assert states(fleet) == {"x": "standby", "y": "active"}
    transitions.take()
    await settle(scheduler, fleet, now, 10)
    assert transitions.take() == []  # settled: no flapping


@pytest.mark.trio
async def test_slow_cheap_node_does_not_displace_a_needed_one():
    fleet = Fleet()
    measured(fleet, "x", 2.0, 12.0)
    scheduler, transitions = make(fleet, FakeTiming())
    now = await settle(scheduler, fleet, T0, 2)
    measured(fleet, "tiny", 0.01, 1.0)  # cheapest per unit, but 1/s cannot replace x
    transitions.take()
    await settle(scheduler, fleet, now, 8)
    assert transitions.take() == [("tiny", "standby")]
    assert states(fleet) == {"x": "active", "tiny": "standby"}


@pytest.mark.trio
async def test_infeasible_capacity_activates_everything_with_the_reason():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    timing = FakeTiming(t_train_s=1.5, t_bcast_s=3.5)  # 2 * 1.5 = 3 s <= T_bcast 3.5 s
    scheduler, transitions = make(fleet, timing)
    await settle(scheduler, fleet, T0, 1)
    active = [(n, r) for n, s, r in transitions.log if s == "active"]
    assert sorted(n for n, _ in active) == ["a", "b", "c"]
    for _, reason in active:
        assert reason.startswith("activate all (kappa * T_train = 2 * 1.5 s = 3 s does not exceed T_bcast = 3.5 s")
        assert "no fleet can keep the learner busy" in reason
    assert scheduler.view.mu_target is None
    # the model still predicts the bubble of the pool it has: idle 20/17 + 3.5 - 3 s per period
    idle = 20 / 17 + 0.5
    assert scheduler.view.predicted_bubble == pytest.approx(idle / (idle + 3.0))
    # the broadcast speeds up: a target exists again, 20 / (3 - 0.5) * 1.1 = 8.8/s, and the
    # surplus is released, priciest first, while the rest keeps 8.8 * 1.2 = 10.56/s
    timing.t_bcast_s = 0.5
    transitions.take()
    await settle(scheduler, fleet, T0 + 10, 2 * (RELEASE_HOLD_PERIODS + 1))
    assert transitions.take() == [("c", "standby")]  # 17 - 4 = 13 >= 10.56; 13 - 8 = 5 < 10.56: b stays
    assert states(fleet) == {"a": "active", "b": "active", "c": "standby"}


@pytest.mark.trio
@pytest.mark.parametrize(
    ("enabled", "t_train_s", "why"), [(False, 1.5, "scheduler disabled"), (True, None, "learner has not stepped yet")]
)
async def test_without_a_target_every_measured_node_works(enabled, t_train_s, why):
    fleet = Fleet()
    measured(fleet, "a", 0.1, 50.0)
    measured(fleet, "b", 0.4, 8.0)
    join(fleet, "p", 0.2)  # still probing: it works on its probe lease, not in the pool
    scheduler, transitions = make(fleet, FakeTiming(t_train_s=t_train_s), enabled=enabled)
    await settle(scheduler, fleet, T0, 5)
    assert states(fleet) == {"a": "active", "b": "active", "p": "probing"}
    assert [r for _, s, r in transitions.log if s == "active"] == [f"activate all ({why})"] * 2


@pytest.mark.trio
async def test_step_metrics():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    scheduler, _ = make(fleet, FakeTiming())
    await settle(scheduler, fleet, T0, 6)
    metrics = scheduler.step_metrics(4, cost_usd=0.02)
    # pool 13/s: idle max(0, 20/13 + 1 - 3) = 0
    assert metrics == pytest.approx(
        {
            "mu_pool": 13.0,
            "mu_min": 10.0,
            "mu_target": 11.0,
            "predicted_bubble": 0.0,
            "usable_fraction": 1.0,
            "active_nodes": 2.0,
            "standby_nodes": 1.0,
            "cost_usd": 0.02,
            "cost_per_step_usd": 0.005,
        }
    )
    fleet.get("b").state = "gone"
    # pool 5/s: idle 20/5 + 1 - 3 = 2 s per period, bubble 2 / (2 + 3)
    assert scheduler.step_metrics(4, 0.02)["predicted_bubble"] == pytest.approx(0.4)
    scheduler.timing = FakeTiming(t_train_s=None).timing()
    metrics = scheduler.step_metrics(0, 0.0)
    assert (metrics["mu_min"], metrics["mu_target"], metrics["predicted_bubble"]) == (None, None, None)
    assert metrics["cost_per_step_usd"] is None


@pytest.mark.trio
async def test_skipped_groups_raise_the_throughput_the_learner_needs():
    """Half the accepted groups skipped (equal rewards, not staleness): the fleet must produce 2R per step, so
    mu_min doubles."""
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    scheduler, _ = make(fleet, FakeTiming(usable=0.5, fresh_usable=0.5))
    await settle(scheduler, fleet, T0, 10)
    metrics = scheduler.step_metrics(4, cost_usd=0.0)
    # R_eff = 10 / 0.5 = 20: mu_min = 2*20 / (2*1.5 - 1) = 20, target 22 > 17 available: all active.
    assert (metrics["mu_min"], metrics["mu_target"], metrics["usable_fraction"]) == pytest.approx((20.0, 22.0, 0.5))
    assert states(fleet) == {"a": "active", "b": "active", "c": "active"}
    # pool 17/s: idle 2*20/17 + 1 - 3 = 6/17 s per period, bubble (6/17) / (6/17 + 3)
    assert metrics["predicted_bubble"] == pytest.approx((6 / 17) / (6 / 17 + 3))


@pytest.mark.trio
async def test_stale_drops_do_not_raise_the_target():
    """Half the accepted groups dropped as stale, none lost otherwise: an over-provisioned fleet's own waste.
    The target stays at R's (10/s, 11/s), so the fleet that made the waste is not grown for it."""
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    scheduler, _ = make(fleet, FakeTiming(usable=0.5, fresh_usable=1.0))
    await settle(scheduler, fleet, T0, 10)
    metrics = scheduler.step_metrics(4, cost_usd=0.0)
    assert (metrics["mu_min"], metrics["mu_target"]) == pytest.approx((10.0, 11.0))
    assert states(fleet) == {"a": "active", "b": "active", "c": "standby"}


@pytest.mark.trio
async def test_a_saturated_reward_buys_no_nodes_and_says_why_once(caplog):
    """Every group with equal rewards: the pool is far below the target the fraction implies, yet no node is
    activated for it, the log says why once, and once more when the share recovers."""
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0).state = "active"
    measured(fleet, "b", 0.4, 8.0).state = "standby"
    saturated = saturation(0.05, 0.95)
    timing = FakeTiming(fresh_usable=0.05)
    timing.saturated = saturated
    scheduler, transitions = make(fleet, timing)
    with caplog.at_level("INFO", logger="echo2.hub.scheduler"):
        now = await settle(scheduler, fleet, T0, 5)
        assert scheduler.view.mu_target == pytest.approx(11.0 / 0.05)
        assert transitions.take() == [] and states(fleet) == {"a": "active", "b": "standby"}
        assert [r.getMessage() for r in caplog.records] == [saturated]
        timing.fresh_usable, timing.saturated = 1.0, None
        await settle(scheduler, fleet, now, 2)
    assert transitions.take() == [("b", "active")]
    assert caplog.records[-1].getMessage().startswith("the usable share of accepted groups recovered")


@pytest.mark.trio
async def test_the_first_step_after_a_broadcast_is_predicted_from_when_the_pool_got_it():
    """S = 3, kappa = 2: step V + 3 is the first that can use nothing older than version V; it starts
    2 * T_train = 3 s after the publish. T_bcast 2.9 s: mu_min = 20 / (3 - 1.4) = 12.5, so all three
    nodes work (17/s). They got V 2.7 s after it on average, so that step waits 10/17 - 0.3 s."""
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    measured(fleet, "c", 0.3, 4.0)
    timing = FakeTiming(t_bcast_s=2.9, staleness=3)
    scheduler, _ = make(fleet, timing)
    await settle(scheduler, fleet, T0, 6)
    # per period: 20/17 s of generation + a 1.4 s stall (T_bcast - (S - kappa) * T_train) < 3 s: no idle
    assert states(fleet) == {"a": "active", "b": "active", "c": "active"}
    assert scheduler.step_metrics(4, 0.0)["predicted_bubble"] == 0.0
    timing.t_arrive_s = 2.7
    idle = 10 / 17 - (3.0 - 2.7)
    assert scheduler.step_metrics(4, 0.0)["predicted_bubble"] == pytest.approx(idle / (idle + 3.0))
    # A fifth of the groups dropped as stale: the period needs R / 0.8, but that step's need is unchanged
    # (the drops are the old version's overproduction). Skipped for other reasons, they raise it too.
    timing.usable = 0.8
    assert scheduler.capacity().predicted_bubble == pytest.approx(idle / (idle + 3.0))
    timing.fresh_usable = 0.8
    idle = 12.5 / 17 - (3.0 - 2.7)
    assert scheduler.capacity().predicted_bubble == pytest.approx(idle / (idle + 3.0))
    # Leases of 4 rollouts: each of the three active nodes hands V's rollouts in half a lease behind a steady
    # flow, 3 * 2 more to wait for.
    with_leases = Scheduler(scheduler.config, fleet, timing.timing(rollouts_per_lease=4), scheduler.set_state)
    idle = (12.5 + 3 * 2) / 17 - (3.0 - 2.7)
    assert with_leases.capacity().predicted_bubble == pytest.approx(idle / (idle + 3.0))
    # Where the balance binds (fresh usable 0.3, no leases: 20 / 0.3 / 17 s of generation per period, against
    # the first step's 10 / 0.3 / 17 - 0.3 s), each node stalls by its own install (a at 1.0 s, b at 2.9 s, c at
    # 2.0 s; 1.5 s of slack): (0 * 5 + 1.4 * 8 + 0.5 * 4) / 17 s, not T_bcast's 1.4 s.
    timing.fresh_usable = 0.3
    idle = 20 / 0.3 / 17 + 1.4 - 3.0
    assert scheduler.capacity().predicted_bubble == pytest.approx(idle / (idle + 3.0))
    timing.installs = ((5.0, 1.0), (8.0, 2.9), (4.0, 2.0))
    idle = 20 / 0.3 / 17 + (1.4 * 8 + 0.5 * 4) / 17 - 3.0
    assert idle > 10 / 0.3 / 17 - 0.3
    assert scheduler.capacity().predicted_bubble == pytest.approx(idle / (idle + 3.0))


def test_heartbeat_period_grows_with_the_fleet_and_timeouts_with_the_period():
    assert heartbeat_period(10, 2.0, 100.0) == 2.0  # a small fleet beats at the configured period
    assert heartbeat_period(1000, 2.0, 100.0) == 10.0  # 1000 nodes at 100 beats/s in all
    assert heartbeat_period(10**9, 2.0, 100.0) == HEARTBEAT_PERIOD_MAX_S
    assert heartbeat_timeout(0.0, 2.0, 15.0) == 15.0  # not told yet: the configured timeout
    assert heartbeat_timeout(2.0, 2.0, 15.0) == 15.0
    assert heartbeat_timeout(10.0, 2.0, 15.0) == 75.0  # the same 7.5 missed beats


@pytest.mark.trio
async def test_a_node_told_a_longer_period_is_dropped_only_after_its_stretched_timeout():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0)
    measured(fleet, "b", 0.4, 8.0)
    scheduler, transitions = make(fleet, FakeTiming())
    now = await settle(scheduler, fleet, T0, 4)
    transitions.take()
    fleet.get("b").heartbeat_period_s = 4.0  # told every 4 s (the configured 2 s, stretched by a large fleet)
    fleet.get("b").last_seen = now - 29.0
    await scheduler.control_once(now)
    assert transitions.take() == []  # 29 s < 15 s x 4 / 2
    fleet.get("b").last_seen = now - 31.0
    await scheduler.control_once(now)
    assert transitions.log[0] == ("b", "gone", "no heartbeat for 30s")


# The policy alone (hub.control.policy.decide): the same function the Scheduler, bench/simulate.py and
# testbed/inproc.py call. Target 11/s, margin 0.2 (band 13.2/s), control period 1 s: a hold of 3 s.
POLICY = SchedulerConfig(gamma=1.1, control_period_s=1.0, release_margin=0.2)
TARGET = CapacityView(0.0, 10.0, 11.0, None, "measured")


def test_policy_moves_measured_probes_to_standby_and_activates_the_cheapest_below_target():
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0).state = "active"
    measured(fleet, "b", 0.4, 8.0).state = "standby"
    measured(fleet, "c", 0.3, 4.0)  # probing, its probe measured
    join(fleet, "p", 0.2)  # probing, not measured: not in the view
    view = fleet_view(fleet)
    assert view == FleetView((NodeOffer("a", 0.1, 5.0),), (NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.3, 4.0)), frozenset({"c"}))
    # pool 5/s, shortfall 6/s: b (rho 0.05, below c's 0.075) covers it alone
    decision = decide(view, TARGET, POLICY, {"a": T0 - 5}, T0)
    assert decision.moves == (
        Move("c", "standby", "probe measured 4 rollouts/s"),
        Move("b", "active", "pool 5/s below target 11/s"),
    )
    assert decision.release_wanted == {}  # an activation ends every release wish


def test_policy_never_activates_a_node_whose_every_group_arrived_late_until_its_measured_rate_changes():
    """Target 11/s. Active: a (5/s). Standby: b at $0.4/h, 3/s (rho 0.133) and l at $0.1/h, 2.9/s (rho 0.034, the
    cheapest), whose last lease came back all late at that rate. Without the hold l would be first: 5 + 2.9 = 7.9,
    then b: 10.9 < 11, so both. With it only b: 5 + 3 = 8/s, the shortfall stays."""
    fleet = Fleet()
    measured(fleet, "a", 0.1, 5.0).state = "active"
    measured(fleet, "b", 0.4, 3.0).state = "standby"
    late = measured(fleet, "l", 0.1, 2.9)
    late.state, late.late_at_rate = "standby", late.rollouts_per_s
    view = fleet_view(fleet)
    assert view.too_slow == frozenset({"l"})
    assert decide(view, TARGET, POLICY, {}, T0).moves == (Move("b", "active", "pool 5/s below target 11/s"),)
    # Without a target (every measured node works), with the scheduler off: still not l.
    untargeted = CapacityView(0.0, None, None, None, "learner has not stepped yet")
    assert [m.node for m in decide(view, untargeted, POLICY, {}, T0).moves] == ["b"]
    off = POLICY.model_copy(update={"enabled": False})
    assert [m.node for m in decide(view, TARGET, off, {}, T0).moves] == ["b"]
    # Active when its lease came back all late: released at once, whatever the target.
    late.state = "active"
    moves = decide(fleet_view(fleet), TARGET, POLICY, {}, T0).moves
    assert moves[0] == Move("l", "standby", "every group of its last two leases arrived late (measured 2.9 rollouts/s)")
    assert [m.node for m in moves[1:]] == ["b"]  # and the pool without it tops up as if it were not there
    # Its measured rate changed (a re-join's probe measured 3.5/s, in time or not yet judged): activated again.
    late.state, late.rollouts_per_s = "standby", 3.5
    assert fleet_view(fleet).too_slow == frozenset()
    assert [m.node for m in decide(fleet_view(fleet), TARGET, POLICY, {}, T0).moves] == ["l", "b"]


def test_policy_without_a_target_activates_every_measured_node():
    view = FleetView((), (NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.3, 4.0)), frozenset({"c"}))
    decision = decide(view, CapacityView(0.0, None, None, None, "learner has not stepped yet"), POLICY, {}, T0)
    assert decision.moves == (
        Move("c", "standby", "probe measured 4 rollouts/s"),
        Move("b", "active", "activate all (learner has not stepped yet)"),
        Move("c", "active", "activate all (learner has not stepped yet)"),
    )
    off = POLICY.model_copy(update={"enabled": False})
    assert [m.reason for m in decide(view, TARGET, off, {}, T0).moves][1:] == ["activate all (scheduler disabled)"] * 2


def test_policy_holds_inside_the_band():
    # pool 13/s meets 11/s; without b (rho 0.05 > a's 0.02) 5/s < 13.2/s: nothing moves, the wishes end
    view = FleetView((NodeOffer("a", 0.1, 5.0), NodeOffer("b", 0.4, 8.0)), ())
    assert decide(view, TARGET, POLICY, {"b": T0 - 1}, T0) == decide(view, TARGET, POLICY, {}, T0)
    assert decide(view, TARGET, POLICY, {"b": T0 - 1}, T0).moves == ()
    assert decide(view, TARGET, POLICY, {"b": T0 - 1}, T0).release_wanted == {}


def test_policy_releases_only_after_the_hold():
    # pool 20/s; without c (rho 0.1) 15/s >= 13.2/s, without b (0.05) too 7/s: c alone is released
    view = FleetView((NodeOffer("a", 0.14, 7.0), NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.5, 5.0)), ())
    first = decide(view, TARGET, POLICY, {}, T0)
    assert (first.moves, first.release_wanted) == ((), {"c": T0})
    early = decide(view, TARGET, POLICY, first.release_wanted, T0 + 2.9)
    assert (early.moves, early.release_wanted) == ((), {"c": T0})
    due = decide(view, TARGET, POLICY, first.release_wanted, T0 + 3.0)
    assert due.moves == (Move("c", "standby", "pool without it 15/s >= target with margin 13.2/s for 3s"),)
    assert due.release_wanted == {}


def test_policy_releases_the_part_of_a_batch_every_period_of_the_hold_wanted():
    # pool 25/s: d (rho 0.2) and c (0.1) can both go (25 - 5 - 5 = 15 >= 13.2/s); c was wanted for 3 s, d only
    # for 1 s: c goes, the reason says it was part of the batch, and d waits on
    view = FleetView(
        (NodeOffer("a", 0.14, 7.0), NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.5, 5.0), NodeOffer("d", 1.0, 5.0)), ()
    )
    decision = decide(view, TARGET, POLICY, {"c": T0 - 3, "d": T0 - 1, "gone": T0 - 9}, T0)
    assert decision.moves == (
        Move("c", "standby", "pool without these 2 15/s >= target with margin 13.2/s for 3s (1 of them wanted that long)"),
    )
    assert decision.release_wanted == {"d": T0 - 1}


def test_a_saturated_view_still_releases_and_still_staffs_an_empty_pool():
    held = CapacityView(0.0, 10.0, 11.0, None, "measured", hold="saturated")
    # pool 20/s: c is released after the hold, as without saturation
    view = FleetView((NodeOffer("a", 0.14, 7.0), NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.5, 5.0)), ())
    assert decide(view, held, POLICY, {"c": T0 - 3}, T0).moves == decide(view, TARGET, POLICY, {"c": T0 - 3}, T0).moves != ()
    # No active node: a learner with no fleet gets the cheapest, saturated or not.
    empty = FleetView((), (NodeOffer("b", 0.4, 8.0), NodeOffer("c", 0.3, 4.0)))
    assert decide(empty, held, POLICY, {}, T0).moves == decide(empty, TARGET, POLICY, {}, T0).moves != ()
    # Below target with an active node: nothing is bought.
    short = FleetView((NodeOffer("a", 0.1, 5.0),), (NodeOffer("b", 0.4, 8.0),))
    assert decide(short, held, POLICY, {}, T0).moves == ()
    assert decide(short, TARGET, POLICY, {}, T0).moves != ()
