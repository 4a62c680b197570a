"""The hub's in-memory registry of volunteer nodes: who joined, what they declared, what the hub measured.

Declared values (price, link, hardware) come from the node; everything used for money or
scheduling decisions (throughput, cost, counts) is measured by the hub itself. Plain data and
pure helpers: Membership (hub/service/membership.py) is the only writer, after its store commits; the
scheduler, the broadcaster and the status board read it (the broadcaster reports what its dial-backs and its
nodes' hole punches found to Membership, `ReachabilityReports`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hub.method.capacity import ewma
from hub.records.schema import NodeRow
from shared.messages import HEARTBEAT_PERIOD_MAX_S, JoinRequest, NodeState, Tallies

THROUGHPUT_EWMA_ALPHA = 0.3
PRICE_HISTORY_KEPT = 8  # (at, $/h) per node in memory and on the status board; the store keeps them all
# The record of a node gone or banned and not seen for this long leaves memory (`Fleet.departed`): throwaway identities
# joining once each must not grow the hub for good. The store keeps its row, its clocks with it (the last price change),
# and a re-join recalls it (hub/service/membership.py). As long as the status board lists such nodes (RECENT_NODES_S).
DEPARTED_KEPT_S = 3600.0
# A departed identity that did nothing worth remembering (`forgettable`) leaves memory this long after it was last seen,
# and its rows leave the store at the next retention (Store.retain): a flood of throwaway identities costs the hub the
# same after it as before. Long enough for the status board to show it leave.
IDLE_DEPARTED_KEPT_S = 60.0
# Answered leases in a row whose every group came back late before a node is held as too slow: one such lease may be
# the one it held when it was released, late for the release, not its pace.
LATE_LEASES_HELD = 2
DEPARTED_STATES: tuple[NodeState, ...] = ("gone", "banned")


def heartbeat_period(live_nodes: int, min_period_s: float, heartbeats_per_s: float) -> float:
    """How often each node should heartbeat so the fleet sends at most `heartbeats_per_s` in all, never more
    often than every `min_period_s` (nor less than every HEARTBEAT_PERIOD_MAX_S): liveness must not cost
    the hub more as the fleet grows."""
    return min(max(min_period_s, live_nodes / heartbeats_per_s), HEARTBEAT_PERIOD_MAX_S)


def heartbeat_timeout(period_told_s: float, min_period_s: float, min_timeout_s: float) -> float:
    """How long a node told to beat every `period_told_s` may be silent before it is dropped: the configured
    timeout, stretched by as much as its period was (the same number of missed beats)."""
    return min_timeout_s * max(1.0, period_told_s / min_period_s)


@dataclass
class NodeRecord:
    peer_id: str
    price_per_hour: float
    link_bps: float
    backend: str
    hardware: str
    listen_addrs: tuple[str, ...]
    remote_ip: str | None
    last_seen: float
    state: NodeState = "probing"
    version_held: int = -1
    receiving_version: int | None = None
    chunks_received: int = 0
    rollouts_per_s: float = 0.0
    measured: bool = False
    tallies: Tallies = field(default_factory=Tallies)
    # Its refused groups by reason (shared.messages.GroupReason), since the hub started: the store keeps the verdicts'
    # texts, not their codes, so a restart counts anew.
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    audits_passed: int = 0
    # Time of the newest submission whose audit passed: a later ban voids only pay booked after it.
    vouched_at: float | None = None
    online_s: float = 0.0  # heartbeating time over all sessions (what an always-on fleet would pay for)
    banned_reason: str | None = None
    # Whether peers can dial it (hub/distribution/reachability.py): "unknown" until the hub's dial-back answers.
    reachability: str = "unknown"
    # The NATed upstream a hole punch with failed (it then pulls from the hub; the planner separates them).
    punch_failed_with: str | None = None
    # The address the hub's dial-back was answered at: the only one peers are told to dial.
    answered_addr: str | None = None
    # The heartbeat period the hub last told it (0: not told yet); its silence timeout follows it.
    heartbeat_period_s: float = 0.0
    # The display name it joined with (None: its short peer id is shown).
    name: str | None = None
    # The price the scheduler ranks it by once it re-declared one (hub.method.prices.ranking_price); None: as joined.
    ranked_price_per_hour: float | None = None
    # When it last re-declared its price since it joined (None: not yet, so it may now).
    price_changed_at: float | None = None
    # Its latest prices, (at, $/h), oldest first: `echo-hub status` shows how its price moved.
    price_history: tuple[tuple[float, float], ...] = ()
    # When it said it stops (LEAVE_PROTOCOL; None: it did not, or joined again since). A member until its heartbeat
    # timeout (a ban still reaches it), but no longer a receiver, a relay, a node to activate or one given work.
    left_at: float | None = None
    # Answered leases in a row whose every group came back late (an accepted group starts it over).
    late_leases: int = 0
    # Its measured rate once LATE_LEASES_HELD leases in a row came back all late (None: not so). Until its measured rate
    # moves from this, it is not activated (`too_slow`); a re-join measures it anew.
    late_at_rate: float | None = None

    @property
    def too_slow(self) -> bool:
        """Every group of its last answer arrived late, and nothing measured since says it got faster: activating it
        again would buy late groups, which the learner never uses."""
        return self.measured and self.late_at_rate == self.rollouts_per_s

    def joins_as(self) -> NodeState:
        """The state a (re)join puts it in: standby once measured, probing to be measured (again, when it was held as
        too slow: another machine or a lighter load may make it fast enough now)."""
        return "standby" if self.measured and self.late_at_rate is None else "probing"

    def changes_price(self, price: float) -> bool:
        """Whether (re-)declaring `price` is a change of a price it declared before (its first join is none)."""
        return bool(self.price_history) and price != self.price_per_hour

    def declare_price(self, price: float, at: float) -> None:
        """The price it is paid at for leases issued from `at` on, kept in its history when it differs."""
        self.price_per_hour = price
        if not self.price_history or self.price_history[-1][1] != price:
            self.price_history = (*self.price_history, (at, price))[-PRICE_HISTORY_KEPT:]

    @property
    def rank_price(self) -> float:
        """The $/h the scheduler ranks it by: its declared price, give or take scheduler.price_band."""
        return self.price_per_hour if self.ranked_price_per_hour is None else self.ranked_price_per_hour

    @property
    def rho(self) -> float:
        """Cost per unit throughput, $/h per (rollout/s); unmeasured nodes sort last."""
        return self.price_per_hour / self.rollouts_per_s if self.rollouts_per_s > 0 else float("inf")

    @classmethod
    def from_row(cls, row: NodeRow, price_history: tuple[tuple[float, float], ...] = ()) -> NodeRecord:
        """A node the store remembers, as a restarted hub sees it: gone until it joins again (or banned)."""
        return cls(
            peer_id=row.peer_id,
            price_per_hour=row.price_per_hour,
            link_bps=row.link_bps or 0.0,
            backend=row.backend,
            hardware=row.hardware,
            listen_addrs=(),
            remote_ip=None,
            last_seen=row.last_seen,
            state="banned" if row.state == "banned" else "gone",
            rollouts_per_s=row.rollouts_per_s,
            measured=row.measured,
            tallies=row.tallies,
            audits_passed=row.audits_passed,
            vouched_at=row.vouched_at,
            online_s=row.online_s,
            banned_reason=row.banned_reason,
            name=row.name,
            price_history=price_history,
            price_changed_at=row.price_changed_at,
        )


def forgettable(record: NodeRecord, paid_usd: float) -> bool:
    """Whether a departed identity left nothing the hub must remember: gone (a ban must survive), never measured, no
    group or refusal counted against it, no audit passed, nothing paid (`paid_usd`). Its price clock goes with it: a fresh
    identity starts without one anyway. Store.retain deletes the rows of such identities by the same rule (IDLE_NODE_SQL
    in hub/records/schema.py)."""
    return (
        record.state == "gone"
        and not record.measured
        and record.tallies == Tallies()
        and record.audits_passed == 0
        and record.vouched_at is None
        and paid_usd == 0.0
    )


class Fleet:
    """Every node the hub holds a record of, by peer id: the pool (joined, neither gone nor banned) apart from those
    departed, in the order they left, so that a reader of the pool, or of the newest departed, never walks the rest."""

    def __init__(self) -> None:
        self._pool: dict[str, NodeRecord] = {}
        self._departed: dict[str, NodeRecord] = {}
        self._departed_usd_s: float | None = 0.0  # their $/h x online seconds; None: summed again when next asked

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        """Every record (a new dict: Membership files them)."""
        return {**self._pool, **self._departed}

    def _file(self, record: NodeRecord) -> None:
        """File `record` as its state says: in the pool, or as the newest departed."""
        peer = record.peer_id
        self._pool.pop(peer, None)
        if self._departed.pop(peer, None) is not None or record.state in DEPARTED_STATES:
            self._departed_usd_s = None
        (self._departed if record.state in DEPARTED_STATES else self._pool)[peer] = record

    def join(self, peer_id: str, request: JoinRequest, remote_ip: str | None, now: float) -> NodeRecord:
        """A node (re)joining: what it declares now replaces what it declared before, in place, so a command
        still holding its record keeps writing to the one the fleet shows; what the hub measured stays."""
        record = self.get(peer_id)
        if record is None:
            record = NodeRecord(
                peer_id=peer_id,
                price_per_hour=0.0,
                link_bps=0.0,
                backend="",
                hardware="",
                listen_addrs=(),
                remote_ip=None,
                last_seen=now,
            )
        if record.changes_price(request.price_per_hour):
            # A re-join at another price is a price change: the clock of the one-per-interval rule is the identity's,
            # not the session's, or leave and re-join would bypass it (issue 54 item 5).
            record.price_changed_at = now
        record.declare_price(request.price_per_hour, now)
        record.link_bps = request.link_bps
        record.ranked_price_per_hour = None
        record.backend, record.hardware, record.name = request.backend, request.hardware, request.name
        if (record.listen_addrs, record.remote_ip) != (request.listen_addrs, remote_ip):
            record.reachability = "unknown"  # another address: dialed back again
            record.punch_failed_with = record.answered_addr = None
        record.listen_addrs, record.remote_ip = request.listen_addrs, remote_ip
        record.last_seen, record.version_held = now, request.version_held
        record.receiving_version, record.chunks_received = None, 0
        record.state = record.joins_as()
        record.measured = record.measured and record.state == "standby"
        if not record.measured:  # measured anew: its lateness too
            record.late_leases = 0
        record.left_at = None
        self._file(record)
        return record

    def put(self, record: NodeRecord) -> None:
        self._file(record)

    def set_state(self, record: NodeRecord, state: NodeState) -> None:
        """Move `record` to `state`, filed accordingly (a record the fleet let go meanwhile stays out)."""
        record.state = state
        if self.get(record.peer_id) is record:
            self._file(record)

    def departed(self, now: float, kept_s: Callable[[NodeRecord], float]) -> list[NodeRecord]:
        """Nodes gone or banned and last seen more than `kept_s` of each ago, taken out of the fleet (DEPARTED_KEPT_S,
        IDLE_DEPARTED_KEPT_S); a walk of the departed only, at each retention."""
        old = [n for n in self._departed.values() if n.last_seen < now - kept_s(n)]
        for record in old:
            del self._departed[record.peer_id]
        if old:
            self._departed_usd_s = None
        return old

    def newest_departed(self) -> Iterator[NodeRecord]:
        """The departed, the last to leave first."""
        return reversed(self._departed.values())

    @property
    def departed_count(self) -> int:
        return len(self._departed)

    @property
    def departed_usd_s(self) -> float:
        """The departed's $/h x online seconds (their share of the all-on cost), summed when one came or went since."""
        if self._departed_usd_s is None:
            self._departed_usd_s = math.fsum(n.price_per_hour * n.online_s for n in self._departed.values())
        return self._departed_usd_s

    def get(self, peer_id: str) -> NodeRecord | None:
        record = self._pool.get(peer_id)
        return record if record is not None else self._departed.get(peer_id)

    @staticmethod
    def reached(record: NodeRecord, answered_addr: str | None) -> None:
        """The hub's dial-back answered at `answered_addr` (None: it did not)."""
        record.reachability = "public" if answered_addr else "nated"
        record.answered_addr = answered_addr

    @staticmethod
    def punch_failed(record: NodeRecord, upstream: str) -> None:
        """The node's hole punch with its NATed `upstream` failed."""
        record.punch_failed_with = upstream

    def is_member(self, peer_id: str) -> bool:
        """A node that joined and is neither banned nor gone."""
        record = self._pool.get(peer_id)
        return record is not None and record.state not in DEPARTED_STATES

    def live(self) -> list[NodeRecord]:
        # The state is read too: a caller that set a record's state itself (tests, the test bed) did not refile it.
        return [n for n in self._pool.values() if n.state not in DEPARTED_STATES]

    def in_state(self, *states: NodeState) -> list[NodeRecord]:
        records = self.nodes.values() if set(states) & set(DEPARTED_STATES) else self._pool.values()
        return [n for n in records if n.state in states]

    @staticmethod
    def throughput_after(record: NodeRecord, accepted_rollouts: int, seconds: float) -> tuple[float, bool]:
        """(rollouts/s, measured) once one answered lease is folded into the node's measured throughput."""
        sample = accepted_rollouts / seconds if seconds > 0 else 0.0
        rate = sample if not record.measured else ewma(record.rollouts_per_s, sample, THROUGHPUT_EWMA_ALPHA)
        return rate, True

    def silent(self, now: float, min_period_s: float, min_timeout_s: float) -> list[NodeRecord]:
        """Live nodes silent for longer than their heartbeat timeout (`heartbeat_timeout`)."""
        return [
            n for n in self.live() if now - n.last_seen > heartbeat_timeout(n.heartbeat_period_s, min_period_s, min_timeout_s)
        ]
