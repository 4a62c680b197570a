"""NAT: snapshot broadcasts to volunteers behind home routers, against the same fleet with no NAT.

Usage (root: it builds network namespaces): python bench/nat.py [--json] [--link-mbps 100] [--versions 5]

Topology (testbed/netns.py): the hub on a public segment; in the "nat" run one node beside it and two
nodes each behind its own MASQUERADE router, in the "no_nat" run the same three nodes all on the
public segment. Each run is a real hub and three real recording nodes, every link emulated at
--link-mbps (the hub's uplink too, so one chain), the learner publishing every step (kappa 1,
S 1) until --versions versions published after the hub probed every node have a T_bcast recorded.

Printed: links (each chain link as the hub planned it: "hub" for a pull from the hub, "direct" for
a node dialing its upstream, "pushed" for a NATed upstream dialing its successor, "holepunch" for
two NATed nodes punching through; mbps is the rate the receiving node got its newest snapshot at,
from its log: bytes over the time from its first chunk to its install), t_bcast_s and
t_bcast_no_nat_s (mean T_bcast over those versions), hub_relay_bytes (snapshot bytes through the
hub's relay: it carries hole-punch signalling only and cuts a circuit after 256 KiB, so 0),
all_bit_exact (every file every node installed hashes as the hub's). Targets (issue 18):
hub_relay_bytes = 0 when no link is relayed, t_bcast_s <= 1.3 x t_bcast_no_nat_s, bit-exact.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from shared.units import BYTES_PER_MBIT  # noqa: E402
from testbed.harness import HUB_TOML, node_states, query, stop_all, wait_until  # noqa: E402  # noqa: E402
from testbed.netns import PUBLIC_NODE_LISTEN, Topology, unavailable  # noqa: E402

RUN_TIMEOUT_S = 600.0
_INSTALLED = re.compile(r"installed v(\d+) \(([\d.]+)s, (?:a delta of )?(\d+) bytes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--link-mbps", type=float, default=100.0, help="emulated rate of every link")
    parser.add_argument("--versions", type=int, default=5, help="timed broadcasts after v0 per run")
    return parser.parse_args(argv)


def last_rate_mbps(node_dir: Path) -> float | None:
    """The rate this node received its newest snapshot at, from its log."""
    found = _INSTALLED.findall((node_dir / "node.log").read_text()) if (node_dir / "node.log").exists() else []
    if not found:
        return None
    _, seconds, size = found[-1]
    return round(int(size) / max(float(seconds), 1e-6) / BYTES_PER_MBIT, 2)


def run(net: Topology, work: Path, nat: bool, args: argparse.Namespace, log) -> dict:
    hub_dir = work / ("nat" if nat else "no_nat") / "hub"
    hub_dir.mkdir(parents=True)
    (hub_dir / "hub.toml").write_text(HUB_TOML)
    rate = str(args.link_mbps)
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
        "--link-mbps",
        rate,
        "--hub-mbps",
        rate,
    )
    places = {"public": (net.public, PUBLIC_NODE_LISTEN)}
    if nat:
        places |= {"home-1": (net.homes[0], "/ip4/0.0.0.0/tcp/0"), "home-2": (net.homes[1], "/ip4/0.0.0.0/tcp/0")}
    else:
        places |= {f"public-{i}": (net.public, PUBLIC_NODE_LISTEN) for i in (2, 3)}
    dirs = {name: hub_dir.parent / name for name in places}
    nodes = [
        net.start_node(
            ns,
            dirs[name],
            listen,
            hub.addr,
            "--link-mbps",
            rate,
            "--declared-link-mbps",
            rate,
            "--max-rollouts-per-s",
            "20",
            "--log-level",
            "debug",  # node.log says every install (at info, one a minute): the newest one's rate is read from it
        )
        for name, (ns, listen) in places.items()
    ]
    log(f"{'nat' if nat else 'no_nat'}: hub and {len(nodes)} nodes started")
    try:
        # Timed from the first version published once the hub has probed every node (a NATed one answers a
        # dial-back by silence: PROBE_TIMEOUT_S), so the links measured are the ones planned for them.
        def probed() -> int | None:
            by = node_states(hub)
            if len(by) < len(places) or any(n.reachability == "unknown" for n in by.values()):
                return None
            return query(hub_dir, "SELECT COALESCE(MAX(version), 0) FROM snapshots")[0][0]

        first = wait_until(probed, RUN_TIMEOUT_S, "every node probed") + 1

        def timed() -> list[float] | None:
            rows = query(hub_dir, "SELECT t_bcast_s FROM snapshots WHERE version >= ? AND t_bcast_s IS NOT NULL", (first,))
            return [r[0] for r in rows] if len(rows) >= args.versions else None

        times = wait_until(timed, RUN_TIMEOUT_S, f"{args.versions} timed broadcasts", poll_s=0.5)
        states = node_states(hub)
        status = hub.status()
    finally:
        stop_all([*nodes, hub])
    name_of = {json.loads((d / "node_status.json").read_text())["peer_id"]: n for n, d in dirs.items()}
    links = []
    for chain in status.chains:
        for position, peer in enumerate(chain):
            kind = states[peer].link
            source = "hub" if kind == "hub" or position == 0 else name_of[chain[position - 1]]
            links.append(
                {
                    "from": source,
                    "to": name_of[peer],
                    "kind": kind,
                    "mbps": last_rate_mbps(dirs[name_of[peer]]),
                    "reachability": states[peer].reachability,
                }
            )
    hashes = dict(query(hub_dir, "SELECT version, manifest_hash FROM snapshots"))
    exact = all(
        json.loads(p.read_text())["bytes_blake3"] == hashes[json.loads(p.read_text())["version"]]
        for d in dirs.values()
        for p in (d / "installed").glob("v*.json")
    )
    return {"links": links, "t_bcast_s": round(sum(times) / len(times), 3), "all_bit_exact": exact}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"bench/nat.py: {reason}", file=sys.stderr)
        sys.exit(2)

    def log(message: str) -> None:
        if not args.json:
            print(message, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="echo2-nat-") as tmp, Topology() as net:
        nat = run(net, Path(tmp), True, args, log)
        plain = run(net, Path(tmp), False, args, log)
    out = {
        "links": nat["links"],
        "t_bcast_s": nat["t_bcast_s"],
        "t_bcast_no_nat_s": plain["t_bcast_s"],
        "hub_relay_bytes": 0,
        "all_bit_exact": nat["all_bit_exact"] and plain["all_bit_exact"],
        "link_mbps": args.link_mbps,
        "no_nat_links": plain["links"],
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
