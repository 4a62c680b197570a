"""Intake: every submission's way in, one linear pipeline over typed values, and what follows its audit.

    frame -> Submission -> Claimed -> Checked (accepted | late | rejected) -> Priced -> Committed
          -> routed: held for audit (a node on probation) | buffered

The steps, each once and in this order (docs/ARCHITECTURE.md lists them with the same numbers):

 1. an open lease to answer: the frame cap is an honest answer to the sender's biggest open lease (the guard
    reserved it); a node without one is refused before one byte is read;
 2. the frame, read up to that cap, and its signature over the exact bytes (`decode_signed`);
 3. the sender: a joined node in good standing, the one the submission names;
 4. the lease claimed: open, the sender's, not past its deadline, not being answered already (the same answer sent
    again to a lease it answered, its reply lost to a crash or a dropped link, gets the reply its commit stored, and
    nothing more happens: `_sent_again`);
 5. the content: every group against its lease and the version window, rewards recomputed (hub/trust/submissions.py,
    in the check pool of hub/trust/checkpool.py); a failure of the operator's reward answers busy. A tool-using run
    settles a lease's rollouts first (hub/agents/rollouts.py): each ended, its environment's reward asked; a group
    holding one the hub did not see through is rejected, and an accepted group's rewards add its environment's;
 6. the lease still open once checked (not withdrawn meanwhile);
 7. the environment: a tool-using rollout's environment segments exactly what the hub sent it (else the group is a
    cheat's, and its node is banned once the submission is committed); copies: a group repeating an earlier one as
    an honest sampler would not (hub/trust/copies.py);
 8. room: buffer room for the accepted groups, and for a node on probation room in the audit backlog (else busy);
 9. the price: the lease's pay (hub/method/prices.py) and the node's measured throughput;
10. the commit: verdicts, pay, tallies, events in one store transaction, which refuses a banned node and a lease
    row no longer open;
11. the route: a node on probation's groups held until their audit passes (then buffered, else discarded and
    unpaid); anyone else's buffered, an audit sampled for later.

Returns only after the commit: the reply built from it is an acknowledgement. The intake owns the buffer room, the
probation count and audits, the copy detector and the reward-failure rule; the node's records change through
Membership, the lease through Leasing, the store through the one StoreWriter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from hub.agents.rollouts import UNKNOWN_ROLLOUT, AgentRollouts, SettledAnswer
from hub.config import HubConfig
from hub.method.capacity import in_time_rollouts_per_s
from hub.method.prices import LeasePay, price_lease
from hub.records.buffer import BufferSignal, ReplayBuffer
from hub.records.fleet import NodeRecord
from hub.records.leases import AnsweredLease, LeaseRecord
from hub.records.schema import NodeBanned
from hub.records.store import Store
from hub.records.writer import StoreWriter
from hub.service.leasing import Leasing
from hub.service.membership import Membership
from hub.service.room import BufferRoom
from hub.service.totals import RunTotals
from hub.trust.audit import AuditJob, AuditQueue
from hub.trust.checkpool import ChecksLost, PoolStopped, SubmissionChecks, ThreadChecks
from hub.trust.copies import CopyDetector, CopyFlag
from hub.trust.probation import Probation, audit_result
from hub.trust.submissions import (
    REASON_ENVIRONMENT,
    GroupVerdict,
    SentMatches,
    SubmissionRules,
    VersionWindow,
    refuse_tampered,
    reject_copies,
    submission_events,
    verdict_reasons,
    verdict_tallies,
)
from shared.logs import PeerLogLimiter, for_operator
from shared.messages import GroupReason, LeaseReply, RejectCode, Submission, SubmitReply, Tallies, add_reasons, short_id
from shared.precision import resolve_dtype
from shared.rollout import Group
from shared.tasks.base import RewardError
from shared.wire import PeerFault, decode_signed

log = logging.getLogger("echo2.hub.intake")

# One hub.log line per node and reason a minute at most (a node refused on every lease must not fill the disk); the
# next one says how many groups were held back.
REASON_LOG_WINDOW_S = 60.0
# The verdict's own text in that line: the first refused group's, cut to this.
REASON_LOG_CHARS = 200

# Reads one frame of at most the given size per tag: (tag, body).
FrameReader = Callable[[dict[int, int]], Awaitable[tuple[int, bytes]]]


class HubBusy(Exception):
    """The hub cannot take this request now; the peer did nothing wrong and may send it again."""


def ban_discard_reason(record: NodeRecord) -> str:
    """Why a banned node's untrained groups are discarded, by why it was banned: tampering with the turns or tool
    answers it exchanged, or else a failed audit."""
    tampered = (record.banned_reason or "").startswith(REASON_ENVIRONMENT)
    return "banned: environment tampered" if tampered else "banned: audit failed"


@dataclass(frozen=True)
class SubmissionOutcome:
    """What the hub decided about one submission, as the node is told."""

    accepted: int
    rejected: tuple[tuple[str, str], ...]
    late: tuple[tuple[str, str], ...]
    paid_usd: float
    paid_s: float  # the lease seconds the ledger booked for paid_usd
    reasons: dict[str, int]  # the refused groups by reason (shared.messages.GroupReason)
    needed_rollouts_per_s: float | None  # with late groups: the pace that would have come back in time

    def reply(self, next_lease: LeaseReply | None = None) -> SubmitReply:
        """The reply that tells the node, with the answer to its next_lease_for."""
        return SubmitReply(
            accepted=self.accepted,
            rejected=self.rejected,
            late=self.late,
            paid_usd=self.paid_usd,
            paid_s=self.paid_s,
            reasons=self.reasons,
            needed_rollouts_per_s=self.needed_rollouts_per_s,
            next_lease=next_lease,
        )

    @classmethod
    def of_reply(cls, reply: SubmitReply) -> SubmissionOutcome:
        """The outcome a reply told (the one an answer's commit stored)."""
        return cls(
            accepted=reply.accepted,
            rejected=reply.rejected,
            late=reply.late,
            paid_usd=reply.paid_usd,
            paid_s=reply.paid_s,
            reasons=dict(reply.reasons),
            needed_rollouts_per_s=reply.needed_rollouts_per_s,
        )


@dataclass(frozen=True)
class Claimed:
    """Steps 1-4 passed: a signed submission of a joined node, its lease claimed."""

    record: NodeRecord
    submission: Submission
    signed_hash: str
    lease: LeaseRecord
    at: float


@dataclass(frozen=True)
class Checked:
    """Steps 5-7 passed: every group's verdict (accepted, late or rejected) and the copies flagged."""

    claimed: Claimed
    verdicts: list[GroupVerdict]
    copies: Sequence[CopyFlag]

    @property
    def accepted(self) -> list[Group]:
        return [v.group for v in self.verdicts if v.group is not None]  # an accepted verdict carries its group

    def outcome(self, pay: LeasePay, window: VersionWindow) -> SubmissionOutcome:
        """What the node is told, with its pay and the version window as it stands now (for the pace late groups
        needed)."""
        refused = [v for v in self.verdicts if not v.accepted]
        return SubmissionOutcome(
            accepted=len(self.verdicts) - len(refused),
            rejected=tuple((v.prompt_id, v.reason) for v in refused if not v.late),
            late=tuple((v.prompt_id, v.reason) for v in refused if v.late),
            paid_usd=pay.usd,
            paid_s=pay.booked_s,
            reasons=verdict_reasons(self.verdicts),
            needed_rollouts_per_s=self.in_time_pace(window),
        )

    def in_time_pace(self, window: VersionWindow) -> float | None:
        """With late groups: the rollouts/s at which this answer would have arrived within the window
        (hub/method/capacity.py in_time_rollouts_per_s); None without."""
        late = [v.submitted.completions[0].version for v in self.verdicts if v.late]  # a late group has one version
        if not late:
            return None
        lease = self.claimed.lease
        return in_time_rollouts_per_s(
            sum(len(v.submitted.completions) for v in self.verdicts),
            self.claimed.at - lease.issued_at,
            window.oldest - lease.min_version,
            min(late) - lease.min_version + 1,
        )


@dataclass(frozen=True)
class Priced:
    """Steps 8-9 passed: room for it, how many of its groups are held for audit, its pay and throughput."""

    checked: Checked
    held: int
    pay: LeasePay
    rate: float
    measured: bool


@dataclass(frozen=True)
class Committed:
    """Step 10 done: committed, with each accepted group's row and what the node is told."""

    priced: Priced
    kept: Sequence[tuple[Group, int]]
    outcome: SubmissionOutcome


class Intake:
    """The submission pipeline and the audits' consequences; see the module docstring."""

    def __init__(
        self,
        store: Store,
        writer: StoreWriter,
        config: HubConfig,
        membership: Membership,
        leasing: Leasing,
        buffer: ReplayBuffer,
        signal: BufferSignal,
        room: BufferRoom,
        totals: RunTotals,
        rules: SubmissionRules | None,
        checks: SubmissionChecks | None,
        audits: AuditQueue | None,
        clock: Callable[[], float],
        sent_matches: SentMatches | None = None,
    ) -> None:
        """`rules` None: a learner-only hub that takes no submissions. `checks` None: ThreadChecks(rules).
        `sent_matches`: the tool loop's record of the environment segments it sent (rules for tool-using rollouts
        need it; None: a run without tools)."""
        trust, lc = config.trust, config.learner
        if rules is not None and audits is None and (trust.audit_rate > 0 or trust.audit_first_n > 0):
            raise ValueError("audits are configured (audit_rate or audit_first_n > 0) but no AuditQueue was given")
        if rules is not None and rules.max_completion_tokens is not None and sent_matches is None:
            raise ValueError("rules for tool-using rollouts need the tool loop's sent_matches")
        self.sent_matches = sent_matches
        self.store = store
        self.writer = writer
        self.lease_config = config.lease
        self.membership = membership
        self.leasing = leasing
        self.buffer = buffer
        self.signal = signal
        self.room = room
        self.totals = totals
        self.rules = rules
        self.checks = checks if checks is not None or rules is None else ThreadChecks(rules, trust.check_timeout_s)
        self.clock = clock
        snapshot_dtype = resolve_dtype(lc.dtype, lc.device)
        self.copies = CopyDetector(
            trust.copy_cache_groups, lc.group_size, trust.copy_false_alarm, trust.mean_abs_gap(snapshot_dtype)
        )
        self.probation = Probation(trust, audits)
        self.reason_log = PeerLogLimiter(REASON_LOG_WINDOW_S, clock)
        membership.on_ban.append(self.copies.forget)
        membership.on_ban.append(self.probation.sampling.forget)
        # The first failure of the operator's reward: the run stops with it (HubState.run raises it).
        self.reward_failure: RewardError | None = None
        self.agents: AgentRollouts | None = None  # a tool-using run's rollouts (HubState sets them)
        self._nursery: trio.Nursery | None = None

    # -- the pipeline ----------------------------------------------------------------------------

    def frame_cap(self, peer: str) -> int:
        """Step 1's cap: the largest signed submission frame `peer` may send now (0: it holds no open lease)."""
        if self.rules is None:
            raise RuntimeError("this hub was built without submission rules")
        return self.leasing.submission_cap(peer, self.rules)

    async def submit(self, peer: str, cap: int, read: FrameReader) -> tuple[Submission, SubmissionOutcome]:
        """A submission from `peer`, whose guard reserved `cap` (`frame_cap`), through every step (see the module
        docstring): the submission and what the node is told of it."""
        if not cap:  # 1
            raise PeerFault("no open lease: ask for one before submitting", RejectCode.BAD_LEASE)
        tag, body = await read({Submission.TYPE: cap})  # 2
        # The Noise handshake proved the stream's peer; the signature binds the exact bytes to it.
        submission = decode_signed(tag, body, peer, Submission)
        return submission, await self.accept(peer, submission, hashlib.blake2b(body, digest_size=16).hexdigest())

    async def accept(self, peer: str, submission: Submission, signed_hash: str) -> SubmissionOutcome:
        """Steps 3-11 of a submission whose signed bytes (hashed: `signed_hash`) `submit` read and verified."""
        if self.checks is None:
            raise RuntimeError("this hub was built without submission rules")
        record = self.membership.submits(peer)  # 3
        if submission.node_id != peer:
            raise PeerFault("submission names another node")
        answered = self.leasing.answered_lease(submission.lease_id, peer)
        if answered is not None:
            return await self._sent_again(answered, signed_hash)
        if self.leasing.being_checked(submission.lease_id, peer):
            # Sent again while the first copy is checked (its node stopped waiting): once it is committed, this gets
            # its reply, or, not the same answer, the refusal of a second answer.
            raise HubBusy("an answer to this lease is being checked: send it again in a moment")
        with self._claimed(record, submission, signed_hash) as claimed:  # 4
            checked = await self._check(claimed)  # 5-7
            priced = self._price(checked)  # 8-9
            committed = await self._commit(priced)  # 10
            await self._ban_tampering(record, checked.verdicts)
            await self._route(committed)  # 11
        if claimed.lease.probe:
            self.membership.changed()  # measured: the scheduler may move it to standby now
        outcome = committed.outcome
        self._log_refusals(record, checked.verdicts, outcome.needed_rollouts_per_s)
        return outcome

    async def _sent_again(self, answered: AnsweredLease, signed_hash: str) -> SubmissionOutcome:
        """Step 4 for a lease already answered: the same signed bytes sent again (their reply was lost: the hub died
        between the commit and the reply, or the link dropped) get the reply that commit stored, and nothing is
        checked, counted, booked or paid again; other bytes are a second answer to it, refused."""
        stored = await trio.to_thread.run_sync(self.store.leases.reply_to, answered.lease_id, answered.node_id, signed_hash)
        if stored is None:
            raise PeerFault("lease already answered by another submission", RejectCode.BAD_LEASE)
        tail = self.reason_log.tail(f"{answered.node_id}/sent again", 1)  # a line a minute at most: the node may insist
        if tail is not None:
            log.info(
                "node %s sent its answer to lease %s again: given the reply it got%s",
                short_id(answered.node_id),
                answered.lease_id[:8],
                tail,
            )
        return SubmissionOutcome.of_reply(SubmitReply.model_validate_json(stored))

    def _log_refusals(self, record: NodeRecord, verdicts: Sequence[GroupVerdict], needed: float | None) -> None:
        """A submission's refused groups in hub.log: a line per reason, at most one per node and reason a minute
        (`reason_log`), naming the node, the count, the reason and the first group's own words."""
        by_reason: dict[GroupReason, list[GroupVerdict]] = {}
        for v in verdicts:
            if v.why is not None:
                by_reason.setdefault(v.why, []).append(v)
        for why, refused in by_reason.items():
            tail = self.reason_log.tail(f"{record.peer_id}/{why.value}", len(refused))
            if tail is None:
                continue
            late = why == GroupReason.LATE
            pace = f"; in time it needed {needed:.3g} rollouts/s" if late and needed is not None else ""
            log.log(
                logging.INFO if late else logging.WARNING,
                "node %s: %d group%s %s (%s): %s%s%s",
                record.name or short_id(record.peer_id),
                len(refused),
                "" if len(refused) == 1 else "s",
                "late" if late else "rejected",
                why.value,
                refused[0].reason[:REASON_LOG_CHARS],
                pace,
                tail,
            )

    @contextmanager
    def _claimed(self, record: NodeRecord, submission: Submission, signed_hash: str) -> Iterator[Claimed]:
        """Step 4: the lease claimed while the submission is checked and committed; open again for a valid answer if
        this one is refused (releasing a lease its committed answer closed is a no-op)."""
        now = self.clock()
        lease = self.leasing.claim(submission.lease_id, record.peer_id, now)
        try:
            yield Claimed(record, submission, signed_hash, lease, now)
        finally:
            self.leasing.release(lease)

    async def _check(self, claimed: Claimed) -> Checked:
        """Steps 5-7: the content in the check pool, the lease still open, the copies."""
        peer, lease = claimed.record.peer_id, claimed.lease
        if self.checks is None:
            raise PeerFault("this hub takes no submissions", RejectCode.BAD_LEASE)
        settled = await self.agents.settle(claimed.submission) if self.agents is not None else None
        try:
            verdicts = await self.checks.check(claimed.submission, lease, self.leasing.window())
        except ChecksLost as exc:
            log.error("%s: refused as busy", exc)
            raise HubBusy("the hub lost this submission's checks: resubmit") from None
        except PoolStopped:
            raise HubBusy("the hub is stopping: send the answer again once it is back") from None
        except RewardError as exc:  # it fails the operator's own probe too (hub/trust/checkpool.py)
            self.reward_failed(exc)
            raise HubBusy("the hub is stopping: the task's reward failed (not this node's fault)") from None
        if lease.closed:
            raise PeerFault("lease withdrawn while the submission was checked", RejectCode.BAD_LEASE)
        if settled is not None:
            verdicts = self._with_environment(verdicts, settled)
        if self.sent_matches is not None:
            verdicts = refuse_tampered(verdicts, lease.lease_id, self.sent_matches)
        verdicts, copies = await reject_copies(verdicts, self.copies, peer, lease.lease_id, self.probation.recompute)
        return Checked(claimed, verdicts, copies)

    def _with_environment(self, verdicts: Sequence[GroupVerdict], settled: SettledAnswer) -> list[GroupVerdict]:
        """Step 5's end for a tool-using run: a group holding a rollout the hub did not settle is rejected, and an
        accepted group's rewards add its environment's get_reward() (weight 1, under the environment's name, as TRL
        adds it; a rollout ended early adds nothing)."""
        assert self.agents is not None, "only a tool-using run settles rollouts"
        name = self.agents.environment_name
        out = []
        for verdict in verdicts:
            group = verdict.group
            if (verdict.accepted or verdict.late) and verdict.prompt_id in settled.unknown:
                verdict = GroupVerdict(verdict.prompt_id, False, UNKNOWN_ROLLOUT, verdict.submitted, code=GroupReason.LEASE)
            elif group is not None and name is not None:
                part = settled.environment_rewards(group.prompt_id, len(group.completions))
                rewards = tuple(r + (e or 0.0) for r, e in zip(group.rewards, part))
                update = {"rewards": rewards, "reward_parts": (*group.reward_parts, (name, part))}
                verdict = dataclasses.replace(verdict, group=group.model_copy(update=update))
            out.append(verdict)
        return out

    def _price(self, checked: Checked) -> Priced:
        """Steps 8-9: room in the buffer and, for a node on probation, in the audit backlog (HubBusy when there is
        none now: the node may send the same submission again later); then the pay and the throughput sample."""
        record, accepted = checked.claimed.record, checked.accepted
        if not self.room.fits(len(accepted)):
            raise HubBusy("hub buffer full: resubmit later")
        held = 0
        if accepted and self.probation.on_probation(record):
            if self.probation.backed_up(len(accepted)):
                # Audits of new nodes are backed up: whoever sends more new work must wait (bounded, not piled up).
                raise HubBusy("audits of new nodes backed up: resubmit later")
            held = len(accepted)
        pay = price_lease(
            checked.claimed.lease.issued_at,
            checked.claimed.lease.price_per_hour,
            len(checked.claimed.lease.prompts),
            accepted,
            checked.claimed.at,
            self.lease_config,
        )
        rate, measured = self.membership.fleet.throughput_after(record, sum(len(g.completions) for g in accepted), pay.held_s)
        return Priced(checked, held, pay, rate, measured)

    async def _commit(self, priced: Priced) -> Committed:
        """Step 10: verdicts, pay, tallies, throughput and events in one transaction (which refuses a banned node and
        a closed lease row), then the records: the lease answered, the node's tallies and throughput, the totals."""
        checked = priced.checked
        claimed, verdicts, pay = checked.claimed, checked.verdicts, priced.pay
        record, lease = claimed.record, claimed.lease
        accepted = len(checked.accepted)
        events = submission_events(record.peer_id, lease, verdicts, checked.copies, priced.rate)
        outcome = checked.outcome(pay, self.leasing.window())
        reply_json = outcome.reply().model_dump_json()
        with trio.CancelScope(shield=True):
            try:
                # Room and the audit backlog are counted before the commit: concurrent submissions must not
                # overfill either with groups their nodes were told were accepted.
                with self.room.reserving(accepted), self.probation.holding(priced.held):
                    row_ids = await self.writer.write(
                        lambda: self.store.groups.record_submission(
                            lease.lease_id,
                            record.peer_id,
                            verdicts,
                            usd=pay.usd,
                            seconds=pay.billed_s,
                            signed_bytes_hash=claimed.signed_hash,
                            now=claimed.at,
                            rollouts_per_s=priced.rate,
                            events=events,
                            hold=priced.held > 0,
                            tokens=pay.tokens,
                            reply_json=reply_json,
                        )
                    )
            except NodeBanned:
                raise PeerFault("banned", RejectCode.BANNED) from None
            self.leasing.answered(lease, [v.prompt_id for v in verdicts])
            counts, reasons = verdict_tallies(verdicts), verdict_reasons(verdicts)
            self.membership.book_work(record, counts, reasons, priced.rate, priced.measured)
            self.totals.groups = self.totals.groups + counts
            self.totals.reasons = add_reasons(self.totals.reasons, reasons)
            if pay.usd > 0 and record.state != "banned":  # a ban under way sets the node's pay itself
                self.totals.paid_usd[record.peer_id] = self.totals.paid_usd.get(record.peer_id, 0.0) + pay.usd
        kept = [(v.group, row_id) for v, row_id in zip(verdicts, row_ids) if v.group is not None]
        return Committed(priced, kept, outcome)

    async def _ban_tampering(self, record: NodeRecord, verdicts: Sequence[GroupVerdict]) -> None:
        """A committed submission holding a group whose turns or tool answers differ from those exchanged is a cheat's,
        as a failed audit is: its node banned, its untrained groups (this submission's too, at the route) dropped."""
        tampered = sum(v.code == GroupReason.ENVIRONMENT for v in verdicts)
        if tampered:
            await self._penalize(record, f"{REASON_ENVIRONMENT} in {tampered} groups", "environment_tampered")

    async def _route(self, committed: Committed) -> None:
        """Step 11: held for audit (a node on probation: audited after the reply, off the handler's clock) or
        buffered."""
        claimed = committed.priced.checked.claimed
        with trio.CancelScope(shield=True):
            if committed.priced.held:
                assert self._nursery is not None, "HubState.run starts the intake's nursery before any submission"
                self._nursery.start_soon(self._audit_held, claimed.record, claimed.lease.lease_id, committed.kept, claimed.at)
            else:
                await self._settle(claimed.record, claimed.lease.lease_id, committed.kept, claimed.at)

    def reward_failed(self, exc: RewardError) -> None:
        """The operator's reward is broken (it fails its probe): the run stops (HubState.run raises the first failure;
        its traceback is logged once)."""
        if self.reward_failure is None:
            self.reward_failure = exc
            log.error("%s: stopping the run", exc, exc_info=exc.__cause__ or exc)

    async def recent_rejections(self, limit: int) -> dict[str, int]:
        """Why the newest `limit` rejected groups were rejected: reason -> count (the stall warning's cause)."""
        return await trio.to_thread.run_sync(self.store.groups.recent_rejections, limit)

    async def recent_discards(self, limit: int) -> dict[str, int]:
        """What became of the newest `limit` settled accepted groups: trained, or why discarded -> count."""
        return await trio.to_thread.run_sync(self.store.groups.recent_discards, limit)

    # -- the routes --------------------------------------------------------------------------------

    async def _settle(self, record: NodeRecord, lease_id: str, kept: Sequence[tuple[Group, int]], answered_at: float) -> None:
        """Groups of a trusted node: into the buffer (an audit may be sampled for later)."""
        self.room.release(len(kept))
        if record.state == "banned":
            # Banned by an audit that failed while this submission was in flight: never trained on.
            if kept:
                ids = [row_id for _, row_id in kept]
                await self.writer.write(self.store.groups.discard_trajectories, ids, ban_discard_reason(record))
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
                passed = await self._audit(
                    [AuditJob(record.peer_id, lease_id, row_id, group, answered_at) for group, row_id in kept], release=row_ids
                )
                self.room.release(len(kept))
                if record.state == "banned":
                    # Failed, or banned meanwhile (a released row must not slip past the ban either):
                    # discard whichever rows the ban has not discarded already.
                    await self.writer.write(self.store.groups.discard_if_pending, row_ids, ban_discard_reason(record))
                elif passed:
                    await self._buffer(kept)
                else:
                    paid = await self.writer.write(
                        self.store.groups.discard_and_void, row_ids, "not audited while on probation", record.peer_id, lease_id
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
            await self.writer.write(self.store.groups.discard_trajectories, ids, reason)
        self.signal.notify()

    async def record_local_group(self, group: Group) -> None:
        """A group from the hub's own in-process rollouts: committed as accepted, then offered to the buffer."""
        with trio.CancelScope(shield=True):
            row_id = await self.writer.write(self.store.groups.record_trajectory, group, None, "", "accepted")
            self.totals.groups = self.totals.groups + Tallies(accepted=1)
            await self._buffer([(group, row_id)])

    # -- audits ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Audit the sampled groups one after another, off the trio thread; check submissions (the check pool's
        workers); the nursery held submissions are audited in (a component of the hub's nursery)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.checks is not None:
                nursery.start_soon(self.checks.run)
            if self.probation.audits is None:
                await trio.sleep_forever()
            while True:
                await self._audit([await self.probation.audits.next_job()])

    async def _audit(self, jobs: Sequence[AuditJob], release: Sequence[int] = ()) -> bool:
        """Audit groups of one submission. True: all passed (one passed audit for the node, its pay up to this
        submission vouched for unless its sampling test holds evidence against it, the `release`d rows free to be
        trained on); False: one failed (the node is banned) or could not be audited."""
        record = await self.membership.recall(jobs[0].node_id)  # gone long ago, its audit is still due
        if record is None or record.state == "banned":
            return False
        verdict = await self.probation.judge(jobs)
        self.totals.audits[audit_result(verdict)] += 1
        if verdict.failure is not None:
            await self._penalize(record, verdict.failure)
        if not verdict.passed:
            return False
        vouched_at = jobs[0].answered_at if verdict.vouches else 0.0
        with trio.CancelScope(shield=True):
            released = await self.writer.write(
                self.store.members.record_audit_pass, record.peer_id, vouched_at, list(release), self.clock()
            )
            if not released:  # banned while it was audited: the ban discarded the rows
                return False
            self.membership.vouch(record, vouched_at)
        return True

    async def _penalize(self, record: NodeRecord, reason: str, kind: str = "audit_fail") -> None:
        """Ban a node caught cheating (the event `kind` says how), drop its untrained groups, void its pay since its
        last passed audit.

        Groups the learner already trained on stay trained on (audits are spot checks, not a gate): the ban's log
        line and event say how many, and the steps that took them.
        """
        if record.state == "banned":
            return
        # Banned in the record at once, before the commit: no submission, join or state change of this node may slip
        # in while the ban is being written.
        self.membership.mark_banned(record, reason)
        # Out of the buffer before the commit: the learner must not take a group being discarded.
        dropped = self.buffer.drop_node(record.peer_id)
        since = self.probation.unvouched_since(record)

        def penalize() -> tuple[int, float, str]:
            trained = self.store.groups.trained_of(record.peer_id).describe()
            detail = f"{reason}; dropped {len(dropped)} groups; {trained}"
            voided, paid = self.store.members.penalize_node(
                record.peer_id,
                dropped,
                since,
                reason,
                event=(kind, record.peer_id, detail),
                discard_reason=ban_discard_reason(record),
            )
            return voided, paid, trained

        with trio.CancelScope(shield=True):
            voided, paid, trained = await self.writer.write(penalize)
            self.totals.paid_usd[record.peer_id] = paid
            self.leasing.release_node(record.peer_id)
        log.warning(
            "banned %s: %s; dropped %d groups, voided %d payments; %s",
            record.name or short_id(record.peer_id),
            reason,
            len(dropped),
            voided,
            trained,
            extra=for_operator("node_banned"),
        )
        self.membership.changed()
