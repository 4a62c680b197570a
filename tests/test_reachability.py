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
