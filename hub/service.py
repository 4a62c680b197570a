"""The hub's libp2p service: join, heartbeat, work leases, signed submissions, status, snapshot fetch.

Every handler treats the peer as untrusted: input is size-capped and verified before use,
a misbehaving peer is logged, counted against it and refused, and the host keeps serving.
State is saved only after every check has passed; a submission is acknowledged only after
its verdicts are committed to the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from hub.audit import AuditJob, Auditor, AuditQueue
from hub.broadcast import CONFIRM_TIMEOUT_S, ChainLinks, HubUplink
from hub.buffer import BufferSignal, ReplayBuffer
from hub.config import LeaseConfig, TrustConfig
from hub.copies import CopyDetector, CopyFlag
from hub.fleet import Fleet, NodeRecord
from hub.guard import LeaseQuota, PeerGuard
from hub.leases import LeaseBook, LeaseError, LeaseRecord
from hub.snapshots import SnapshotShelf
from hub.store import Store
from hub.submissions import GroupVerdict, SubmissionRules, VersionWindow, check_submission
from shared.messages import (
    BUSY_PREFIX,
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    REPORT_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    BadChunkReport,
    Heartbeat,
    HeartbeatReply,
    HubStatus,
    JoinReply,
    JoinRequest,
    Lease,
    LeasePrompt,
    LeaseReply,
    LeaseRequest,
    Reject,
    SnapshotRequest,
    StatusRequest,
    Submission,
    SubmitReply,
)
from shared.net import remote_ip, remote_peer_id, set_handler
from shared.rollout import SamplingParams
from shared.transfer import RECEIVER_GONE, serve_snapshot
from shared.wire import (
    FrameError,
    StreamEOF,
    decode_signed,
    read_frame,
    read_message,
    signed_caps,
    write_message,
)

log = logging.getLogger("echo2.hub.service")


class HubBusy(Exception):
    """The hub cannot take this request now; the peer did nothing wrong and may send it again."""


READ_TIMEOUT_S = 30.0
TRANSFER_TIMEOUT_S = 3600.0
LEASE_SWEEP_PERIOD_S = 1.0
NO_WORK_RETRY_S = 0.25
STANDBY_RETRY_S = 2.0
PROBE_PROMPTS = 1
GUARD_IDLE_S = 300.0


@dataclass(frozen=True)
class LearnerView:
    """What the service needs to know of the learner, read through callables so it is always current."""

    oldest_useful_version: Callable[[], int]
    staleness: int
    prompts_per_step: int


@dataclass(frozen=True)
class Defences:
    """The trust defences the service applies to every peer (DESIGN section 7)."""

    audits: AuditQueue
    copies: CopyDetector
    guard: PeerGuard
    quota: LeaseQuota
    rng: random.Random

    @classmethod
    def build(
        cls,
        trust: TrustConfig,
        model_dir: Path,
        shelf: SnapshotShelf,
        sampling: SamplingParams,
        prompts_per_lease: int,
        seed: int,
        on_pass: Callable[[str], Awaitable[None]],
        on_fail: Callable[[str, str], Awaitable[None]],
    ) -> Defences:
        return cls(
            audits=AuditQueue(Auditor(model_dir, shelf, sampling, trust), on_pass, on_fail, trust.audit_queue_groups),
            copies=CopyDetector(trust.copy_cache_groups, trust.copy_min_surprise_nats),
            guard=PeerGuard(trust, time.monotonic),
            quota=LeaseQuota(trust, prompts_per_lease),
            rng=random.Random(seed),
        )


# Largest frame a handler of each protocol may read: what the guard reserves against a peer's memory budget.
PROTOCOL_FRAME_CAPS = {
    JOIN_PROTOCOL: JoinRequest.MAX_BYTES,
    HEARTBEAT_PROTOCOL: Heartbeat.MAX_BYTES,
    LEASE_PROTOCOL: LeaseRequest.MAX_BYTES,
    SUBMIT_PROTOCOL: signed_caps(Submission)[Submission.TYPE],
    STATUS_PROTOCOL: StatusRequest.MAX_BYTES,
    SNAPSHOT_PROTOCOL: SnapshotRequest.MAX_BYTES,
    REPORT_PROTOCOL: BadChunkReport.MAX_BYTES,
}
# How long a handler may take. A snapshot transfer lasts as long as the model takes to cross the
# link; a bad-chunk report waits for the hub to check the accused chunk itself; the rest is one exchange.
PROTOCOL_TIMEOUTS_S = {SNAPSHOT_PROTOCOL: TRANSFER_TIMEOUT_S, REPORT_PROTOCOL: READ_TIMEOUT_S + CONFIRM_TIMEOUT_S}


class HubService:
    """Serves the hub's protocols on `host`; one component of the hub's trio nursery."""

    def __init__(
        self,
        host: IHost,
        *,
        store: Store,
        fleet: Fleet,
        leases: LeaseBook,
        buffer: ReplayBuffer,
        buffer_signal: BufferSignal,
        shelf: SnapshotShelf,
        rules: SubmissionRules,
        learner: LearnerView,
        config: LeaseConfig,
        model_config_hash: str,
        task_name: str,
        heartbeat_period_s: float,
        status: Callable[[int], HubStatus],
        chain_links: Callable[[str], ChainLinks],
        on_fleet_change: Callable[[], None],
        uplink: HubUplink,
        on_heartbeat: Callable[[], None],
        defences: Defences,
        on_report: Callable[[INetStream], Awaitable[None]],
    ) -> None:
        self.host = host
        self.store = store
        self.fleet = fleet
        self.leases = leases
        self.buffer = buffer
        self.buffer_signal = buffer_signal
        self.shelf = shelf
        self.rules = rules
        self.learner = learner
        self.config = config
        self.model_config_hash = model_config_hash
        self.task_name = task_name
        self.heartbeat_period_s = heartbeat_period_s
        self.status = status
        self.chain_links = chain_links
        self.on_fleet_change = on_fleet_change
        self.uplink = uplink
        self.on_heartbeat = on_heartbeat
        self.defences = defences
        self.on_report = on_report
        self.counters: dict[str, int] = {}

    # -- bookkeeping -----------------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    async def event(self, kind: str, node_id: str | None, detail: str) -> None:
        log.info("%s %s %s", kind, node_id or "-", detail)
        await trio.to_thread.run_sync(self.store.add_event, kind, node_id, detail)

    async def misbehaved(self, stream: INetStream, protocol: str, exc: Exception) -> None:
        """A peer sent something we refuse: count it against the peer, tell it why, keep serving."""
        peer = remote_peer_id(stream)
        self.count(f"refused:{protocol}")
        record = self.fleet.get(peer)
        if record is not None:
            record.refused += 1
            await trio.to_thread.run_sync(self.store.count_refusal, peer)
        log.warning("refused %s from %s: %s", protocol, peer, exc)
        await self._refuse(stream, str(exc))

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        try:
            with trio.move_on_after(2):
                await write_message(stream, Reject(reason=reason[:1000]))
                await stream.close()
        except Exception:  # noqa: BLE001 - the peer may already be gone
            await stream.reset()

    def window(self) -> VersionWindow:
        return VersionWindow(oldest=self.learner.oldest_useful_version(), newest=self.shelf.newest_version())

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        handlers = {
            JOIN_PROTOCOL: self._on_join,
            HEARTBEAT_PROTOCOL: self._on_heartbeat,
            LEASE_PROTOCOL: self._on_lease,
            SUBMIT_PROTOCOL: self._on_submit,
            STATUS_PROTOCOL: self._on_status,
            SNAPSHOT_PROTOCOL: self._on_snapshot,
            REPORT_PROTOCOL: self.on_report,
        }
        # Leases of an earlier run of this hub died with its lease book: none can be answered now.
        await trio.to_thread.run_sync(self.store.expire_leases, math.inf)
        for protocol, handler in handlers.items():
            set_handler(self.host, protocol, self._guarded(protocol, handler), log)
        while True:
            await trio.sleep(LEASE_SWEEP_PERIOD_S)
            now = time.time()
            for record in self.leases.expire(now):
                self.count("leases_expired")
                await self.event("lease_expired", record.node_id, f"lease {record.lease_id[:8]} re-queued")
            # The store follows the book one handler deadline late, so a submission being
            # checked when its lease's deadline passed can still commit against an open row.
            await trio.to_thread.run_sync(self.store.expire_leases, now - READ_TIMEOUT_S)
            self.defences.guard.prune(idle_s=GUARD_IDLE_S)

    def _guarded(self, protocol: str, handler: Callable[[INetStream], object]):
        cap = PROTOCOL_FRAME_CAPS[protocol]
        guard = self.defences.guard
        timeout_s = PROTOCOL_TIMEOUTS_S.get(protocol, READ_TIMEOUT_S)

        async def guarded(stream: INetStream) -> None:
            peer = remote_peer_id(stream)
            admission = guard.admit(peer, cap)
            if not admission.admitted:
                await self._turn_away(stream, peer, admission)
                return
            try:
                with trio.fail_after(timeout_s):
                    await handler(stream)
            except HubBusy as exc:
                self.count(f"busy:{protocol}")
                await self._refuse(stream, f"{BUSY_PREFIX} {exc}")
            except (FrameError, StreamEOF, trio.TooSlowError, ValueError) as exc:
                await self.misbehaved(stream, protocol, exc)
            finally:
                guard.release(peer, admission)

        guarded.__qualname__ = f"HubService[{protocol}]"
        return guarded

    async def _turn_away(self, stream: INetStream, peer: str, admission) -> None:
        """A peer over its stream, rate or memory caps: told to retry later, disconnected if it keeps on."""
        self.count(f"guard_{admission.verdict}")
        await self._refuse(stream, f"{BUSY_PREFIX} retry in {admission.retry_after_s:.2f}s: {admission.reason}")
        if admission.verdict == "disconnect":
            await self.event("disconnect", peer, admission.reason)
            await self.host.disconnect(ID.from_base58(peer))

    async def _reply(self, stream: INetStream, msg) -> None:
        await write_message(stream, msg)
        await stream.close()

    # -- protocols -------------------------------------------------------------------

    async def _on_join(self, stream: INetStream) -> None:
        peer = remote_peer_id(stream)
        request = await read_message(stream, JoinRequest)
        if request.model_config_hash != self.model_config_hash:
            raise ValueError("model config differs from the hub's: start the node with the hub's model")
        previous = self.fleet.get(peer)
        stored = await trio.to_thread.run_sync(self.store.node, peer)
        # A ban outlives the hub process: the store remembers it when the fleet (in memory) does not.
        if (previous is not None and previous.state == "banned") or (stored is not None and stored.state == "banned"):
            raise ValueError("banned")
        record = self.fleet.join(peer, request, remote_ip(stream), time.time())
        if stored is not None:  # the store's tallies, kept in step with the fleet's, outlive a hub restart
            record.accepted, record.rejected, record.late = stored.accepted, stored.rejected, stored.late
            record.refused, record.audits_passed = stored.refused, stored.audits_passed
        await trio.to_thread.run_sync(
            lambda: self.store.upsert_node(
                peer, record.price_per_hour, record.hardware, record.link_bps, record.backend, record.state
            )
        )
        await self.event("join", peer, f"price ${record.price_per_hour:.2f}/h backend {record.backend}")
        self.on_fleet_change()
        await self._reply(
            stream,
            JoinReply(
                state=record.state,
                latest_version=self.shelf.newest_version(),
                staleness=self.learner.staleness,
                task=self.task_name,
                heartbeat_period_s=self.heartbeat_period_s,
            ),
        )

    def _known(self, peer: str) -> NodeRecord:
        record = self.fleet.get(peer)
        if record is None or record.state == "gone":
            raise ValueError("unknown node: join first")
        if record.state == "banned":
            raise ValueError("banned")
        return record

    async def _on_heartbeat(self, stream: INetStream) -> None:
        peer = remote_peer_id(stream)
        beat = await read_message(stream, Heartbeat)
        record = self._known(peer)
        record.last_seen = time.time()
        record.version_held = beat.version_held
        record.receiving_version = beat.receiving_version
        record.chunks_received = beat.chunks_received
        self.on_heartbeat()
        links = self.chain_links(peer)
        await self._reply(
            stream,
            HeartbeatReply(
                state=record.state,
                latest_version=self.shelf.newest_version(),
                upstream=links.upstream,
                upstream_addrs=links.upstream_addrs,
                downstream=links.downstream,
                chain=links.chain,
                chain_position=links.chain_position,
            ),
        )

    def _lease_for(self, record: NodeRecord, request: LeaseRequest) -> tuple[LeaseRecord | None, str, float]:
        window = self.window()
        if record.state not in ("probing", "active"):
            return None, f"{record.state}: no work for now", STANDBY_RETRY_S
        if request.version_held < window.oldest or request.version_held < 0:
            return None, f"fetch a snapshot >= v{window.oldest} first", NO_WORK_RETRY_S
        probe = record.state == "probing"
        if probe and any(r.node_id == record.peer_id for r in self.leases.open.values()):
            return None, "probe lease outstanding", NO_WORK_RETRY_S
        holders = [(r.node_id, (self.fleet.get(r.node_id) or record).remote_ip) for r in self.leases.open.values()]
        quota = self.defences.quota.decide(record.peer_id, record.remote_ip, record.audits_passed, holders)
        if not quota.allowed:
            return None, quota.reason, NO_WORK_RETRY_S
        k = PROBE_PROMPTS if probe else quota.prompts
        if not probe:  # a probe (one prompt, one per node) must not starve behind the cap
            room = int(self.config.max_inflight_steps * self.learner.prompts_per_step) - (
                len(self.buffer) + self.leases.outstanding_prompts()
            )
            # A lease shrinks to the room left rather than waiting for room it may never get.
            k = min(k, room)
            if k < 1:
                return None, "enough work in flight", NO_WORK_RETRY_S
        lease = self.leases.issue(
            record.peer_id, k, min_version=window.oldest, now=time.time(),
            timeout_s=self.config.lease_timeout_s, probe=probe,
        )
        return lease, "", 0.0

    async def _on_lease(self, stream: INetStream) -> None:
        peer = remote_peer_id(stream)
        request = await read_message(stream, LeaseRequest)
        record = self._known(peer)
        record.last_seen = time.time()
        record.version_held = max(record.version_held, request.version_held)
        lease, reason, retry = self._lease_for(record, request)
        if lease is None:
            await self._reply(stream, LeaseReply(lease=None, retry_after_s=retry, reason=reason))
            return
        await trio.to_thread.run_sync(
            self.store.add_lease, lease.lease_id, peer, list(lease.prompt_ids), lease.min_version, lease.deadline
        )
        message = Lease(
            lease_id=lease.lease_id,
            prompts=tuple(LeasePrompt(prompt_id=p.id, text=p.text) for p in lease.prompts),
            group_size=self.rules.group_size,
            sampling=self.rules.sampling,
            min_version=lease.min_version,
            deadline_s=lease.deadline - lease.issued_at,
        )
        await self._reply(stream, LeaseReply(lease=message))

    async def _on_submit(self, stream: INetStream) -> None:
        peer = remote_peer_id(stream)
        tag, body = await read_frame(stream, signed_caps(Submission))
        # The Noise handshake proved the stream's peer; the signature binds the exact bytes to it.
        submission = decode_signed(tag, body, peer, Submission)
        now = time.time()
        record = self._known(peer)
        if submission.node_id != peer:
            raise ValueError("submission names another node")
        try:
            lease = self.leases.claim(submission.lease_id, peer, now)
        except LeaseError as exc:
            self.count("submissions_refused")
            raise ValueError(str(exc)) from None
        committed = False
        try:
            verdicts = await trio.to_thread.run_sync(check_submission, submission, lease, self.rules, self.window())
            if lease.closed:
                raise ValueError("lease withdrawn while the submission was checked (node dropped or released)")
            verdicts, copies = self._reject_copies(verdicts, peer, lease.lease_id)
            accepted = [v for v in verdicts if v.accepted]
            if accepted and len(self.buffer) + len(accepted) > self.buffer.capacity_groups:
                raise HubBusy("hub buffer full: resubmit later")
            seconds = min(now - lease.issued_at, self.config.lease_timeout_s)
            share = len(accepted) / len(lease.prompts)
            usd = min(record.price_per_hour * seconds / 3600.0 * share, self.config.max_cost_per_lease_usd)
            signed_hash = hashlib.blake2b(body, digest_size=16).hexdigest()
            # Shielded: once the commit starts, the in-memory state must follow it even if the
            # stream's deadline fires meanwhile (a commit without its buffer entries is a lost ack).
            with trio.CancelScope(shield=True):
                row_ids = await trio.to_thread.run_sync(
                    lambda: self.store.record_submission(
                        lease.lease_id, peer, verdicts, usd=usd, seconds=seconds, signed_bytes_hash=signed_hash
                    )
                )
                committed = True
                await self._accept(record, lease, verdicts, row_ids, seconds)
            for flag in copies:
                self.count("copies_flagged")
                await self.event("copy_detected", peer, flag.describe())
        finally:
            if not committed:
                self.leases.release(lease)
        refused = [v for v in verdicts if not v.accepted]
        await self._reply(stream, SubmitReply(
            accepted=len(accepted),
            rejected=tuple((v.prompt_id, v.reason) for v in refused if not v.late),
            late=tuple((v.prompt_id, v.reason) for v in refused if v.late),
        ))

    def _reject_copies(
        self, verdicts: list[GroupVerdict], peer: str, lease_id: str
    ) -> tuple[list[GroupVerdict], list[CopyFlag]]:
        """Groups that repeat earlier work too exactly to be honest are refused: neither trained on nor paid."""
        flags, out = [], []
        for verdict in verdicts:
            flag = self.defences.copies.check(verdict.group, peer, lease_id) if verdict.accepted else None
            if flag is not None:
                flags.append(flag)
                verdict = dataclasses.replace(verdict, accepted=False, reason="copy of an earlier group", group=None)
            out.append(verdict)
        return out, flags

    async def _accept(
        self, record: NodeRecord, lease: LeaseRecord, verdicts: list[GroupVerdict], row_ids: list[int], seconds: float
    ) -> None:
        """Fold a committed submission into the lease book, the buffer, the node's record and the counters."""
        peer = record.peer_id
        accepted = [v for v in verdicts if v.accepted]
        for verdict in verdicts:
            lease.answered.add(verdict.prompt_id)
        self.leases.close(lease)
        await self._buffer_accepted(record, lease, verdicts, row_ids)
        record.accepted += len(accepted)
        late = sum(v.verdict == "late" for v in verdicts)
        record.late += late
        record.rejected += len(verdicts) - len(accepted) - late
        self.fleet.record_work(record, sum(len(v.group.completions) for v in accepted), seconds)
        if lease.probe:
            await self.event("probed", peer, f"{record.rollouts_per_s:.2f} rollouts/s")
            self.on_fleet_change()
        self.count("groups_accepted", len(accepted))
        self.count("groups_rejected", len(verdicts) - len(accepted) - late)
        self.count("groups_late", late)
        mismatches = sum(v.claimed_reward_mismatch for v in verdicts)
        if mismatches:
            self.count("claimed_reward_mismatch", mismatches)
            await self.event("reward_claim_mismatch", peer, f"{mismatches} groups claimed other rewards")

    async def _buffer_accepted(
        self, record: NodeRecord, lease: LeaseRecord, verdicts: list[GroupVerdict], row_ids: list[int]
    ) -> None:
        """Hand committed groups to the buffer, behind the audit when the node is still on probation."""
        audits, rng = self.defences.audits, self.defences.rng
        kept = [(v.group, row_id) for v, row_id in zip(verdicts, row_ids) if v.accepted]
        if not kept:
            return
        # Banned by an audit that failed while this submission was in flight, or by this one's own
        # audit (its buffered work dropped, its pay voided): these groups never reach the buffer.
        banned = record.state == "banned"
        if not banned and audits.on_probation(record):
            # Which group is audited is decided only now, after the submission arrived.
            group, row_id = kept[rng.randrange(len(kept))]
            banned = await audits.audit_now(AuditJob(record.peer_id, lease.lease_id, row_id, group)) is False
        elif not banned:  # trusted: audited later, by sample
            audits.sample(record, lease.lease_id, kept, rng)
        if banned:
            ids = [row_id for _, row_id in kept]
            await trio.to_thread.run_sync(self.store.discard_trajectories, ids, "banned: audit failed")
            return
        for group, row_id in kept:
            result = self.buffer.add(group, row_id)
            if not result.accepted:
                await trio.to_thread.run_sync(self.store.discard_trajectories, [row_id], result.reason)
        self.buffer_signal.notify()

    async def _on_status(self, stream: INetStream) -> None:
        request = await read_message(stream, StatusRequest)
        await self._reply(stream, self.status(request.events))

    async def _on_snapshot(self, stream: INetStream) -> None:
        """Serve a snapshot straight from the hub (first fetch, repair, or a chain head's pull)."""
        request = await read_message(stream, SnapshotRequest)
        peer = remote_peer_id(stream)
        self._known(peer)
        try:
            ack = await serve_snapshot(stream, self.shelf, request, limiter=self.uplink.for_stream())
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        except RECEIVER_GONE as exc:
            # The receiver left mid-transfer (node stopped, or re-linked): ordinary churn, not misbehaviour.
            log.info("snapshot transfer to %s ended early: %s", peer[-8:], exc)
            await stream.reset()
            return
        if not ack.ok:
            log.warning("snapshot v%d to %s ended badly: %s", ack.version, peer, ack.reason)
        await stream.close()
