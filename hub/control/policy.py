"""The scheduler's move each control period, as one pure function (`decide`): the hub's Scheduler, the fleet
simulator (bench/simulate.py) and the in-process test hub (testbed/inproc.py) all call it.

Measured probes join the standby pool. Without a target (scheduler off, nothing measured yet, or no fleet
can keep up) every measured node works, so the learner waits as little as possible. Otherwise one set of
nodes is activated or released (hub.method.capacity.control_decision: a fleet of thousands settles in a few
periods, not one period per node). Activation is immediate (a starving learner costs the most); a node is
released only once it has been wanted for release RELEASE_HOLD_PERIODS control periods on end, on top of
the release margin, so neither a noisy throughput nor a noisy T_train can make the loop release nodes and
buy them back. While the usable share is saturated (CapacityView.hold: a reward that scores every completion
alike, or most groups discarded) no node is activated, since more rollouts carry no more signal. Releases still
follow the target, but a target sized by a share under 0.2 is 5x R's or more, so in practice the fleet is held as
it is until the share recovers. A node whose every group of its last two leases arrived late is released and not
activated again until its measured rate changes (NodeRecord.too_slow): at that rate its groups miss the version
window, and more of them buy the learner nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from hub.config import SchedulerConfig
from hub.method.capacity import (
    Arrival,
    CapacityRule,
    Decision,
    InfeasibleCapacity,
    NodeOffer,
    control_decision,
    held_release,
    mu_min,
    predicted_bubble,
    rule_staleness,
)
from hub.records.fleet import Fleet, NodeRecord

RELEASE_HOLD_PERIODS = 3


@dataclass(frozen=True)
class CapacityView:
    """The capacity model's inputs and outputs at one control period."""

    mu_pool: float
    mu_min: float | None
    mu_target: float | None
    predicted_bubble: float | None
    reason: str
    usable_fraction: float = 1.0
    # Why no node is activated however short the pool falls (hub.method.capacity.saturation); None: activate freely.
    hold: str | None = None


@dataclass(frozen=True)
class FleetView:
    """The measured fleet at one control period, as `decide` sees it."""

    active: tuple[NodeOffer, ...]
    # Standby nodes and measured probes, in the fleet's order.
    standby: tuple[NodeOffer, ...]
    # Those of `standby` still probing: they move to standby first.
    probed: frozenset[str] = frozenset()
    # Those of `active` and `standby` whose every group of their last two leases arrived late, at the rate they are measured
    # at still (NodeRecord.too_slow): never activated, and released.
    too_slow: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Move:
    """One node to move to `state`, with the reason its event records."""

    node: str
    state: Literal["standby", "active"]
    reason: str


@dataclass(frozen=True)
class PeriodDecision:
    """A control period's moves, in order, and since when each node is wanted for release (for the next)."""

    moves: tuple[Move, ...]
    release_wanted: Mapping[str, float] = field(default_factory=dict)


def capacity_view(
    mu_pool: float,
    kappa: int,
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    usable: float,
    staleness: int | None,
    arrival: Arrival | None,
    gamma: float,
    rule: CapacityRule = "refined",
    saturated: str | None = None,
) -> CapacityView:
    """The capacity model at one control period, from what the hub measured: mu_min, the target gamma * mu_min
    and the bubble the active pool leaves, under the capacity `rule` (the Scheduler and bench/simulate.py both call
    it). `usable`: the fresh usable fraction (hub.method.capacity.fresh_usable_fraction); `saturated`: why it is
    too low for more nodes to help (the view then holds activations)."""
    # Accepted rollouts the fleet must produce per step, counting the groups the learner skips for any cause
    # but staleness.
    r = rollouts_per_step / usable
    staleness = rule_staleness(rule, staleness)
    bubble = predicted_bubble(kappa, r, t_train_s, t_bcast_s, mu_pool, staleness, arrival)
    try:
        needed = mu_min(kappa, r, t_train_s, t_bcast_s, staleness)
    except InfeasibleCapacity as exc:
        # No target, but the bubble of the pool we have is still predicted (never 0 here).
        return CapacityView(mu_pool, None, None, bubble, str(exc), usable, saturated)
    reason = f"T_train {t_train_s:.3g}s T_bcast {t_bcast_s:.3g}s usable {usable:.0%} ({rule} rule)"
    return CapacityView(mu_pool, needed, gamma * needed, bubble, reason, usable, saturated)


def offer(record: NodeRecord) -> NodeOffer:
    """A node as the capacity model sees it: its ranking price (its declared one, give or take
    scheduler.price_band) and measured throughput."""
    return NodeOffer(record.peer_id, record.rank_price, record.rollouts_per_s)


def fleet_view(fleet: Fleet) -> FleetView:
    """The fleet's active nodes, standby nodes and measured probes, as plain offers (not a node that said it leaves)."""
    staying = [n for n in fleet.in_state("active", "probing", "standby") if n.left_at is None]
    waiting = [n for n in staying if n.state == "standby" or (n.state == "probing" and n.measured)]
    return FleetView(
        tuple(offer(n) for n in staying if n.state == "active"),
        tuple(offer(n) for n in waiting),
        frozenset(n.peer_id for n in waiting if n.state == "probing"),
        frozenset(n.peer_id for n in staying if n.too_slow),
    )


def decide(
    fleet: FleetView, capacity: CapacityView, config: SchedulerConfig, release_wanted: Mapping[str, float], now: float
) -> PeriodDecision:
    """This period's moves, from the measured fleet, the capacity model's target and the release wishes so far
    (node -> since when it has been wanted for release without a break). A node too slow for the version window
    (FleetView.too_slow) is released at once and never activated, whatever the target."""
    probes = tuple(
        Move(n.name, "standby", f"probe measured {n.rollouts_per_s:.4g} rollouts/s")
        for n in fleet.standby
        if n.name in fleet.probed
    ) + tuple(
        Move(n.name, "standby", f"every group of its last two leases arrived late (measured {n.rollouts_per_s:.4g} rollouts/s)")
        for n in fleet.active
        if n.name in fleet.too_slow
    )
    return _decide_for(_without_too_slow(fleet), probes, capacity, config, release_wanted, now)


def _without_too_slow(fleet: FleetView) -> FleetView:
    """The fleet the target is met from: its too slow nodes left out (released by `decide`, never activated)."""
    return FleetView(
        tuple(n for n in fleet.active if n.name not in fleet.too_slow),
        tuple(n for n in fleet.standby if n.name not in fleet.too_slow),
        fleet.probed,
    )


def _decide_for(
    fleet: FleetView,
    probes: tuple[Move, ...],
    capacity: CapacityView,
    config: SchedulerConfig,
    release_wanted: Mapping[str, float],
    now: float,
) -> PeriodDecision:
    """`decide`'s moves after `probes` (the measured probes and the too slow nodes to standby), on a fleet without
    its too slow nodes."""
    if not config.enabled:
        return PeriodDecision(probes + tuple(Move(n.name, "active", "activate all (scheduler disabled)") for n in fleet.standby))
    # A saturated reward buys nothing: releases still follow the target, and an empty pool still gets its nodes.
    holding = capacity.hold is not None and bool(fleet.active)
    if capacity.mu_target is None:
        if holding:
            return PeriodDecision(probes)
        return PeriodDecision(probes + tuple(Move(n.name, "active", f"activate all ({capacity.reason})") for n in fleet.standby))
    decision = control_decision(fleet.active, fleet.standby, capacity.mu_target, config.release_margin)
    if holding and decision.action == "activate":
        return PeriodDecision(probes)
    if decision.action == "release":
        released = _held_release(decision, release_wanted, now, RELEASE_HOLD_PERIODS * config.control_period_s)
        return PeriodDecision(probes + released.moves, released.release_wanted)
    return PeriodDecision(probes + tuple(Move(name, "active", decision.reason) for name in decision.nodes))


def _held_release(decision: Decision, release_wanted: Mapping[str, float], now: float, hold_s: float) -> PeriodDecision:
    """The nodes of a release decision wanted for release at least hold_s, the hold in their reason."""
    ready, since = held_release(release_wanted, decision.nodes, now, hold_s)
    if not ready:
        return PeriodDecision((), since)
    held_s = now - max(since[name] for name in ready)
    subset = "" if len(ready) == len(decision.nodes) else f" ({len(ready)} of them wanted that long)"
    reason = f"{decision.reason} for {held_s:.3g}s{subset}"
    gone = set(ready)
    return PeriodDecision(
        tuple(Move(name, "standby", reason) for name in ready), {name: t for name, t in since.items() if name not in gone}
    )
