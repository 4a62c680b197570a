"""Sybil and resource limits: lease quotas per identity and per address, and per-peer stream/rate/memory caps.

Identities are free (an Ed25519 key), addresses are not: quotas count open leases per peer id
and per address (IPv4 address, IPv6 /64), and a new identity gets 1-prompt leases until it has
passed a few audits, so a swarm of fresh keys costs the hub little and earns little.

`PeerGuard` is asked before every inbound stream is served. A peer over one of its caps
(concurrent streams, token-bucket stream rate, frame bytes it may pin in hub memory) is told to
retry later; a peer refused `violations_to_disconnect` times within `violation_window_s` is
disconnected and refused outright for `disconnect_cooldown_s`. Honest nodes open a heartbeat
every couple of seconds and a lease/submit pair per lease, far below the defaults.

Both classes are plain bookkeeping with the clock passed in; the hub calls them from its trio thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from hub.config import TrustConfig
from shared.net import address_key

STREAM_RETRY_S = 0.5
MEMORY_RETRY_S = 1.0


@dataclass(frozen=True)
class QuotaDecision:
    allowed: bool
    prompts: int
    reason: str = ""


class LeaseQuota:
    """How many prompts a node may be leased now, given the leases already open."""

    def __init__(self, config: TrustConfig, prompts_per_lease: int) -> None:
        if prompts_per_lease < 1:
            raise ValueError(f"prompts_per_lease must be >= 1, got {prompts_per_lease}")
        self.config = config
        self.prompts_per_lease = prompts_per_lease

    def prompts_for(self, audits_passed: int) -> int:
        if audits_passed < self.config.trusted_after_audits:
            return min(self.config.lease_new_node_prompts, self.prompts_per_lease)
        return self.prompts_per_lease

    def decide(
        self,
        peer_id: str,
        ip: str | None,
        audits_passed: int,
        open_by_peer: int,
        open_by_address: Mapping[str, int],
        exempt: Collection[str] = frozenset(),
    ) -> QuotaDecision:
        """`open_by_peer`: leases this peer holds open; `open_by_address`: open leases per address key, the
        operator's own nodes left out. `exempt`: those own nodes (the ones `echo-hub start` spawned), which
        share its address without sharing a Sybil's quota."""
        key = address_key(ip)
        by_address = open_by_address.get(key, 0) if key is not None and peer_id not in exempt else 0
        prompts = self.prompts_for(audits_passed)
        if open_by_peer >= self.config.max_open_leases_per_peer:
            return QuotaDecision(
                False, 0, f"{open_by_peer} leases open for this node (max {self.config.max_open_leases_per_peer})"
            )
        if by_address >= self.config.max_open_leases_per_ip:
            return QuotaDecision(
                False, 0, f"{by_address} leases open for address {key} (max {self.config.max_open_leases_per_ip})"
            )
        return QuotaDecision(True, prompts)


Verdict = Literal["admit", "throttle", "disconnect"]


@dataclass(frozen=True)
class Admission:
    """The guard's answer for one inbound stream; `reserved_bytes` must be released with the stream."""

    verdict: Verdict
    retry_after_s: float = 0.0
    reason: str = ""
    reserved_bytes: int = 0

    @property
    def admitted(self) -> bool:
        return self.verdict == "admit"


@dataclass
class _Peer:
    tokens: float
    refilled_at: float
    last_active: float
    streams: int = 0
    buffered_bytes: int = 0
    violations: deque[float] = field(default_factory=deque)
    disconnected_until: float = 0.0


class PeerGuard:
    """Per-peer caps on concurrent streams, stream rate and buffered frame bytes, plus a global byte cap."""

    def __init__(self, config: TrustConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self.buffered_bytes = 0

    def _peer(self, peer_id: str, now: float) -> _Peer:
        state = self._peers.get(peer_id)
        if state is None:
            state = self._peers[peer_id] = _Peer(tokens=float(self.config.request_burst), refilled_at=now, last_active=now)
        state.tokens = min(
            float(self.config.request_burst), state.tokens + (now - state.refilled_at) * self.config.requests_per_s
        )
        state.refilled_at = now
        state.last_active = now
        return state

    def _refuse(self, state: _Peer, now: float, retry_after_s: float, reason: str) -> Admission:
        window_start = now - self.config.violation_window_s
        while state.violations and state.violations[0] < window_start:
            state.violations.popleft()
        state.violations.append(now)
        if len(state.violations) >= self.config.violations_to_disconnect:
            state.violations.clear()
            state.disconnected_until = now + self.config.disconnect_cooldown_s
            return Admission("disconnect", self.config.disconnect_cooldown_s, f"{reason}; repeated violations: disconnected")
        return Admission("throttle", retry_after_s, reason)

    def admit(self, peer_id: str, reserve_bytes: int) -> Admission:
        """May `peer_id` open a stream whose frames may pin up to `reserve_bytes` of hub memory?"""
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        now = self.clock()
        state = self._peer(peer_id, now)
        if now < state.disconnected_until:
            return Admission("disconnect", state.disconnected_until - now, "disconnected for repeated violations")
        if state.streams >= self.config.max_streams_per_peer:
            return self._refuse(
                state, now, STREAM_RETRY_S, f"{state.streams} streams open (max {self.config.max_streams_per_peer})"
            )
        if state.tokens < 1.0:
            wait = (1.0 - state.tokens) / self.config.requests_per_s
            return self._refuse(state, now, wait, f"over {self.config.requests_per_s:g} requests/s")
        if state.buffered_bytes + reserve_bytes > self.config.max_buffered_bytes_per_peer:
            return self._refuse(state, now, MEMORY_RETRY_S, f"{state.buffered_bytes} bytes buffered for this peer")
        if self.buffered_bytes + reserve_bytes > self.config.max_buffered_bytes_total:
            # The hub as a whole is full: not this peer's fault, so no violation is counted.
            return Admission("throttle", MEMORY_RETRY_S, "hub busy")
        state.tokens -= 1.0
        state.streams += 1
        state.buffered_bytes += reserve_bytes
        self.buffered_bytes += reserve_bytes
        return Admission("admit", reserved_bytes=reserve_bytes)

    def release(self, peer_id: str, admission: Admission) -> None:
        """The admitted stream ended: free its slot and its bytes."""
        if not admission.admitted:
            raise ValueError("only admitted streams are released")
        state = self._peers[peer_id]
        state.streams -= 1
        state.buffered_bytes -= admission.reserved_bytes
        self.buffered_bytes -= admission.reserved_bytes
        state.last_active = self.clock()

    def last_active(self, peer_id: str) -> float | None:
        """When the peer last opened or closed a stream (None: not seen, or forgotten by `prune`)."""
        state = self._peers.get(peer_id)
        return None if state is None else state.last_active

    def prune(self, idle_s: float) -> int:
        """Forget peers idle for `idle_s` with nothing open and no cooldown running; how many."""
        now = self.clock()
        gone = [
            peer
            for peer, s in self._peers.items()
            if s.streams == 0 and now - s.last_active > idle_s and now >= s.disconnected_until
        ]
        for peer in gone:
            del self._peers[peer]
        return len(gone)
