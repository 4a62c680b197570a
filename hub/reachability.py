"""Which nodes peers can dial: the hub dials each joining node back, on a connection of its own.

A node's listen addresses (0.0.0.0 replaced by the address the hub saw it come from, or the address
it declares with `--public-addr`) are dialed from a throwaway libp2p host with a key of its own: the
connection the node opened to the hub cannot answer for it, and the Noise handshake proves the
peer that answers is the node. Answered within PROBE_TIMEOUT_S: "public"; not: "nated" (behind a
NAT or a firewall: it dials out, nobody dials in). Not yet probed: "unknown".

py-libp2p's AutoNAT is not used: its server answers through any existing connection to the asker,
so it reports every node dialable.

The hub also runs a circuit relay v2 service (`relay_service`): NATed nodes reserve on it so that a
NATed successor can reach them to coordinate a hole punch (node/nat.py). Its limits let signalling
through, never a snapshot.
"""

from __future__ import annotations

import logging

import trio

from shared.crypto import Identity
from shared.net import build_host, connect

log = logging.getLogger("echo2.hub.reachability")

PROBE_TIMEOUT_S = 5.0
PROBES_AT_ONCE = 8
# The hub's circuit relay v2 carries hole-punch signalling (DCUtR) between NATed nodes, never snapshot
# bytes: a circuit ends after this much data or time.
RELAY_DATA_BYTES = 256 * 1024
RELAY_DURATION_S = 120
RELAY_RESERVATIONS = 4096
RELAY_CIRCUITS_PER_PEER = 4
RELAY_RESERVATION_TTL_S = 3600


def relay_service(host):
    """The hub's circuit relay v2 service (run it with libp2p's background_trio_service)."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits

    limits = RelayLimits(duration=RELAY_DURATION_S, data=RELAY_DATA_BYTES, max_circuit_conns=RELAY_CIRCUITS_PER_PEER,
                         max_reservations=RELAY_RESERVATIONS, reservation_ttl=RELAY_RESERVATION_TTL_S)
    return CircuitV2Protocol(host, limits=limits, allow_hop=True)


async def dial_back(peer_id: str, addrs: tuple[str, ...]) -> bool:
    """Whether `peer_id` answers a fresh dial at one of `addrs` (each ending in /p2p/<peer_id> or not)."""
    if not addrs:
        return False  # it listens nowhere: nothing to dial
    host = build_host(Identity.generate())
    async with host.run(listen_addrs=[]):
        await host.get_network().auto_connector.stop()
        for addr in addrs:
            target = addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
            if not target.endswith(f"/p2p/{peer_id}"):
                continue  # an address naming another peer proves nothing about this one
            try:
                with trio.fail_after(PROBE_TIMEOUT_S):
                    await connect(host, target)
                return True
            except Exception as exc:  # noqa: BLE001 - refused, dropped, timed out, wrong key: all "not dialable"
                log.debug("dial-back of %s at %s failed: %r", peer_id[-8:], target, exc)
    return False
