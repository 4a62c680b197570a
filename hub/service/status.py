"""The hub's status board: one HubStatus snapshot of the whole system, refreshed every second,
served on the status protocol and written atomically to DATA_DIR/status.json (the dashboard
reads either, also after the run has ended).

Nodes, tallies, costs and run totals are the hub's owners' view (all-time, restored on restart); T_train, T_bcast
and the usable fractions are the hub's measurements (hub/records/measurements.py), the ones the scheduler plans by;
the step history and events are read from the store; the warnings are the lines the hub logged for its operator."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from hub.control.policy import CapacityView
from hub.control.scheduler import Scheduler
from hub.distribution.broadcast import Broadcaster
from hub.records.fleet import NodeRecord
from hub.records.schema import Credit, LeaderRow
from hub.records.snapshots import SnapshotShelf
from hub.service.state import HubState
from hub.training.metrics import policy_reward
from shared.files import atomic_write_text
from shared.layout import HUB_STATUS_FILE
from shared.logs import OperatorLine
from shared.messages import (
    LEADERS_MAX,
    Contribution,
    EvalPoint,
    EventRecord,
    HubStatus,
    Leader,
    NodeStatus,
    StepPoint,
    ToolTotals,
    short_id,
)
from shared.snapshot import Snapshot
from shared.staleness import StalenessMove
from shared.tools import TOOL_CALLS_METRIC
from shared.wire import HEADER, encode_frame

STATUS_PERIOD_S = 1.0
# A build older than this was not refreshed by `run` (which builds every period plus its own time): a status
# request builds anew.
STATUS_MAX_AGE_S = 2 * STATUS_PERIOD_S
HISTORY_POINTS = 300
EVENTS_KEPT = 200
# A status request's event count is served from the smallest of these that covers it (one encoding each).
EVENT_BUCKETS = (0, 20, 50, EVENTS_KEPT)
# Nodes listed: every live one, and the last STATUS_DEPARTED_MAX to leave (gone or banned) within RECENT_NODES_S, at
# most STATUS_NODES_MAX in all (about 5 MB encoded, under HubStatus.MAX_BYTES); the rest are counted as omitted (the
# store keeps them). A status costs the same however many identities came and went.
RECENT_NODES_S = 3600.0
STATUS_NODES_MAX = 10_000
STATUS_DEPARTED_MAX = 100
# The leaderboard lists the top LEADERS_MAX (shared/messages.py) volunteers of the whole run and of the last day. Its query (the day
# sums 24 hourly buckets per volunteer: 60 ms for 2,000 of them) takes at most LEADERS_DUTY of the store's time:
# the next one waits 1 / LEADERS_DUTY times as long as the last took (a small fleet's is fresh every build).
LEADERS_DUTY = 0.01


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
# The span a rate of tool calls is measured over (seconds), and the samples kept for it (one per status built).
TOOL_RATE_WINDOW_S = 60.0
TOOL_RATE_SAMPLES = 128


class RecentRate:
    """A count's rate over the last `window_s`, from samples of its running total (a bounded number kept)."""

    def __init__(self, window_s: float = TOOL_RATE_WINDOW_S, samples: int = TOOL_RATE_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque(maxlen=samples)

    def add(self, at: float, total: int) -> float | None:
        """Record `total` at `at` (monotonic seconds): the rate since the oldest sample within the window (None:
        none older yet)."""
        while self._samples and at - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        self._samples.append((at, total))
        first_at, first = self._samples[0]
        return (total - first) / (at - first_at) if at > first_at else None


class StatusBoard:
    """Without a broadcaster or a scheduler (in-process hubs of tests and benchmarks) it shows no chains
    and no capacity model."""

    def __init__(
        self,
        info: RunInfo,
        data_dir: Path,
        state: HubState,
        learner_step: Callable[[], int] | None = None,
        broadcaster: Broadcaster | None = None,
        scheduler: Scheduler | None = None,
        warnings: Callable[[], Sequence[OperatorLine]] = tuple,
    ) -> None:
        """`warnings`: the newest lines logged for the operator (shared.logs.OperatorLines.newest)."""
        self.warnings = warnings
        self.info = info
        self.path = Path(data_dir) / HUB_STATUS_FILE
        self.state = state
        self.store = state.store
        self.broadcaster = broadcaster
        self.scheduler = scheduler
        # The learner's step (None: as the learner last set it in the hub's measurements).
        self.learner_step = learner_step
        self.measured = state.measurements
        self.history: tuple[StepPoint, ...] = ()
        self.events: tuple[EventRecord, ...] = ()
        self.evals: tuple[EvalPoint, ...] = ()
        self.leaders: tuple[Leader, ...] = ()
        self._leaders_due = -float("inf")
        self._tool_rate = RecentRate()
        self.running = True
        # The status of the last refresh, and its encodings served since: (operator, events) -> frame bytes.
        self._built: HubStatus | None = None
        self._built_at = -float("inf")
        self._encoded: dict[tuple[bool, int], bytes] = {}
        self._encoding = trio.Lock()

    def _read_store(self) -> None:
        steps = self.store.training.recent_steps(HISTORY_POINTS)
        self.history = tuple(
            StepPoint(
                step=s.step,
                version=s.version,
                reward_mean=policy_reward(s.as_json_dict()),
                staleness_mean=s.staleness_mean,
                bubble=s.bubble,
                t_train_s=s.t_train_s,
                t_idle_s=s.t_idle_s,
                tool_calls=s.extra.get(TOOL_CALLS_METRIC),
            )
            for s in steps
        )
        self.evals = tuple(self.store.training.evals(HISTORY_POINTS))
        if (started := time.monotonic()) >= self._leaders_due:
            self.leaders = tuple(leader(row) for row in self.store.members.leaders(time.time(), LEADERS_MAX))
            self._leaders_due = started + (time.monotonic() - started) / LEADERS_DUTY
        self.events = tuple(
            EventRecord(at=e.at, kind=e.kind, node_id=e.node_id, detail=e.detail) for e in self.store.journal.events(EVENTS_KEPT)
        )

    def _listed(self, now: float) -> tuple[list[NodeRecord], int]:
        """The nodes a status lists (see RECENT_NODES_S), and how many it leaves out (those the fleet let go too); it
        reads the live records and the departed it lists, never the others."""
        fleet = self.state.fleet
        live = fleet.live()
        if len(live) > STATUS_NODES_MAX:
            live.sort(key=lambda n: -n.last_seen)
        room = min(STATUS_DEPARTED_MAX, max(0, STATUS_NODES_MAX - len(live)))
        recent = (n for n in fleet.newest_departed() if now - n.last_seen <= RECENT_NODES_S)
        listed = live[:STATUS_NODES_MAX] + list(itertools.islice(recent, room))
        return listed, len(live) + fleet.departed_count - len(listed) + self.state.membership.departed_count

    def snapshot(self, events: int = 50) -> HubStatus:
        """The status now (on the trio thread: the state's view is only ever touched there)."""
        now = time.time()
        state = self.state
        listed, omitted = self._listed(now)
        chains = self.broadcaster.chains if self.broadcaster else []
        chain_of = {p: (i, j) for i, chain in enumerate(chains) for j, p in enumerate(chain)}
        kinds = self.broadcaster.link_kinds() if self.broadcaster else {}
        sampling = state.intake.probation.sampling
        nodes = tuple(
            NodeStatus(
                peer_id=n.peer_id,
                state=n.state,
                price_per_hour=n.price_per_hour,
                rollouts_per_s=n.rollouts_per_s,
                version_held=n.version_held,
                receiving_version=n.receiving_version,
                chunks_received=n.chunks_received,
                tallies=n.tallies,
                cost_usd=state.totals.paid_usd.get(n.peer_id, 0.0),
                backend=n.backend,
                hardware=n.hardware,
                chain=chain_of.get(n.peer_id, (None, None))[0],
                chain_position=chain_of.get(n.peer_id, (None, None))[1],
                reachability=n.reachability,
                link=kinds.get(n.peer_id, ""),
                name=n.name or short_id(n.peer_id),
                audits_passed=n.audits_passed,
                sampling_nats=sampling.statistic(n.peer_id),
                price_history=n.price_history,
                reasons=n.refused_by_reason,
                too_slow=n.too_slow,
            )
            for n in listed
        )
        last = self.history[-1] if self.history else None
        cost = state.cost_usd(now)
        step = self.learner_step() if self.learner_step is not None else self.measured.learner.step
        capacity = self.scheduler.view if self.scheduler else NO_CAPACITY
        shelf = self.broadcaster.shelf if self.broadcaster else None
        newest, delta = _newest(shelf)
        moves = self._staleness_moves()
        staleness, kappa = (moves[-1].staleness, moves[-1].kappa) if moves else (self.info.staleness, self.info.kappa)
        return HubStatus(
            hub_id=self.info.hub_id,
            addrs=self.info.addrs,
            running=self.running,
            updated_at=now,
            step=step,
            steps_target=self.info.steps_target,
            version=step,
            staleness=staleness,
            kappa=kappa,
            task=self.info.task,
            nodes=nodes,
            chains=tuple(tuple(c) for c in chains),
            broadcast_mode=self.info.broadcast_mode,
            open_leases=state.leasing.open_leases(),
            totals=state.totals.groups,
            dropped_stale=state.totals.dropped_stale,
            reasons=state.totals.reasons,
            submissions=state.totals.submissions,
            heartbeats=state.totals.heartbeats,
            audits_passed=state.totals.audits["passed"],
            audits_failed=state.totals.audits["failed"],
            audits_unverified=state.totals.audits["unverified"],
            sampling_threshold_nats=sampling.threshold_nats if state.intake.probation.audits is not None else None,
            reward_mean=last.reward_mean if last else None,
            t_train_s=self.measured.t_train_recent_s,
            t_bcast_s=self.measured.t_bcast_s,
            snapshot_bytes=newest.manifest.total_bytes if newest else None,
            delta_bytes=delta.manifest.total_bytes if delta else None,
            bubble=last.bubble if last else None,
            predicted_bubble=capacity.predicted_bubble,
            mu_pool=capacity.mu_pool,
            mu_min=capacity.mu_min,
            mu_target=capacity.mu_target,
            usable_fraction=self.measured.usable_fraction,
            cost_usd=cost,
            cost_per_step_usd=cost / step if step else None,
            all_on_cost_usd=state.all_on_cost_usd(now),
            history=self.history,
            tools=self._tools(),
            evals=self.evals,
            events=self.events[:events],
            warnings=tuple(EventRecord(at=w.at, kind=w.kind, detail=w.text) for w in self.warnings()),
            nodes_omitted=omitted,
            leaders=self.leaders,
            staleness_moves=moves,
        )

    def _tools(self) -> ToolTotals | None:
        agents = self.state.agents
        if agents is None:
            return None
        tally = agents.loop.tally
        return ToolTotals(
            calls=tally.calls,
            errors=tally.errors,
            ends=dict(tally.ends),
            environment_s=tally.environment_s,
            calls_per_s=self._tool_rate.add(time.monotonic(), tally.calls),
        )

    def _staleness_moves(self) -> tuple[StalenessMove, ...]:
        """S and kappa over time, the ones in force last: the scheduler moves them under --staleness auto."""
        return tuple(self.scheduler.staleness_moves) if self.scheduler else ()

    def refresh_sync(self) -> HubStatus:
        """Read the store and write status.json, outside trio (the final write after the event loop ended)."""
        self._read_store()
        status = self.snapshot(EVENTS_KEPT)
        atomic_write_text(self.path, status.model_dump_json())
        return status

    async def refresh(self) -> HubStatus:
        """Build the status and write status.json: the operator's full view, encoded once and also kept as the
        frame an operator's status request gets until the next build."""
        async with self._encoding:
            status = await self._build()
            frame = await self._frame(True, EVENTS_KEPT)
        await trio.to_thread.run_sync(atomic_write_text, self.path, frame[HEADER.size :].decode())
        return status

    async def _build(self) -> HubStatus:
        await trio.to_thread.run_sync(self._read_store)
        status = self.snapshot(EVENTS_KEPT)  # on the trio thread: the fleet is only ever touched there
        self._built, self._built_at, self._encoded = status, time.monotonic(), {}
        return status

    async def _fresh(self) -> None:
        """Build unless `run` built within STATUS_MAX_AGE_S (callers hold _encoding)."""
        if self._built is None or time.monotonic() - self._built_at > STATUS_MAX_AGE_S:
            await self._build()

    async def _frame(self, operator: bool, events: int) -> bytes:
        """One view of the last build, encoded at most once per build, in a worker thread (callers hold _encoding)."""
        key = (operator, events)
        if key not in self._encoded:
            self._encoded[key] = await trio.to_thread.run_sync(_encode_view, self._built, operator, events)
        return self._encoded[key]

    async def encoded(self, operator: bool, events: int) -> bytes:
        """The status frame a status request gets (the operator's view, or the redacted one everyone else gets):
        the last build's while `run` keeps building every STATUS_PERIOD_S, built here only when nobody does
        (an in-process hub of tests and benchmarks), so at most one build per period whoever asks."""
        async with self._encoding:
            await self._fresh()
            return await self._frame(operator, next((b for b in EVENT_BUCKETS if b >= events), EVENT_BUCKETS[-1]))

    async def public_json(self) -> bytes:
        """The redacted view strangers get over the status protocol, as JSON: what the web process serves and its /metrics
        read (hub/service/web.py)."""
        return (await self.encoded(False, 0))[HEADER.size :]

    async def run(self) -> None:
        while True:
            await self.refresh()
            await trio.sleep(STATUS_PERIOD_S)


def _newest(shelf: SnapshotShelf | None) -> tuple[Snapshot | None, Snapshot | None]:
    """The newest snapshot on the shelf and its delta (None for what is not there)."""
    newest = shelf.get(None) if shelf is not None else None
    if shelf is None or newest is None:
        return None, None
    return newest, shelf.delta(newest.manifest.version)


def leader(row: LeaderRow) -> Leader:
    """A leaderboard row as the status shows it: a display name always, hours of work."""

    def contribution(credit: Credit) -> Contribution:
        return Contribution(
            accepted=credit.accepted, tokens=credit.tokens, gpu_hours=credit.gpu_s / 3600.0, audits_passed=credit.audits_passed
        )

    return Leader(
        peer_id=row.peer_id, name=row.name or short_id(row.peer_id), run=contribution(row.run), day=contribution(row.day)
    )


def _encode_view(status: HubStatus, operator: bool, events: int) -> bytes:
    """One view of `status` as a frame, always within HubStatus.MAX_BYTES: nodes are dropped from the end of the
    list until it fits (a list past STATUS_NODES_MAX was already cut to the live and newest; this is the last line)."""
    view = status if operator else status.redact()
    view = view.model_copy(update={"events": view.events[:events]})
    while len(body := view.model_dump_json().encode()) > HubStatus.MAX_BYTES:
        keep = len(view.nodes) // 2
        view = view.model_copy(update={"nodes": view.nodes[:keep], "nodes_omitted": view.nodes_omitted + len(view.nodes) - keep})
    return encode_frame(HubStatus.TYPE, body)
