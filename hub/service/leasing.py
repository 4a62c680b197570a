"""Leasing: who holds which prompts. It owns the lease book (hub/records/leases.py), the per-identity and
per-address lease quotas, the operator's own nodes' exemption from the address quota, the version window a lease
and a submission are held to (`min_useful_version`) and the largest submission a node may send (its cap). It grants
leases, sweeps expired ones, and hands them to the intake to claim, answer or release; every durable change goes
through the one StoreWriter.

A lease being written is open in the book before its commit (concurrent requests count it against quotas and the
in-flight cap) and withdrawn if the commit fails: the one change made before its write, in the safe direction. Lease
rows in the store follow the book one handler deadline late (`sweep`): a submission still being checked when its
lease's deadline passed can commit against an open row.

A lease outlives the hub that granted it: its row keeps its terms, and a restarted hub opens its unexpired leases
again (`_reopen`), so a node whose answer the crash cut off delivers it to the new hub and is paid as agreed. An
answered lease is kept until its deadline, here and across a restart (`answered_lease`): the same answer sent again,
its reply lost, gets the reply its commit stored (hub/service/intake.py), and may be as large as its lease allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import trio

from hub.config import HubConfig
from hub.method.capacity import SATURATED_USABLE_FRACTION
from hub.records.buffer import fresh_room, leasable
from hub.records.leases import AnsweredLease, LeaseBook, LeaseError, LeaseRecord
from hub.records.schema import LeaseTerms, NewEvent
from hub.records.store import Store
from hub.records.writer import StoreWriter
from hub.service.membership import Membership
from hub.service.room import BufferRoom
from hub.trust.guard import LeaseQuota
from hub.trust.probes import PROBE_STRIKES_TO_STANDBY, ProbeStrikes
from hub.trust.submissions import SubmissionRules, VersionWindow
from shared.crypto import SIGNATURE_BYTES
from shared.messages import RejectCode, Submission
from shared.net import address_key
from shared.tasks.base import Prompt, Task
from shared.wire import PeerFault, signed_caps

log = logging.getLogger("echo2.hub.leasing")

# The longest a protocol handler may run (and so hold a claimed lease): the service's deadline.
HANDLER_TIMEOUT_S = 30.0
NO_WORK_RETRY_S = 0.25
STANDBY_RETRY_S = 2.0
PROBE_PROMPTS = 1
# Probes open at once, all identities together: they are outside the in-flight cap (see `grant`), so they get a
# bound of their own.
OPEN_PROBES_MAX = 256


class LearnerVersions(Protocol):
    """The learner's window as leases read it: hub.records.measurements.LearnerWindow, or a test bed's stand-in."""

    def min_useful_version(self) -> int:
        """The oldest version whose fresh rollouts the next take can still use."""
        ...

    def takes_served(self, held: int) -> int:
        """How many takes from the next still use version `held`."""
        ...


@dataclass(frozen=True)
class LeaseGrant:
    """A lease for the node, or why there is none and when to ask again."""

    lease: LeaseRecord | None
    reason: str = ""
    retry_after_s: float = 0.0


class Leasing:
    """The lease book, its quotas and the version window; see the module docstring."""

    def __init__(
        self,
        store: Store,
        writer: StoreWriter,
        config: HubConfig,
        task: Task,
        membership: Membership,
        room: BufferRoom,
        learner: LearnerVersions,
        usable: Callable[[], float],
        newest_version: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        """`room`: the buffer room the intake reserves, counted here against the in-flight cap (read only).
        `learner`: the learner's window (hub.records.measurements.LearnerWindow); `usable`: the measured share of
        accepted groups the learner trains on (Measurements.fresh_usable_fraction); `newest_version`: the shelf's."""
        self.store = store
        self.membership = membership
        membership.on_departure.append(self.release_node)
        self.writer = writer
        self.config = config.lease
        self.prompts_per_step = config.learner.prompts_per_step
        self.room = room
        self.learner = learner
        self.usable = usable
        self.newest_version = newest_version
        self.clock = clock
        self.book = LeaseBook(task, seed=config.learner.seed)
        self.quota = LeaseQuota(config.trust, config.lease.prompts_per_lease)
        self.probes = ProbeStrikes(first_wait_s=config.lease.lease_timeout_s)
        # Nodes `echo-hub start` spawned itself (their keys made by the hub): exempt from the per-address quota.
        self._own_nodes: frozenset[str] = frozenset()
        self._reopen(task)

    def _reopen(self, task: Task) -> None:
        """Open again the leases an earlier run of this hub granted that are still good (blocking: on start, before trio
        runs): their holders' answers, sent again to this hub, are taken on the terms they were granted on. One whose
        prompts the task no longer has (a resume that changed it) stays closed; its row expires at its deadline. Those it
        saw answered are kept as answered until their deadlines: the same answer, its reply lost, may come again."""
        now = self.clock()
        for row in self.store.leases.answered_since(now):
            self.book.keep_answered(AnsweredLease(row.id, row.node_id, len(row.prompt_ids), row.deadline))
        rows = self.store.leases.reopen(now)
        prompts = {p.id: p for p in task.prompts()} if rows else {}
        reopened = 0
        for row in rows:
            if row.price_per_hour is None or any(pid not in prompts for pid in row.prompt_ids):
                continue
            record = LeaseRecord(
                lease_id=row.id,
                node_id=row.node_id,
                prompts=tuple(prompts[pid] for pid in row.prompt_ids),
                min_version=row.min_version,
                issued_at=row.issued_at,
                deadline=row.deadline,
                price_per_hour=row.price_per_hour,
                probe=bool(row.probe),
                held_version=row.held_version,
                address=row.address,
            )
            self.book.open_lease(record)
            reopened += 1
        if reopened:
            log.info("%d leases granted before this start are open again until their deadlines", reopened)

    # -- reading ---------------------------------------------------------------------------

    def min_useful_version(self) -> int:
        """The oldest version whose fresh rollouts the learner's next take can still use: a lease's floor."""
        return self.learner.min_useful_version()

    def window(self) -> VersionWindow:
        """The versions a submission's groups may be made with now."""
        return VersionWindow(oldest=self.min_useful_version(), newest=self.newest_version())

    def exempt(self, peers: Iterable[str]) -> None:
        """The operator's own nodes (spawned by `echo-hub start`): out of the per-address quota, and vouched for."""
        self._own_nodes = frozenset(peers)

    def is_own(self, peer: str) -> bool:
        return peer in self._own_nodes

    def open_leases(self) -> int:
        return len(self.book.open)

    def submission_cap(self, peer: str, rules: SubmissionRules) -> int:
        """The largest signed submission frame `peer` may send now: an honest answer to its biggest open lease, or
        answered one not past its deadline (0 without one). What the guard reserves for the stream and the intake
        reads, at most."""
        prompts = max(
            [len(lease.prompts) for lease in self.book.leases_of(peer)] + [a.prompts for a in self.book.answered_of(peer)],
            default=0,
        )
        if not prompts:
            return 0
        cap = rules.frame_cap(prompts)
        return min(cap + SIGNATURE_BYTES, signed_caps(Submission)[Submission.TYPE])

    # -- granting ----------------------------------------------------------------------------

    async def grant(self, peer: str, version_held: int) -> LeaseGrant:
        """A lease for a node that asks for work holding `version_held`, or why none (PeerFault: it may not ask)."""
        # A node holds nothing the hub has not published: a claim past it is taken as the newest.
        version_held = min(version_held, self.newest_version())
        record = self.membership.asks_for_work(peer, version_held)
        window = self.window()
        if record.state not in ("probing", "active"):
            return LeaseGrant(None, f"{record.state}: no work for now", STANDBY_RETRY_S)
        if record.left_at is not None:  # a probing node that said it leaves: its probe went back to the pool
            return LeaseGrant(None, "left: join again for work", STANDBY_RETRY_S)
        if version_held < window.oldest or version_held < 0:
            return LeaseGrant(None, f"fetch a snapshot >= v{window.oldest} first", NO_WORK_RETRY_S)
        probe = record.state == "probing"
        address = None if peer in self._own_nodes else address_key(record.remote_ip)
        if probe and (refusal := self._probe_refusal(peer, address)) is not None:
            return refusal
        quota = self.quota.decide(
            peer, record.remote_ip, record.audits_passed, self.book.open_count(peer), self.book.open_by_address, self._own_nodes
        )
        if not quota.allowed:
            return LeaseGrant(None, quota.reason, NO_WORK_RETRY_S)
        k = PROBE_PROMPTS if probe else quota.prompts
        if not probe:  # a probe (one prompt, one per node, OPEN_PROBES_MAX in all) must not starve behind the cap
            # Both bounds count the prompts takes will train on; below the saturated share more rollouts do not
            # help (the scheduler then activates none).
            usable = max(self.usable(), SATURATED_USABLE_FRACTION)
            buffered, coming = len(self.room.buffer), self.room.reserved + self.book.outstanding_prompts()
            room = int(leasable(self.config.max_inflight_steps * self.prompts_per_step - buffered, coming, usable))
            # Work that would reach the buffer behind more than its version's takes can use is dropped as
            # stale: a node on an old version waits for the new one instead.
            takes = self.learner.takes_served(version_held)
            fresh = int(leasable(fresh_room(takes, self.prompts_per_step, buffered), coming, usable))
            # A lease shrinks to the room left rather than waiting for room it may never get.
            k = min(k, room, fresh)
            if k < 1:
                if fresh < room:
                    return LeaseGrant(
                        None, f"work queued ahead outlasts v{version_held}: fetch a newer snapshot", NO_WORK_RETRY_S
                    )
                return LeaseGrant(None, "enough work in flight", NO_WORK_RETRY_S)
        # Open in the book before the commit, so concurrent requests see it against their quota and the
        # in-flight cap; withdrawn if the commit fails. Its id reaches the node only after the commit.
        lease = self.book.draft(
            peer,
            k,
            min_version=window.oldest,
            now=self.clock(),
            timeout_s=self.config.lease_timeout_s,
            price_per_hour=record.price_per_hour,
            probe=probe,
            address=address,
            held_version=version_held,
        )
        self.book.open_lease(lease)
        try:
            with trio.CancelScope(shield=True):
                await self.writer.write(
                    self.store.leases.add_lease,
                    lease.lease_id,
                    peer,
                    list(lease.prompt_ids),
                    lease.min_version,
                    lease.issued_at,
                    lease.deadline,
                    LeaseTerms(lease.price_per_hour, lease.probe, lease.held_version, lease.address),
                )
        except BaseException:
            self.book.abandon(lease)
            raise
        return LeaseGrant(lease)

    def _probe_refusal(self, peer: str, address: str | None) -> LeaseGrant | None:
        """Why `peer`, probing, gets no probe now (None: it may have one)."""
        if self.book.holds(peer):
            return LeaseGrant(None, "probe lease outstanding", NO_WORK_RETRY_S)
        wait_s = self.probes.wait_s(peer, address, self.clock())
        if wait_s > 0:
            return LeaseGrant(None, f"a probe of this node or its address went unanswered: next in {wait_s:.0f}s", wait_s)
        if self.book.open_probes >= OPEN_PROBES_MAX:
            return LeaseGrant(None, f"{OPEN_PROBES_MAX} new nodes are being probed: wait for a probe slot", STANDBY_RETRY_S)
        return None

    async def sweep(self) -> None:
        """Expire leases past their deadline: their prompts are leased again. An unanswered probe costs its holder and its
        address a back-off (hub/trust/probes.py); PROBE_STRIKES_TO_STANDBY rounds of them put the holder on standby."""
        now = self.clock()
        expired = self.book.expire(now)
        for record in expired:
            log.info("lease %s of %s expired: re-queued", record.lease_id[:8], record.node_id[-8:])
            if record.probe and self.probes.unanswered(record.node_id, record.address, now) >= PROBE_STRIKES_TO_STANDBY:
                node = self.membership.fleet.get(record.node_id)
                if node is not None and node.state == "probing":
                    await self.membership.set_state(node, "standby", f"{PROBE_STRIKES_TO_STANDBY} rounds of probes unanswered")
        # The store follows the book one handler deadline late: see the module docstring.
        events: list[NewEvent] = [("lease_expired", r.node_id, f"lease {r.lease_id[:8]} re-queued") for r in expired]
        checking = [r.lease_id for r in self.book.open.values() if r.checking]
        await self.writer.write(lambda: self.store.leases.expire_leases(now - HANDLER_TIMEOUT_S, events, checking))

    def release_node(self, peer: str) -> list[LeaseRecord]:
        """A node leaving the pool: its open leases back to the pool (those whose submission is being checked stay
        with it)."""
        released = self.book.drop_node(peer)
        for lease in released:
            log.info("lease %s of %s back to the pool", lease.lease_id[:8], peer[-8:])
        return released

    # -- the intake's side: a lease answered -----------------------------------------------------

    def holds(self, peer: str) -> bool:
        """Whether `peer` holds an open lease (only then may it send a submission's worth of bytes)."""
        return self.book.holds(peer)

    def held_lease(self, lease_id: str, peer: str) -> LeaseRecord:
        """`peer`'s open lease `lease_id`, before its deadline, which its rollouts' turns are sent under (PeerFault:
        it holds no such lease)."""
        lease = self.book.open.get(lease_id)
        if lease is None or lease.node_id != peer or self.clock() > lease.deadline:
            raise PeerFault(f"no open lease {lease_id[:32]!r} of this node", RejectCode.BAD_LEASE)
        return lease

    def rendered(self, lease: LeaseRecord, prompts: tuple[Prompt, ...]) -> None:
        """A lease's prompts as its holder reads them (an environment's observation rendered in:
        hub/agents/rollouts.py): the same prompts by id; the pool gets the task's back (LeaseBook.close)."""
        if [p.id for p in prompts] != [p.id for p in lease.prompts]:
            raise ValueError("a lease's prompts rendered are its own prompts, in order")
        lease.prompts = prompts

    def give_back(self, lease: LeaseRecord) -> None:
        """A lease granted but not handed out (its rollouts could not open): closed, its prompts back to the pool."""
        self.book.close(lease)

    def claim(self, lease_id: str, peer: str, now: float) -> LeaseRecord:
        """The lease a submission answers, claimed while the submission is checked and committed (PeerFault:
        it answers none)."""
        try:
            return self.book.claim(lease_id, peer, now)
        except LeaseError as exc:
            raise PeerFault(str(exc), RejectCode.BAD_LEASE) from None

    def release(self, lease: LeaseRecord) -> None:
        """A claimed lease whose answer was refused: open again for a valid answer (a no-op once answered)."""
        self.book.release(lease)

    def answered_lease(self, lease_id: str, peer: str) -> AnsweredLease | None:
        """`peer`'s lease `lease_id`, answered and not past its deadline (None: it is not)."""
        return self.book.answered_lease(lease_id, peer)

    def being_checked(self, lease_id: str, peer: str) -> bool:
        """Whether `peer`'s open lease `lease_id` is claimed by an answer being checked and committed now."""
        lease = self.book.open.get(lease_id)
        return lease is not None and lease.node_id == peer and lease.checking

    def answered(self, lease: LeaseRecord, prompt_ids: Collection[str]) -> None:
        """A lease's answer committed: these prompts are answered, the rest go back to the pool."""
        self.book.answer(lease, prompt_ids)
        if lease.probe:
            self.probes.answered(lease.node_id, lease.address)
