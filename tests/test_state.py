"""HubState against a real SQLite file and the real tokenizer, in process: every command commits before the
view moves, a reopened state shows exactly what the old one showed, audit verdicts vouch for and void
pay across a restart, and our own failures are never counted against a peer."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio

from hub.config import HubConfig, LearnerConfig, LeaseConfig, TrustConfig
from hub.control.policy import fleet_view
from hub.method.prices import billable_seconds
from hub.records.fleet import DEPARTED_KEPT_S, IDLE_DEPARTED_KEPT_S, NodeRecord
from hub.records.schema import StepRecord
from hub.records.snapshots import SnapshotShelf
from hub.service.leasing import HANDLER_TIMEOUT_S
from hub.service.state import RETAIN_PERIOD_S, HubState
from hub.service.status import STATUS_DEPARTED_MAX, RunInfo, StatusBoard
from hub.trust.audit import AuditJob, AuditResult
from shared.crypto import Identity
from shared.messages import LEFT_REASON, Heartbeat, JoinRequest, RejectCode, Submission, SubmittedGroup, Tallies
from shared.model_io import build_snapshot
from shared.rollout import Completion, Group, SamplingParams
from shared.wire import PeerFault
from testbed.inproc import PERMISSIVE_TRUST, LearnerAt, open_state

CONFIG = HubConfig(
    learner=LearnerConfig(staleness=2, prompts_per_step=2, group_size=2),
    sampling=SamplingParams(max_new_tokens=16),  # longer than any prompt word + one letter + EOS
    lease=LeaseConfig(prompts_per_lease=2),
    trust=PERMISSIVE_TRUST,
)


class ScriptedAudits:
    """Stands in for AuditQueue: judges each job by a script (the real auditor is tested in test_audit.py)."""

    def __init__(self) -> None:
        self.passes = True
        self.judged: list[AuditJob] = []

    def offer(self, job: AuditJob) -> bool:
        raise AssertionError("these tests sample no audits: audit_rate is 0")

    async def next_job(self) -> AuditJob:
        await trio.sleep_forever()

    async def judge(self, job: AuditJob) -> AuditResult:
        self.judged.append(job)
        return AuditResult(self.passes, 0.0 if self.passes else 0.5, 0.0, 4, reason="" if self.passes else "gap 0.5")


def join_request(state: HubState, price: float = 0.5) -> JoinRequest:
    return JoinRequest(
        price_per_hour=price,
        hardware="t",
        link_bps=1e8,
        backend="hf",
        dtype="float32",
        model_config_hash=state.model_config_hash,
        version_held=0,
    )


def answer(tokenizer, lease, node_id: str, right: bool = True) -> Submission:
    groups = []
    for p in lease.prompts:
        word = p.text[:-1]
        texts = (word[::-1], word) if right else (word + "q", word + "z")
        completions = []
        for text in texts:
            ids = (*tokenizer.encode(text), tokenizer.eos_token_id)
            completions.append(Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=0, text=text))
        groups.append(SubmittedGroup(prompt_id=p.id, completions=tuple(completions)))
    return Submission(lease_id=lease.lease_id, node_id=node_id, groups=tuple(groups))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@asynccontextmanager
async def running(state: HubState, ends_with: type[Exception] | None = None) -> AsyncIterator[None]:
    """The state's own tasks (lease sweeps, audits of held groups) running around the block. `ends_with`: the error
    the state's loop is to end the run with (a reward that failed); the block runs to its end whatever the loop does
    meanwhile (the loop checks every second, so it may stop the run mid-block), then the loop must end so."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.run)
            while state.intake._nursery is None:
                await trio.sleep(0)
            if ends_with is None:
                yield
                nursery.cancel_scope.cancel()
            else:
                with trio.CancelScope(shield=True):
                    yield
                with trio.fail_after(10):
                    await trio.sleep_forever()
    except BaseExceptionGroup as group:  # the loop not ending so fails the wait above: TooSlowError is the rest
        if ends_with is None or group.split(ends_with)[1] is not None:
            raise


async def settled(state: HubState) -> None:
    """Every committed group is in the buffer or discarded (audits of held groups included)."""
    with trio.fail_after(10):
        while state.intake.room.reserved:
            await trio.sleep(0.01)


def reopen(data_dir: Path, model_dir: Path, config: HubConfig = CONFIG) -> HubState:
    """A state over DATA_DIR's store whose hub published v0 (so work at v0 is in the window)."""
    shelf = SnapshotShelf(keep=3)
    shelf.add(build_snapshot({"w": torch.zeros(4)}, 0, Identity.generate(), "0" * 64, data_dir / "snapshots"))
    return open_state(data_dir, model_dir, config, shelf, LearnerAt(config.learner.staleness))


def view(state: HubState) -> dict:
    return {
        "nodes": {
            p: (
                n.state if n.state == "banned" else "gone",
                n.tallies,
                n.audits_passed,
                n.vouched_at,
                round(n.rollouts_per_s, 9),
                n.measured,
                round(n.online_s, 6),
            )
            for p, n in state.fleet.nodes.items()
        },
        "totals": (state.totals.groups, state.totals.dropped_stale, state.totals.paid_usd),
    }


@pytest.mark.trio
async def test_a_reopened_state_shows_what_the_old_one_showed(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir)
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    for peer in (a, b):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
    # a: a probe, then full leases; b: one wrong answer and a refused request, then it leaves.
    grant = await state.leasing.grant(a, 0)
    await state.intake.accept(a, answer(tokenizer, grant.lease, a), "h1")
    await state.set_state(state.fleet.get(a), "active", "test")
    grant = await state.leasing.grant(a, 0)
    outcome = await state.intake.accept(a, answer(tokenizer, grant.lease, a), "h2")
    assert outcome.accepted == 2 and outcome.paid_usd > 0
    grant = await state.leasing.grant(b, 0)
    await state.intake.accept(b, answer(tokenizer, grant.lease, b, right=False), "h3")  # zero variance: accepted
    await state.membership.record_refusal(b, RejectCode.BAD_REQUEST)
    await state.membership.record_refusal(b, RejectCode.UNKNOWN_NODE)  # not its fault: not counted
    state.membership.heartbeat(b, Heartbeat(version_held=0), 0)
    await state.set_state(state.fleet.get(b), "gone", "no heartbeat")
    # The learner trains on two groups and drops one as stale.
    ids = state.buffer.row_ids()
    await state.commit_step(StepRecord(1, 1, 0.5, 0.5, 0.0, 0, 1, 0.1, 0.0, 0.0, 10, 0.0), ids[:2], ids[2:3])
    flushed_at = state.clock()  # the flush records the learner's time up to a moment after this one
    await state.flush()
    assert state.totals.groups == Tallies(accepted=4, refused=1) and state.totals.dropped_stale == 1
    assert state.fleet.get(b).tallies == Tallies(accepted=1, refused=1)
    before, cost = view(state), state.cost_usd(flushed_at)
    state.store.close()

    again = reopen(tmp_path, default_model_dir)
    assert view(again) == before
    assert again.cost_usd(again.clock()) >= cost  # learner time keeps counting from where it was
    # The nodes rejoin with what the hub measured: no second probe.
    record = await again.membership.join(a, join_request(again, price=0.7), "10.0.0.1")
    assert record.state == "standby" and record.tallies == Tallies(accepted=3) and record.price_per_hour == 0.7
    again.store.close()


def set_clock(state: HubState, clock) -> None:
    """The state and its three owners on a clock the test moves."""
    state.clock = state.membership.clock = state.leasing.clock = state.intake.clock = clock


@pytest.mark.trio
async def test_failed_audit_after_reopen_voids_only_pay_since_the_last_pass(tmp_path, default_model_dir, tokenizer):
    config = CONFIG.model_copy(update={"trust": TrustConfig(audit_first_n=10, audit_rate=0.0)})
    clock = [1000.0]
    audits = ScriptedAudits()

    def state_at() -> HubState:
        state = reopen(tmp_path, default_model_dir, config)
        state.intake.probation.audits = audits
        set_clock(state, lambda: clock[0])
        return state

    state = state_at()
    peer = Identity.generate().peer_id
    async with running(state):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        for _ in range(3):  # on probation: each submission is audited before its groups are buffered
            grant = await state.leasing.grant(peer, 0)
            clock[0] += 10.0
            await state.intake.accept(peer, answer(tokenizer, grant.lease, peer), "h")
            await settled(state)
            await state.set_state(state.fleet.get(peer), "active", "test")
    assert len(audits.judged) == 3 and state.fleet.get(peer).vouched_at == clock[0]
    assert state.totals.audits == {"passed": 3, "failed": 0, "unverified": 0}
    paid = state.totals.paid_usd[peer]
    state.store.close()

    state = state_at()
    assert state.fleet.get(peer).vouched_at == clock[0]
    async with running(state):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        await state.set_state(state.fleet.get(peer), "active", "test")
        audits.passes = False
        grant = await state.leasing.grant(peer, 0)
        clock[0] += 10.0
        outcome = await state.intake.accept(peer, answer(tokenizer, grant.lease, peer), "h")
        assert outcome.paid_usd > 0  # booked with the answer, voided by the audit that follows
        await settled(state)
    record = state.fleet.get(peer)
    assert record.state == "banned" and "gap 0.5" in record.banned_reason
    assert state.totals.audits == {"passed": 0, "failed": 1, "unverified": 0}  # this session's
    assert state.totals.paid_usd[peer] == pytest.approx(paid) == state.store.groups.ledger_total_usd(peer)
    assert len(state.buffer) == 0  # the cheat's groups never reached the buffer
    with pytest.raises(PeerFault) as refused:
        await state.membership.join(peer, join_request(state), "10.0.0.1")
    assert refused.value.code == RejectCode.BANNED
    state.store.close()


@pytest.mark.trio
async def test_peer_faults_carry_codes_and_our_own_errors_propagate(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir)
    stranger = Identity.generate().peer_id
    with pytest.raises(PeerFault) as fault:
        await state.leasing.grant(stranger, 0)
    assert fault.value.code == RejectCode.UNKNOWN_NODE
    bad = join_request(state).model_copy(update={"model_config_hash": "0" * 64})
    with pytest.raises(PeerFault) as fault:
        await state.membership.join(stranger, bad, None)
    assert fault.value.code == RejectCode.MODEL_MISMATCH
    # An engine in another dtype than the snapshots (a CPU hub publishes float32): refused with the flag to pass.
    other_dtype = join_request(state).model_copy(update={"dtype": "bfloat16"})
    with pytest.raises(PeerFault, match="restart the node with --dtype float32") as fault:
        await state.membership.join(stranger, other_dtype, None)
    assert fault.value.code == RejectCode.MODEL_MISMATCH and state.fleet.get(stranger) is None
    peer = Identity.generate().peer_id
    await state.membership.join(peer, join_request(state), None)
    grant = await state.leasing.grant(peer, 0)
    with pytest.raises(PeerFault) as fault:
        await state.intake.accept(peer, answer(tokenizer, grant.lease, peer).model_copy(update={"lease_id": "x" * 24}), "h")
    assert fault.value.code == RejectCode.BAD_LEASE
    # A store that fails under us is our bug: it raises as itself, and the lease stays answerable.
    state.store.close()
    with pytest.raises(Exception) as ours:
        await state.intake.accept(peer, answer(tokenizer, grant.lease, peer), "h")
    assert not isinstance(ours.value, PeerFault)
    assert grant.lease.lease_id in state.leasing.book.open and not grant.lease.checking
    assert state.fleet.get(peer).tallies == Tallies()


def test_audit_draws_come_from_the_os_csprng(tmp_path, default_model_dir):
    """Two hubs started with the same seed must not draw the same audits: a node could replay them."""
    draws = []
    for i in range(2):
        state = reopen(tmp_path / str(i), default_model_dir)
        # The OS's generator: not seedable, so nothing a node learns of the run's seed predicts an audit.
        assert isinstance(state.intake.probation.rng, secrets.SystemRandom)
        draws.append([state.intake.probation.rng.random() for _ in range(8)])
        state.store.close()
    assert draws[0] != draws[1]


@pytest.mark.trio
async def test_on_probation_every_group_is_audited_before_any_reaches_the_buffer(tmp_path, default_model_dir, tokenizer):
    config = CONFIG.model_copy(
        update={"trust": TrustConfig(audit_first_n=10, audit_rate=0.0, trusted_after_audits=0, lease_new_node_prompts=2)}
    )
    state = reopen(tmp_path, default_model_dir, config)
    audits = ScriptedAudits()
    state.intake.probation.audits = audits
    peer = Identity.generate().peer_id
    async with running(state):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        grant = await state.leasing.grant(peer, 0)  # the probe
        await state.intake.accept(peer, answer(tokenizer, grant.lease, peer), "h")
        await settled(state)
        await state.set_state(state.fleet.get(peer), "active", "test")
        grant = await state.leasing.grant(peer, 0)
        assert len(grant.lease.prompts) == 2
        # One honest group and one fabricated one: the fabricated one is not the first audited.
        fabricated = grant.lease.prompts[1].id
        audits.judge = lambda job: _scripted(job, fabricated)  # type: ignore[method-assign]
        outcome = await state.intake.accept(peer, answer(tokenizer, grant.lease, peer), "h")
        assert len(state.buffer) == 1  # held for its audit: only the probe's group is in the buffer
        await settled(state)
    assert outcome.accepted == 2  # acknowledged and booked before the audit's verdict...
    assert state.fleet.get(peer).state == "banned"  # ...which then bans the node
    assert len(state.buffer) == 0  # neither group of the lie, and the probe's group dropped with the ban
    rows = {r.prompt_id: r.discard_reason for r in state.store.groups.trajectories() if r.lease_id == grant.lease.lease_id}
    assert set(rows.values()) == {"banned: audit failed"}
    state.store.close()


async def _scripted(job: AuditJob, fabricated: str) -> AuditResult:
    bad = job.group.prompt_id == fabricated
    return AuditResult(not bad, 0.5 if bad else 0.0, 0.0, 4, reason="gap 0.5" if bad else "")


@pytest.mark.trio
async def test_pay_follows_the_price_at_lease_time_and_the_work_done(tmp_path, default_model_dir, tokenizer):
    clock = [1000.0]
    state = reopen(tmp_path, default_model_dir)
    set_clock(state, lambda: clock[0])
    peer = Identity.generate().peer_id
    await state.membership.join(peer, join_request(state, price=1.0), "10.0.0.1")
    grant = await state.leasing.grant(peer, 0)
    # Holding the lease for 50 s and answering with a handful of tokens is paid for the tokens, not the hold.
    clock[0] += 50.0
    submission = answer(tokenizer, grant.lease, peer)
    tokens = sum(len(c.token_ids) for g in submission.groups for c in g.completions)
    # Rejoining at a higher price does not reprice the lease already issued.
    await state.membership.join(peer, join_request(state, price=9.0), "10.0.0.1")
    outcome = await state.intake.accept(peer, submission, "h")
    floor = CONFIG.lease.paid_tokens_per_s_floor
    assert outcome.paid_usd == pytest.approx(1.0 * tokens / floor / 3600.0)
    assert outcome.paid_usd < 1.0 * 50.0 / 3600.0 / 100
    # Above the hub's ceiling, a node is refused before it is probed (or paid for a probe).
    too_dear = join_request(state, price=CONFIG.scheduler.max_price_per_hour + 1)
    with pytest.raises(PeerFault) as refused:
        await state.membership.join(Identity.generate().peer_id, too_dear, "10.0.0.2")
    assert refused.value.code == RejectCode.PRICE_TOO_HIGH
    state.store.close()


def test_billable_seconds_by_hand():
    # 10 s held, 3 of 4 prompts accepted, 600 tokens at a 100 tokens/s floor: min(7.5, 6.0).
    assert billable_seconds(10.0, 3, 4, 600, 100.0) == 6.0
    assert billable_seconds(10.0, 3, 4, 6000, 100.0) == 7.5
    assert billable_seconds(10.0, 0, 4, 0, 100.0) == 0.0
    with pytest.raises(ValueError):
        billable_seconds(10.0, 5, 4, 10, 100.0)


@pytest.mark.trio
async def test_the_address_quota_counts_the_leases_open_at_an_address_and_frees_them_as_they_close(
    tmp_path, default_model_dir, tokenizer
):
    trust = PERMISSIVE_TRUST.model_copy(update={"max_open_leases_per_ip": 2})
    state = reopen(tmp_path, default_model_dir, CONFIG.model_copy(update={"trust": trust}))
    peers = [Identity.generate().peer_id for _ in range(4)]
    for peer in peers[:3]:
        await state.membership.join(peer, join_request(state), "198.51.100.7")
    await state.membership.join(peers[3], join_request(state), "203.0.113.9")
    async with running(state):
        first, second = [(await state.leasing.grant(p, 0)).lease for p in peers[:2]]
        refused = await state.leasing.grant(peers[2], 0)
        assert refused.lease is None and refused.reason == "2 leases open for address 198.51.100.7 (max 2)"
        assert (await state.leasing.grant(peers[3], 0)).lease is not None  # another address has its own quota
        await state.intake.accept(peers[0], answer(tokenizer, first, peers[0]), "h")
        assert (await state.leasing.grant(peers[2], 0)).lease is not None  # the answered lease freed its slot
        state.leasing.exempt(peers[:3])  # the operator's own nodes neither use nor count against it
        assert state.leasing.book.open_by_address["198.51.100.7"] == 2
        assert (await state.leasing.grant(peers[0], 0)).lease is not None
        assert state.leasing.book.open_by_address["198.51.100.7"] == 2 and state.leasing.book.open_count(peers[0]) == 1
        assert second.lease_id in state.leasing.book.open


def test_the_test_bed_builds_its_hub_as_echo_hub_start_does(tmp_path, default_model_dir):
    """testbed.inproc builds through hub.cli.build: stop ids are every EOS the model declares (not the tokenizer's
    alone), and the run's identity is recorded as a resume checks it."""
    from shared.model_identity import load_model_identity

    state = reopen(tmp_path, default_model_dir)
    assert state.intake.rules.stop_ids == load_model_identity(default_model_dir).stop_ids
    assert state.store.run_info()["task"] == "reverse"
    state.store.close()


@pytest.mark.trio
async def test_a_node_that_leaves_gives_its_leases_back_at_once_and_stays_answerable(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir)
    a, b, stranger = (Identity.generate().peer_id for _ in range(3))
    for peer in (a, b):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
    first = await state.leasing.grant(a, 0)
    await state.intake.accept(a, answer(tokenizer, first.lease, a), "h1")
    await state.set_state(state.fleet.get(a), "active", "test")
    paid = state.totals.paid_usd[a]
    held = await state.leasing.grant(a, 0)
    assert [r.lease_id for r in state.leasing.book.leases_of(a)] == [held.lease.lease_id]

    relinked = []  # what hub/cli/run.py listens with: the broadcaster relinks the chains, the scheduler decides
    state.membership.on_change.append(lambda: relinked.append(True))
    assert await state.membership.leave(a) == 1 and relinked
    # out of the active pool with its leases back, but still a member until its silence drops it: a relay's
    # chunks are still judged against it, and a ban still reaches it
    assert state.fleet.get(a).state == "standby" and state.leasing.book.leases_of(a) == []
    assert state.fleet.get(b).state == "probing"  # only the peer that asked
    assert state.totals.paid_usd[a] == paid  # its accepted work stands
    events = state.store.db.execute("SELECT kind, node_id, detail FROM events WHERE detail = ?", (LEFT_REASON,)).fetchall()
    assert events == [("release", a, LEFT_REASON)]
    relinked.clear()
    assert await state.membership.leave(a) == 0  # said twice: nothing more to give back
    assert not relinked  # nor a replan of the chains for each time it is said
    await state.set_state(state.fleet.get(a), "active", "the scheduler decided before the leave came")
    assert state.fleet.get(a).state == "standby"
    # never activated again, nor a receiver or relay (hub/distribution/broadcast.py), unless it joins again
    assert state.fleet.get(a).left_at is not None
    assert a not in {o.name for o in fleet_view(state.fleet).standby}
    await state.membership.join(a, join_request(state), "10.0.0.1")
    assert state.fleet.get(a).left_at is None and a in {o.name for o in fleet_view(state.fleet).standby}
    assert await state.membership.leave(a) == 0 and state.fleet.get(a).left_at is not None
    await state.membership.ban(state.fleet.get(a), "a corrupt chunk it relayed before it left")
    assert state.fleet.get(a).state == "banned"
    # a probing node that left is given no more probes
    assert (await state.leasing.grant(b, 0)).lease is not None
    assert await state.membership.leave(b) == 1
    refused = await state.leasing.grant(b, 0)
    assert refused.lease is None and refused.reason.startswith("left")
    # banned, gone or never joined: refused as any members-only request
    await state.set_state(state.fleet.get(b), "gone", "no heartbeat")
    for peer, code in ((a, RejectCode.BANNED), (b, RejectCode.UNKNOWN_NODE), (stranger, RejectCode.UNKNOWN_NODE)):
        with pytest.raises(PeerFault) as refused:
            await state.membership.leave(peer)
        assert refused.value.code is code
    state.store.close()


def ledger_of(state: HubState, lease_id: str) -> list[tuple]:
    return state.store.db.execute("SELECT usd, seconds, voided FROM ledger WHERE lease_id = ?", (lease_id,)).fetchall()


@pytest.mark.trio
async def test_an_answer_sent_again_gets_the_reply_it_got_once_paid_here_and_after_a_restart(
    tmp_path, default_model_dir, tokenizer
):
    """Issue 67 item 1: an answer the hub committed whose reply never reached its node (the hub killed between the two,
    or the link dropped) is sent again. The same signed bytes get the reply the commit stored, paid seconds included,
    from this hub and from one restarted on its store, until the lease's deadline: nothing is counted, booked or paid
    again, and it is no peer fault. Other bytes are a second answer to the lease, refused; one sent while the first is
    being checked is told to send it again (busy), not refused."""
    from hub.service.intake import HubBusy

    clock = [time.time()]
    state = reopen(tmp_path, default_model_dir)
    set_clock(state, lambda: clock[0])
    rules = state.intake.rules
    peer = Identity.generate().peer_id
    await state.membership.join(peer, join_request(state), "10.0.0.1")
    lease = (await state.leasing.grant(peer, 0)).lease
    submission = answer(tokenizer, lease, peer)
    claimed = state.leasing.claim(lease.lease_id, peer, clock[0])  # another copy being checked and committed
    with pytest.raises(HubBusy, match="being checked: send it again"):
        await state.intake.accept(peer, submission, "signed")
    state.leasing.release(claimed)
    clock[0] += 7.0
    first = await state.intake.accept(peer, submission, "signed")
    assert first.accepted == len(lease.prompts) and first.paid_s > 0 and first.paid_usd > 0
    (booked,) = ledger_of(state, lease.lease_id)
    assert booked[1] == pytest.approx(first.paid_s) and state.leasing.book.leases_of(peer) == []
    books = view(state)
    assert state.leasing.submission_cap(peer, rules) > 0  # room to read the same answer again
    assert await state.intake.accept(peer, submission, "signed") == first
    assert view(state) == books and ledger_of(state, lease.lease_id) == [booked]
    with pytest.raises(PeerFault, match="already answered by another submission") as second:
        await state.intake.accept(peer, answer(tokenizer, lease, peer, right=False), "other bytes")
    assert second.value.code == RejectCode.BAD_LEASE
    state.store.close()

    restarted = reopen(tmp_path, default_model_dir)  # as after a SIGKILL between the commit and the reply
    set_clock(restarted, lambda: clock[0])
    await restarted.membership.join(peer, join_request(restarted), "10.0.0.1")
    books = view(restarted)
    assert restarted.leasing.book.leases_of(peer) == [] and restarted.leasing.submission_cap(peer, rules) > 0
    assert await restarted.intake.accept(peer, submission, "signed") == first
    assert view(restarted) == books and ledger_of(restarted, lease.lease_id) == [booked]
    # Past the lease's deadline the hub lets it go: the node stops sending it by then.
    clock[0] = lease.deadline + 1.0
    await restarted.leasing.sweep()
    assert restarted.leasing.submission_cap(peer, rules) == 0
    with pytest.raises(PeerFault) as lapsed:
        await restarted.intake.accept(peer, submission, "signed")
    assert lapsed.value.code == RejectCode.BAD_LEASE and ledger_of(restarted, lease.lease_id) == [booked]
    restarted.store.close()


@pytest.mark.trio
async def test_the_price_change_clock_holds_across_leave_rejoin_and_restart(tmp_path, default_model_dir):
    """Issue 54 item 5: one price change per price_change_interval_s, whether by a re-price or by a re-join at another
    price, however the identity leaves, re-joins, or the hub restarts meanwhile (the clock lives with its row)."""
    interval = CONFIG.scheduler.price_change_interval_s
    clock = [time.time()]
    state = reopen(tmp_path, default_model_dir)
    set_clock(state, lambda: clock[0])
    peer = Identity.generate().peer_id
    await state.membership.join(peer, join_request(state, price=1.0), "10.0.0.1")
    clock[0] += 10.0
    await state.membership.reprice(peer, 1.5)  # its one change
    for _ in range(3):  # leave and re-join at another price: a change too soon
        await state.membership.leave(peer)
        clock[0] += 1.0
        with pytest.raises(PeerFault, match="a re-join at another price is a price change") as refused:
            await state.membership.join(peer, join_request(state, price=2.0), "10.0.0.1")
        assert refused.value.code == RejectCode.BAD_REQUEST
        await state.membership.join(peer, join_request(state, price=1.5), "10.0.0.1")  # at its price: welcome
        with pytest.raises(PeerFault, match="one price change per"):
            await state.membership.reprice(peer, 2.0)
    assert state.fleet.get(peer).price_per_hour == 1.5
    changed_at = state.fleet.get(peer).price_changed_at
    state.store.close()

    again = reopen(tmp_path, default_model_dir)
    set_clock(again, lambda: clock[0])
    with pytest.raises(PeerFault, match="a re-join at another price is a price change"):
        await again.membership.join(peer, join_request(again, price=2.0), "10.0.0.1")
    await again.membership.join(peer, join_request(again, price=1.5), "10.0.0.1")
    with pytest.raises(PeerFault, match="one price change per"):
        await again.membership.reprice(peer, 2.0)
    clock[0] = changed_at + interval
    await again.membership.leave(peer)
    assert (await again.membership.join(peer, join_request(again, price=2.0), "10.0.0.1")).price_per_hour == 2.0
    assert again.store.members.node(peer).price_changed_at == clock[0]
    again.store.close()


@pytest.mark.trio
async def test_records_of_departed_nodes_leave_memory_and_come_back_whole_on_a_rejoin(tmp_path, default_model_dir):
    """Issue 54 item 5: a fleet record per identity ever seen grew the hub for good. Gone for DEPARTED_KEPT_S, a node's
    record leaves memory (at the next retention); its row keeps what the hub measured and its clocks, and the all-on cost
    keeps its share."""
    clock = [time.time()]
    state = reopen(tmp_path, default_model_dir)
    set_clock(state, lambda: clock[0])
    peers = [Identity.generate().peer_id for _ in range(20)]
    for peer in peers:
        await state.membership.join(peer, join_request(state, price=1.0), "10.0.0.1")
    keeper = peers[0]
    clock[0] += 5.0
    for peer in peers:
        state.membership.heartbeat(peer, Heartbeat(version_held=0), 0)  # online 5 s
    await state.membership.reprice(keeper, 2.0)
    for peer in peers:  # something to remember (not `forgettable`): a recall brings it back from the row
        await state.membership.record_refusal(peer, RejectCode.BAD_REQUEST)
    for peer in peers:
        await state.set_state(state.fleet.get(peer), "gone", "no heartbeat")
    await state.flush()

    def nodes_all_on() -> float:
        """The nodes' share of the all-on cost (nobody was paid: cost_usd is the learner's alone)."""
        return state.all_on_cost_usd(clock[0]) - state.cost_usd(clock[0])

    all_on = nodes_all_on()
    assert all_on == pytest.approx(len(peers) * 1.0 * 5.0 / 3600.0 + (2.0 - 1.0) * 5.0 / 3600.0)
    changed_at = state.fleet.get(keeper).price_changed_at
    clock[0] += DEPARTED_KEPT_S - 1.0
    await state.flush()
    assert len(state.fleet.nodes) == len(peers)  # listed for as long as the status board lists them
    clock[0] += RETAIN_PERIOD_S
    await state.flush()
    assert state.fleet.nodes == {} and state.membership.departed_count == len(peers)
    assert nodes_all_on() == pytest.approx(all_on)
    with pytest.raises(PeerFault) as unknown:
        state.membership.heartbeat(keeper, Heartbeat(version_held=0), 0)
    assert unknown.value.code == RejectCode.UNKNOWN_NODE
    record = await state.membership.join(keeper, join_request(state, price=2.0), "10.0.0.1")
    assert (record.online_s, record.price_changed_at, record.tallies.refused) == (5.0, changed_at, 1)
    assert [p for _, p in record.price_history] == [1.0, 2.0]
    assert nodes_all_on() == pytest.approx(all_on)  # its share counted once, in the fleet again
    assert state.membership.departed_count == len(peers) - 1
    state.store.close()


@pytest.mark.trio
async def test_a_flood_of_throwaway_identities_costs_the_hub_the_same_after_it_as_before(tmp_path, default_model_dir, tokenizer):
    """Issue 65: each identity that joined and left (or fell silent) without doing any work kept its rows in the store for
    good (765 B) and its record in memory for an hour. Now such a record leaves memory IDLE_DEPARTED_KEPT_S after it was
    last seen and its rows leave the store at the next retention: after the flood the hub holds what it held before.
    An identity that worked is remembered as before, and a ban survives."""
    clock = [time.time()]
    state = reopen(tmp_path, default_model_dir)
    set_clock(state, lambda: clock[0])
    worker, banned = (Identity.generate().peer_id for _ in range(2))
    for peer in (worker, banned):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
    first = await state.leasing.grant(worker, 0)
    await state.intake.accept(worker, answer(tokenizer, first.lease, worker), "h1")
    await state.membership.reprice(worker, 0.75)  # its price clock runs from now
    changed_at = clock[0]
    await state.membership.ban(state.fleet.get(banned), "a corrupt chunk")
    await state.set_state(state.fleet.get(worker), "gone", "no heartbeat")
    await state.flush()

    def held() -> tuple:
        """The store's rows of every identity, and the records in memory."""
        db = state.store.db
        rows = tuple(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("nodes", "prices", "leases"))
        return rows, sorted(state.fleet.nodes)

    before = held()
    flood = [Identity.generate().peer_id for _ in range(200)]
    for i, peer in enumerate(flood):
        await state.membership.join(peer, join_request(state, price=0.1 + i / 1000), f"10.0.{i // 8}.1")
        if i % 4 == 0:
            await state.leasing.grant(peer, 0)  # a probe lease it never answers
        if i % 2 == 0:
            await state.membership.leave(peer)
    assert held() != before
    clock[0] += 5.0
    for peer in flood:  # said it leaves or fell silent: what the scheduler does after heartbeat_timeout_s
        await state.set_state(state.fleet.get(peer), "gone", "no heartbeat")
    # past the probes' deadline and the store's handler deadline after it, and past IDLE_DEPARTED_KEPT_S
    clock[0] += max(CONFIG.lease.lease_timeout_s + HANDLER_TIMEOUT_S, IDLE_DEPARTED_KEPT_S) + 1.0
    await state.leasing.sweep()
    await state.flush()
    assert held() == before
    assert state.membership.departed_count == len(flood)  # the status still says how many left

    # the worker is still in memory, and remembered when the fleet lets it go: its work, its price clock
    assert state.fleet.get(worker).tallies.accepted == 1  # its probe, answered
    clock[0] += DEPARTED_KEPT_S
    await state.flush()
    assert state.fleet.nodes == {}
    record = await state.membership.join(worker, join_request(state, price=0.75), "10.0.0.1")
    assert record.tallies.accepted == 1 and record.measured and record.price_changed_at == changed_at
    with pytest.raises(PeerFault) as refused:
        await state.membership.join(banned, join_request(state), "10.0.0.1")
    assert refused.value.code == RejectCode.BANNED
    state.store.close()

    again = reopen(tmp_path, default_model_dir)  # a restart counts the flood among the nodes that left, too
    set_clock(again, lambda: clock[0])
    assert again.membership.departed_count == len(flood)
    with pytest.raises(PeerFault) as refused:
        await again.membership.join(banned, join_request(again), "10.0.0.1")
    assert refused.value.code == RejectCode.BANNED
    again.store.close()


@pytest.mark.trio
async def test_a_status_reads_the_live_records_and_the_departed_it_lists_never_the_rest(tmp_path, default_model_dir):
    """Issue 65: after a flood an idle hub spent 0.12 cores on statuses, each a walk of 799 departed records (1.4 cores
    projected at 10,000). A status now reads the live records and the last STATUS_DEPARTED_MAX to leave: counted in
    records read, a status after the first reads no more of 2,000 departed than it lists."""
    state = reopen(tmp_path, default_model_dir)
    live = [Identity.generate().peer_id for _ in range(3)]
    for peer in live:
        await state.membership.join(peer, join_request(state), "10.0.0.1")
    read: set[str] = set()

    class Counted(NodeRecord):
        """A departed record that notes each status that reads it."""

        def __getattribute__(self, name: str):
            read.add(object.__getattribute__(self, "peer_id"))
            return object.__getattribute__(self, name)

    now = time.time()
    for i in range(2_000):
        peer = f"gone{i}".replace("0", "z")  # base58, as peer ids are
        state.fleet.put(Counted(peer, 1.0, 1e8, "hf", "t", (), "10.0.0.1", now - 60 + i / 100, state="gone", online_s=5.0))
    board = StatusBoard(RunInfo("hub", (), 0, 2, 1, "reverse", "chain"), tmp_path, state, lambda: 0)
    board.snapshot(0)  # the first sums the departed's share of the all-on cost, once for all that came or went
    read.clear()
    status = board.snapshot(0)
    assert len(read) == STATUS_DEPARTED_MAX
    assert [n.peer_id for n in status.nodes[3:]] == [f"gone{i}".replace("0", "z") for i in range(1_999, 1_899, -1)]
    assert status.nodes_omitted == 2_000 - STATUS_DEPARTED_MAX
    assert status.all_on_cost_usd == pytest.approx(2_000 * 1.0 * 5.0 / 3600.0, rel=0.01)
    state.store.close()


@pytest.mark.trio
async def test_a_node_on_an_old_version_is_not_leased_work_that_queued_work_would_make_stale(tmp_path, default_model_dir):
    """At step 4 under S = 2 the next take starts at v2 and each later one a version later. With one step's prompts
    already leased, a node on v2 would reach the buffer behind them, past its last take: it waits for a snapshot,
    told why, while a node on v4 is leased (hub.records.buffer.fresh_room)."""
    shelf = SnapshotShelf(keep=3)
    shelf.add(build_snapshot({"w": torch.zeros(4)}, 4, Identity.generate(), "0" * 64, tmp_path / "snapshots"))
    state = open_state(tmp_path, default_model_dir, CONFIG, shelf, LearnerAt(CONFIG.learner.staleness, step=4))
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    for peer in (a, b):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        await state.set_state(state.fleet.get(peer), "active", "test")
    first = await state.leasing.grant(b, 4)
    assert first.lease is not None and len(first.lease.prompts) == CONFIG.learner.prompts_per_step
    refused = await state.leasing.grant(a, 2)
    assert refused.lease is None and refused.reason == "work queued ahead outlasts v2: fetch a newer snapshot"
    granted = await state.leasing.grant(a, 4)
    assert granted.lease is not None and len(granted.lease.prompts) == 2
    state.store.close()


@pytest.mark.trio
async def test_the_in_flight_cap_counts_the_work_the_learner_will_train_on(tmp_path, default_model_dir):
    """The cap is 2 steps of 2 prompts the learner trains on. With every group trained on (usable 1.0), 2 leases of 2
    fill it. When half of the settled groups had equal rewards (usable 0.5), 4 leases do, as the scheduler sizes the
    fleet for R / 0.5; a group already in the buffer (it takes no zero-variance one) counts whole: (4 - 1) / 0.5 = 6
    leased prompts, not (4 - 0.5) / 0.5 = 7. Below the saturated share (0.2) the cap stops growing."""

    async def leased(usable: float, buffered: int = 0) -> list[int]:
        run = tmp_path / f"u{usable}-b{buffered}"
        state = reopen(run, default_model_dir)  # v0 published: a node holds nothing the hub has not
        state.measurements.fresh_usable_fraction = usable
        for row_id in range(buffered):
            completions = tuple(
                Completion(token_ids=(1,), logprobs=(-0.5,), finish_reason="stop", version=0, text="x") for _ in "ab"
            )
            added = state.buffer.add(
                Group(prompt_id=f"b{row_id}", prompt_text="x>", version=0, completions=completions, rewards=(0.0, 1.0)), row_id
            )
            assert added.accepted
        peer = Identity.generate().peer_id
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        await state.set_state(state.fleet.get(peer), "active", "test")
        sizes = []
        while (grant := await state.leasing.grant(peer, 0)).lease is not None and len(sizes) < 20:
            sizes.append(len(grant.lease.prompts))
        assert grant.reason == "enough work in flight"
        state.store.close()
        return sizes

    assert await leased(1.0) == [2, 2]
    assert await leased(0.5) == [2, 2, 2, 2]
    assert await leased(0.5, buffered=1) == [2, 2, 2]
    assert await leased(0.01) == await leased(0.2) == [2] * 10


@pytest.mark.trio
async def test_identities_holding_probes_they_never_answer_neither_starve_an_honest_node_nor_keep_probing(
    tmp_path, default_model_dir, tokenizer
):
    """Issue 65: 48 identities on 6 addresses claimed a version, took their one-prompt probe leases and never answered.
    Probes counted in every other node's room and were re-leased at once when they expired: the learner fell from
    32 steps/min to 0. Now a probe counts against its holder only, and an unanswered one costs its identity and its
    address a back-off, then the identity its probing."""
    from hub.trust.probes import PROBE_STRIKES_TO_STANDBY

    state = reopen(tmp_path, default_model_dir)
    now = [state.leasing.clock()]
    state.leasing.clock = lambda: now[0]
    timeout_s = CONFIG.lease.lease_timeout_s  # the first wait: as long as the probe was held
    honest = Identity.generate().peer_id
    await state.membership.join(honest, join_request(state), "10.0.0.1")
    probe = (await state.leasing.grant(honest, 0)).lease
    await state.intake.accept(honest, answer(tokenizer, probe, honest), "h")
    await state.set_state(state.fleet.get(honest), "active", "test")
    # 64 identities on 8 addresses, each holding its probe.
    attackers = {Identity.generate().peer_id: f"10.0.1.{i % 8}" for i in range(64)}
    for peer, ip in attackers.items():
        await state.membership.join(peer, join_request(state), ip)
        assert (await state.leasing.grant(peer, 2**53)).lease is not None  # a version past the newest: taken as v0
        assert state.fleet.get(peer).version_held == 0
    grant = await state.leasing.grant(honest, 0)
    assert grant.lease is not None and len(grant.lease.prompts) == CONFIG.lease.prompts_per_lease, grant.reason
    # The probes expire unanswered: each identity, and every identity on those addresses, waits.
    now[0] += timeout_s + 1
    await state.leasing.sweep()
    for peer in list(attackers)[:3]:
        refused = await state.leasing.grant(peer, 0)
        assert refused.lease is None and "unanswered" in refused.reason and refused.retry_after_s == timeout_s
    fresh, elsewhere = Identity.generate().peer_id, Identity.generate().peer_id
    await state.membership.join(fresh, join_request(state), "10.0.1.0")
    await state.membership.join(elsewhere, join_request(state), "10.0.2.1")
    assert (await state.leasing.grant(fresh, 0)).lease is None
    assert (await state.leasing.grant(elsewhere, 0)).lease is not None
    # Each round past the back-off, one more probe each, twice as long a wait after it; then they are probed no more.
    for round_ in range(1, PROBE_STRIKES_TO_STANDBY):
        now[0] += timeout_s * 2 ** (round_ - 1)
        for peer in attackers:
            assert (await state.leasing.grant(peer, 0)).lease is not None
        now[0] += timeout_s + 1
        await state.leasing.sweep()
        expected = "standby" if round_ == PROBE_STRIKES_TO_STANDBY - 1 else "probing"
        assert {state.fleet.get(peer).state for peer in attackers} == {expected}
    now[0] += 3600.0
    assert (await state.leasing.grant(next(iter(attackers)), 0)).reason == "standby: no work for now"
    state.store.close()


@pytest.mark.trio
async def test_probes_open_at_once_are_capped_in_all(tmp_path, default_model_dir, monkeypatch):
    """Probes sit outside the in-flight cap, so they have a bound of their own in all (OPEN_PROBES_MAX), whatever the
    identities and addresses asking: the next newcomer waits for a slot, and gets one once a probe closes."""
    from hub.service import leasing

    monkeypatch.setattr(leasing, "OPEN_PROBES_MAX", 5)
    state = reopen(tmp_path, default_model_dir)
    peers = [Identity.generate().peer_id for _ in range(6)]
    for i, peer in enumerate(peers):
        await state.membership.join(peer, join_request(state), f"10.0.{i}.1")
    held = [(await state.leasing.grant(peer, 0)).lease for peer in peers[:5]]
    assert all(lease is not None for lease in held)
    refused = await state.leasing.grant(peers[5], 0)
    assert refused.lease is None and "probe slot" in refused.reason
    state.leasing.book.close(held[0])
    assert (await state.leasing.grant(peers[5], 0)).lease is not None
    state.store.close()


@pytest.mark.trio
async def test_a_node_that_edits_a_tool_answer_is_banned_as_a_cheat(tmp_path, default_model_dir, tokenizer):
    """Tool-using rollouts: honest ones, whose environment segments are what the hub sent (the record here holds their
    digests as hub.agents.loop.ToolLoop keeps them), are accepted and paid; a submission with one edited segment has
    that group refused for ENVIRONMENT, and its node is banned as for a failed audit: its untrained groups dropped,
    its pay since its last vouched audit voided, an environment_tampered event written."""
    from dataclasses import replace

    from hub.agents.loop import segment_digest
    from hub.trust.checkpool import ThreadChecks
    from shared.messages import GroupReason
    from shared.tools import rollout_key

    state = reopen(tmp_path, default_model_dir)
    rules = replace(state.intake.rules, max_completion_tokens=CONFIG.sampling.max_new_tokens)
    state.intake.rules, state.intake.checks = rules, ThreadChecks(rules, CONFIG.trust.check_timeout_s)
    sent: dict[str, list[str]] = {}
    state.intake.sent_matches = lambda key, segments: sent.get(key) == [segment_digest(s) for s in segments]
    eos = tokenizer.eos_token_id
    # Special tokens only, so that the decoded text, and the reward, are `answer`'s.
    tool_answer = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id)

    def tool_answer_of(lease, edit: bool = False) -> Submission:
        """`answer`'s completions after a first turn (EOS alone) the hub answered (the answer recorded as sent)."""
        honest = answer(tokenizer, lease, peer)
        groups = []
        for g in honest.groups:
            completions = []
            for i, c in enumerate(g.completions):
                exchanged = ((eos,), tool_answer, c.token_ids)  # the first turn, the hub's answer, the last turn
                sent[rollout_key(lease.lease_id, g.prompt_id, i)] = [segment_digest(s) for s in exchanged]
                shown = (tool_answer[0], tool_answer[1] + 1, *tool_answer[2:]) if edit and g is honest.groups[0] else tool_answer
                ids = (eos, *shown, *c.token_ids)
                logprobs = (-0.5, *(0.0,) * len(shown), *c.logprobs)
                completions.append(c.model_copy(update={"token_ids": ids, "logprobs": logprobs, "env_spans": ((1, len(shown)),)}))
            groups.append(g.model_copy(update={"completions": tuple(completions)}))
        return honest.model_copy(update={"groups": tuple(groups)})

    peer = Identity.generate().peer_id
    async with running(state):
        await state.membership.join(peer, join_request(state), "10.0.0.1")
        grant = await state.leasing.grant(peer, 0)  # the probe
        honest = await state.intake.accept(peer, tool_answer_of(grant.lease), "h1")
        assert (honest.accepted, honest.reasons) == (1, {}) and honest.paid_usd > 0
        await settled(state)
        assert len(state.buffer) == 1 and state.fleet.get(peer).state != "banned"
        await state.set_state(state.fleet.get(peer), "active", "test")
        grant = await state.leasing.grant(peer, 0)
        assert len(grant.lease.prompts) == 2
        tampered = await state.intake.accept(peer, tool_answer_of(grant.lease, edit=True), "h2")
        await settled(state)
    assert tampered.reasons == {GroupReason.ENVIRONMENT.value: 1} and tampered.accepted == 1
    assert tampered.rejected[0][1] == "model turns or tool answers differ from those exchanged with the hub"
    record = state.fleet.get(peer)
    assert record.state == "banned" and "tool answers differ" in record.banned_reason
    assert len(state.buffer) == 0  # neither submission's groups will be trained on
    assert state.totals.paid_usd[peer] == 0.0 == state.store.groups.ledger_total_usd(peer)
    assert [e.kind for e in state.store.journal.events() if e.node_id == peer].count("environment_tampered") == 1
    dropped = {r.discard_reason for r in state.store.groups.trajectories() if r.node_id == peer and r.discard_reason}
    assert dropped == {"banned: environment tampered"}  # not "audit failed": no audit failed
    state.store.close()
