"""Which nodes peers can dial: the hub dials each joining node back, on a connection of its own.

The hub dials the IP it saw the node come from, on the TCP ports the node declares (its listen
addresses, or `--public-addr`), never a host the node names: a joiner cannot make the hub, or any
volunteer, dial a third host, and no name is resolved. The dial comes from a throwaway libp2p host
with a key of its own: the connection the node opened to the hub cannot answer for it, and the Noise
handshake proves the peer that answers is the node. Answered within PROBE_TIMEOUT_S: "public"; not:
"nated" (behind a NAT or a firewall: it dials out, nobody dials in). Not yet probed: "unknown", and
peers are told no address of it until a probe confirms one (they pull from the hub meanwhile).

Probes are scheduled by `DialBackQueue`: audited identities first, one probe at a time per address
(the peer guard's address key: an IPv4 address or an IPv6 /64) from a bucket that refills slowly,
each identity at most once per PROBE_INTERVAL_S, so throwaway identities on a few addresses cannot
starve honest nodes' probes. A probe that is not answered gets its verdict PROBE_VERDICT_S after it
started, refused or silent alike, so its timing says nothing about the port.

py-libp2p's AutoNAT is not used: its server answers through any existing connection to the asker,
so it reports every node dialable.

The hub also runs a circuit relay v2 service (`relay_service`): NATed nodes reserve on it so that a
NATed successor can reach them to coordinate a hole punch (node/nat.py). Its limits let signalling
through, never a snapshot. `RelayGate` stands in front of it: fleet members only, one message per
stream; a reservation only for the stream's own peer (py-libp2p takes it from the message), at most
RELAY_RESERVATIONS_PER_ADDRESS per address, for RELAY_RESERVATION_TTL_S, dropped when its node leaves;
a circuit only between two nodes the broadcaster planned to hole-punch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Container

import trio

from shared.buckets import TokenBuckets
from shared.crypto import Identity
from shared.logs import PeerLogLimiter
from shared.net import address_key, admit_only, build_host, connect, remote_peer_id

log = logging.getLogger("echo2.hub.reachability")

PROBE_TIMEOUT_S = 5.0
PROBES_AT_ONCE = 8
# A node's declared ports tried, at most: each unanswered one holds a probe slot PROBE_TIMEOUT_S.
PROBED_ADDRS = 2
# When a probe that was not answered gets its verdict, from its start: after the longest a probe can take.
PROBE_VERDICT_S = PROBED_ADDRS * PROBE_TIMEOUT_S + 1.0
# An identity is dialed back at most once in this long, whatever it rejoins with.
PROBE_INTERVAL_S = 30.0
# Probes per address key: a burst, then one per PROBE_REFILL_S.
PROBE_BURST = 16
PROBE_REFILL_S = 2.0
_LISTEN_RE = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/([0-9]{1,5})(?:/p2p/(\w+))?")
# The hub's circuit relay v2 carries hole-punch signalling (DCUtR) between NATed nodes, never snapshot
# bytes: a circuit ends after this much data or time.
RELAY_DATA_BYTES = 256 * 1024
RELAY_DURATION_S = 120
RELAY_RESERVATIONS = 4096
RELAY_CIRCUITS_PER_PEER = 4
# Nodes renew every node.nat.RESERVE_EVERY_S (120 s): a reservation lives a little longer than that.
RELAY_RESERVATION_TTL_S = 300
RELAY_RESERVATIONS_PER_ADDRESS = 8
RELAY_READ_TIMEOUT_S = 10.0


def relay_service(host):
    """The hub's circuit relay v2 service (run it with libp2p's background_trio_service, then guard_relay)."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits

    limits = RelayLimits(
        duration=RELAY_DURATION_S,
        data=RELAY_DATA_BYTES,
        max_circuit_conns=RELAY_CIRCUITS_PER_PEER,
        max_reservations=RELAY_RESERVATIONS,
        reservation_ttl=RELAY_RESERVATION_TTL_S,
    )
    return CircuitV2Protocol(host, limits=limits, allow_hop=True)


class RelayGate:
    """Who may use the hub's relay, for what (see the module docstring). Decisions are pure; `handle` applies
    them to a hop stream and hands what passes to py-libp2p's own reserve and connect handlers."""

    def __init__(
        self,
        relay,
        member: Callable[[str], bool],
        address_of: Callable[[str], str | None],
        planned_punch: Callable[[str, str], bool],
        refused: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self.relay = relay
        self.member = member
        self.address_of = address_of  # a member's address key (shared.net.address_key of where it connects from)
        self.planned_punch = planned_punch  # (initiator, target): the broadcaster planned a hole punch between them
        self.refused = refused  # counted against the peer, with why
        self._refusal_log = PeerLogLimiter()  # a member refused in a loop must not fill the disk with lines

    def _log_refusal(self, peer: str, reason: str) -> None:
        if (tail := self._refusal_log.tail(peer)) is not None:
            log.info("refused relay use by %s: %s%s", peer[-8:], reason, tail)

    def reserved(self) -> dict[str, str | None]:
        """peer -> address key of every reservation py-libp2p holds."""
        # py-libp2p 0.8.1 (pinned, shared/net.py) keeps them in a dict keyed by ID, with no way to list or drop one.
        return {peer.to_base58(): self.address_of(peer.to_base58()) for peer in self.relay.resource_manager._reservations}

    def reserve_refusal(self, peer: str, named: str | None) -> str | None:
        """Why `peer` may not reserve for `named` (None: itself), counted against it; None when it may."""
        return "a relay reservation for another peer" if named is not None and named != peer else None

    def address_full(self, peer: str) -> bool:
        """Its address holds RELAY_RESERVATIONS_PER_ADDRESS others' already (a limit, not the peer's fault)."""
        key = self.address_of(peer)
        return (
            key is not None and sum(k == key and p != peer for p, k in self.reserved().items()) >= RELAY_RESERVATIONS_PER_ADDRESS
        )

    def connect_refusal(self, source: str, target: str) -> str | None:
        if self.planned_punch(source, target) or self.planned_punch(target, source):
            return None
        return "a relay circuit to a node it was not planned to hole-punch with"

    def sweep(self) -> int:
        """Drop the reservations of peers no longer in the fleet; how many went."""
        from libp2p.peer.id import ID

        gone = [p for p in self.reserved() if not self.member(p)]
        for peer in gone:
            self.relay.resource_manager._reservations.pop(ID.from_base58(peer), None)
        return len(gone)

    async def handle(self, stream) -> None:
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol import StatusCode, _is_relayed_stream
        from libp2p.relay.circuit_v2.utils import read_delimited_msg

        peer = remote_peer_id(stream)
        if _is_relayed_stream(stream):  # the spec's rule: no relaying over a relayed connection
            await stream.reset()
            return
        with trio.fail_after(RELAY_READ_TIMEOUT_S):
            msg = await read_delimited_msg(stream, HopMessage)
        if msg.type == HopMessage.RESERVE:
            named = ID(msg.peer.id).to_base58() if msg.HasField("peer") and msg.peer.id else None
            reason = self.reserve_refusal(peer, named)
            if reason is None and self.address_full(peer):
                self._log_refusal(peer, f"its address holds {RELAY_RESERVATIONS_PER_ADDRESS} relay reservations already")
                await self._answer(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "this address holds its relay reservations")
                return
            if reason is None:
                msg.ClearField("peer")  # py-libp2p then reserves for the stream's own peer
                await self.relay._handle_reserve(stream, msg)
        elif msg.type == HopMessage.CONNECT:
            target = ID(msg.peer.id).to_base58() if msg.HasField("peer") and msg.peer.id else None
            reason = "a relay circuit to nobody" if target is None else self.connect_refusal(peer, target)
            if reason is None:
                await self.relay._handle_connect(stream, msg)
                return
        else:
            reason = f"relay message type {msg.type}"
        if reason is not None:
            self._log_refusal(peer, reason)
            await self._answer(stream, StatusCode.PERMISSION_DENIED, reason)
            await self.refused(peer, reason)
            return
        await stream.close()

    async def _answer(self, stream, status, reason: str) -> None:
        with trio.move_on_after(RELAY_READ_TIMEOUT_S):  # a peer that does not read its answer is not waited for
            await self.relay._send_status(stream, status, reason)
        await stream.close()  # not a reset: that would discard the answer


async def guard_relay(host, relay, gate: RelayGate, sweep_period_s: float = 5.0) -> None:
    """Only fleet members may reserve on or relay through the hub, and only as RelayGate says: strangers and banned
    peers are reset unread. Sweeps the reservations of nodes that left."""
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID

    await relay.event_started.wait()
    admit_only(host, PROTOCOL_ID, gate.handle, gate.member, log)
    while True:
        await trio.sleep(sweep_period_s)
        if dropped := gate.sweep():
            log.info("dropped %d relay reservations of nodes that left", dropped)


async def dial_back(peer_id: str, addrs: tuple[str, ...]) -> str | None:
    """The first of `addrs` (each ending in /p2p/<peer_id> or not; at most PROBED_ADDRS tried) at which
    `peer_id` answers a fresh dial, or None. Peers are then told that address only: a node cannot pass the
    probe at one address and send its peers to another."""
    for addr in addrs[:PROBED_ADDRS]:
        target = addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
        if not target.endswith(f"/p2p/{peer_id}"):
            continue  # an address naming another peer proves nothing about this one
        # A host of its own per address: a failed dial leaves py-libp2p's peerstore and backoff behind.
        host = build_host(Identity.generate())
        async with host.run(listen_addrs=[]):
            await host.get_network().auto_connector.stop()
            try:
                with trio.fail_after(PROBE_TIMEOUT_S):
                    await connect(host, target)
                return target
            except Exception as exc:  # noqa: BLE001 - refused, dropped, timed out, wrong key: all "not dialable"
                log.debug("dial-back of %s at %s failed: %r", peer_id[-8:], target, exc)
    return None


def probe_targets(peer_id: str, listen_addrs: tuple[str, ...], observed_ip: str | None) -> tuple[str, ...]:
    """Where the hub dials `peer_id` back: the IP it saw the node come from, on each TCP port the node declares
    (at most PROBED_ADDRS), never a host or name the node gives; none without an observed IP. An address
    naming another peer is skipped: it proves nothing about this one."""
    if observed_ip is None:
        return ()
    family = "ip6" if ":" in observed_ip else "ip4"
    ports: list[int] = []
    for addr in listen_addrs:
        match = _LISTEN_RE.fullmatch(addr)
        if match is None or (match.group(2) is not None and match.group(2) != peer_id):
            continue
        port = int(match.group(1))
        if 0 < port < 65536 and port not in ports:
            ports.append(port)
    return tuple(f"/{family}/{observed_ip}/tcp/{port}/p2p/{peer_id}" for port in ports[:PROBED_ADDRS])


class DialBackQueue:
    """Whose dial-back starts next (see the module docstring): a pure scheduler, the caller runs the probes.

    Per address key: one probe at a time, and a bucket of PROBE_BURST probes refilled at one per
    PROBE_REFILL_S (a machine running a few honest nodes is probed at once; throwaway identities on one
    address wait their turn). Per identity: one probe per PROBE_INTERVAL_S, whatever it rejoins with.
    """

    def __init__(self, interval_s: float = PROBE_INTERVAL_S, burst: int = PROBE_BURST, refill_s: float = PROBE_REFILL_S) -> None:
        self.interval_s = interval_s
        self._buckets = TokenBuckets(1.0 / refill_s, burst)
        self._waiting: dict[str, tuple[int, int, str]] = {}  # peer -> (priority: higher first, arrival, address key)
        self._busy: set[str] = set()  # address keys with a probe running
        self._probed: dict[str, float] = {}  # peer -> when its last probe started
        self._arrivals = 0

    def offer(self, peer: str, ip: str | None, priority: int) -> None:
        """Queue `peer` (seen at `ip`; priority: audits it passed). Offered again, it keeps its place."""
        if peer not in self._waiting:
            self._arrivals += 1
            self._waiting[peer] = (priority, self._arrivals, address_key(ip) or f"peer:{peer}")

    def retain(self, peers: Container[str]) -> None:
        """Forget waiting probes of nodes no longer in the fleet."""
        self._waiting = {p: v for p, v in self._waiting.items() if p in peers}

    def __contains__(self, peer: str) -> bool:
        return peer in self._waiting

    def take(self, now: float) -> tuple[str, str] | None:
        """The next (peer, address key) to probe, or None while no waiting one may start now."""
        ready = [
            (-prio, seq, peer, key)
            for peer, (prio, seq, key) in self._waiting.items()
            if key not in self._busy
            and self._buckets.level(key, now) >= 1.0
            and now - self._probed.get(peer, -self.interval_s) >= self.interval_s
        ]
        if not ready:
            return None
        _, _, peer, key = min(ready)
        del self._waiting[peer]
        self._busy.add(key)
        self._buckets.take(key, now)
        self._probed[peer] = now
        return peer, key

    def done(self, key: str) -> None:
        self._busy.discard(key)

    def prune(self, now: float) -> None:
        """Forget identities rested past the interval (the buckets bound themselves, hub.trust.guard.TokenBuckets)."""
        self._probed = {p: at for p, at in self._probed.items() if now - at < self.interval_s}
