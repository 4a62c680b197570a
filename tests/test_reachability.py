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
        assert await dial_back(node.peer_id, tuple(node_addrs))
        bare = node_addrs[0].split("/p2p/")[0]
        assert await dial_back(node.peer_id, (bare,))  # the peer id is added and checked
        assert not await dial_back(Identity.generate().peer_id, (bare,))  # another key answers there
        assert not await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1",))  # nobody listens
        # The node's own connection to the hub proves nothing: a node that cannot be dialed stays so.
        await connect(node_host, hub_addrs[0])
        assert not await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1",))
        with trio.fail_after(30):  # several unreachable addresses are each given up on, not waited on forever
            assert not await dial_back(node.peer_id, ("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"))


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
        records[b.peer_id].punch_failed_with = a.peer_id  # b's heartbeat said its punch with a failed
        assert links(b.peer_id).kind == "hub" and links(b.peer_id).upstream is None
        assert links(a.peer_id).downstream is None  # a no longer waits to serve b
        hub.broadcaster.replan()
        assert hub.broadcaster.chains == [[a.peer_id, c.peer_id, b.peer_id]]
        assert [links(n.peer_id).kind for n in (a, c, b)] == ["hub", "pushed", "direct"]
