"""Home volunteers behind NAT, in Linux network namespaces this test builds (tests/netns.py): the hub and a
public node on a public segment, two nodes each behind its own MASQUERADE router. The hub dials each
node back to learn who is dialable, plans the chain so no NATed node has to dial a NATed one, and has
a NATed upstream dial its public successor; every node installs every snapshot bit-exact."""

from __future__ import annotations

import json

import pytest

from tests.harness import Proc, query, wait_until
from tests.netns import PUBLIC_NODE_IP, Topology, unavailable
from tests.test_broadcast import HUB_TOML, node_states, stop_all

REASON = unavailable()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"NAT test: {REASON}")]


def test_nated_nodes_get_links_they_can_make_and_install_every_snapshot_bit_exact(tmp_path):
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    (hub_dir / "hub.toml").write_text(HUB_TOML)
    with Topology() as net:
        hub = net.start_hub(hub_dir, "--config", str(hub_dir / "hub.toml"), "--prompts-per-step", "2",
                            "--group-size", "4", "--kappa", "1", "--staleness", "1", "--max-new-tokens", "4")
        nodes: list[Proc] = []
        try:
            places = {"public": (net.public, f"/ip4/{PUBLIC_NODE_IP}/tcp/0"),
                      "home-1": (net.homes[0], "/ip4/0.0.0.0/tcp/0"), "home-2": (net.homes[1], "/ip4/0.0.0.0/tcp/0")}
            nodes = [net.start_node(ns, tmp_path / name, listen, hub.addr, "--max-rollouts-per-s", "20")
                     for name, (ns, listen) in places.items()]

            def planned() -> dict | None:
                by = node_states(hub)
                if len(by) < 3 or any(n.reachability == "unknown" for n in by.values()):
                    return None
                return by if all(n.version_held >= 3 for n in by.values()) else None

            states = wait_until(planned, 240, "three probed nodes holding v3")
            status = hub.status()
        finally:
            stop_all([*nodes, hub])
    ids = {name: json.loads((tmp_path / name / "node_status.json").read_text())["peer_id"] for name in places}
    assert {name: states[ids[name]].reachability for name in places} == {
        "public": "public", "home-1": "nated", "home-2": "nated"}
    # One chain; the public node sits between the two NATed ones: the first pulls from the hub, dials the
    # public node, which pulls over that connection ("pushed"), and the second NATed node dials the public one.
    (chain,) = status.chains
    assert chain[1] == ids["public"]
    assert [states[p].link for p in chain] == ["hub", "pushed", "direct"]
    hashes = dict(query(hub_dir, "SELECT version, manifest_hash FROM snapshots"))
    for name in places:
        records = [json.loads(p.read_text()) for p in (tmp_path / name / "installed").glob("v*.json")]
        assert len(records) >= 3 and all(r["bytes_blake3"] == hashes[r["version"]] for r in records), name
