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
from collections.abc import Callable

import trio

from shared.crypto import Identity
from shared.net import admit_only, build_host, connect

log = logging.getLogger("echo2.hub.reachability")

PROBE_TIMEOUT_S = 5.0
PROBES_AT_ONCE = 8
# A node's listen addresses tried, at most: each unanswered one holds a probe slot PROBE_TIMEOUT_S.
PROBED_ADDRS = 2
# The hub's circuit relay v2 carries hole-punch signalling (DCUtR) between NATed nodes, never snapshot
# bytes: a circuit ends after this much data or time.
RELAY_DATA_BYTES = 256 * 1024
RELAY_DURATION_S = 120
RELAY_RESERVATIONS = 4096
RELAY_CIRCUITS_PER_PEER = 4
RELAY_RESERVATION_TTL_S = 3600


def relay_service(host):
    """The hub's circuit relay v2 service (run it with libp2p's background_trio_service, then guard_relay)."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits

    limits = RelayLimits(duration=RELAY_DURATION_S, data=RELAY_DATA_BYTES, max_circuit_conns=RELAY_CIRCUITS_PER_PEER,
                         max_reservations=RELAY_RESERVATIONS, reservation_ttl=RELAY_RESERVATION_TTL_S)
    return CircuitV2Protocol(host, limits=limits, allow_hop=True)


async def guard_relay(host, relay, member: Callable[[str], bool]) -> None:
    """Only fleet members may reserve on or relay through the hub: strangers and banned peers are reset."""
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID

    await relay.event_started.wait()
    admit_only(host, PROTOCOL_ID, relay._handle_hop_stream, member, log)


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
