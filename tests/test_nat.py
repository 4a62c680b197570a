"""Home volunteers behind NAT, in Linux network namespaces this test builds (testbed/netns.py): the hub on a
public segment, a public node beside it, and nodes each behind its own MASQUERADE router that drops what
it did not ask for. The hub dials each node back to learn who is dialable and plans each link by it: a
node dials a dialable upstream, a NATed upstream dials its dialable successor, and two NATed nodes
hole-punch through the hub's relay. Every node installs every snapshot bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hub.method.chains import link_kind
from testbed.harness import HUB_TOML, Proc, node_states, query, stop_all, wait_until
from testbed.netns import PUBLIC_NODE_LISTEN, Topology, unavailable

REASON = unavailable()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"NAT test: {REASON}")]


def node_view(node_dir: Path) -> dict:
    """The node's own account of itself (NodeView, rewritten every second)."""
    return json.loads((node_dir / "node_status.json").read_text())


def heard_one_plan(hub, node_dirs: list[Path], plan: dict):
    """The hub's status once every node has installed two versions since its own status first named the upstream
    the hub's current chains give it; None before (the chains' change starts the count again)."""
    status = hub.status()
    if status is None:
        return None
    if plan.get("chains") != status.chains:
        plan.update(chains=status.chains, heard={})
        return None
    upstream = {peer: chain[i - 1] if i else None for chain in status.chains for i, peer in enumerate(chain)}
    views = [node_view(d) for d in node_dirs if (d / "node_status.json").exists()]
    heard = plan["heard"]
    for view in views:
        if view["peer_id"] in upstream and view["peer_id"] not in heard and view["upstream"] == upstream[view["peer_id"]]:
            heard[view["peer_id"]] = view["version_held"]
    done = len(heard) == len(node_dirs) and all(view["version_held"] >= heard[view["peer_id"]] + 2 for view in views)
    return status if done else None


def newest_install(node_dir: Path) -> dict:
    """The record testbed.recording_node wrote for the node's newest install."""
    return max((json.loads(p.read_text()) for p in (node_dir / "installed").glob("v*.json")), key=lambda r: r["version"])


def pulls_logged(node_dir: Path) -> list[str]:
    """node.log's lines about its snapshot pulls: what a failed link assertion shows."""
    words = ("snapshot v", "re-linked", "installed v", "upstream")
    return [line for line in (node_dir / "node.log").read_text().splitlines() if any(w in line for w in words)][-30:]


def run_fleet(tmp_path: Path, with_public_node: bool):
    """A hub and its nodes in the namespaces until every node, once probed, installed two more versions:
    (names -> peer ids, node states, hub status)."""
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    (hub_dir / "hub.toml").write_text(HUB_TOML)
    with Topology() as net:
        hub = net.start_hub(
            hub_dir,
            "--config",
            str(hub_dir / "hub.toml"),
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--kappa",
            "1",
            "--staleness",
            "1",
            "--max-new-tokens",
            "4",
        )
        places = {"home-1": (net.homes[0], "/ip4/0.0.0.0/tcp/0"), "home-2": (net.homes[1], "/ip4/0.0.0.0/tcp/0")}
        if with_public_node:
            places["public"] = (net.public, PUBLIC_NODE_LISTEN)
        nodes: list[Proc] = []
        try:
            nodes = [
                net.start_node(ns, tmp_path / name, listen, hub.addr, "--max-rollouts-per-s", "20")
                for name, (ns, listen) in places.items()
            ]

            def probed() -> dict | None:
                by = node_states(hub)
                return by if len(by) == len(places) and all(n.reachability != "unknown" for n in by.values()) else None

            # Until its dial-back's verdict a node pulls from the hub: the planned links carry what comes after.
            wait_until(probed, 120, f"{len(places)} probed nodes")
            # The chains still change after that: a node the hub measures moves ahead of those it has not
            # (hub.method.chains.proven_first), and a node hears its upstream only with its next heartbeat reply.
            # So the links are judged on two versions each node installed after it heard one plan the hub holds.
            plan: dict = {}
            status = wait_until(
                lambda: heard_one_plan(hub, [tmp_path / name for name in places], plan),
                180,
                "every node holding two versions more since it heard one plan",
            )
            states = {n.peer_id: n for n in status.nodes}
        finally:
            stop_all([*nodes, hub])
    ids = {name: node_view(tmp_path / name)["peer_id"] for name in places}
    hashes = dict(query(hub_dir, "SELECT version, manifest_hash FROM snapshots"))
    for name in places:
        records = [json.loads(p.read_text()) for p in (tmp_path / name / "installed").glob("v*.json")]
        assert records and all(r["bytes_blake3"] == hashes[r["version"]] for r in records), name
    return ids, states, status


def test_every_link_is_made_the_way_its_ends_allow_and_installs_are_bit_exact(tmp_path):
    ids, states, status = run_fleet(tmp_path, with_public_node=True)
    assert {name: states[peer].reachability for name, peer in ids.items()} == {
        "public": "public",
        "home-1": "nated",
        "home-2": "nated",
    }
    (chain,) = status.chains
    expected = [
        link_kind(states[chain[i - 1]].reachability if i else None, states[peer].reachability) for i, peer in enumerate(chain)
    ]
    assert [states[p].link for p in chain] == expected
    assert {"hub"} < set(expected)
    name_of = {peer: name for name, peer in ids.items()}
    for up, peer in zip(chain, chain[1:]):  # each got its newest snapshot from its upstream, as planned
        node_dir = tmp_path / name_of[peer]
        assert newest_install(node_dir)["source"] == up[-8:], pulls_logged(node_dir)


def test_two_nated_nodes_hole_punch_through_the_hubs_relay(tmp_path):
    ids, states, status = run_fleet(tmp_path, with_public_node=False)
    (chain,) = status.chains
    assert [states[p].link for p in chain] == ["hub", "holepunch"]
    tail = tmp_path / next(name for name, peer in ids.items() if peer == chain[1])
    # Its newest snapshot came from the other NATed node: over a direct connection, which between two NATs
    # only a hole punch opens (the hub's relay cuts a circuit after 256 KiB; a snapshot is 4.2 MB).
    assert newest_install(tail)["source"] == chain[0][-8:], pulls_logged(tail)
