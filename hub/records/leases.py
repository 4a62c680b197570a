"""Work leases: which prompts each node owes the hub, until when, and what happens when it doesn't answer.

A lease hands a node a batch of prompts; a submission must answer an open, unexpired lease
of the node that holds it, each prompt at most once. Prompts of expired or abandoned leases
go back to the front of the pool and are leased to someone else.

A claimed lease is being checked against one submission (the checks and the store commit
await worker threads): a second submission for it is refused and the expiry sweep leaves it
alone until the first is committed (`close`) or refused (`release`).

The book indexes open leases by node and by address, so every question a request asks of it (does
this node hold a lease, how many are open at its address, how big may its submission be) costs the
same with ten open leases as with ten thousand.

An answered lease is kept, as its id, holder, size and deadline, until that deadline (`answered_lease`): its holder
may send the same answer again when the reply was lost (the hub died between its commit and the reply, or the link
dropped), and gets the reply the commit stored (hub/service/intake.py). Kept no longer than a lease may be answered,
they are at most the leases answered within one lease timeout.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.tasks.base import Prompt, Task


@dataclass
class LeaseRecord:
    """The hub's own record of a lease; nothing in it comes from the node."""

    lease_id: str
    node_id: str
    prompts: tuple[Prompt, ...]
    min_version: int
    issued_at: float
    deadline: float
    price_per_hour: float  # the node's price when the lease was issued: what the lease is paid at
    probe: bool = False
    # The version the node said it held when it asked (at most the newest published): its groups may not be older,
    # or a node could be leased the room of a new version and fill it with groups about to go stale.
    held_version: int = 0
    # The holder's address key (hub.trust.guard.address_key) when the lease counts against its address's quota;
    # None for the operator's own nodes and holders of no known address.
    address: str | None = None
    answered: set[str] = field(default_factory=set)
    closed: bool = False
    checking: bool = False

    @property
    def prompt_ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.prompts)


@dataclass(frozen=True)
class AnsweredLease:
    """A lease whose answer the store holds, until its deadline: what a copy of that answer may be sent against."""

    lease_id: str
    node_id: str
    prompts: int
    deadline: float


class LeaseError(Exception):
    """A submission that does not answer an open lease of its sender."""


class LeaseBook:
    """Prompt pool plus open leases. Pure bookkeeping: callers pass the clock in."""

    def __init__(self, task: Task, seed: int) -> None:
        self._task = task
        self._rng = random.Random(seed)
        self._pool: deque[Prompt] = deque()
        self._distinct_prompts = len({p.id for p in task.prompts()})
        self.open: dict[str, LeaseRecord] = {}
        self._of_node: dict[str, dict[str, LeaseRecord]] = {}
        self.open_by_address: Counter[str] = Counter()
        self._open_prompts = 0
        self.open_probes = 0
        self._answered: dict[str, AnsweredLease] = {}
        self._answered_of_node: dict[str, dict[str, AnsweredLease]] = {}
        # Told of every lease that closes (answered, expired, given back): what it held dies with it (its rollouts'
        # environments, hub/agents/rollouts.py).
        self.on_close: list[Callable[[LeaseRecord], None]] = []

    def outstanding_prompts(self) -> int:
        """Prompts of open leases other than probes (a lease's answered prompts leave with it: it closes as they are
        recorded). A probe counts against its holder's quota, not against the room every other node shares."""
        return self._open_prompts

    def _next_prompts(self, k: int) -> tuple[Prompt, ...]:
        """Up to k distinct prompts from the front of the pool: a lease answers each prompt once, so a
        prompt drawn twice waits, at the front, for a later lease."""
        k = min(k, self._distinct_prompts)
        chosen: dict[str, Prompt] = {}
        skipped: list[Prompt] = []
        while len(chosen) < k:
            if not self._pool:
                self._pool.extend(self._task.sample(self._rng, max(k, 64)))
            prompt = self._pool.popleft()
            if prompt.id in chosen:
                skipped.append(prompt)
            else:
                chosen[prompt.id] = prompt
        self._pool.extendleft(reversed(skipped))
        return tuple(chosen.values())

    def draft(
        self,
        node_id: str,
        k: int,
        min_version: int,
        now: float,
        timeout_s: float,
        price_per_hour: float = 0.0,
        probe: bool = False,
        address: str | None = None,
        held_version: int = 0,
    ) -> LeaseRecord:
        """A lease of up to k prompts taken from the pool, not open yet: `open_lease` it once it is stored,
        or `abandon` it to give its prompts back."""
        return LeaseRecord(
            lease_id=secrets.token_hex(12),
            node_id=node_id,
            prompts=self._next_prompts(k),
            min_version=min_version,
            issued_at=now,
            deadline=now + timeout_s,
            price_per_hour=price_per_hour,
            probe=probe,
            address=address,
            held_version=held_version,
        )

    def open_lease(self, record: LeaseRecord) -> None:
        if record.lease_id in self.open or record.closed:
            raise ValueError(f"lease {record.lease_id} was opened before")
        self.open[record.lease_id] = record
        self._of_node.setdefault(record.node_id, {})[record.lease_id] = record
        if record.address is not None:
            self.open_by_address[record.address] += 1
        if record.probe:
            self.open_probes += 1
        else:
            self._open_prompts += len(record.prompts)

    def _withdraw(self, record: LeaseRecord) -> None:
        """Take an open lease out of the book and its indexes."""
        if self.open.pop(record.lease_id, None) is None:
            return
        mine = self._of_node[record.node_id]
        del mine[record.lease_id]
        if not mine:
            del self._of_node[record.node_id]
        if record.address is not None:
            self.open_by_address[record.address] -= 1
            if not self.open_by_address[record.address]:
                del self.open_by_address[record.address]
        if record.probe:
            self.open_probes -= 1
        else:
            self._open_prompts -= len(record.prompts)

    def leases_of(self, node_id: str) -> list[LeaseRecord]:
        """The node's open leases."""
        return list(self._of_node.get(node_id, {}).values())

    def answered_of(self, node_id: str) -> list[AnsweredLease]:
        """The node's answered leases still before their deadline."""
        return list(self._answered_of_node.get(node_id, {}).values())

    def answered_lease(self, lease_id: str, node_id: str) -> AnsweredLease | None:
        """`lease_id`, answered by `node_id` and not past its deadline; None otherwise."""
        answered = self._answered.get(lease_id)
        return answered if answered is not None and answered.node_id == node_id else None

    def keep_answered(self, answered: AnsweredLease) -> None:
        """Keep an answered lease until its deadline (`answer` does, and a restarted hub for the leases it finds
        answered in its store)."""
        self._answered[answered.lease_id] = answered
        self._answered_of_node.setdefault(answered.node_id, {})[answered.lease_id] = answered

    def answer(self, record: LeaseRecord, prompt_ids: Iterable[str]) -> None:
        """A lease's answer committed: these prompts are answered, the rest go back to the pool; the lease is kept as
        answered until its deadline."""
        record.answered.update(prompt_ids)
        self.close(record)
        self.keep_answered(AnsweredLease(record.lease_id, record.node_id, len(record.prompts), record.deadline))

    def open_count(self, node_id: str) -> int:
        return len(self._of_node.get(node_id, ()))

    def holds(self, node_id: str) -> bool:
        """Whether the node holds an open lease (only then may it send a submission's worth of bytes)."""
        return node_id in self._of_node

    def abandon(self, record: LeaseRecord) -> None:
        """A lease whose store write failed: withdrawn, its prompts back at the front of the pool."""
        self._withdraw(record)
        record.closed = True
        self._pool.extendleft(reversed(record.prompts))

    def claim(self, lease_id: str, node_id: str, now: float) -> LeaseRecord:
        """The open lease a submission answers, or LeaseError saying why it answers none."""
        record = self.open.get(lease_id)
        if record is None:
            raise LeaseError(f"unknown or already answered lease {lease_id[:32]!r}")
        if record.node_id != node_id:
            raise LeaseError("lease belongs to another node")
        if record.checking:
            raise LeaseError("a submission for this lease is already being checked")
        if now > record.deadline:
            self.close(record)
            raise LeaseError("lease expired")
        record.checking = True
        return record

    def release(self, record: LeaseRecord) -> None:
        """A claimed lease whose submission was refused stays open (until its deadline) for a valid answer."""
        record.checking = False

    def close(self, record: LeaseRecord) -> None:
        """Close an answered lease; prompts left unanswered go back to the pool. Closing twice is a no-op."""
        if record.closed:
            return
        record.closed = True
        record.checking = False
        self._withdraw(record)
        # The task's own prompts go back: a lease's may have been rendered for it (an environment's observation).
        self._pool.extendleft(reversed([self._task.get(p.id) for p in record.prompts if p.id not in record.answered]))
        for hook in self.on_close:
            hook(record)

    def expire(self, now: float) -> list[LeaseRecord]:
        """Expire every lease past its deadline (except one being checked); their prompts are re-leased. Answered leases
        past theirs are let go."""
        gone = [rec for rec in self.open.values() if now > rec.deadline and not rec.checking]
        for record in gone:
            self.close(record)
        for answered in [a for a in self._answered.values() if now > a.deadline]:
            del self._answered[answered.lease_id]
            mine = self._answered_of_node[answered.node_id]
            del mine[answered.lease_id]
            if not mine:
                del self._answered_of_node[answered.node_id]
        return gone

    def drop_node(self, node_id: str) -> list[LeaseRecord]:
        """Give back the leases of a node that left or was banned; one whose submission is being checked
        is left to that submission (answered, its prompts stay answered; refused, it expires)."""
        gone = [rec for rec in self.leases_of(node_id) if not rec.checking]
        for record in gone:
            self.close(record)
        return gone
