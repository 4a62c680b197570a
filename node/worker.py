"""The node's worker: takes leases from the hub, generates the groups, signs and submits them (again, a few times
within the lease's validity, when the hub did not take the answer in: it went away or restarted).

Generation runs in a worker thread (the libp2p host must never be starved: py-libp2p
resets a stream whose reader stalls ~5 s), a slice of the lease's prompts at a time (the engine's
`batch_rollouts`), so the engine's peak memory is that of a slice whatever the lease's size; a multi-turn lease's
slice turn by turn with the hub (node/turns.py); a lease asking
more than LEASE_MAX_TOKENS is not answered (docs/volunteers.md: what a hub can and cannot make a volunteer
do). The engine is shared with the snapshot keeper, so generation and weight swaps take turns under one lock, and every completion records
the version that actually produced it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from node.client import HubClient
from node.engine import Engine
from node.turns import TurnsBroken, multi_turn_groups
from shared.failures import plain_failure
from shared.logs import PeerLogLimiter
from shared.messages import (
    GroupReason,
    Lease,
    LeaseReply,
    Reject,
    RejectCode,
    Submission,
    SubmitReply,
    SubmittedGroup,
    Tallies,
    TurnReply,
    TurnRequest,
    add_reasons,
    printable_excerpt,
    reasons_text,
)
from shared.rollout import SEED_LIMIT, Completion, SamplingParams

log = logging.getLogger("echo2.node.worker")

IDLE_RETRY_S = 0.5
# The node's log: one line per verdict (rejected, late) a minute at most, the next one counting the groups held back.
REFUSAL_LOG_WINDOW_S = 60.0
# The hub's words about a refused group, as the node keeps and shows them (the hub is a peer: its text is cut and
# cleaned first).
REFUSAL_TEXT_CHARS = 200
PROMPT_ID_CHARS = 40
LAST_REFUSALS = 5
# The most a lease may ask of this node, in rollouts x max_new_tokens: the answer is held until it is submitted
# (Python objects, ~100 bytes a token, so ~400 MB at most), and past this an answer at full length would not fit
# one submission (Submission.MAX_BYTES, at least 8 JSON bytes a token) anyway. A hub's default lease asks 16 Ki.
LEASE_MAX_TOKENS = 1 << 22
# An answer the hub did not take in is sent again, within its lease's validity and SUBMIT_TRIES times in all at most,
# the waits doubling from SUBMIT_RETRY_S up to SUBMIT_RETRY_MAX_S (tries over 95 s: a restarted hub's time to come back).
SUBMIT_TRIES = 10
SUBMIT_RETRY_S = 1.0
SUBMIT_RETRY_MAX_S = 16.0

Rewrite = Callable[[Lease, tuple[SubmittedGroup, ...]], Awaitable[tuple[SubmittedGroup, ...]]]


def lease_tokens(lease: Lease) -> int:
    """The most tokens answering `lease` generates: every completion at max_new_tokens."""
    return len(lease.prompts) * lease.group_size * lease.sampling.max_new_tokens


def prompt_slices(prompts: int, group_size: int, batch_rollouts: int) -> list[range]:
    """The prompts of a lease cut into consecutive slices of at most `batch_rollouts` rollouts (one prompt at least)."""
    step = max(1, batch_rollouts // group_size)
    return [range(start, min(start + step, prompts)) for start in range(0, prompts, step)]


def slice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """A seeded lease's sampling for its slice `index`: a seed of its own, or every slice would draw the first's
    random numbers again (an unseeded one samples fresh anyway)."""
    if sampling.seed is None or index == 0:
        return sampling
    return sampling.model_copy(update={"seed": (sampling.seed + index) % SEED_LIMIT})


@dataclass
class WorkStats:
    leases_done: int = 0
    # The hub's verdicts on this node's work as it replied (refused: whole submissions refused).
    tallies: Tallies = field(default_factory=Tallies)
    earned_usd: float = 0.0  # what the hub booked, as it replied
    paid_s: float = 0.0  # the lease seconds it booked them for, as it replied
    # Answers sent that got no reply (lost on the way, or cut off by a stop): the hub may have booked them.
    unanswered: int = 0
    rollouts: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    tokens_per_s: float = 0.0
    rollouts_per_s: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # refused groups by reason, as the hub replied
    # The pace the hub's last late verdict said would have come back in time (SubmitReply.needed_rollouts_per_s).
    needed_rollouts_per_s: float | None = None
    last_refusals: list[str] = field(default_factory=list)  # the hub's newest refusals, in its words (cleaned)


class Worker:
    """Lease -> generate -> sign -> submit, for as long as the hub has work for this node."""

    def __init__(
        self,
        client: HubClient,
        engine: Engine,
        engine_lock: trio.Lock,
        can_work: Callable[[], bool],
        version_held: Callable[[], int],
        max_rollouts_per_s: float | None,
        on_unknown: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        # Called when the hub says it does not know this node (restarted, or dropped it as silent): the hub
        # link beats at once to find out and rejoin, rather than at its next beat, which a large fleet's
        # hub may have set minutes away.
        self.on_unknown = on_unknown
        self.engine = engine
        self.engine_lock = engine_lock
        self.can_work = can_work
        self.version_held = version_held
        self.max_rollouts_per_s = max_rollouts_per_s
        self.stats = WorkStats()
        self.refusal_log = PeerLogLimiter(REFUSAL_LOG_WINDOW_S, trio.current_time)
        self.wake = trio.Event()

    async def run(self) -> None:
        # The hub's answer to the lease request the last submission carried: one round trip per lease.
        next_lease: LeaseReply | None = None
        while True:
            if not self.can_work() or self.version_held() < 0:
                next_lease = None  # a lease this node cannot work on now lapses; the hub re-leases it
                with trio.move_on_after(IDLE_RETRY_S):
                    await self.wake.wait()
                continue
            lease, next_lease = await self.next_lease(next_lease), None
            if isinstance(lease, str):
                continue
            answered = await self.work(lease)
            if isinstance(answered, SubmitReply):
                next_lease = answered.next_lease

    async def next_lease(self, carried: LeaseReply | None = None) -> Lease | str:
        """A lease from the hub (`carried`: its answer carried by the last submission, else one asked for now), or
        why there is none, once the wait the hub asked for has passed."""
        reply: LeaseReply | Reject | None = carried
        if reply is None:
            try:
                reply = await self.client.lease(self.version_held())
            except Exception as exc:  # noqa: BLE001 - hub unreachable: the hub link reconnects
                log.debug("lease request failed: %r", exc)
                await trio.sleep(IDLE_RETRY_S)
                return f"lease request failed: {exc!r}"
        reason = printable_excerpt(reply.reason, REFUSAL_TEXT_CHARS)
        if isinstance(reply, Reject):
            log.info("lease refused: %s", reason)
            if reply.code == RejectCode.UNKNOWN_NODE:
                self.on_unknown()
            await trio.sleep(IDLE_RETRY_S)
            return f"lease refused: {reason}"
        if reply.lease is None:
            await trio.sleep(max(reply.retry_after_s, 0.05))
            return f"no lease: {reason}"
        return reply.lease

    async def _generate_turns(self, lease: Lease) -> list[list[Completion]] | None:
        """A multi-turn lease's groups (node/turns.py), a slice of its prompts at a time, every turn of a slice with the
        engine held (one version); None when the hub's answers could not be followed (the lease lapses)."""
        assert lease.tools is not None, "a multi-turn lease"
        groups: list[list[Completion]] = []
        batch = self.engine.batch_rollouts or len(lease.prompts) * lease.group_size
        slices = prompt_slices(len(lease.prompts), lease.group_size, batch)
        deadline = trio.current_time() + lease.deadline_s

        async def send(request: TurnRequest) -> TurnReply | Reject:
            # Not past the lease: a hub that keeps answering could otherwise keep the engine re-reading contexts.
            left = deadline - trio.current_time()
            if left <= 0:
                raise TurnsBroken("its time ran out before the hub ended its rollouts")
            try:
                return await self.client.turns(request, timeout_s=left)
            except Exception as exc:  # noqa: BLE001 - libp2p's errors share no base class
                raise TurnsBroken(f"the hub {plain_failure(exc)}") from exc

        try:
            for index, part in enumerate(slices):
                prompts = [lease.prompts[i] for i in part]

                def sampling_of(turn: int, index: int = index) -> SamplingParams:
                    return slice_sampling(lease.sampling, turn * len(slices) + index)

                groups += await multi_turn_groups(lease, prompts, self.engine, send, sampling_of)
        except TurnsBroken as exc:  # the hub refused, could not be followed, or went away mid-lease (the engine's own
            # failures are not the hub's: they propagate, as a single-turn lease's do)
            log.warning("lease %s not answered: %s", printable_excerpt(lease.lease_id, 8), exc)
            return None
        return groups

    def _generate(self, lease: Lease) -> list[list[Completion]]:
        """The lease's groups, in prompt order, generated a slice at a time (blocking: runs in a worker thread)."""
        groups: list[list[Completion]] = []
        batch = self.engine.batch_rollouts or len(lease.prompts) * lease.group_size  # (a group is never split)
        for index, part in enumerate(prompt_slices(len(lease.prompts), lease.group_size, batch)):
            texts = [lease.prompts[i].text for i in part]
            groups += self.engine.generate(texts, lease.group_size, slice_sampling(lease.sampling, index))
        return groups

    async def _too_large(self, lease: Lease) -> bool:
        """Whether `lease` asks more than this node takes (LEASE_MAX_TOKENS): then it lapses, said in a line a
        minute at most, and the next lease is asked for a little later (a hub that sends only such leases is not
        hammered)."""
        tokens = lease_tokens(lease)
        if tokens <= LEASE_MAX_TOKENS:
            return False
        tail = self.refusal_log.tail("too_large")
        if tail is not None:
            log.warning(
                "lease %s asks %d prompts x %d completions x %d tokens, more than this node takes (%d tokens): not answered%s",
                printable_excerpt(lease.lease_id, PROMPT_ID_CHARS),
                len(lease.prompts),
                lease.group_size,
                lease.sampling.max_new_tokens,
                LEASE_MAX_TOKENS,
                tail,
            )
        await trio.sleep(IDLE_RETRY_S)
        return True

    async def work(self, lease: Lease, rewrite: Rewrite | None = None) -> SubmitReply | Reject | None:
        """Answer one lease; the hub's reply, or None when it was not answered (the hub re-leases its prompts).
        `rewrite`: the hostile peers of tests and benchmarks (testbed/fault_scenarios.py) submit what it makes of the
        groups generated; a node never passes it."""
        if self.version_held() < lease.min_version:
            # Work made with an older policy than the lease allows would be refused: let the lease lapse.
            log.warning(
                "lease %s needs v%d, this node holds v%d: not answered",
                printable_excerpt(lease.lease_id, 8),
                lease.min_version,
                self.version_held(),
            )
            return None
        if await self._too_large(lease):
            return None
        started = trio.current_time()
        async with self.engine_lock:
            if lease.tools is None:
                groups = await trio.to_thread.run_sync(self._generate, lease)
            elif (turned := await self._generate_turns(lease)) is not None:
                groups = turned
            else:
                return None
        rollouts = sum(len(g) for g in groups)
        if self.max_rollouts_per_s is not None:
            # Emulated slow hardware: the work takes as long as it would at the throttled rate.
            await trio.sleep(max(0.0, rollouts / self.max_rollouts_per_s - (trio.current_time() - started)))
        elapsed = trio.current_time() - started
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        answer = tuple(SubmittedGroup(prompt_id=p.prompt_id, completions=tuple(g)) for p, g in zip(lease.prompts, groups))
        if rewrite is not None:
            answer = await rewrite(lease, answer)
        submission = Submission(
            lease_id=lease.lease_id,
            node_id=self.client.peer_id,
            groups=answer,
            next_lease_for=self.version_held() if self.can_work() else None,
        )
        self.stats.unanswered += 1  # until the hub's reply comes: a stop may cut it off
        reply = await self._deliver(submission, started + lease.deadline_s)
        if reply is not None:
            self.stats.unanswered -= 1
        self.stats.leases_done += 1
        self.stats.rollouts += rollouts
        self.stats.tokens += tokens
        self.stats.busy_s += elapsed
        self.stats.tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0
        self.stats.rollouts_per_s = rollouts / elapsed if elapsed > 0 else 0.0
        if isinstance(reply, SubmitReply):
            self.stats.tallies = self.stats.tallies + Tallies(
                accepted=reply.accepted, rejected=len(reply.rejected), late=len(reply.late)
            )
            self.stats.earned_usd += reply.paid_usd
            self.stats.paid_s += reply.paid_s
            self._note_refusals(reply)
        elif isinstance(reply, Reject):
            if reply.code == RejectCode.UNKNOWN_NODE:
                self.on_unknown()
            self.stats.tallies = self.stats.tallies + Tallies(refused=1)
            reason = printable_excerpt(reply.reason, REFUSAL_TEXT_CHARS)
            self.stats.last_refusals = [f"submission refused: {reason}"]
            log.warning("submission refused: %s", reason)
        return reply

    async def _deliver(self, submission: Submission, deadline: float) -> SubmitReply | Reject | None:
        """The hub's reply to `submission`, or None when it did not take it in. An answer the hub did not get (it went
        away mid-answer) or turned away as from a stranger (it restarted, and the link rejoins it) is sent again,
        SUBMIT_TRIES times at most and while its lease holds (`deadline`, trio.current_time): a restarted hub takes
        the answers to the leases it granted, and one it took before it went away gets the reply it got then (paid
        once). A retry refused for its lease (it lapsed at the hub) is None too: that says nothing of the work."""
        lease_id = printable_excerpt(submission.lease_id, 8)
        wait = SUBMIT_RETRY_S
        for attempt in range(SUBMIT_TRIES):
            try:
                reply = await self.client.submit(submission, deadline=deadline)
            except Exception as exc:  # noqa: BLE001 - hub gone or restarting mid-answer: tried again below
                log.debug("submission for lease %s not delivered: %r", lease_id, exc)
                failure = f"the hub {plain_failure(exc)}"
            else:
                if attempt and isinstance(reply, Reject) and reply.code == RejectCode.BAD_LEASE:
                    log.warning(
                        "the answer to lease %s, sent again, was refused: the hub no longer holds that lease (it lapsed "
                        "there, or the hub's restart could not take it back)",
                        lease_id,
                    )
                    return None
                if not (isinstance(reply, Reject) and reply.code == RejectCode.UNKNOWN_NODE):
                    return reply
                self.on_unknown()
                failure = "the hub does not know this node (it restarted): joining it again"
            if attempt + 1 == SUBMIT_TRIES or trio.current_time() + wait >= deadline:
                break
            log.info("the answer to lease %s was not delivered: %s; next try in %.0fs", lease_id, failure, wait)
            await trio.sleep(wait)
            wait = min(2 * wait, SUBMIT_RETRY_MAX_S)
        log.warning("the answer to lease %s was not delivered: %s; the hub leases its prompts again", lease_id, failure)
        return None

    def _note_refusals(self, reply: SubmitReply) -> None:
        """The groups a reply refused: counted by reason, kept in the hub's words (cleaned and cut: a hostile hub's
        text must not reach a terminal as it is) and logged, one line per verdict a minute at most."""
        refused = reply.rejected + reply.late
        if not refused:
            return
        # A reply counts no more groups than it refused, whatever it claims.
        claimed = {key: min(n, len(refused)) for key, n in reply.reasons.items()}
        self.stats.reasons = add_reasons(self.stats.reasons, claimed)
        if reply.needed_rollouts_per_s is not None:
            self.stats.needed_rollouts_per_s = reply.needed_rollouts_per_s
        words = [
            f"{printable_excerpt(pid, PROMPT_ID_CHARS)}: {printable_excerpt(why, REFUSAL_TEXT_CHARS)}"
            for pid, why in refused[-LAST_REFUSALS:]
        ]
        self.stats.last_refusals = (self.stats.last_refusals + words)[-LAST_REFUSALS:]
        late = GroupReason.LATE.value
        for verdict, groups in (("rejected", reply.rejected), ("late", reply.late)):
            tail = self.refusal_log.tail(verdict, len(groups)) if groups else None
            if tail is None:
                continue
            why = reasons_text({k: n for k, n in reply.reasons.items() if (k == late) == (verdict == "late")})
            pace = reply.needed_rollouts_per_s if verdict == "late" else None
            # Both on the volunteer's terminal: late work is unpaid too, however honest.
            log.warning(
                "hub: %d group%s %s (%s): %s%s%s",
                len(groups),
                "" if len(groups) == 1 else "s",
                verdict,
                why,
                printable_excerpt(groups[0][1], REFUSAL_TEXT_CHARS),
                f"; in time it needed {pace:.3g} rollouts/s, this node ran {self.stats.rollouts_per_s:.3g}" if pace else "",
                tail,
            )
