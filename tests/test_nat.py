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
            # (hub.method.chains.proven_first). So the links are judged on two versions installed under one plan.
            plan: dict = {}

            def installed_under_one_plan():
                status = hub.status()
                if status is None:
                    return None
                held = {n.peer_id: n.version_held for n in status.nodes}
                if plan.get("chains") != status.chains:
                    plan.update(chains=status.chains, after=max(held.values()) + 2)
                    return None
                return status if all(v >= plan["after"] for v in held.values()) else None

            status = wait_until(installed_under_one_plan, 180, "every node holding two versions more under one plan")
            states = {n.peer_id: n for n in status.nodes}
        finally:
            stop_all([*nodes, hub])
    ids = {name: json.loads((tmp_path / name / "node_status.json").read_text())["peer_id"] for name in places}
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
        installs = [line for line in (tmp_path / name_of[peer] / "node.log").read_text().splitlines() if "installed v" in line]
        assert f"last from {up[-8:]}" in installs[-1], installs


def test_two_nated_nodes_hole_punch_through_the_hubs_relay(tmp_path):
    ids, states, status = run_fleet(tmp_path, with_public_node=False)
    (chain,) = status.chains
    assert [states[p].link for p in chain] == ["hub", "holepunch"]
    tail = next(name for name, peer in ids.items() if peer == chain[1])
    installs = [line for line in (tmp_path / tail / "node.log").read_text().splitlines() if "installed v" in line]
    # Its newest snapshot came from the other NATed node: over a direct connection, which between two NATs
    # only a hole punch opens (the hub's relay cuts a circuit after 256 KiB; a snapshot is 4.2 MB).
    assert f"last from {chain[0][-8:]}" in installs[-1], installs
