"""HubState: the one owner of the hub's state — node lifecycle, leases, per-node tallies, audits, the
ledger and the run totals — over the store.

Its methods are the hub's commands (`join`, `grant_lease`, `accept_submission`, `set_state`,
`ban`, `commit_step`, ...). Each writes all-or-nothing (events included) through the group commit
of hub/records/writer.py, one savepoint in a batch committed in a worker thread, and changes the in-memory view (fleet, lease book, replay buffer, totals) only after
the commit returns, on the trio thread with no checkpoint in between, so no other task sees one
without the other; a commit and its view update are shielded from cancellation together. A few
changes come before their commit, always in the safe direction, and the code says where: a
lease being written is already open (concurrent requests count it against quotas), buffer room
is reserved for accepted groups being committed, and a ban marks the node banned and takes its
groups out of the buffer first (no submission slips in; the learner never trains on a group
whose discard is being committed). A ban is also checked inside every write of a node's work.

Its collaborators decide and count, and write nothing: the checks of a submission
(hub/trust/submissions.py), probation and audit sampling (hub/trust/probation.py: groups of a node on
probation are committed `held`, audited after the reply, off the handler's clock, and released to the
buffer by the transaction that records the passed audit), the pay of a lease (hub/service/pricing.py)
and the buffer room reserved for groups being committed (hub/service/room.py).

Lease rows in the store follow the lease book one handler deadline late (`sweep`): a submission
still being checked when its lease's deadline passed can commit against an open row.

On start the view is rebuilt from the store: every node ever seen (as gone, unless banned) with
its tallies, measured throughput, passed audits and last vouched-for submission, the ledger per
node, the run's group counts, stale drops and learner time. A restarted hub therefore shows
what it showed before, and a failed audit voids only pay booked after the node's last passed one.

Everything here runs on the trio thread except the `record_*` methods marked as learner records,
which touch only the store. Peer faults raise `PeerFault`; anything else is our own invariant
and propagates. A reward that fails or overruns on a node's work while it passes the operator's probe is
the node's doing: its groups are rejected (hub/trust/checkpool.py). One that fails the probe too is the
operator's: the submission is answered busy, nothing of it is committed, and `run` raises the failure to stop
the run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from hub.config import HubConfig
from hub.method.prices import price_change_refusal, ranking_price
from hub.records.buffer import BufferSignal, ReplayBuffer
from hub.records.fleet import PRICE_HISTORY_KEPT, Fleet, NodeRecord, heartbeat_period, heartbeat_timeout
from hub.records.leases import LeaseBook, LeaseError, LeaseRecord
from hub.records.store import CLOSED_RETAINED_S, EVENTS_RETAINED, NewEvent, NodeBanned, Retained, StepRecord, Store
from hub.records.writer import StoreWriter
from hub.service.pricing import price_lease
from hub.service.room import BufferRoom
from hub.trust.audit import AuditJob, AuditQueue
from hub.trust.checkpool import ChecksLost, SubmissionChecks, ThreadChecks
from hub.trust.copies import CopyDetector, CopyFlag
from hub.trust.guard import LeaseQuota
from hub.trust.probation import AUDIT_RESULTS, Probation, audit_result
from hub.trust.submissions import (
    GroupVerdict,
    SubmissionRules,
    VersionWindow,
    reject_copies,
    submission_events,
    submission_frame_cap,
    verdict_tallies,
)
from shared.crypto import SIGNATURE_BYTES, public_key_from_peer_id
from shared.messages import LEFT_REASON, EvalPoint, Heartbeat, JoinRequest, NodeState, RejectCode, Submission, Tallies
from shared.net import address_key
from shared.precision import resolve_dtype
from shared.rollout import Group
from shared.tasks.base import RewardError, Task
from shared.wire import PeerFault, signed_caps

log = logging.getLogger("echo2.hub.state")

# The longest a protocol handler may run (and so hold a claimed lease): the service's deadline.
HANDLER_TIMEOUT_S = 30.0
NO_WORK_RETRY_S = 0.25
STANDBY_RETRY_S = 2.0
PROBE_PROMPTS = 1
# Liveness (last seen, time online, measured throughput) and the learner's time reach the store
# this often: a crash loses at most this much of them, never anything acknowledged or paid.
FLUSH_PERIOD_S = 5.0
# Retention (Store.retain) and a WAL checkpoint run this often, from the flush: a pass that finds nothing costs
# about 0.17 s on a store of 100,000 steps, and payloads wait at most this long past their version's shelf life.
RETAIN_PERIOD_S = 15.0
# One "join" event row per node per this long, however often it rejoins.
JOIN_EVENT_WINDOW_S = 60.0
# How stale the live-node count behind the heartbeat period may be.
HEARTBEAT_RECOUNT_S = 1.0


class HubBusy(Exception):
    """The hub cannot take this request now; the peer did nothing wrong and may send it again."""


@dataclass(frozen=True)
class LeaseGrant:
    """A lease for the node, or why there is none and when to ask again."""

    lease: LeaseRecord | None
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class SubmissionOutcome:
    """What the hub decided about one submission, as the node is told."""

    accepted: int
    rejected: tuple[tuple[str, str], ...]
    late: tuple[tuple[str, str], ...]
    paid_usd: float


@dataclass
class RunTotals:
    """All-time figures of the run (every session of this data dir), as the status shows them."""

    groups: Tallies  # groups received by verdict (local rollouts included) and protocol refusals of nodes
    dropped_stale: int
    paid_usd: dict[str, float]  # per node, booked and not voided
    learner_s_before: float  # learner time of earlier sessions
    session_started: float
    session_id: int = 0
    # Messages received in this session only (what /metrics counts; a Prometheus counter restarts with the process).
    submissions: int = 0
    heartbeats: int = 0
    # Audits of submissions by result (`audit_result`), this session.
    audits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(AUDIT_RESULTS, 0))

    def learner_s(self, now: float) -> float:
        return self.learner_s_before + max(0.0, now - self.session_started)


class HubState:
    """The hub's state; see the module docstring for the rules every command follows."""

    def __init__(
        self,
        store: Store,
        config: HubConfig,
        task: Task,
        *,
        rules: SubmissionRules | None = None,  # None: a learner-only state that takes no submissions
        checks: SubmissionChecks | None = None,  # where submissions are checked (None: ThreadChecks)
        model_config_hash: str = "",
        model_label: str = "",
        audits: AuditQueue | None = None,
        oldest_useful_version: Callable[[], int] = lambda: 0,
        newest_version: Callable[[], int] = lambda: -1,
        shelved_versions: Callable[[], list[int]] = list,  # the versions on the snapshot shelf (retention)
        clock: Callable[[], float] = time.time,
        run: Mapping[str, str] | None = None,
    ) -> None:
        trust, lc = config.trust, config.learner
        if rules is not None and audits is None and (trust.audit_rate > 0 or trust.audit_first_n > 0):
            raise ValueError("audits are configured (audit_rate or audit_first_n > 0) but no AuditQueue was given")
        self.store = store
        self.writer = StoreWriter(store)
        self.rules = rules
        self.checks = checks if checks is not None or rules is None else ThreadChecks(rules, trust.check_timeout_s)
        self.model_config_hash = model_config_hash
        self.model_label = model_label  # hub.cli.build: name (architecture, vocab), for the mismatch refusal
        self.snapshot_dtype = resolve_dtype(config.learner.dtype, config.learner.device)
        self.lease_config = config.lease
        self.heartbeat_timeout_s = config.scheduler.heartbeat_timeout_s
        self.min_heartbeat_period_s = config.scheduler.heartbeat_period_s
        self.heartbeats_per_s = config.scheduler.heartbeats_per_s
        self._heartbeat_period_s = self.min_heartbeat_period_s
        self._period_counted_at = -math.inf
        self.max_price_per_hour = config.scheduler.max_price_per_hour
        self.price_change_interval_s = config.scheduler.price_change_interval_s
        self.price_band = config.scheduler.price_band
        # Nodes `echo-hub start` spawned itself (their keys made by the hub): exempt from the per-address quota.
        self.own_nodes: frozenset[str] = frozenset()
        self.prompts_per_step = lc.prompts_per_step
        self.group_size = lc.group_size
        self.staleness = lc.staleness
        self.learner_price_per_hour = lc.learner_price_per_hour
        self.oldest_useful_version = oldest_useful_version
        self.newest_version = newest_version
        self.shelved_versions = shelved_versions
        self.clock = clock
        self.fleet = Fleet()
        self.leases = LeaseBook(task, seed=lc.seed)
        self.buffer = ReplayBuffer(lc.buffer_max_groups, lc.staleness, lc.skip_zero_variance)
        self.signal = BufferSignal()
        self.copies = CopyDetector(trust.copy_cache_groups, lc.group_size, trust.copy_min_surprise_nats, trust.mean_abs_gap(self.snapshot_dtype))
        self.quota = LeaseQuota(trust, config.lease.prompts_per_lease)
        self.probation = Probation(trust, audits)
        self.room = BufferRoom(self.buffer)
        # Called after a node joins, leaves, is banned or gets measured: chains and activation follow.
        self.on_membership: list[Callable[[], None]] = []
        # The first failure of the operator's reward: the run stops with it (`run` raises it).
        self.reward_failure: RewardError | None = None
        if run is not None:
            store.set_run(run)  # what this run trains: a later start that asks for another is refused
        self._dirty: set[str] = set()  # nodes whose liveness changed since the last flush
        self._join_events: dict[str, float] = {}  # node -> when its last "join" event was written
        # With audits off, nothing vouches for pay: only a ban voids it, all of it (Store.retain).
        self._vouch_needed = trust.audit_rate > 0 or trust.audit_first_n > 0
        self._retained_at = -math.inf
        self._nursery: trio.Nursery | None = None
        self.totals = self._load()

    # -- start: the view from the store ---------------------------------------------------

    def _load(self) -> RunTotals:
        """Rebuild the view from the store (blocking; runs before trio starts)."""
        paid = self.store.ledger_by_node_usd()
        prices = self.store.price_history(PRICE_HISTORY_KEPT)
        for row in self.store.nodes():
            self.fleet.put(NodeRecord.from_row(row, tuple(prices.get(row.peer_id, ()))))
        refill_refused: dict[str, list[int]] = {}
        for row_id, group in self.store.unconsumed_groups():
            if len(group.rewards) != self.group_size:  # made before a resume changed group_size: no step takes it
                refill_refused.setdefault(f"group size {len(group.rewards)}, not the run's {self.group_size}",
                                          []).append(row_id)
                continue
            result = self.buffer.add(group, row_id)
            if not result.accepted:
                refill_refused.setdefault(result.reason or "refused", []).append(row_id)
        for reason, ids in refill_refused.items():
            self.store.discard_trajectories(ids, reason)
        unaudited = self.store.discard_held("not audited before the hub stopped")
        if unaudited:
            log.warning("discarded %d groups of nodes on probation: their audits died with the last hub", unaudited)
        counts = self.store.trajectory_counts()
        now = self.clock()
        learner_s_before = self.store.learner_seconds()
        session_id = self.store.start_session(now)
        # Leases of an earlier run of this hub died with its lease book: none can be answered now.
        self.store.expire_leases(float("inf"))
        return RunTotals(
            groups=Tallies(**counts, refused=sum(n.tallies.refused for n in self.fleet.nodes.values())),
            dropped_stale=self.store.dropped_stale_count(),
            paid_usd=paid,
            learner_s_before=learner_s_before,
            session_started=now,
            session_id=session_id,
        )

    # -- reading ---------------------------------------------------------------------------

    def window(self) -> VersionWindow:
        return VersionWindow(oldest=self.oldest_useful_version(), newest=self.newest_version())

    def is_member(self, peer: str) -> bool:
        """A joined node in good standing (not gone, not banned)."""
        record = self.fleet.get(peer)
        return record is not None and record.state not in ("gone", "banned")

    def known(self, peer: str) -> NodeRecord:
        """The record of a joined node, or PeerFault saying why the peer may not do this."""
        record = self.fleet.get(peer)
        if record is None or record.state == "gone":
            raise PeerFault("unknown node: join first", RejectCode.UNKNOWN_NODE)
        if record.state == "banned":
            raise PeerFault(f"banned: {record.banned_reason}", RejectCode.BANNED)
        return record

    def cost_usd(self, now: float) -> float:
        """The run's cost so far: learner time at its price plus every node payment booked and not voided."""
        return sum(self.totals.paid_usd.values()) + self.learner_price_per_hour * self.totals.learner_s(now) / 3600.0

    def all_on_cost_usd(self, now: float) -> float:
        """What the run would have cost with every node working whenever it was online."""
        nodes = sum(n.price_per_hour * n.online_s for n in self.fleet.nodes.values()) / 3600.0
        return self.learner_price_per_hour * self.totals.learner_s(now) / 3600.0 + nodes

    def _membership_changed(self) -> None:
        for listener in self.on_membership:
            listener()

    # -- node lifecycle --------------------------------------------------------------------

    async def join(self, peer: str, request: JoinRequest, remote_ip: str | None) -> NodeRecord:
        if request.model_config_hash != self.model_config_hash:
            raise PeerFault(f"model config differs from the hub's: the hub trains {self.model_label or 'another model'}; "
                            "start the node without --model to use the hub's, or with that model", RejectCode.MODEL_MISMATCH)
        if request.dtype != self.snapshot_dtype:
            raise PeerFault(f"this hub publishes {self.snapshot_dtype} snapshots and the node's engine runs "
                            f"{request.dtype}: restart the node with --dtype {self.snapshot_dtype}", RejectCode.MODEL_MISMATCH)
        try:
            public_key_from_peer_id(peer)
        except ValueError:
            # Every commitment and signature is checked against the key inlined in the peer id.
            raise PeerFault("this peer id inlines no Ed25519 key: use an echo2 identity", RejectCode.BAD_REQUEST) from None
        if request.price_per_hour > self.max_price_per_hour:
            # Before any probe: a price above the ceiling is never worth measuring, let alone paying for.
            raise PeerFault(f"price ${request.price_per_hour:g}/h is above this hub's ceiling "
                            f"${self.max_price_per_hour:g}/h: join with a lower --price", RejectCode.PRICE_TOO_HIGH)
        previous = self.fleet.get(peer)
        if previous is not None and previous.state == "banned":
            raise PeerFault(f"banned: {previous.banned_reason}", RejectCode.BANNED)
        state = "standby" if previous is not None and previous.measured else "probing"
        # A node rejoining in a loop gets one event row per JOIN_EVENT_WINDOW_S, not one per join.
        now = self.clock()
        event = None
        if now - self._join_events.get(peer, -JOIN_EVENT_WINDOW_S) >= JOIN_EVENT_WINDOW_S:
            self._join_events[peer] = now
            event = ("join", peer, f"price ${request.price_per_hour:.2f}/h backend {request.backend}")
        with trio.CancelScope(shield=True):
            joined = await self.writer.write(lambda: self.store.upsert_node(
                peer, request.price_per_hour, request.hardware, request.link_bps, request.backend, state, event=event,
                name=request.name,
            ))
            banned = self.fleet.get(peer)
            if not joined or (banned is not None and banned.state == "banned"):  # banned while this join was written
                raise PeerFault("banned", RejectCode.BANNED)
            record = self.fleet.join(peer, request, remote_ip, self.clock())
            record.heartbeat_period_s = self.heartbeat_period()
        if event is not None:  # a node rejoining in a loop gets a line per window too
            log.info("join %s state %s", peer, record.state)
        self._membership_changed()
        return record

    def heartbeat(self, peer: str, beat: Heartbeat) -> NodeRecord:
        """A live node's news; kept in memory and flushed to the store every FLUSH_PERIOD_S."""
        record = self.known(peer)
        self._seen(record)
        self.totals.heartbeats += 1
        record.version_held = beat.version_held
        record.receiving_version = beat.receiving_version
        record.chunks_received = beat.chunks_received
        record.heartbeat_period_s = self.heartbeat_period()
        return record

    async def reprice(self, peer: str, price: float) -> float:
        """A joined node's new price: paid for leases issued from now on (open ones keep theirs), ranked by the
        scheduler at its next period once it moved more than scheduler.price_band. Returns the seconds until
        the next change is taken; a change out of bounds or too soon is a PeerFault, counted against the peer."""
        record = self.known(peer)
        self._seen(record)
        now = self.clock()
        if price == record.price_per_hour:  # nothing changes, nor does the time the next change waits for
            last = record.price_changed_at
            return 0.0 if last is None else max(0.0, self.price_change_interval_s - (now - last))
        refusal = price_change_refusal(price, self.max_price_per_hour, record.price_changed_at, now,
                                       self.price_change_interval_s)
        if refusal is not None:
            raise PeerFault(refusal, RejectCode.BAD_REQUEST)
        # Counted before the write (the safe direction): a second change racing this one is already too soon.
        record.price_changed_at = now
        event = ("price", peer, f"${record.price_per_hour:.2f}/h -> ${price:.2f}/h")
        with trio.CancelScope(shield=True):
            changed = await self.writer.write(lambda: self.store.set_node_price(peer, price, now, event=event))
            if not changed or record.state == "banned":  # banned while this change was written
                raise PeerFault("banned", RejectCode.BANNED)
            record.ranked_price_per_hour = ranking_price(record.rank_price, price, self.price_band)
            record.declare_price(price, now)
        log.info("price %s: $%.4g/h (ranked at $%.4g/h)", peer, price, record.rank_price)
        return self.price_change_interval_s

    async def leave(self, peer: str) -> int:
        """A joined node stops (LEAVE_PROTOCOL): its open leases go back to the pool now, an active node leaves the
        active pool, and its chain is relinked around it, rather than after heartbeat_timeout_s of silence while the
        learner waits for its leases and its downstream for chunks. It is not activated again unless it joins again.
        It stays a member until that timeout drops it, as before, so it can still be banned: a report of a chunk it
        relayed is still judged against it (hub/distribution/broadcast.py; a relay could otherwise corrupt a chunk and
        leave before its downstream's report came). Its pay and accepted work stand. Returns how many leases went
        back. Said again before it rejoins, it changes nothing: a member repeating it cannot make the hub replan its
        chains on every request."""
        record = self.known(peer)
        if record.left_at is not None:
            return 0  # its leases went back at the first leave, and it has been given none since
        record.left_at = self.clock()
        if record.state == "active":
            await self.set_state(record, "standby", LEFT_REASON)
        released = len(self._leases_back(peer))
        self._membership_changed()
        return released

    def _leases_back(self, peer: str) -> list[LeaseRecord]:
        """The node's open leases back to the pool (those whose submission is being checked stay with it)."""
        released = self.leases.drop_node(peer)
        for lease in released:
            log.info("lease %s of %s back to the pool", lease.lease_id[:8], peer[-8:])
        return released

    def heartbeat_period(self) -> float:
        """The period nodes are told to heartbeat at now (`hub.records.fleet.heartbeat_period`); the live nodes are
        counted at most once per HEARTBEAT_RECOUNT_S, so a beat costs the same in any fleet."""
        now = self.clock()
        if now - self._period_counted_at >= HEARTBEAT_RECOUNT_S:
            self._period_counted_at = now
            self._heartbeat_period_s = heartbeat_period(len(self.fleet.live()), self.min_heartbeat_period_s,
                                                        self.heartbeats_per_s)
        return self._heartbeat_period_s

    def _seen(self, record: NodeRecord) -> None:
        now = self.clock()
        gap = now - record.last_seen
        timeout_s = heartbeat_timeout(record.heartbeat_period_s, self.min_heartbeat_period_s, self.heartbeat_timeout_s)
        if 0 < gap <= timeout_s:  # a longer silence was time offline
            record.online_s += gap
        record.last_seen = max(record.last_seen, now)
        self._dirty.add(record.peer_id)

    async def set_state(self, record: NodeRecord, state: NodeState, reason: str) -> None:
        """Move a node to `state` (activate, release, drop, ...); a no-op when it is there already, for a banned node
        (a ban is for good, whatever a caller decided before it awaited), and to activate a node that said it leaves
        (the scheduler may have decided before the leave came)."""
        if record.state in (state, "banned") or (state == "active" and record.left_at is not None):
            return
        previous = record.state
        kind = {"active": "activate", "standby": "release" if previous == "active" else "standby",
                "gone": "leave", "banned": "ban"}.get(state, state)
        banned_reason = reason if state == "banned" else None
        with trio.CancelScope(shield=True):
            moved = await self.writer.write(lambda: self.store.set_node_state(
                record.peer_id, state, banned_reason, event=(kind, record.peer_id, reason),
            ))
            if not moved or record.state == "banned":  # banned meanwhile
                return
            record.state = state
            if banned_reason is not None:
                record.banned_reason = banned_reason
            if state in ("gone", "banned"):
                # A released (standby) node may still finish the lease it holds: it did what it was told.
                self._leases_back(record.peer_id)
            if state == "banned":  # its sightings are no evidence against anyone (hub/trust/copies.py)
                self.copies.forget(record.peer_id)
        log.info("%s %s: %s", kind, record.peer_id, reason)
        if state in ("gone", "banned") or previous in ("gone", "banned"):
            self._membership_changed()

    async def ban(self, record: NodeRecord, reason: str) -> None:
        """Ban a node for good (a relay caught corrupting chunks); its pay and accepted work stand."""
        await self.set_state(record, "banned", reason)

    async def record_refusal(self, peer: str, code: RejectCode) -> None:
        """A known node's request was refused at the protocol level: counted against it, durably. Not counted:
        "join first" (a node the hub dropped, or a hub restarted under it) and "busy" (the hub's own limits)."""
        record = self.fleet.get(peer)
        if record is None or code in (RejectCode.UNKNOWN_NODE, RejectCode.BUSY):
            return
        with trio.CancelScope(shield=True):
            await self.writer.write(self.store.count_refusal, peer)
            record.tallies = record.tallies + Tallies(refused=1)
            self.totals.groups = self.totals.groups + Tallies(refused=1)

    # -- leases ------------------------------------------------------------------------------

    async def grant_lease(self, peer: str, version_held: int) -> LeaseGrant:
        record = self.known(peer)
        self._seen(record)
        record.version_held = max(record.version_held, version_held)
        window = self.window()
        if record.state not in ("probing", "active"):
            return LeaseGrant(None, f"{record.state}: no work for now", STANDBY_RETRY_S)
        if record.left_at is not None:  # a probing node that said it leaves: its probe went back to the pool
            return LeaseGrant(None, "left: join again for work", STANDBY_RETRY_S)
        if version_held < window.oldest or version_held < 0:
            return LeaseGrant(None, f"fetch a snapshot >= v{window.oldest} first", NO_WORK_RETRY_S)
        probe = record.state == "probing"
        if probe and self.leases.holds(peer):
            return LeaseGrant(None, "probe lease outstanding", NO_WORK_RETRY_S)
        quota = self.quota.decide(peer, record.remote_ip, record.audits_passed, self.leases.open_count(peer),
                                  self.leases.open_by_address, self.own_nodes)
        if not quota.allowed:
            return LeaseGrant(None, quota.reason, NO_WORK_RETRY_S)
        k = PROBE_PROMPTS if probe else quota.prompts
        if not probe:  # a probe (one prompt, one per node) must not starve behind the cap
            room = int(self.lease_config.max_inflight_steps * self.prompts_per_step) - (
                self.room.in_use() + self.leases.outstanding_prompts()
            )
            # A lease shrinks to the room left rather than waiting for room it may never get.
            k = min(k, room)
            if k < 1:
                return LeaseGrant(None, "enough work in flight", NO_WORK_RETRY_S)
        # Open in the book before the commit, so concurrent requests see it against their quota and the
        # in-flight cap; withdrawn if the commit fails. Its id reaches the node only after the commit.
        lease = self.leases.draft(peer, k, min_version=window.oldest, now=self.clock(),
                                  timeout_s=self.lease_config.lease_timeout_s, price_per_hour=record.price_per_hour,
                                  probe=probe, address=None if peer in self.own_nodes else address_key(record.remote_ip))
        self.leases.open_lease(lease)
        try:
            with trio.CancelScope(shield=True):
                await self.writer.write(
                    self.store.add_lease, lease.lease_id, peer, list(lease.prompt_ids), lease.min_version,
                    lease.issued_at, lease.deadline,
                )
        except BaseException:
            self.leases.abandon(lease)
            raise
        return LeaseGrant(lease)

    async def sweep(self) -> None:
        """Expire leases past their deadline: their prompts are leased again."""
        now = self.clock()
        expired = self.leases.expire(now)
        for record in expired:
            log.info("lease %s of %s expired: re-queued", record.lease_id[:8], record.node_id[-8:])
        # The store follows the book one handler deadline late: see the module docstring.
        events: list[NewEvent] = [("lease_expired", r.node_id, f"lease {r.lease_id[:8]} re-queued") for r in expired]
        checking = [r.lease_id for r in self.leases.open.values() if r.checking]
        await self.writer.write(lambda: self.store.expire_leases(now - HANDLER_TIMEOUT_S, events, checking))

    # -- submissions -------------------------------------------------------------------------

    def _rules(self) -> SubmissionRules:
        """The submission rules; a learner-only state has none and takes no submissions."""
        if self.rules is None:
            raise RuntimeError("this HubState was built without submission rules")
        return self.rules

    def _checks(self) -> SubmissionChecks:
        """Where submissions are checked; a learner-only state has no rules, so no checks either."""
        if self.checks is None:
            raise RuntimeError("this HubState was built without submission rules")
        return self.checks

    def submission_cap(self, peer: str) -> int:
        """The largest signed submission frame `peer` may send now: an honest answer to its biggest open
        lease (0 without one). What the guard reserves for the stream and the handler reads, at most."""
        rules = self._rules()
        prompts = max((len(lease.prompts) for lease in self.leases.leases_of(peer)), default=0)
        if not prompts:
            return 0
        cap = submission_frame_cap(prompts, rules.group_size, rules.sampling.max_new_tokens, rules.token_text_bytes)
        return min(cap + SIGNATURE_BYTES, signed_caps(Submission)[Submission.TYPE])

    async def accept_submission(self, peer: str, submission: Submission, signed_hash: str) -> SubmissionOutcome:
        """Check a signed submission against its lease, commit its verdicts and pay, settle what passes.

        Returns only after the commit: the reply built from it is an acknowledgement. Groups of a node on
        probation are held (durably) until their audit, which runs after the reply, off the handler.
        """
        checks = self._checks()
        record = self.known(peer)
        self.totals.submissions += 1
        if submission.node_id != peer:
            raise PeerFault("submission names another node")
        now = self.clock()
        with self._claimed(submission.lease_id, peer, now) as lease:
            try:
                verdicts = await checks.check(submission, lease, self.window())
            except ChecksLost as exc:
                log.error("%s: refused as busy", exc)
                raise HubBusy("the hub lost this submission's checks: resubmit") from None
            except RewardError as exc:  # it fails the operator's own probe too
                self.reward_failed(exc)
                raise HubBusy("the hub is stopping: the task's reward failed (not this node's fault)") from None
            if lease.closed:
                raise PeerFault("lease withdrawn while the submission was checked", RejectCode.BAD_LEASE)
            verdicts, copies = await reject_copies(verdicts, self.copies, peer, lease.lease_id, self.probation.recompute)
            usd = await self._commit_submission(record, lease, verdicts, copies, signed_hash, now)
        if lease.probe:
            self._membership_changed()  # measured: the scheduler may move it to standby now
        refused = [v for v in verdicts if not v.accepted]
        return SubmissionOutcome(
            accepted=len(verdicts) - len(refused),
            rejected=tuple((v.prompt_id, v.reason) for v in refused if not v.late),
            late=tuple((v.prompt_id, v.reason) for v in refused if v.late),
            paid_usd=usd,
        )

    def reward_failed(self, exc: RewardError) -> None:
        """The operator's reward is broken (it fails its probe): the run stops (`run` raises the first failure; its
        traceback is logged once)."""
        if self.reward_failure is None:
            self.reward_failure = exc
            log.error("%s: stopping the run", exc, exc_info=exc.__cause__ or exc)

    @contextmanager
    def _claimed(self, lease_id: str, peer: str, now: float) -> Iterator[LeaseRecord]:
        """The lease a submission answers, claimed while the submission is checked and committed; open again
        for a valid answer if this one is refused (releasing a lease its committed answer closed is a no-op)."""
        try:
            lease = self.leases.claim(lease_id, peer, now)
        except LeaseError as exc:
            raise PeerFault(str(exc), RejectCode.BAD_LEASE) from None
        try:
            yield lease
        finally:
            self.leases.release(lease)

    def _admit(self, record: NodeRecord, accepted: int) -> int:
        """How many of a submission's `accepted` groups are held for audit (all of a node on probation), or
        HubBusy when there is no room for them now: the node may send the same submission again later."""
        if not self.room.fits(accepted):
            raise HubBusy("hub buffer full: resubmit later")
        if not accepted or not self.probation.on_probation(record):
            return 0
        if self.probation.backed_up(accepted):
            # Audits of new nodes are backed up: whoever sends more new work must wait (bounded, not piled up).
            raise HubBusy("audits of new nodes backed up: resubmit later")
        return accepted

    async def _commit_submission(
        self, record: NodeRecord, lease: LeaseRecord, verdicts: list[GroupVerdict], copies: Sequence[CopyFlag],
        signed_hash: str, now: float,
    ) -> float:
        """Commit checked verdicts with their pay, tallies, throughput and events, then hand the accepted groups
        on: to their audit (held) or to the buffer. Returns the pay booked."""
        accepted = [v.group for v in verdicts if v.accepted]
        held = self._admit(record, len(accepted))
        pay = price_lease(lease, accepted, now, self.lease_config)
        rate, measured = self.fleet.throughput_after(record, sum(len(g.completions) for g in accepted), pay.held_s)
        events = submission_events(record.peer_id, lease, verdicts, copies, rate)
        with trio.CancelScope(shield=True):
            try:
                # Room and the audit backlog are counted before the commit: concurrent submissions must not
                # overfill either with groups their nodes were told were accepted.
                with self.room.reserving(len(accepted)), self.probation.holding(held):
                    row_ids = await self.writer.write(lambda: self.store.record_submission(
                        lease.lease_id, record.peer_id, verdicts, usd=pay.usd, seconds=pay.billed_s,
                        signed_bytes_hash=signed_hash, now=now, rollouts_per_s=rate, events=events, hold=held > 0,
                        tokens=pay.tokens,
                    ))
            except NodeBanned:
                raise PeerFault("banned", RejectCode.BANNED) from None
            self._book_submission(record, lease, verdicts, pay.usd, rate, measured)
            kept = [(v.group, row_id) for v, row_id in zip(verdicts, row_ids) if v.accepted]
            if held:
                self._nursery.start_soon(self._audit_held, record, lease.lease_id, kept, now)
            else:
                await self._settle(record, lease.lease_id, kept, now)
        return pay.usd

    def _book_submission(
        self, record: NodeRecord, lease: LeaseRecord, verdicts: Sequence[GroupVerdict], usd: float, rate: float,
        measured: bool,
    ) -> None:
        """The view after a submission's commit: its lease answered, the node's tallies, pay and throughput."""
        for verdict in verdicts:
            lease.answered.add(verdict.prompt_id)
        self.leases.close(lease)
        counts = verdict_tallies(verdicts)
        record.tallies = record.tallies + counts
        self.totals.groups = self.totals.groups + counts
        if usd > 0 and record.state != "banned":  # a ban under way sets the node's pay itself
            self.totals.paid_usd[record.peer_id] = self.totals.paid_usd.get(record.peer_id, 0.0) + usd
        record.rollouts_per_s, record.measured = rate, measured
        self._dirty.add(record.peer_id)

    async def _settle(self, record: NodeRecord, lease_id: str, kept: Sequence[tuple[Group, int]], answered_at: float) -> None:
        """Groups of a trusted node: into the buffer (an audit may be sampled for later)."""
        self.room.release(len(kept))
        if record.state == "banned":
            # Banned by an audit that failed while this submission was in flight: never trained on.
            if kept:
                ids = [row_id for _, row_id in kept]
                await self.writer.write(self.store.discard_trajectories, ids, "banned: audit failed")
            return
        if kept:
            self.probation.sample(record.peer_id, lease_id, kept, answered_at)
        await self._buffer(kept)

    async def _audit_held(self, record: NodeRecord, lease_id: str, kept: Sequence[tuple[Group, int]], answered_at: float) -> None:
        """Groups of a node on probation: every one audited, and only then released to the buffer. Work whose
        audit cannot run (its version left the shelf) is discarded and not paid: unverified is unpaid."""
        row_ids = [row_id for _, row_id in kept]
        try:
            with trio.CancelScope(shield=True):
                passed = await self._audit([AuditJob(record.peer_id, lease_id, row_id, group, answered_at)
                                            for group, row_id in kept], release=row_ids)
                self.room.release(len(kept))
                if record.state == "banned":
                    # Failed, or banned meanwhile (a released row must not slip past the ban either):
                    # discard whichever rows the ban has not discarded already.
                    await self.writer.write(self.store.discard_if_pending, row_ids, "banned: audit failed")
                elif passed:
                    await self._buffer(kept)
                else:
                    paid = await self.writer.write(
                        self.store.discard_and_void, row_ids, "not audited while on probation", record.peer_id, lease_id,
                    )
                    self.totals.paid_usd[record.peer_id] = paid
        finally:
            self.probation.release(len(kept))

    async def _buffer(self, kept: Sequence[tuple[Group, int]]) -> None:
        """Groups committed as accepted go into the buffer; a refusal is recorded on the row, never silent."""
        refused: dict[str, list[int]] = {}
        for group, row_id in kept:
            result = self.buffer.add(group, row_id)
            if not result.accepted:
                refused.setdefault(result.reason or "refused", []).append(row_id)
        for reason, ids in refused.items():
            await self.writer.write(self.store.discard_trajectories, ids, reason)
        self.signal.notify()

    async def record_local_group(self, group: Group) -> None:
        """A group from the hub's own in-process rollouts: committed as accepted, then offered to the buffer."""
        with trio.CancelScope(shield=True):
            row_id = await self.writer.write(self.store.record_trajectory, group, None, "", "accepted")
            self.totals.groups = self.totals.groups + Tallies(accepted=1)
            await self._buffer([(group, row_id)])

    # -- audits ------------------------------------------------------------------------------

    async def run_audits(self) -> None:
        """Audit the sampled groups one after another, off the trio thread (a component of the hub's nursery)."""
        if self.probation.audits is None:
            await trio.sleep_forever()
        while True:
            await self._audit([await self.probation.audits.next_job()])

    async def _audit(self, jobs: Sequence[AuditJob], release: Sequence[int] = ()) -> bool:
        """Audit groups of one submission. True: all passed (one passed audit for the node, its pay up to this
        submission vouched for, the `release`d rows free to be trained on); False: one failed (the node is
        banned) or could not be audited."""
        record = self.fleet.get(jobs[0].node_id)
        if record is None or record.state == "banned":
            return False
        verdict = await self.probation.judge(jobs)
        self.totals.audits[audit_result(verdict)] += 1
        if verdict.failure is not None:
            await self._penalize(record, verdict.failure)
        if not verdict.passed:
            return False
        answered_at = jobs[0].answered_at
        with trio.CancelScope(shield=True):
            released = await self.writer.write(self.store.record_audit_pass, record.peer_id, answered_at, list(release),
                                               self.clock())
            if not released:  # banned while it was audited: the ban discarded the rows
                return False
            record.audits_passed += 1
            record.vouched_at = max(record.vouched_at or 0.0, answered_at)
        return True

    async def _penalize(self, record: NodeRecord, reason: str) -> None:
        """Ban a node caught cheating, drop its untrained groups, void its pay since its last passed audit.

        Groups the learner already trained on stay trained on: audits are spot checks, not a gate.
        """
        if record.state == "banned":
            return
        # Banned in the view at once, before the commit (the one other exception to "view after commit"):
        # no submission, join or state change of this node may slip in while the ban is being written.
        record.state = "banned"
        record.banned_reason = reason
        # Out of the buffer before the commit: the learner must not take a group being discarded.
        dropped = self.buffer.drop_node(record.peer_id)
        since = self.probation.unvouched_since(record)
        with trio.CancelScope(shield=True):
            voided, paid = await self.writer.write(lambda: self.store.penalize_node(
                record.peer_id, dropped, since, reason,
                event=("audit_fail", record.peer_id, f"{reason}; dropped {len(dropped)} groups"),
            ))
            self.totals.paid_usd[record.peer_id] = paid
            for lease in self.leases.drop_node(record.peer_id):
                log.info("lease %s of %s back to the pool", lease.lease_id[:8], record.peer_id[-8:])
        log.warning("banned %s: %s; dropped %d groups, voided %d payments", record.peer_id, reason, len(dropped), voided)
        self._membership_changed()

    # -- learner records ----------------------------------------------------------------------

    async def commit_step(self, record: StepRecord, consumed_ids: Sequence[int], dropped_stale_ids: Sequence[int]) -> None:
        """A learner step: its row, the groups it trained on and the ones dropped as stale, in one transaction."""
        with trio.CancelScope(shield=True):
            await self.writer.write(self.store.commit_step, record, consumed_ids, dropped_stale_ids)
            self.totals.dropped_stale += len(dropped_stale_ids)

    def record_snapshot(self, version: int, path: str, manifest_hash: str, total_bytes: int, started_at: float) -> None:
        """Learner record (store only, any thread): a snapshot is on disk; its build began at `started_at`
        (so published_at - created_at is the time to write it)."""
        self.store.add_snapshot(version, path, manifest_hash, total_bytes, created_at=started_at)

    async def record_eval(self, row: EvalPoint) -> None:
        """A held-out evaluation finished: its row and an event."""
        detail = f"step {row.step}: reward {row.reward:.3f}, pass@1 {row.pass_at_1:.3f}, pass@{row.k} {row.pass_at_k:.3f}"

        def write() -> None:
            self.store.add_eval(row)
            self.record_event("eval", None, detail)

        with trio.CancelScope(shield=True):
            await self.writer.write(write)

    def record_checkpoint(self, step: int, path: Path, version: int) -> None:
        """Learner record (store only, any thread): a checkpoint was written."""
        self.store.add_checkpoint(step, str(path), version)

    async def record_broadcast_time(self, version: int, seconds: float) -> None:
        await self.writer.write(lambda: self.store.set_broadcast_time(
            version, seconds, event=("broadcast_done", None, f"v{version} on every node in {seconds:.2f}s"),
        ))

    def record_event(self, kind: str, node_id: str | None, detail: str) -> None:
        """An event with no state change of its own (store only, any thread; blocking)."""
        log.info("event %s %s %s", kind, node_id or "-", detail)
        self.store.add_event(kind, node_id, detail)

    async def event(self, kind: str, node_id: str | None, detail: str) -> None:
        """`record_event` from the trio thread (a snapshot published, a report that could not be checked...)."""
        await self.writer.write(self.record_event, kind, node_id, detail)

    # -- liveness ------------------------------------------------------------------------------

    def _liveness(self) -> list[tuple[str, float, float, float, bool]]:
        rows = [(p, n.last_seen, n.online_s, n.rollouts_per_s, n.measured)
                for p in self._dirty if (n := self.fleet.get(p)) is not None]
        self._dirty = set()
        return rows

    async def flush(self) -> None:
        """Write liveness and the learner's time to the store; keep the newest EVENTS_RETAINED events; forget
        join-event times past their window; every RETAIN_PERIOD_S, `retain`."""
        rows, now = self._liveness(), self.clock()
        await self.writer.write(self.store.flush_liveness, rows, self.totals.session_id, now)
        await self.writer.write(self.store.prune_events, EVENTS_RETAINED)
        self._join_events = {p: at for p, at in self._join_events.items() if now - at < JOIN_EVENT_WINDOW_S}
        if now - self._retained_at >= RETAIN_PERIOD_S:
            self._retained_at = now
            await self.retain(now)

    async def retain(self, now: float) -> Retained:
        """Let go of what the books no longer need (payloads of settled groups off the shelf, closed leases, final
        ledger rows), then checkpoint the WAL."""
        # A group made at a version still on the shelf may still be audited (the auditor scores with it).
        keep_from = min([self.oldest_useful_version(), *self.shelved_versions()])
        kept = await self.writer.write(self.store.retain, keep_from, now - CLOSED_RETAINED_S, self._vouch_needed)
        await trio.to_thread.run_sync(self.store.checkpoint)
        return kept

    def flush_sync(self) -> None:
        """The last flush, after trio ended (blocking)."""
        self.store.flush_liveness(self._liveness(), self.totals.session_id, self.clock())

    async def run(self) -> None:
        """Lease sweeps every second, liveness flushes every FLUSH_PERIOD_S, audits as they come (a component
        of the hub's nursery). Raises the reward's first failure: the run cannot go on without its reward."""
        flushed = self.clock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.run_audits)
            if self.checks is not None:
                nursery.start_soon(self.checks.run)
            while True:
                if self.reward_failure is not None:
                    raise self.reward_failure
                await trio.sleep(1.0)
                await self.sweep()
                if self.clock() - flushed >= FLUSH_PERIOD_S:
                    flushed = self.clock()
                    await self.flush()
