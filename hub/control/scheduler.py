"""Closed-loop fleet control (DESIGN sections 3-4): buy the rollout throughput that keeps the learner busy
from the nodes that are cheapest per unit of throughput, and keep buying it as nodes come, go and change speed.

Every control period: nodes silent past the heartbeat timeout are dropped (their leases go
back to the pool); newly probed nodes join the standby pool; mu_min is recomputed from the
measured T_train and T_bcast, mu_target = gamma * mu_min, and one set of nodes is activated or
released (hub.method.capacity.control_decision: a fleet of thousands settles in a few periods, not one
period per node). Activation is immediate (a starving learner costs the most); a node is released
only once it has been wanted for release RELEASE_HOLD_PERIODS control periods on end, on top of the
release margin, so neither a noisy throughput nor a noisy T_train can make the loop release nodes
and buy them back. Every state change is an event with its reason (through `set_state`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from hub.config import SchedulerConfig
from hub.method.capacity import (
    Arrival,
    InfeasibleCapacity,
    NodeOffer,
    control_decision,
    held_release,
    mu_min,
    predicted_bubble,
)
from hub.records.fleet import Fleet, NodeRecord, heartbeat_timeout

log = logging.getLogger("echo2.hub.scheduler")

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


@dataclass(frozen=True)
class LearnerTiming:
    """What the capacity model needs from the learner and the broadcaster, read when needed."""

    kappa: int
    rollouts_per_step: int
    t_train_s: Callable[[], float | None]
    t_bcast_s: Callable[[], float | None]
    # Share of accepted groups that end up trained on (hub.method.capacity.usable_fraction).
    usable_fraction: Callable[[], float] = lambda: 1.0
    # S: how long nodes may go on with the version they hold (hub.method.capacity.broadcast_stall_s); None: DESIGN's
    # formula, where the broadcast stops the fleet for all of T_bcast.
    staleness: int | None = None
    # The active pool's throughput-weighted mean time to install the newest version, and the usable
    # fraction without stale drops: the bubble of the first step that needs that version
    # (hub.method.capacity.first_step_idle_s). None: not measured, and that step is not modelled.
    t_arrive_s: Callable[[], float | None] = lambda: None
    # (rollouts/s, seconds from publish to install) of each active node for that version: the pool's stall
    # (hub.method.capacity.pool_stall_s). Empty: every node is charged T_bcast.
    installs: Callable[[], tuple[tuple[float, float], ...]] = lambda: ()
    fresh_usable_fraction: Callable[[], float] = lambda: 1.0
    # Rollouts in one lease (prompts_per_lease * group_size): each active node hands in a new version's
    # rollouts a lease at a time, half a lease behind a steady flow (hub.method.capacity.Arrival.lease_rollouts).
    rollouts_per_lease: int = 0


def offer(record: NodeRecord) -> NodeOffer:
    return NodeOffer(record.peer_id, record.price_per_hour, record.rollouts_per_s)


class Scheduler:
    """Runs `control_once` every control period (or sooner when poked) on the hub's fleet."""

    def __init__(
        self,
        config: SchedulerConfig,
        fleet: Fleet,
        timing: LearnerTiming,
        set_state: Callable[[NodeRecord, str, str], Awaitable[None]],
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.timing = timing
        self.set_state = set_state
        self.view = CapacityView(0.0, None, None, None, "no measurements yet")
        self.wake = trio.Event()
        # Node -> since when the loop has wanted to release it without a break (hub.method.capacity.held_release).
        self._release_wanted: dict[str, float] = {}

    @property
    def release_hold_s(self) -> float:
        return RELEASE_HOLD_PERIODS * self.config.control_period_s

    def capacity(self) -> CapacityView:
        active = self.fleet.in_state("active")
        mu_pool = math.fsum(n.rollouts_per_s for n in active)
        t_train, t_bcast = self.timing.t_train_s(), self.timing.t_bcast_s() or 0.0
        if t_train is None:
            return CapacityView(mu_pool, None, None, None, "learner has not stepped yet")
        usable = self.timing.usable_fraction()
        # Accepted rollouts the fleet must produce per step, counting the groups the learner skips.
        k, r = self.timing.kappa, self.timing.rollouts_per_step / usable
        t_arrive = self.timing.t_arrive_s()
        arrival = None if t_arrive is None else Arrival(
            t_arrive, self.timing.rollouts_per_step / self.timing.fresh_usable_fraction(),
            len(active) * self.timing.rollouts_per_lease / 2, self.timing.installs())
        try:
            needed = mu_min(k, r, t_train, t_bcast, self.timing.staleness)
        except InfeasibleCapacity as exc:
            # No target, but the bubble of the pool we have is still predicted (never 0 here).
            return CapacityView(
                mu_pool, None, None, predicted_bubble(k, r, t_train, t_bcast, mu_pool, self.timing.staleness, arrival),
                str(exc),
                usable,
            )
        return CapacityView(
            mu_pool, needed, self.config.gamma * needed,
            predicted_bubble(k, r, t_train, t_bcast, mu_pool, self.timing.staleness, arrival),
            f"T_train {t_train:.3g}s T_bcast {t_bcast:.3g}s usable {usable:.0%}", usable,
        )

    async def control_once(self, now: float) -> None:
        config = self.config
        for record in self.fleet.silent(now, config.heartbeat_period_s, config.heartbeat_timeout_s):
            timeout_s = heartbeat_timeout(record.heartbeat_period_s, config.heartbeat_period_s, config.heartbeat_timeout_s)
            await self.set_state(record, "gone", f"no heartbeat for {timeout_s:g}s")
        for record in self.fleet.in_state("probing"):
            if record.measured:
                await self.set_state(record, "standby", f"probe measured {record.rollouts_per_s:.4g} rollouts/s")
        self.view = self.capacity()
        standby = self.fleet.in_state("standby")
        if not self.config.enabled or self.view.mu_target is None:
            # No target to aim at (scheduler off, nothing measured yet, or no fleet can keep
            # up): everything measured works, so the learner waits as little as possible.
            self._release_wanted.clear()
            why = "scheduler disabled" if not self.config.enabled else self.view.reason
            for record in standby:
                await self.set_state(record, "active", f"activate all ({why})")
            self.view = self.capacity()
            return
        decision = control_decision(
            [offer(n) for n in self.fleet.in_state("active")],
            [offer(n) for n in standby],
            self.view.mu_target,
            self.config.release_margin,
        )
        if decision.action == "release":
            ready = held_release(self._release_wanted, decision.nodes, now, self.release_hold_s)
            if not ready:
                return
            held_s = now - max(self._release_wanted[name] for name in ready)
            subset = "" if len(ready) == len(decision.nodes) else f" ({len(ready)} of them wanted that long)"
            reason, state, nodes = f"{decision.reason} for {held_s:.3g}s{subset}", "standby", ready
            for name in ready:
                del self._release_wanted[name]
        elif decision.action == "activate":
            self._release_wanted.clear()
            reason, state, nodes = decision.reason, "active", list(decision.nodes)
        else:
            self._release_wanted.clear()
            return
        for name in nodes:
            await self.set_state(self.fleet.get(name), state, reason)
        self.view = self.capacity()

    def step_metrics(self, step: int, cost_usd: float) -> dict[str, float | None]:
        """Per-step ledger fields for metrics.jsonl: the capacity model now and the money spent so far.

        `cost_usd` is the run's cost up to this step (learner time plus node ledger);
        cost_per_step_usd is that cost over `step` steps. Fields the model cannot give yet
        (no T_train, infeasible capacity) are None.
        """
        view = self.capacity()
        return {
            "mu_pool": view.mu_pool,
            "mu_min": view.mu_min,
            "mu_target": view.mu_target,
            "predicted_bubble": view.predicted_bubble,
            "usable_fraction": view.usable_fraction,
            "active_nodes": float(len(self.fleet.in_state("active"))),
            "standby_nodes": float(len(self.fleet.in_state("standby"))),
            "cost_usd": cost_usd,
            "cost_per_step_usd": cost_usd / step if step > 0 else None,
        }

    async def run(self) -> None:
        while True:
            await self.control_once(time.time())
            with trio.move_on_after(self.config.control_period_s):
                await self.wake.wait()
            self.wake = trio.Event()

    def poke(self) -> None:
        """Fleet changed (join, probe measured, leave): decide now rather than at the next period."""
        self.wake.set()
