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
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

import trio

from hub.config import SchedulerConfig
from hub.control.policy import CapacityView, capacity_view, decide, fleet_view
from hub.control.staleness import StalenessCost, StalenessHold, choose_staleness, staleness_costs
from hub.method.capacity import Arrival, default_kappa
from hub.records.fleet import Fleet, NodeRecord, heartbeat_timeout
from hub.records.measurements import Measurements
from shared.logs import for_operator
from shared.messages import NodeState
from shared.staleness import StalenessMove, StalenessReason

log = logging.getLogger("echo2.hub.scheduler")

# Moves of S kept for the status board (the store's events keep them all).
STALENESS_MOVES_KEPT = 100


@dataclass(frozen=True)
class LearnerTiming:
    """What the capacity model needs from the learner and the broadcaster: its shape here, the figures measured
    (T_train, T_bcast, usable fractions, arrivals and installs: hub/records/measurements.py) read when needed."""

    kappa: int
    rollouts_per_step: int
    measured: Measurements
    # S: how long nodes may go on with the version they hold (hub.method.capacity.broadcast_stall_s); None: the
    # upstream formula (docs/DESIGN.md §5.2), where the broadcast stops the fleet for all of T_bcast.
    staleness: int | None = None
    # Rollouts in one lease (prompts_per_lease * group_size): each active node hands in a new version's
    # rollouts a lease at a time, half a lease behind a steady flow (hub.method.capacity.Arrival.lease_rollouts).
    rollouts_per_lease: int = 0


@dataclass(frozen=True)
class StalenessBounds:
    """`--staleness auto`: the largest S, the drift bound, and the learner's price the cost per step counts."""

    staleness_max: int
    drift_max: float
    learner_price_per_hour: float


class Scheduler:
    """Runs `control_once` every control period (or sooner when poked) on the hub's fleet."""

    def __init__(
        self,
        config: SchedulerConfig,
        fleet: Fleet,
        timing: LearnerTiming,
        set_state: Callable[[NodeRecord, NodeState, str], Awaitable[None]],
        adaptive: StalenessBounds | None = None,
        start_step: int = 0,
    ) -> None:
        """`adaptive`: S is chosen each publish period (`adapt_staleness`) within these bounds; None: S stays."""
        self.config = config
        self.fleet = fleet
        self.timing = timing
        self.set_state = set_state
        self.adaptive = adaptive
        # S and kappa in force over time, and why each moved: what the status board shows.
        self.staleness_moves: deque[StalenessMove] = deque(maxlen=STALENESS_MOVES_KEPT)
        if timing.staleness is not None:
            self.staleness_moves.append(
                StalenessMove(step=start_step, staleness=timing.staleness, kappa=timing.kappa, reason=StalenessReason.START)
            )
        self.view = CapacityView(0.0, None, None, None, "no measurements yet")
        self.wake = trio.Event()
        # Node -> since when the loop has wanted to release it without a break (hub.method.capacity.held_release).
        self._release_wanted: Mapping[str, float] = {}
        # What the S choice's hysteresis counts over publish periods (hub.control.staleness.choose_staleness).
        self._staleness_hold = StalenessHold()
        # The saturation line last said (hub.method.capacity.saturation): said once, not every period.
        self._saturated: str | None = None

    def capacity(self) -> CapacityView:
        active = self.fleet.in_state("active")
        mu_pool = math.fsum(n.rollouts_per_s for n in active)
        measured = self.timing.measured
        t_train, t_bcast = measured.t_train_recent_s, measured.t_bcast_s or 0.0
        if t_train is None:
            return CapacityView(mu_pool, None, None, None, "learner has not stepped yet")
        t_arrive = measured.t_arrive_s
        # The active pool's throughput-weighted mean time to install the newest version, and the usable fraction
        # without stale drops: the bubble of the first step that needs that version (hub.method.capacity.
        # first_step_idle_s); each active node's (rollouts/s, install time) gives the pool's stall (pool_stall_s).
        arrival = (
            None
            if t_arrive is None
            else Arrival(
                t_arrive,
                self.timing.rollouts_per_step / measured.fresh_usable_fraction,
                len(active) * self.timing.rollouts_per_lease / 2,
                measured.installs,
            )
        )
        return capacity_view(
            mu_pool,
            self.timing.kappa,
            self.timing.rollouts_per_step,
            t_train,
            t_bcast,
            measured.fresh_usable_fraction,
            self.timing.staleness,
            arrival,
            self.config.gamma,
            self.config.capacity_rule,
            measured.saturated,
        )

    async def control_once(self, now: float) -> None:
        """One control period: drop the silent nodes, then make the policy's moves."""
        config = self.config
        for record in self.fleet.silent(now, config.heartbeat_period_s, config.heartbeat_timeout_s):
            timeout_s = heartbeat_timeout(record.heartbeat_period_s, config.heartbeat_period_s, config.heartbeat_timeout_s)
            await self.set_state(record, "gone", f"no heartbeat for {timeout_s:g}s")
        self.view = self.capacity()
        self._say_saturation(self.view.hold)
        decision = decide(fleet_view(self.fleet), self.view, config, self._release_wanted, now)
        self._release_wanted = decision.release_wanted
        for move in decision.moves:
            if (moved := self.fleet.get(move.node)) is not None:  # not gone while an earlier move was written
                await self.set_state(moved, move.state, move.reason)
        if decision.moves:
            self.view = self.capacity()

    def _say_saturation(self, hold: str | None) -> None:
        """One line when the usable share falls below the saturation bound, and one when it recovers."""
        if hold is not None and self._saturated is None:
            log.warning("%s", hold, extra=for_operator("no_activation"))
        elif hold is None and self._saturated is not None:
            log.info("the usable share of accepted groups recovered: the scheduler activates nodes again")
        self._saturated = hold

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

    def adapt_staleness(
        self, step: int, drift: float | None, drift_per_version: float | None = None, age: float | None = None
    ) -> StalenessMove | None:
        """After the publish of version `step`: the S (and kappa) for the next period, put in force here, or None when S
        stays. `drift`, `drift_per_version`, `age`: the period's reading (hub/method/drift.py)."""
        bounds, timing = self.adaptive, self.timing
        if bounds is None or timing.staleness is None:
            raise RuntimeError("adapt_staleness needs adaptive bounds and a staleness in force")
        choice = choose_staleness(
            timing.staleness,
            bounds.staleness_max,
            drift,
            bounds.drift_max,
            self._staleness_costs(),
            drift_per_version,
            self._staleness_hold,
            age,
        )
        self._staleness_hold = self._staleness_hold.after(choice)
        if choice.reason is None:
            return None
        move = StalenessMove(
            step=step,
            staleness=choice.staleness,
            kappa=default_kappa(choice.staleness),
            reason=choice.reason,
            drift=drift,
            detail=choice.detail,
        )
        self.timing = replace(timing, staleness=move.staleness, kappa=move.kappa)
        self.staleness_moves.append(move)
        self.view = self.capacity()
        return move

    def _staleness_costs(self) -> dict[int, StalenessCost]:
        """The capacity model's cost per step at each S the bounds allow, over every measured node; empty before T_train."""
        timing, bounds = self.timing, self.adaptive
        measured = timing.measured
        t_train = measured.t_train_recent_s
        if t_train is None or bounds is None:
            return {}
        view = fleet_view(self.fleet)
        offers = [n for n in view.active + view.standby if n.rollouts_per_s > 0]
        return staleness_costs(
            offers,
            bounds.staleness_max,
            timing.rollouts_per_step / measured.fresh_usable_fraction,
            t_train,
            measured.t_bcast_s or 0.0,
            self.config.gamma,
            bounds.learner_price_per_hour,
            self.config.capacity_rule,
        )

    async def run(self) -> None:
        while True:
            await self.control_once(time.time())
            with trio.move_on_after(self.config.control_period_s):
                await self.wake.wait()
            self.wake = trio.Event()

    def poke(self) -> None:
        """Fleet changed (join, probe measured, leave): decide now rather than at the next period."""
        self.wake.set()
