"""Closed-loop fleet control (DESIGN sections 3-4): buy the rollout throughput that keeps the learner busy
from the nodes that are cheapest per unit of throughput, and keep buying it as nodes come, go and change speed.

Every control period: nodes silent past the heartbeat timeout are dropped (their leases go
back to the pool); newly probed nodes join the standby pool; mu_min is recomputed from the
measured T_train and T_bcast, mu_target = gamma * mu_min, and one node is activated or
released (with hysteresis). Every decision is an event with its reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from hub.capacity import InfeasibleCapacity, NodeOffer, control_decision, mu_min, predicted_bubble
from hub.config import SchedulerConfig
from hub.fleet import Fleet, NodeRecord

log = logging.getLogger("echo2.hub.scheduler")


@dataclass(frozen=True)
class CapacityView:
    """The capacity model's inputs and outputs at one control period."""

    mu_pool: float
    mu_min: float | None
    mu_target: float | None
    predicted_bubble: float | None
    reason: str


@dataclass(frozen=True)
class LearnerTiming:
    kappa: int
    rollouts_per_step: int
    t_train_s: Callable[[], float | None]
    t_bcast_s: Callable[[], float | None]


def offer(record: NodeRecord) -> NodeOffer:
    return NodeOffer(record.peer_id, record.price_per_hour, record.rollouts_per_s)


class Scheduler:
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

    def capacity(self) -> CapacityView:
        active = self.fleet.in_state("active")
        mu_pool = sum(n.rollouts_per_s for n in active)
        t_train, t_bcast = self.timing.t_train_s(), self.timing.t_bcast_s() or 0.0
        if t_train is None:
            return CapacityView(mu_pool, None, None, None, "learner has not stepped yet")
        k, r = self.timing.kappa, self.timing.rollouts_per_step
        try:
            needed = mu_min(k, r, t_train, t_bcast)
        except InfeasibleCapacity as exc:
            return CapacityView(mu_pool, None, None, None, str(exc))
        return CapacityView(
            mu_pool, needed, self.config.gamma * needed, predicted_bubble(k, r, t_train, t_bcast, mu_pool), "measured"
        )

    async def control_once(self, now: float) -> None:
        for record in self.fleet.silent_since(now - self.config.heartbeat_timeout_s):
            await self.set_state(record, "gone", f"no heartbeat for {self.config.heartbeat_timeout_s:.0f}s")
        for record in self.fleet.in_state("probing"):
            if record.measured:
                await self.set_state(record, "standby", f"probe measured {record.rollouts_per_s:.2f} rollouts/s")
        self.view = self.capacity()
        standby = self.fleet.in_state("standby")
        if not self.config.enabled or self.view.mu_target is None:
            # No target to aim at (scheduler off, nothing measured yet, or no fleet can keep
            # up): everything measured works, so the learner waits as little as possible.
            for record in standby:
                await self.set_state(record, "active", f"activate all ({self.view.reason})")
            return
        decision = control_decision(
            [offer(n) for n in self.fleet.in_state("active")],
            [offer(n) for n in standby],
            self.view.mu_target,
            self.config.release_margin,
        )
        if decision.action == "hold":
            return
        record = self.fleet.get(decision.node)
        await self.set_state(record, "active" if decision.action == "activate" else "standby", decision.reason)
        self.view = self.capacity()

    async def run(self) -> None:
        while True:
            await self.control_once(time.time())
            with trio.move_on_after(self.config.control_period_s):
                await self.wake.wait()
            self.wake = trio.Event()

    def poke(self) -> None:
        """Fleet changed (join, probe measured, leave): decide now rather than at the next period."""
        self.wake.set()
