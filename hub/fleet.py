"""The hub's registry of volunteer nodes: who joined, what they declared, what the hub measured.

Declared values (price, link, hardware) come from the node; everything used for money or
scheduling decisions (throughput, cost, counts) is measured by the hub itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hub.capacity import ewma
from shared.messages import JoinRequest, NodeState

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
    joined_at: float
    last_seen: float
    state: NodeState = "probing"
    version_held: int = -1
    receiving_version: int | None = None
    chunks_received: int = 0
    rollouts_per_s: float = 0.0
    measured: bool = False
    accepted: int = 0
    rejected: int = 0
    late: int = 0
    refused: int = 0  # requests refused at the protocol level, not groups
    audits_passed: int = 0
    bad_chunks: int = 0
    recent_events: list[str] = field(default_factory=list)

    @property
    def rho(self) -> float:
        """Cost per unit throughput, $/h per (rollout/s); unmeasured nodes sort last."""
        return self.price_per_hour / self.rollouts_per_s if self.rollouts_per_s > 0 else float("inf")


class Fleet:
    """In-memory node registry; the hub mirrors changes into the store."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}

    def join(self, peer_id: str, request: JoinRequest, remote_ip: str | None, now: float) -> NodeRecord:
        previous = self.nodes.get(peer_id)
        if previous is not None and previous.state == "banned":
            return previous
        record = NodeRecord(
            peer_id=peer_id,
            price_per_hour=request.price_per_hour,
            link_bps=request.link_bps,
            backend=request.backend,
            hardware=request.hardware,
            listen_addrs=request.listen_addrs,
            remote_ip=remote_ip,
            joined_at=now,
            last_seen=now,
            version_held=request.version_held,
        )
        if previous is not None:
            # A rejoin keeps what the hub measured (its tallies are the store's: see HubService._on_join).
            record.rollouts_per_s, record.measured = previous.rollouts_per_s, previous.measured
            record.state = "standby" if previous.measured else "probing"
        self.nodes[peer_id] = record
        return record

    def get(self, peer_id: str) -> NodeRecord | None:
        return self.nodes.get(peer_id)

    def live(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state not in ("banned", "gone")]

    def in_state(self, *states: NodeState) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state in states]

    def record_work(self, record: NodeRecord, accepted_rollouts: int, seconds: float) -> None:
        """Fold one answered lease into the node's measured throughput (accepted rollouts per lease second)."""
        sample = accepted_rollouts / seconds if seconds > 0 else 0.0
        record.rollouts_per_s = sample if not record.measured else ewma(record.rollouts_per_s, sample, THROUGHPUT_EWMA_ALPHA)
        record.measured = True

    def silent_since(self, deadline: float) -> list[NodeRecord]:
        """Live nodes whose last heartbeat is older than `deadline`."""
        return [n for n in self.live() if n.last_seen < deadline]
