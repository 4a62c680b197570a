"""The volunteer leaderboard against a real SQLite file: accepted groups, tokens, hours of accepted work and audits
passed per volunteer, over the last day (hourly buckets) and the whole run (running tallies), banned volunteers left
out; display names kept with the node's record across a hub restart."""

from __future__ import annotations

import time

import pytest

from hub.records.schema import CREDIT_HOUR_S, CREDIT_HOURS_KEPT, Credit
from hub.records.store import Store
from hub.service.status import RunInfo, StatusBoard
from hub.trust.submissions import GroupVerdict
from shared.crypto import Identity
from shared.messages import GroupReason, SubmittedGroup
from tests.test_state import answer, join_request, reopen
from tests.test_store import make_group

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def submit(store: Store, peer: str, lease: str, accepted: int, refused: int, seconds: float, tokens: int, now: float) -> None:
    """One answered lease of `peer`: `accepted` good groups and `refused` bad ones."""
    store.leases.add_lease(lease, peer, [f"{lease}-{i}" for i in range(accepted + refused)], 0, now - 10, now + 60)
    verdicts = []
    for i in range(accepted + refused):
        group = make_group(f"{lease}-{i}", 0)
        submitted = SubmittedGroup(prompt_id=group.prompt_id, completions=group.completions)
        ok = i < accepted
        verdicts.append(
            GroupVerdict(
                group.prompt_id,
                ok,
                "" if ok else "tokens after EOS",
                submitted,
                group=group if ok else None,
                code=None if ok else GroupReason.TOKENS,
            )
        )
    store.groups.record_submission(lease, peer, verdicts, usd=0.0, seconds=seconds, signed_bytes_hash="h", now=now, tokens=tokens)


def test_leaders_sum_the_day_and_the_run_and_leave_the_banned_out(tmp_path) -> None:
    store = Store(tmp_path / "hub.db")
    now = time.time()
    for peer, name in (("A", "ada"), ("B", None), ("C", "cheat")):
        store.members.upsert_node(peer, 0.5, "gpu", 1e8, "hf", name=name)
    submit(store, "A", "a-old", 1, 0, 10.0, 6, now - 2 * 86400)  # the run's, not the day's
    submit(store, "A", "a-new", 2, 1, 4.0, 12, now)
    assert store.members.record_audit_pass("A", now)
    submit(store, "B", "b-new", 1, 1, 3.0, 6, now - 3600)
    submit(store, "C", "c-new", 5, 0, 9.0, 30, now)
    store.members.penalize_node("C", [], 0.0, "audit failed")

    (a, b) = store.members.leaders(now, 10)
    assert (a.peer_id, a.name, b.peer_id, b.name) == ("A", "ada", "B", None)
    assert a.run == Credit(accepted=3, tokens=18, gpu_s=14.0, audits_passed=1)
    assert a.day == Credit(accepted=2, tokens=12, gpu_s=4.0, audits_passed=1)
    assert b.run == b.day == Credit(accepted=1, tokens=6, gpu_s=3.0, audits_passed=0)
    assert [r.peer_id for r in store.members.leaders(now, 1)] == ["A"]  # the top of the run is also the top of the day

    # Hour buckets older than CREDIT_HOURS_KEPT go; the run's tallies stay.
    submit(store, "B", "b-later", 1, 0, 1.0, 6, now + (CREDIT_HOURS_KEPT + 2) * CREDIT_HOUR_S)
    hours = [r[0] for r in store.db.execute("SELECT hour FROM credit_hours").fetchall()]
    assert hours == [int(now // CREDIT_HOUR_S) + CREDIT_HOURS_KEPT + 2]
    (a_later, b_later) = store.members.leaders(now + (CREDIT_HOURS_KEPT + 2) * CREDIT_HOUR_S, 10)
    assert (a_later.peer_id, a_later.run, a_later.day) == ("A", Credit(3, 18, 14.0, 1), Credit(0, 0, 0.0, 0))
    assert (b_later.peer_id, b_later.run.accepted, b_later.day.accepted) == ("B", 2, 1)
    # One of each: the run's top (A) and the day's (B).
    assert [r.peer_id for r in store.members.leaders(now + (CREDIT_HOURS_KEPT + 2) * CREDIT_HOUR_S, 1)] == ["A", "B"]


def test_a_banned_volunteer_takes_no_slot_of_the_day(tmp_path) -> None:
    store = Store(tmp_path / "hub.db")
    now = time.time()
    for peer in ("A", "B", "C"):
        store.members.upsert_node(peer, 0.5, "gpu", 1e8, "hf")
    submit(store, "A", "a-old", 9, 0, 1.0, 6, now - 2 * 86400)  # the run's top, not the day's
    submit(store, "B", "b-new", 1, 0, 1.0, 6, now)
    submit(store, "C", "c-new", 5, 0, 1.0, 30, now)  # the day's top, then banned
    store.members.penalize_node("C", [], 0.0, "audit failed")
    assert [r.peer_id for r in store.members.leaders(now, 1)] == ["A", "B"]  # B is the day's top once C is out


def test_an_audit_pass_counts_in_the_hour_of_its_clock(tmp_path) -> None:
    store = Store(tmp_path / "hub.db")
    now = time.time() - 3 * 86400  # a clock days behind the wall's: the audit's hour is the clock's
    store.members.upsert_node("A", 0.5, "gpu", 1e8, "hf")
    submit(store, "A", "a", 1, 0, 1.0, 6, now)
    assert store.members.record_audit_pass("A", now, now=now)
    hours = store.db.execute("SELECT hour, accepted, audits_passed FROM credit_hours").fetchall()
    assert [tuple(h) for h in hours] == [(int(now // CREDIT_HOUR_S), 1, 1)]


def test_a_volunteer_without_accepted_work_is_not_a_leader(tmp_path) -> None:
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("A", 0.5, "gpu", 1e8, "hf")
    submit(store, "A", "a", 0, 2, 0.0, 0, time.time())
    assert store.members.leaders(time.time(), 10) == []
    assert store.db.execute("SELECT COUNT(*) FROM credit_hours").fetchone()[0] == 0


@pytest.mark.trio
async def test_the_display_name_and_the_credit_survive_a_hub_restart(tmp_path, default_model_dir, tokenizer) -> None:
    state = reopen(tmp_path, default_model_dir)
    peer = Identity.generate().peer_id
    await state.membership.join(peer, join_request(state).model_copy(update={"name": HOSTILE}), "10.0.0.1")
    grant = await state.leasing.grant(peer, 0)
    submission = answer(tokenizer, grant.lease, peer)
    outcome = await state.intake.accept(peer, submission, "h1")
    assert outcome.accepted == len(submission.groups)
    await state.flush()
    state.store.close()

    state = reopen(tmp_path, default_model_dir)
    assert state.fleet.get(peer).name == HOSTILE
    board = StatusBoard(RunInfo("hub", (), 0, 2, 1, "reverse", "chain"), tmp_path, state, lambda: 0)
    status = board.refresh_sync()
    (node,) = status.nodes
    assert node.name == HOSTILE
    (leader,) = status.leaders
    billed_s = state.store.db.execute("SELECT SUM(seconds) FROM ledger").fetchone()[0]
    tokens = sum(len(c.token_ids) for g in submission.groups for c in g.completions)
    assert (leader.name, leader.run.accepted, leader.run.tokens) == (HOSTILE, len(submission.groups), tokens)
    assert leader.run.gpu_hours == pytest.approx(billed_s / 3600) and billed_s > 0
    assert leader.day == leader.run
    assert status.redact().leaders == status.leaders  # public: no price, cost or hardware in it
