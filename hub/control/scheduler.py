"""Closed-loop fleet control (docs/DESIGN.md §5-6): buy the rollout throughput that keeps the learner busy
from the nodes that are cheapest per unit of throughput, and keep buying it as nodes come, go and change speed.

Every control period: nodes silent past the heartbeat timeout are dropped (their leases go
back to the pool); mu_min is recomputed from the measured T_train and T_bcast, mu_target = gamma * mu_min;
and the policy (hub.control.policy.decide) says which nodes move: measured probes to standby, and one set
of nodes activated or released. Every state change is an event with its reason (through `set_state`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import trio

from hub.config import SchedulerConfig
from hub.control.policy import CapacityView, decide, fleet_view
from hub.method.capacity import Arrival, InfeasibleCapacity, mu_min, predicted_bubble
from hub.records.fleet import Fleet, NodeRecord, heartbeat_timeout

log = logging.getLogger("echo2.hub.scheduler")


@dataclass(frozen=True)
class LearnerTiming:
    """What the capacity model needs from the learner and the broadcaster, read when needed."""

    kappa: int
    rollouts_per_step: int
    t_train_s: Callable[[], float | None]
    t_bcast_s: Callable[[], float | None]
    # Share of accepted groups that end up trained on (hub.method.capacity.usable_fraction).
    usable_fraction: Callable[[], float] = lambda: 1.0
    # S: how long nodes may go on with the version they hold (hub.method.capacity.broadcast_stall_s); None: the
    # upstream formula (docs/DESIGN.md §5.2), where the broadcast stops the fleet for all of T_bcast.
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
        self._release_wanted: Mapping[str, float] = {}

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
        """One control period: drop the silent nodes, then make the policy's moves."""
        config = self.config
        for record in self.fleet.silent(now, config.heartbeat_period_s, config.heartbeat_timeout_s):
            timeout_s = heartbeat_timeout(record.heartbeat_period_s, config.heartbeat_period_s, config.heartbeat_timeout_s)
            await self.set_state(record, "gone", f"no heartbeat for {timeout_s:g}s")
        self.view = self.capacity()
        decision = decide(fleet_view(self.fleet), self.view, config, self._release_wanted, now)
        self._release_wanted = decision.release_wanted
        for move in decision.moves:
            await self.set_state(self.fleet.get(move.node), move.state, move.reason)
        if decision.moves:
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
