"""HubState: the hub's state, held by three owners over one store, and the learner's records.

The owners, built in this order (each knows only those before it), each with its own slice and its own writes:
- `Membership` (hub/service/membership.py): the fleet's node records; join, heartbeat, leave, state changes, bans,
  re-pricing, reachability;
- `Leasing` (hub/service/leasing.py): the lease book and quotas; grant, sweep, the version window, submission caps
  (it takes back a departing node's leases: Membership's `on_departure`);
- `Intake` (hub/service/intake.py): the submission pipeline, buffer room, probation and audits, copy detection,
  pay.
Nothing outside an owner changes what it owns. Every write, theirs and the learner's records here, goes through the
one StoreWriter (hub/records/writer.py): all-or-nothing, one savepoint in a group-committed batch, events written
inside the change they describe; an owner changes its in-memory view only after the commit returns, on the trio
thread with no checkpoint in between, and a commit and its view update are shielded from cancellation together.
The few changes made before their commit, always in the safe direction, are each owner's to say.

What the learner and the broadcaster measured (T_train, usable fractions, T_bcast, the learner's window) is in
`measurements` (hub/records/measurements.py), fed by the step commit here.

On start the view is rebuilt from the store: every node ever seen (as gone, unless banned) with its tallies,
measured throughput, passed audits and last vouched-for submission, the ledger per node, the run's group counts,
stale drops and learner time, the buffer's groups; Leasing opens the unexpired leases again. A restarted hub therefore
shows what it showed before, takes the answers to the leases it granted, and a failed audit voids only pay booked after
the node's last passed one.

Everything here runs on the trio thread except `record_snapshot`, `record_checkpoint` and `record_event`, which the
learner calls from its worker threads (they wait for the writer's commit there). Peer faults raise `PeerFault`;
anything else is our own invariant and propagates. A failure of the operator's reward is neither: the submission it
scored is answered busy, nothing of it is committed or counted against its node, and `run` raises the failure to stop
the run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from hub.config import HubConfig
from hub.records.buffer import BufferSignal, ReplayBuffer
from hub.records.fleet import IDLE_DEPARTED_KEPT_S, NodeRecord
from hub.records.measurements import LearnerWindow, Measurements, read_step_figures
from hub.records.schema import CLOSED_RETAINED_S, EVENTS_RETAINED, Retained, StepRecord
from hub.records.store import Store
from hub.records.writer import StoreWriter
from hub.service.intake import Intake
from hub.service.leasing import LearnerVersions, Leasing
from hub.service.membership import Membership, NodeTerms
from hub.service.room import BufferRoom
from hub.service.totals import RunTotals
from hub.trust.audit import AuditQueue
from hub.trust.checkpool import SubmissionChecks
from hub.trust.submissions import SentMatches, SubmissionRules
from shared.logs import for_operator
from shared.messages import EvalPoint, NodeState, Tallies
from shared.precision import resolve_dtype
from shared.tasks.base import Task

if TYPE_CHECKING:
    from hub.agents.rollouts import AgentRollouts

log = logging.getLogger("echo2.hub.state")

# Liveness (last seen, time online, measured throughput) and the learner's time reach the store
# this often: a crash loses at most this much of them, never anything acknowledged or paid.
FLUSH_PERIOD_S = 5.0
# Retention (Store.retain) and a WAL checkpoint run this often, from the flush: a pass that finds nothing costs
# about 0.17 s on a store of 100,000 steps, and payloads wait at most this long past their version's shelf life.
RETAIN_PERIOD_S = 15.0


class HubState:
    """The three owners over one store and writer; see the module docstring."""

    def __init__(
        self,
        store: Store,
        config: HubConfig,
        task: Task,
        *,
        rules: SubmissionRules | None = None,  # None: a learner-only state that takes no submissions
        checks: SubmissionChecks | None = None,  # where submissions are checked (None: ThreadChecks(rules))
        model_config_hash: str = "",
        model_label: str = "",
        audits: AuditQueue | None = None,
        learner: LearnerVersions | None = None,  # None: the learner's window in `measurements`
        newest_version: Callable[[], int] = lambda: -1,
        shelved_versions: Callable[[], list[int]] = list,  # the versions on the snapshot shelf (retention)
        clock: Callable[[], float] = time.time,
        run: Mapping[str, str] | None = None,
        sent_matches: SentMatches | None = None,  # the tool loop's record of what it sent (None: a run without tools)
        agents: AgentRollouts | None = None,  # a tool-using run's rollouts (None: a run without tools)
    ) -> None:
        lc, trust = config.learner, config.trust
        self.store = store
        self.writer = StoreWriter(store)
        self.model_config_hash = model_config_hash
        self.learner_price_per_hour = lc.learner_price_per_hour
        self.group_size = lc.group_size
        self.shelved_versions = shelved_versions
        self.clock = clock
        self.measurements = Measurements(
            LearnerWindow.at_start(store, lc.staleness, lc.effective_kappa, lc.staleness_max if lc.staleness_auto else None)
        )
        self.buffer = ReplayBuffer(lc.buffer_max_groups, lc.staleness, lc.skip_zero_variance)
        self.signal = BufferSignal()
        room = BufferRoom(self.buffer)
        if run is not None:
            store.set_run(run)  # what this run trains: a later start that asks for another is refused
        self.totals = self._load()
        terms = NodeTerms(model_config_hash, model_label, resolve_dtype(lc.dtype, lc.device))
        self.membership = Membership(store, self.writer, config, terms, self.totals, clock)
        self.membership.load()
        self.leasing = Leasing(
            store,
            self.writer,
            config,
            task,
            self.membership,
            room,
            learner or self.measurements.learner,
            lambda: self.measurements.fresh_usable_fraction,
            newest_version,
            clock,
        )
        self.intake = Intake(
            store,
            self.writer,
            config,
            self.membership,
            self.leasing,
            self.buffer,
            self.signal,
            room,
            self.totals,
            rules,
            checks,
            audits,
            clock,
            sent_matches,
        )
        # A tool-using run's rollouts: opened with their leases, settled by the intake, ended as their leases close.
        self.agents = agents
        if agents is not None:
            self.intake.agents = agents
            self.leasing.book.on_close.append(agents.lease_closed)
        # The fleet, to read (the scheduler, the broadcaster, the status board); Membership writes it.
        self.fleet = self.membership.fleet
        # With audits off, nothing vouches for pay: only a ban voids it, all of it (Store.retain).
        self._vouch_needed = trust.audit_rate > 0 or trust.audit_first_n > 0
        self._retained_at = -math.inf

    # -- start: the view from the store ---------------------------------------------------

    def _load(self) -> RunTotals:
        """Rebuild the buffer and the run's totals from the store (blocking; runs before trio starts)."""
        paid = self.store.groups.ledger_by_node_usd()
        refused = sum(row.tallies.refused for row in self.store.members.nodes())
        refill_refused: dict[str, list[int]] = {}
        for row_id, group in self.store.groups.unconsumed_groups():
            if len(group.rewards) != self.group_size:  # made before a resume changed group_size: no step takes it
                refill_refused.setdefault(f"group size {len(group.rewards)}, not the run's {self.group_size}", []).append(row_id)
                continue
            result = self.buffer.add(group, row_id)
            if not result.accepted:
                refill_refused.setdefault(result.reason or "refused", []).append(row_id)
        for reason, ids in refill_refused.items():
            self.store.groups.discard_trajectories(ids, reason)
        unaudited = self.store.groups.discard_held("not audited before the hub stopped")
        if unaudited:
            log.warning(
                "discarded %d groups of nodes on probation: their audits died with the last hub",
                unaudited,
                extra=for_operator("groups_discarded"),
            )
        counts = self.store.groups.trajectory_counts()
        now = self.clock()
        learner_s_before = self.store.learner_seconds()
        session_id = self.store.start_session(now)
        self.measurements.step_committed(read_step_figures(self.store))
        return RunTotals(
            groups=Tallies(**counts, refused=refused),
            dropped_stale=self.store.groups.dropped_stale_count(),
            paid_usd=paid,
            learner_s_before=learner_s_before,
            session_started=now,
            session_id=session_id,
        )

    # -- reading ---------------------------------------------------------------------------

    def cost_usd(self, now: float) -> float:
        """The run's cost so far: learner time at its price plus every node payment booked and not voided."""
        return sum(self.totals.paid_usd.values()) + self.learner_price_per_hour * self.totals.learner_s(now) / 3600.0

    def all_on_cost_usd(self, now: float) -> float:
        """What the run would have cost with every node working whenever it was online (the departed's share is summed
        only when one comes or goes: a status costs the same however many left)."""
        live = sum(n.price_per_hour * n.online_s for n in self.fleet.live())
        nodes = (live + self.fleet.departed_usd_s + self.membership.departed_usd_s) / 3600.0
        return self.learner_price_per_hour * self.totals.learner_s(now) / 3600.0 + nodes

    async def set_state(self, record: NodeRecord, state: NodeState, reason: str) -> None:
        """Membership.set_state, for the test bed's in-process hub (testbed/inproc.py), which moves its nodes itself."""
        await self.membership.set_state(record, state, reason)

    # -- learner records ----------------------------------------------------------------------

    async def commit_step(self, record: StepRecord, consumed_ids: Sequence[int], dropped_stale_ids: Sequence[int]) -> None:
        """A learner step: its row, the groups it trained on and the ones dropped as stale, in one transaction, which
        also reads back the figures the step changed (T_train, usable fractions) into `measurements`."""

        def commit():
            self.store.training.commit_step(record, consumed_ids, dropped_stale_ids)
            return read_step_figures(self.store)

        with trio.CancelScope(shield=True):
            reading = await self.writer.write(commit)
            self.totals.dropped_stale += len(dropped_stale_ids)
            self.measurements.step_committed(reading)

    def record_snapshot(self, version: int, path: str, manifest_hash: str, total_bytes: int, started_at: float) -> None:
        """Learner record (any thread; blocking): a snapshot is on disk; its build began at `started_at`
        (so published_at - created_at is the time to write it)."""
        self.writer.write_blocking(
            lambda: self.store.shelf.add_snapshot(version, path, manifest_hash, total_bytes, created_at=started_at)
        )

    async def record_eval(self, row: EvalPoint) -> None:
        """A held-out evaluation finished: its row and an event."""
        detail = f"step {row.step}: reward {row.reward:.3f}, pass@1 {row.pass_at_1:.3f}, pass@{row.k} {row.pass_at_k:.3f}"

        def write() -> None:
            self.store.training.add_eval(row)
            self._add_event("eval", None, detail)

        with trio.CancelScope(shield=True):
            await self.writer.write(write)

    def record_checkpoint(self, step: int, path: Path, version: int) -> None:
        """Learner record (any thread; blocking): a checkpoint was written."""
        self.writer.write_blocking(self.store.training.add_checkpoint, step, str(path), version)

    async def record_broadcast_time(self, version: int, seconds: float) -> None:
        await self.writer.write(
            lambda: self.store.shelf.set_broadcast_time(
                version, seconds, event=("broadcast_done", None, f"v{version} on every node in {seconds:.2f}s")
            )
        )

    def record_event(self, kind: str, node_id: str | None, detail: str) -> None:
        """An event with no state change of its own (any thread but trio's; blocking)."""
        self.writer.write_blocking(self._add_event, kind, node_id, detail)

    async def event(self, kind: str, node_id: str | None, detail: str) -> None:
        """`record_event` from the trio thread (a snapshot published, a report that could not be checked...)."""
        await self.writer.write(self._add_event, kind, node_id, detail)

    def _add_event(self, kind: str, node_id: str | None, detail: str) -> None:
        log.info("event %s %s %s", kind, node_id or "-", detail)
        self.store.journal.add_event(kind, node_id, detail)

    # -- liveness ------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write liveness and the learner's time to the store; keep the newest EVENTS_RETAINED events; forget
        join-event times past their window; every RETAIN_PERIOD_S, `retain` (which forgets departed nodes too)."""
        rows, now = self.membership.liveness(), self.clock()
        await self.writer.write(self.store.members.flush_liveness, rows, self.totals.session_id, now)
        await self.writer.write(self.store.journal.prune_events, EVENTS_RETAINED)
        self.membership.forget_join_events(now)
        if now - self._retained_at >= RETAIN_PERIOD_S:
            self._retained_at = now
            await self.retain(now)

    async def retain(self, now: float) -> Retained:
        """Let go of what the books no longer need (payloads of settled groups off the shelf, closed leases, final
        ledger rows, the rows of departed identities that left nothing to remember), then checkpoint the WAL."""
        # A group made at a version still on the shelf may still be audited (the auditor scores with it).
        keep_from = min([self.leasing.min_useful_version(), *self.shelved_versions()])
        # Those identities' records left memory first (Membership.forget_departed, by the same cut): a command of the
        # fleet's never meets a record whose row is gone.
        self.membership.forget_departed(now)
        kept = await self.writer.write(
            self.store.retain, keep_from, now - CLOSED_RETAINED_S, self._vouch_needed, now - IDLE_DEPARTED_KEPT_S
        )
        await trio.to_thread.run_sync(self.store.checkpoint)
        return kept

    def flush_sync(self) -> None:
        """The last flush, after trio ended (blocking)."""
        self.store.members.flush_liveness(self.membership.liveness(), self.totals.session_id, self.clock())

    async def run(self) -> None:
        """Lease sweeps every second, liveness flushes every FLUSH_PERIOD_S, the intake's audits and checks (a
        component of the hub's nursery). Raises the reward's first failure: the run cannot go on without its reward."""
        flushed = self.clock()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.intake.run)
            while True:
                if self.intake.reward_failure is not None:
                    raise self.intake.reward_failure
                await trio.sleep(1.0)
                await self.leasing.sweep()
                if self.clock() - flushed >= FLUSH_PERIOD_S:
                    flushed = self.clock()
                    await self.flush()
