"""The hub's status board: one HubStatus snapshot of the whole system, refreshed every second,
served on the status protocol and written atomically to DATA_DIR/status.json (the dashboard
reads either, also after the run has ended).

Nodes, tallies, costs and run totals are HubState's view (all-time, restored on restart); the
step history, events and the usable fraction are read from the store."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from hub.broadcast import Broadcaster
from hub.capacity import usable_fraction
from hub.metrics import policy_reward
from hub.scheduler import CapacityView, Scheduler
from hub.state import HubState
from shared.files import atomic_write_text
from shared.layout import HUB_STATUS_FILE
from shared.messages import EvalPoint, EventRecord, HubStatus, NodeStatus, StepPoint

STATUS_PERIOD_S = 1.0
HISTORY_POINTS = 300
EVENTS_KEPT = 200
# Settled accepted groups the usable fraction is measured over: recent enough to follow the reward.
USABLE_WINDOW_GROUPS = 512


@dataclass(frozen=True)
class RunInfo:
    hub_id: str
    addrs: tuple[str, ...]
    steps_target: int
    staleness: int
    kappa: int
    task: str
    broadcast_mode: str


NO_CAPACITY = CapacityView(0.0, None, None, None, "no scheduler")


class StatusBoard:
    """Without a broadcaster or a scheduler (in-process hubs of tests and benchmarks) it shows no chains
    and no capacity model."""

    def __init__(
        self,
        info: RunInfo,
        data_dir: Path,
        state: HubState,
        learner_step: Callable[[], int],
        broadcaster: Broadcaster | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.info = info
        self.path = Path(data_dir) / HUB_STATUS_FILE
        self.state = state
        self.store = state.store
        self.broadcaster = broadcaster
        self.scheduler = scheduler
        self.learner_step = learner_step
        self.history: tuple[StepPoint, ...] = ()
        self.events: tuple[EventRecord, ...] = ()
        self.evals: tuple[EvalPoint, ...] = ()
        self.t_train_recent_s: float | None = None
        self.usable_fraction = 1.0
        # The same without stale drops: what one step's rollouts shrink by (hub.capacity.Arrival).
        self.fresh_usable_fraction = 1.0
        self.running = True

    def _read_store(self) -> None:
        steps = self.store.recent_steps(HISTORY_POINTS)
        self.history = tuple(
            StepPoint(step=s.step, version=s.version, reward_mean=policy_reward(s.as_json_dict()), staleness_mean=s.staleness_mean,
                      bubble=s.bubble, t_train_s=s.t_train_s, t_idle_s=s.t_idle_s)
            for s in steps
        )
        recent = [s.t_train_s for s in steps[-10:]]
        self.t_train_recent_s = sum(recent) / len(recent) if recent else None
        trained, settled, stale = self.store.recent_usable_groups(USABLE_WINDOW_GROUPS)
        self.usable_fraction = usable_fraction(trained, settled)
        # Everything settled went stale: no step of ours to learn the other skips from.
        self.fresh_usable_fraction = usable_fraction(trained, settled - stale) if settled > stale else self.usable_fraction
        self.evals = tuple(self.store.evals(HISTORY_POINTS))
        self.events = tuple(
            EventRecord(at=e.at, kind=e.kind, node_id=e.node_id, detail=e.detail)
            for e in self.store.events(EVENTS_KEPT)
        )

    def snapshot(self, events: int = 50) -> HubStatus:
        """The status now (on the trio thread: the state's view is only ever touched there)."""
        now = time.time()
        state = self.state
        chains = self.broadcaster.chains if self.broadcaster else []
        chain_of = {p: (i, j) for i, chain in enumerate(chains) for j, p in enumerate(chain)}
        kinds = self.broadcaster.link_kinds() if self.broadcaster else {}
        nodes = tuple(
            NodeStatus(
                peer_id=n.peer_id, state=n.state, price_per_hour=n.price_per_hour, rollouts_per_s=n.rollouts_per_s,
                version_held=n.version_held, receiving_version=n.receiving_version,
                chunks_received=n.chunks_received, tallies=n.tallies, cost_usd=state.totals.paid_usd.get(n.peer_id, 0.0),
                backend=n.backend, hardware=n.hardware,
                chain=chain_of.get(n.peer_id, (None, None))[0], chain_position=chain_of.get(n.peer_id, (None, None))[1],
                reachability=n.reachability,
                link=kinds.get(n.peer_id, ""),
            )
            for n in state.fleet.nodes.values()
        )
        last = self.history[-1] if self.history else None
        cost = state.cost_usd(now)
        step = self.learner_step()
        capacity = self.scheduler.view if self.scheduler else NO_CAPACITY
        shelf = self.broadcaster.shelf if self.broadcaster else None
        newest = shelf.get(None) if shelf else None
        delta = shelf.delta(newest.manifest.version) if newest else None
        return HubStatus(
            hub_id=self.info.hub_id, addrs=self.info.addrs, running=self.running, updated_at=now, step=step,
            steps_target=self.info.steps_target, version=step, staleness=self.info.staleness, kappa=self.info.kappa,
            task=self.info.task, nodes=nodes, chains=tuple(tuple(c) for c in chains),
            broadcast_mode=self.info.broadcast_mode, open_leases=len(state.leases.open),
            totals=state.totals.groups, dropped_stale=state.totals.dropped_stale,
            reward_mean=last.reward_mean if last else None,
            t_train_s=self.t_train_recent_s, t_bcast_s=self.broadcaster.last_t_bcast_s() if self.broadcaster else None,
            snapshot_bytes=newest.manifest.total_bytes if newest else None,
            delta_bytes=delta.manifest.total_bytes if delta else None,
            bubble=last.bubble if last else None, predicted_bubble=capacity.predicted_bubble,
            mu_pool=capacity.mu_pool, mu_min=capacity.mu_min, mu_target=capacity.mu_target,
            usable_fraction=capacity.usable_fraction,
            cost_usd=cost, cost_per_step_usd=cost / step if step else None, all_on_cost_usd=state.all_on_cost_usd(now),
            history=self.history, evals=self.evals, events=self.events[:events],
        )

    def refresh_sync(self) -> HubStatus:
        """Read the store and write status.json, outside trio (the final write after the event loop ended)."""
        self._read_store()
        status = self.snapshot(EVENTS_KEPT)
        atomic_write_text(self.path, status.model_dump_json())
        return status

    async def refresh(self) -> HubStatus:
        await trio.to_thread.run_sync(self._read_store)
        status = self.snapshot(EVENTS_KEPT)  # on the trio thread: the fleet is only ever touched there
        await trio.to_thread.run_sync(atomic_write_text, self.path, status.model_dump_json())
        return status

    async def run(self) -> None:
        while True:
            await self.refresh()
            await trio.sleep(STATUS_PERIOD_S)
