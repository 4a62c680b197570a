"""The hub's status board: one HubStatus snapshot of the whole system, refreshed every second,
served on the status protocol and written atomically to DATA_DIR/status.json (the dashboard
reads either, also after the run has ended)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from hub.broadcast import Broadcaster
from hub.capacity import usable_fraction
from hub.fleet import Fleet
from hub.leases import LeaseBook
from hub.metrics import policy_reward
from hub.scheduler import Scheduler
from hub.store import Store
from shared.files import atomic_write_text
from shared.messages import EventRecord, HubStatus, NodeStatus, StepPoint

STATUS_FILE = "status.json"
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
    learner_price_per_hour: float
    started_at: float


class StatusBoard:
    def __init__(
        self,
        info: RunInfo,
        data_dir: Path,
        store: Store,
        fleet: Fleet,
        leases: LeaseBook,
        broadcaster: Broadcaster,
        scheduler: Scheduler,
        learner_step: Callable[[], int],
        dropped_stale: Callable[[], int],
    ) -> None:
        self.info = info
        self.path = Path(data_dir) / STATUS_FILE
        self.store = store
        self.fleet = fleet
        self.leases = leases
        self.broadcaster = broadcaster
        self.scheduler = scheduler
        self.learner_step = learner_step
        self.dropped_stale = dropped_stale
        self.history: tuple[StepPoint, ...] = ()
        self.events: tuple[EventRecord, ...] = ()
        self.counts: dict[str, int] = {}
        self.paid_usd: dict[str, float] = {}
        self.t_train_recent_s: float | None = None
        self.usable_fraction = 1.0
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
        self.usable_fraction = usable_fraction(*self.store.recent_usable_groups(USABLE_WINDOW_GROUPS))
        self.events = tuple(
            EventRecord(at=e.at, kind=e.kind, node_id=e.node_id, detail=e.detail)
            for e in self.store.events(EVENTS_KEPT)
        )
        self.counts = self.store.trajectory_counts()
        # From the ledger, not the fleet's memory: a ban voids pay there, and a restart keeps it.
        self.paid_usd = self.store.ledger_by_node_usd()

    def cost_usd(self, now: float) -> float:
        """What the run has cost so far: learner time at its price plus every node payment booked."""
        return sum(self.paid_usd.values()) + self.info.learner_price_per_hour * (now - self.info.started_at) / 3600.0

    def snapshot(self, events: int = 50) -> HubStatus:
        now = time.time()
        chain_of = {p: (i, j) for i, chain in enumerate(self.broadcaster.chains) for j, p in enumerate(chain)}
        nodes = tuple(
            NodeStatus(
                peer_id=n.peer_id, state=n.state, price_per_hour=n.price_per_hour, rollouts_per_s=n.rollouts_per_s,
                version_held=n.version_held, receiving_version=n.receiving_version,
                chunks_received=n.chunks_received, accepted=n.accepted, rejected=n.rejected, late=n.late, refused=n.refused,
                cost_usd=self.paid_usd.get(n.peer_id, 0.0),
                backend=n.backend, hardware=n.hardware,
                chain=chain_of.get(n.peer_id, (None, None))[0], chain_position=chain_of.get(n.peer_id, (None, None))[1],
            )
            for n in self.fleet.nodes.values()
        )
        last = self.history[-1] if self.history else None
        hours = (now - self.info.started_at) / 3600.0
        cost = self.cost_usd(now)
        all_on = self.info.learner_price_per_hour * hours + sum(
            n.price_per_hour * max(0.0, n.last_seen - n.joined_at) / 3600.0 for n in self.fleet.nodes.values()
        )
        step = self.learner_step()
        capacity = self.scheduler.view
        return HubStatus(
            hub_id=self.info.hub_id, addrs=self.info.addrs, running=self.running, updated_at=now, step=step,
            steps_target=self.info.steps_target, version=step, staleness=self.info.staleness, kappa=self.info.kappa,
            task=self.info.task, nodes=nodes, chains=tuple(tuple(c) for c in self.broadcaster.chains),
            broadcast_mode=self.info.broadcast_mode, open_leases=len(self.leases.open),
            accepted=self.counts.get("accepted", 0), rejected=self.counts.get("rejected", 0),
            late=self.counts.get("late", 0), dropped_stale=self.dropped_stale(),
            reward_mean=last.reward_mean if last else None,
            t_train_s=self.t_train_recent_s, t_bcast_s=self.broadcaster.last_t_bcast_s(),
            bubble=last.bubble if last else None, predicted_bubble=capacity.predicted_bubble,
            mu_pool=capacity.mu_pool, mu_min=capacity.mu_min, mu_target=capacity.mu_target,
            usable_fraction=capacity.usable_fraction,
            cost_usd=cost, cost_per_step_usd=cost / step if step else None, all_on_cost_usd=all_on,
            history=self.history, events=self.events[:events],
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
