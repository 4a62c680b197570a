"""LeaseBook: issue, claim by the right node only, expiry and abandoned leases re-queue their prompts first."""

from __future__ import annotations

import pytest

from hub.records.leases import LeaseBook, LeaseError, LeaseRecord
from shared.tasks.reverse import ReverseTask

TIMEOUT_S = 10.0


@pytest.fixture
def book() -> LeaseBook:
    return LeaseBook(ReverseTask(size=64), seed=3)


def issue(book: LeaseBook, node_id: str, k: int, **kwargs) -> LeaseRecord:
    """Draft and open a lease, as HubState does around its store commit."""
    lease = book.draft(node_id, k, **kwargs)
    book.open_lease(lease)
    return lease


def test_issue_gives_distinct_leases_with_deadlines(book):
    a = issue(book, "node-a", 3, min_version=2, now=100.0, timeout_s=TIMEOUT_S)
    b = issue(book, "node-b", 2, min_version=2, now=101.0, timeout_s=TIMEOUT_S, probe=True)
    assert a.lease_id != b.lease_id and len(a.lease_id) == 24
    assert (len(a.prompts), len(b.prompts)) == (3, 2)
    assert a.deadline == 110.0 and b.deadline == 111.0 and b.probe and not a.probe
    assert a.min_version == 2
    assert set(book.open) == {a.lease_id, b.lease_id}
    # A probe counts against its holder's quota, not in the room every node shares.
    assert (book.outstanding_prompts(), book.open_probes) == (3, 1)
    # Prompts come from the task and carry its answer, which only the hub sees.
    task = ReverseTask(size=64)
    for p in a.prompts + b.prompts:
        assert task.get(p.id) == p and p.answer is not None


def test_claim_checks_lease_node_and_deadline(book):
    lease = issue(book, "node-a", 2, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    with pytest.raises(LeaseError, match="unknown"):
        book.claim("f" * 24, "node-a", 1.0)
    with pytest.raises(LeaseError, match="another node"):
        book.claim(lease.lease_id, "node-b", 1.0)
    assert book.claim(lease.lease_id, "node-a", 1.0) is lease
    # While one submission is being checked, a second one for the same lease is refused.
    with pytest.raises(LeaseError, match="already being checked"):
        book.claim(lease.lease_id, "node-a", 1.0)
    book.release(lease)  # the first was refused: the lease stays open for a valid answer
    assert book.claim(lease.lease_id, "node-a", 2.0) is lease
    lease.answered.update(lease.prompt_ids)
    book.close(lease)
    assert lease.closed and book.open == {}
    # A replay of an answered lease answers nothing.
    with pytest.raises(LeaseError, match="already answered"):
        book.claim(lease.lease_id, "node-a", 3.0)


def test_claim_after_deadline_expires_the_lease(book):
    lease = issue(book, "node-a", 2, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    with pytest.raises(LeaseError, match="expired"):
        book.claim(lease.lease_id, "node-a", TIMEOUT_S + 0.001)
    assert lease.closed and lease.lease_id not in book.open
    # Its prompts are the next ones handed out.
    again = issue(book, "node-b", 2, min_version=0, now=20.0, timeout_s=TIMEOUT_S)
    assert again.prompt_ids == lease.prompt_ids


def test_expiry_requeues_prompts_to_the_front_in_order(book):
    first = issue(book, "node-a", 3, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    second = issue(book, "node-b", 2, min_version=0, now=5.0, timeout_s=TIMEOUT_S)
    assert book.expire(TIMEOUT_S) == []  # the deadline itself is still in time
    assert book.expire(TIMEOUT_S + 1) == [first]
    assert set(book.open) == {second.lease_id}
    nxt = issue(book, "node-c", 4, min_version=0, now=12.0, timeout_s=TIMEOUT_S)
    assert nxt.prompt_ids[:3] == first.prompt_ids
    assert nxt.prompt_ids[3] not in first.prompt_ids + second.prompt_ids


def test_partly_answered_lease_requeues_only_unanswered_prompts(book):
    lease = issue(book, "node-a", 3, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    book.claim(lease.lease_id, "node-a", 1.0)
    lease.answered.add(lease.prompt_ids[1])
    book.close(lease)
    book.close(lease)  # idempotent: prompts are not re-queued twice
    nxt = issue(book, "node-b", 3, min_version=0, now=2.0, timeout_s=TIMEOUT_S)
    assert nxt.prompt_ids[:2] == (lease.prompt_ids[0], lease.prompt_ids[2])
    assert nxt.prompt_ids[2] not in lease.prompt_ids


def test_lease_being_checked_is_not_swept(book):
    lease = issue(book, "node-a", 1, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    book.claim(lease.lease_id, "node-a", 9.0)
    assert book.expire(TIMEOUT_S + 5) == []
    book.release(lease)
    assert book.expire(TIMEOUT_S + 5) == [lease]


def test_drop_node_gives_back_only_that_nodes_leases(book):
    a1 = issue(book, "node-a", 2, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    b = issue(book, "node-b", 1, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    a2 = issue(book, "node-a", 1, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    dropped = book.drop_node("node-a")
    assert {r.lease_id for r in dropped} == {a1.lease_id, a2.lease_id}
    assert set(book.open) == {b.lease_id}
    assert book.outstanding_prompts() == 1
    nxt = issue(book, "node-c", 3, min_version=0, now=1.0, timeout_s=TIMEOUT_S)
    assert set(nxt.prompt_ids) == set(a1.prompt_ids + a2.prompt_ids)
    with pytest.raises(LeaseError):
        book.claim(a1.lease_id, "node-a", 1.0)


def test_a_lease_never_holds_the_same_prompt_twice():
    class TwoPrompts(ReverseTask):
        def prompts(self):
            return super().prompts()[:2]

    book = LeaseBook(TwoPrompts(), seed=0)
    for _ in range(20):
        lease = issue(book, "n", 3, min_version=0, now=0.0, timeout_s=10.0)
        assert len(set(lease.prompt_ids)) == len(lease.prompt_ids) == 2
        book.close(lease)


def test_an_abandoned_draft_gives_its_prompts_back_first(book):
    draft = book.draft("node-a", 3, min_version=0, now=0.0, timeout_s=TIMEOUT_S)
    assert book.open == {} and book.outstanding_prompts() == 0  # not open until stored
    book.abandon(draft)
    again = issue(book, "node-b", 3, min_version=0, now=1.0, timeout_s=TIMEOUT_S)
    assert again.prompt_ids == draft.prompt_ids


def test_the_indexes_follow_every_way_a_lease_leaves_the_book(book):
    """Counts by node, by address and of prompts are kept as leases open and close, never recounted."""
    a = issue(book, "node-a", 2, min_version=0, now=0.0, timeout_s=TIMEOUT_S, address="10.0.0.1")
    b = issue(book, "node-b", 1, min_version=0, now=5.0, timeout_s=TIMEOUT_S, address="10.0.0.1")
    c = issue(book, "node-a", 3, min_version=0, now=5.0, timeout_s=TIMEOUT_S)
    d = issue(book, "node-c", 1, min_version=0, now=5.0, timeout_s=TIMEOUT_S, address="10.0.0.2")
    assert book.open_by_address == {"10.0.0.1": 2, "10.0.0.2": 1}
    assert (book.open_count("node-a"), book.holds("node-b"), book.holds("node-z")) == (2, True, False)
    assert book.outstanding_prompts() == 7
    assert book.expire(TIMEOUT_S + 1) == [a]
    book.close(b)
    book.abandon(d)
    assert book.open_by_address == {} and book.open_count("node-a") == 1 and not book.holds("node-b")
    assert book.outstanding_prompts() == 3
    assert book.drop_node("node-a") == [c]
    assert book.open == {} and book.outstanding_prompts() == 0 and not book.holds("node-a")
    with pytest.raises(ValueError):
        book.open_lease(c)  # a closed lease never comes back
