"""The hub's dial-back (hub/reachability.py) on loopback: a node that answers a fresh dial is public; an address
that refuses, or answers with another key, is not. And `echo-node join --public-addr` is checked up front."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from hub.reachability import dial_back
from shared.crypto import Identity
from shared.net import connect, running_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@pytest.mark.trio
async def test_dial_back_answers_only_for_the_node_itself_on_a_connection_of_its_own():
    node, hub = Identity.generate(), Identity.generate()
    async with running_host(node, [LOOPBACK]) as (node_host, node_addrs), running_host(hub, [LOOPBACK]) as (_host, hub_addrs):
        assert await dial_back(node.peer_id, tuple(node_addrs)) == node_addrs[0]
        bare = node_addrs[0].split("/p2p/")[0]
        assert await dial_back(node.peer_id, (bare,)) == node_addrs[0]  # the peer id is added and checked
        assert await dial_back(Identity.generate().peer_id, (bare,)) is None  # another key answers there
        assert await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1",)) is None  # nobody listens
        # The address that answered is the one returned (peers are told that one only); at most two are tried.
        assert await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1", node_addrs[0])) == node_addrs[0]
        assert await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2", node_addrs[0])) is None
        # The node's own connection to the hub proves nothing: a node that cannot be dialed stays so.
        await connect(node_host, hub_addrs[0])
        assert await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1",)) is None


def test_a_malformed_public_addr_is_one_line_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--hub", "/ip4/127.0.0.1/tcp/4077/p2p/12D3KooWQY",
         "--public-addr", "203.0.113.5:4001"], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "public_addr" in line.replace("-", "_"), line


@pytest.mark.trio
async def test_two_nated_nodes_hole_punch_and_after_a_failed_punch_a_dialable_node_goes_between():
    from types import SimpleNamespace

    from tests.peers import hub_peer
    from tests.relay_scenarios import Hub, join

    async with hub_peer(Identity.generate()) as peer:
        hub = Hub(peer, "chain")
        a, b, c = (SimpleNamespace(peer_id=Identity.generate().peer_id, addr=f"/ip4/127.0.0.1/tcp/{port}")
                   for port in (4101, 4102, 4103))
        records = {n.peer_id: join(hub.fleet, n) for n in (a, b, c)}
        records[a.peer_id].reachability = records[b.peer_id].reachability = "nated"
        records[c.peer_id].reachability = "public"
        hub.broadcaster.chains = [[a.peer_id, b.peer_id, c.peer_id]]
        links = hub.broadcaster.links
        assert [links(n.peer_id).kind for n in (a, b, c)] == ["hub", "holepunch", "pushed"]
        assert links(a.peer_id).downstream == b.peer_id
        records[c.peer_id].answered_addr = f"{c.addr}/p2p/{c.peer_id}"
        assert links(b.peer_id).downstream_addrs == (records[c.peer_id].answered_addr,)  # only what answered
        hub.broadcaster.punch_failed(b.peer_id, c.peer_id)  # not its upstream: not believed
        hub.broadcaster.punch_failed(c.peer_id, b.peer_id)  # not a punched link: not believed
        assert links(b.peer_id).kind == "holepunch" and links(c.peer_id).kind == "pushed"
        hub.broadcaster.punch_failed(b.peer_id, a.peer_id)  # b's heartbeat: its punch with a failed
        assert records[b.peer_id].punch_failed_with == a.peer_id
        # Separated at once: the public node goes between the NATed ones.
        assert hub.broadcaster.chains == [[a.peer_id, c.peer_id, b.peer_id]]
        assert [links(n.peer_id).kind for n in (a, c, b)] == ["hub", "pushed", "direct"]


@pytest.mark.trio
async def test_only_fleet_members_may_use_the_hubs_relay():
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
    from libp2p.tools.anyio_service import background_trio_service

    from hub.reachability import guard_relay, relay_service
    from shared.net import open_stream

    hub, member, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    async with running_host(hub, [LOOPBACK]) as (hub_host, hub_addrs), \
            running_host(member, [LOOPBACK]) as (member_host, _), running_host(stranger, [LOOPBACK]) as (stranger_host, _):
        relay = relay_service(hub_host)
        async with background_trio_service(relay), trio.open_nursery() as nursery:
            nursery.start_soon(guard_relay, hub_host, relay, lambda peer: peer == member.peer_id)
            await relay.event_started.wait()
            await trio.sleep(0.1)
            for host in (member_host, stranger_host):
                await connect(host, hub_addrs[0])
            stream = await open_stream(stranger_host, hub.peer_id, PROTOCOL_ID)
            with trio.fail_after(5), pytest.raises(Exception):  # reset unread: nothing ever comes back
                await stream.write(b"\x08\x00")
                await stream.read(1)
            from node.nat import NatTraversal

            nat = NatTraversal(member_host, hub_addrs[0], lambda peer: False)
            async with nat.running():
                await nat.reserve(nursery)
                assert nat.reserved_at is not None
            nursery.cancel_scope.cancel()
