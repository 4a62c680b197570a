"""The hub's in-memory registry of volunteer nodes: who joined, what they declared, what the hub measured.

Declared values (price, link, hardware) come from the node; everything used for money or
scheduling decisions (throughput, cost, counts) is measured by the hub itself. Plain data and
pure helpers: HubState (hub/state.py) is the only writer, after its store commits; the
scheduler, the broadcaster and the status board read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hub.capacity import ewma
from hub.store import NodeRow
from shared.messages import JoinRequest, NodeState, Tallies

THROUGHPUT_EWMA_ALPHA = 0.3


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
    audits_passed: int = 0
    # Time of the newest submission whose audit passed: a later ban voids only pay booked after it.
    vouched_at: float | None = None
    online_s: float = 0.0  # heartbeating time over all sessions (what an always-on fleet would pay for)
    banned_reason: str | None = None

    @property
    def rho(self) -> float:
        """Cost per unit throughput, $/h per (rollout/s); unmeasured nodes sort last."""
        return self.price_per_hour / self.rollouts_per_s if self.rollouts_per_s > 0 else float("inf")

    @classmethod
    def from_row(cls, row: NodeRow) -> NodeRecord:
        """A node the store remembers, as a restarted hub sees it: gone until it joins again (or banned)."""
        return cls(
            peer_id=row.peer_id, price_per_hour=row.price_per_hour, link_bps=row.link_bps or 0.0, backend=row.backend,
            hardware=row.hardware, listen_addrs=(), remote_ip=None, last_seen=row.last_seen,
            state="banned" if row.state == "banned" else "gone", rollouts_per_s=row.rollouts_per_s,
            measured=row.measured, tallies=row.tallies, audits_passed=row.audits_passed, vouched_at=row.vouched_at,
            online_s=row.online_s, banned_reason=row.banned_reason,
        )


class Fleet:
    """Every node the hub knows, by peer id."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}

    @staticmethod
    def joined(
        peer_id: str, request: JoinRequest, remote_ip: str | None, now: float, previous: NodeRecord | None
    ) -> NodeRecord:
        """The record of a node (re)joining: what it declares now, and what the hub measured of it before."""
        record = NodeRecord(
            peer_id=peer_id,
            price_per_hour=request.price_per_hour,
            link_bps=request.link_bps,
            backend=request.backend,
            hardware=request.hardware,
            listen_addrs=request.listen_addrs,
            remote_ip=remote_ip,
            last_seen=now,
            version_held=request.version_held,
        )
        if previous is not None:
            record.rollouts_per_s, record.measured = previous.rollouts_per_s, previous.measured
            record.tallies, record.audits_passed = previous.tallies, previous.audits_passed
            record.vouched_at, record.online_s = previous.vouched_at, previous.online_s
            record.state = "standby" if previous.measured else "probing"
        return record

    def put(self, record: NodeRecord) -> None:
        self.nodes[record.peer_id] = record

    def get(self, peer_id: str) -> NodeRecord | None:
        return self.nodes.get(peer_id)

    def live(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state not in ("banned", "gone")]

    def in_state(self, *states: NodeState) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state in states]

    @staticmethod
    def throughput_after(record: NodeRecord, accepted_rollouts: int, seconds: float) -> tuple[float, bool]:
        """(rollouts/s, measured) once one answered lease is folded into the node's measured throughput."""
        sample = accepted_rollouts / seconds if seconds > 0 else 0.0
        rate = sample if not record.measured else ewma(record.rollouts_per_s, sample, THROUGHPUT_EWMA_ALPHA)
        return rate, True

    def silent_since(self, deadline: float) -> list[NodeRecord]:
        """Live nodes whose last heartbeat is older than `deadline`."""
        return [n for n in self.live() if n.last_seen < deadline]
