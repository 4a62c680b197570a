"""The node's side of NAT traversal: a reservation on the hub's relay, and hole punches to a NATed upstream.

A node the hub found NATed (hub/distribution/reachability.py) reserves a slot on the hub's circuit relay v2, so
that a NATed successor can reach it through the hub. The successor dials it there
(`/<hub>/p2p-circuit/p2p/<upstream>`) and runs DCUtR over that relayed connection: both exchange
the addresses the hub observed them at and dial each other at once, which opens both NATs. On
success the relayed connection is closed and the snapshot flows over the direct one; the relay
carries signalling only (its limits cut anything bigger). On failure the keeper pulls from the hub
and the heartbeat says so, so the hub stops planning that pair.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from shared.net import admit_only, open_stream

log = logging.getLogger("echo2.node.nat")

PUNCH_TIMEOUT_S = 20.0
RESERVE_EVERY_S = 120.0
RELAY_RETRY_S = 0.5
DIAL_TIMEOUT_S = 5  # each simultaneous-open dial of a punch


def _relayed(conn) -> bool:
    return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())


class NatTraversal:
    """Relay reservation and hole punching for one node's host."""

    def __init__(self, host: IHost, hub_addr: str, neighbour: Callable[[str], bool]) -> None:
        """`neighbour(peer id)`: whether that peer is our chain neighbour, the only one we hole-punch with
        (relayed connections come through our hub's relay only)."""
        self.host = host
        self.neighbour = neighbour
        self.hub_addr = hub_addr
        self.hub_id = ID.from_base58(hub_addr.rsplit("/p2p/", 1)[1])
        self.stop = CircuitV2Protocol(host, allow_hop=False)  # accepts connections relayed to us
        self.dcutr = DCUtRProtocol(host, dial_timeout=DIAL_TIMEOUT_S)
        self.transport = CircuitV2Transport(host, self.stop, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
        self.reserved_at: float | None = None  # trio.current_time() of our last reservation on the hub
        self.reserving = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[NatTraversal]:
        async with background_trio_service(self.stop), background_trio_service(self.dcutr):
            await self.stop.event_started.wait()
            await self.dcutr.event_started.wait()
            # A relayed connection is handed to us by the relay itself: only our hub's may.
            admit_only(self.host, STOP_PROTOCOL, self.stop._handle_stop_stream, lambda peer: peer == self.hub_id.to_base58(), log)
            admit_only(self.host, DCUTR_PROTOCOL, self.dcutr._handle_dcutr_stream, self.neighbour, log)
            yield self

    def needs_reservation(self) -> bool:
        """No reservation yet, none in flight, or one old enough to renew (a hub that restarted forgot it)."""
        return not self.reserving and (self.reserved_at is None or trio.current_time() - self.reserved_at > RESERVE_EVERY_S)

    async def reserve(self, nursery: trio.Nursery) -> None:
        """A slot on the hub's relay, so NATed successors can reach us; one attempt at a time."""
        self.reserving = True
        try:
            stream = await open_stream(self.host, self.hub_id.to_base58(), HOP_PROTOCOL)
            try:
                held = await self.transport.reserve(stream, self.hub_id, nursery)
            finally:
                await stream.close()
        finally:
            self.reserving = False
        if held:
            self.reserved_at = trio.current_time()
        log.info("relay reservation on the hub: %s", "held" if held else "refused")

    def direct(self, peer_id: str) -> bool:
        conns = self.host.get_network().connections.get(ID.from_base58(peer_id), [])
        return any(not _relayed(c) for c in conns)

    async def punch(self, peer_id: str) -> bool:
        """A direct connection to the NATed `peer_id`, through the hub's relay and DCUtR; True once it exists."""
        if self.direct(peer_id):
            return True
        peer = ID.from_base58(peer_id)
        circuit = Multiaddr(f"{self.hub_addr}/p2p-circuit/p2p/{peer_id}")
        try:
            with trio.fail_after(PUNCH_TIMEOUT_S):
                while True:
                    try:
                        await self.transport.dial(circuit)
                        break
                    except ConnectionError as exc:
                        # The upstream learns it is NATed, and reserves, on the same heartbeat round we learn
                        # to punch to it: its reservation may be a moment behind.
                        log.debug("relay to %s not ready: %r", peer_id[-8:], exc)
                        await trio.sleep(RELAY_RETRY_S)
                # Its listen addresses are unreachable by definition: dialing them first (DCUtR's "unilateral
                # upgrade") would only wait out a timeout before the real exchange.
                self.host.get_peerstore().clear_addrs(peer)
                punched = await self.dcutr.initiate_hole_punch(peer)
        except Exception as exc:  # noqa: BLE001 - a relay refusal, a timeout, a peer gone: the punch failed
            log.info("hole punch with %s failed: %r", peer_id[-8:], exc)
            return False
        if not (punched and self.direct(peer_id)):
            log.info("hole punch with %s failed: no direct connection came up", peer_id[-8:])
            return False
        for conn in list(self.host.get_network().connections.get(peer, [])):
            if _relayed(conn):  # the snapshot must not go through the hub's relay
                await conn.close()
        log.info("hole punch with %s: direct", peer_id[-8:])
        return True
