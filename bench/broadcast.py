"""Snapshot broadcast time T_bcast vs fleet size, chained against star, on loopback with emulated links.

Usage: python bench/broadcast.py [--nodes 1,2,4,8] [--size-mb 64] [--link-mbps 40] [--chunk-kib 1024]
                                 [--hub-mbps X] [--modes chain,star] [--out bench/out/broadcast.png] [--json]

Drives the real transfer code in one process: a hub host serving a SnapshotShelf over the
snapshot protocol (as hub/service/handlers.py does) and N node hosts running the real SnapshotKeeper,
each a real libp2p host (Noise, Yamux, TCP) on 127.0.0.1. Every sender writes through a
RateLimiter: each node at Bw (--link-mbps), the hub at B0 (--hub-mbps, default Bw) in total
and at most Bw per connection. The snapshot is random bytes signed by the hub like any
snapshot. Chain mode lays nodes out with hub.method.chains.plan_chains and starts each snapshot the
way the hub does (a RelayOffer to each chain head; every relay announces to its successor);
star mode has every node pull from the hub. T is from the hub's first offer to the last
node's verified install; the ideal is docs/DESIGN.md §7 (hub.method.chains).

All hosts share one Python process and so one core: what the emulated links allow in
aggregate (chain: N * Bw) must stay below what that core can push through Noise and Yamux,
or the run measures the CPU rather than the links; cpu_s per run shows how close it came.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from hub.distribution.broadcast import HubUplink
from hub.method.chains import chained_broadcast_ideal_s, plan_chains, star_ideal_s
from hub.records.snapshots import SnapshotShelf
from node.client import HubClient
from node.keeper import HUB, SnapshotKeeper, Upstream
from shared.crypto import Identity
from shared.messages import RELAY_PROTOCOL, SNAPSHOT_PROTOCOL, RelayOffer, SnapshotRequest
from shared.net import RateLimiter, connect, open_stream, running_host, set_handler
from shared.snapshot import Snapshot
from shared.transfer import serve_snapshot
from shared.units import BYTES_PER_MBIT
from shared.wire import read_message, write_message

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
RUN_TIMEOUT_S = 1800.0
log = logging.getLogger("bench.broadcast")


# Snapshot files of the hub and of every node; removed when the bench ends.
SCRATCH = Path(tempfile.mkdtemp(prefix="echo2-bench-broadcast-"))
atexit.register(shutil.rmtree, SCRATCH, True)


@dataclass(frozen=True)
class Result:
    mode: str
    nodes: int
    seconds: float
    ideal_seconds: float
    cpu_s: float


def random_snapshot(identity: Identity, size_bytes: int, chunk_bytes: int, directory: Path) -> Snapshot:
    import torch

    from shared.model_io import build_snapshot

    tensor = torch.frombuffer(bytearray(os.urandom(size_bytes)), dtype=torch.uint8)
    return build_snapshot({"w": tensor}, 1, identity, "0" * 64, directory, chunk_size=chunk_bytes)


@dataclass
class BenchNode:
    peer_id: str
    addr: str
    host: object
    keeper: SnapshotKeeper
    done: trio.Event
    installed_at: float | None = None


@asynccontextmanager
async def bench_hub(identity: Identity, shelf: SnapshotShelf, link_bps: float, hub_bps: float):
    uplink = HubUplink(hub_bps, link_bps)

    async def serve(stream) -> None:
        request = await read_message(stream, SnapshotRequest)
        await serve_snapshot(stream, shelf, request, uplink.for_stream(), identity)
        await stream.close()

    async with running_host(identity, [LOOPBACK]) as (host, addrs):
        set_handler(host, SNAPSHOT_PROTOCOL, serve, log)
        yield host, addrs[0]


@asynccontextmanager
async def bench_node(hub_peer_id: str, hub_addr: str, link_bps: float, max_snapshot_bytes: int, nursery: trio.Nursery):
    identity = Identity.generate()
    async with running_host(identity, [LOOPBACK]) as (host, addrs):
        node: BenchNode

        async def install(path: Path, version: int, probe) -> None:
            node.installed_at = trio.current_time()
            node.done.set()

        client = HubClient(host, identity, hub_addr)
        keeper = SnapshotKeeper(
            host,
            identity,
            hub_peer_id,
            Path(tempfile.mkdtemp(dir=SCRATCH)),
            install,
            RateLimiter(link_bps),
            on_installed=lambda v: None,
            report=client.report,
            max_snapshot_bytes=max_snapshot_bytes,
        )
        node = BenchNode(identity.peer_id, addrs[0], host, keeper, trio.Event())
        set_handler(host, SNAPSHOT_PROTOCOL, keeper.serve, log)
        set_handler(host, RELAY_PROTOCOL, keeper.on_relay_offer, log)
        await connect(host, hub_addr)  # what joining the hub does
        await keeper.start(nursery)
        yield node


async def offer(host, peer_id: str, version: int) -> None:
    """The hub's nudge to a chain head (hub/distribution/broadcast.py)."""
    stream = await open_stream(host, peer_id, RELAY_PROTOCOL)
    await write_message(stream, RelayOffer(version=version))
    await stream.close()


async def run_once(mode: str, n: int, snapshot: Snapshot, hub_id: Identity, link_bps: float, hub_bps: float) -> float:
    shelf = SnapshotShelf(keep=1)
    shelf.add(snapshot)
    version = snapshot.manifest.version
    async with AsyncExitStack() as stack:
        hub_host, hub_addr = await stack.enter_async_context(bench_hub(hub_id, shelf, link_bps, hub_bps))
        nursery = await stack.enter_async_context(trio.open_nursery())
        nodes = [
            await stack.enter_async_context(
                bench_node(hub_id.peer_id, hub_addr, link_bps, snapshot.manifest.total_bytes, nursery)
            )
            for _ in range(n)
        ]
        by_id = {node.peer_id: node for node in nodes}
        chains = plan_chains([(p, link_bps) for p in by_id], hub_bps) if mode == "chain" else [[p] for p in by_id]
        for chain in chains:
            for position, peer in enumerate(chain):
                node = by_id[peer]
                upstream = by_id[chain[position - 1]] if position else None
                if upstream is not None:
                    await connect(node.host, upstream.addr)  # links from earlier snapshots are already up
                node.keeper.update(
                    -1,
                    Upstream(upstream.peer_id, (upstream.addr,)) if upstream else HUB,
                    chain[position + 1] if position + 1 < len(chain) else None,
                )
        await trio.sleep(0.2)
        started = trio.current_time()
        for chain in chains:
            nursery.start_soon(offer, hub_host, chain[0], version)
        with trio.fail_after(RUN_TIMEOUT_S):
            for node in nodes:
                await node.done.wait()
        elapsed = max(node.installed_at for node in nodes) - started
        nursery.cancel_scope.cancel()
    return elapsed


def ideal_s(mode: str, n: int, total_bytes: int, chunk_bytes: int, link_bps: float, hub_bps: float) -> float:
    if mode == "chain":
        return chained_broadcast_ideal_s(total_bytes, chunk_bytes, n, hub_bps, link_bps)
    return star_ideal_s(total_bytes, n, hub_bps, link_bps)


def plot(results: list[Result], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, color in (("chain", "tab:blue"), ("star", "tab:orange")):
        rows = sorted((r for r in results if r.mode == mode), key=lambda r: r.nodes)
        if not rows:
            continue
        xs = [r.nodes for r in rows]
        ax.plot(xs, [r.seconds for r in rows], "o-", color=color, label=f"{mode} measured")
        ax.plot(xs, [r.ideal_seconds for r in rows], "--", color=color, alpha=0.6, label=f"{mode} ideal")
    ax.set_xlabel("nodes N")
    ax.set_ylabel("T_bcast (s)")
    ax.set_title(title)
    ax.set_xticks(sorted({r.nodes for r in results}))
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def checks(results: list[Result]) -> dict[str, bool]:
    """The targets: chain within 1.25x of its ideal at every N; chain faster than star by 0.6 N at N >= 4."""
    chain = {r.nodes: r for r in results if r.mode == "chain"}
    star = {r.nodes: r for r in results if r.mode == "star"}
    out = {}
    if chain:
        out["chain_within_1.25x_ideal"] = all(r.seconds <= 1.25 * r.ideal_seconds for r in chain.values())
    big = [n for n in chain if n in star and n >= 4]
    if big:
        out["chain_beats_star_by_0.6N"] = all(star[n].seconds / chain[n].seconds >= 0.6 * n for n in big)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,4,8", help="comma-separated fleet sizes")
    parser.add_argument("--size-mb", type=float, default=64.0, help="snapshot size in MB (10^6 bytes)")
    parser.add_argument("--link-mbps", type=float, default=40.0, help="Bw: every node's link, Mbit/s")
    parser.add_argument("--hub-mbps", type=float, default=None, help="B0: hub uplink, Mbit/s (default Bw)")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="chunk size in KiB")
    parser.add_argument("--modes", default="chain,star", help="chain, star or both")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "broadcast.png", help="plot path")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    sizes = [int(x) for x in args.nodes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if not sizes or min(sizes) < 1 or not set(modes) <= {"chain", "star"}:
        parser.error("--nodes needs sizes >= 1 and --modes only chain and/or star")
    link_bps = args.link_mbps * BYTES_PER_MBIT
    hub_bps = (args.hub_mbps or args.link_mbps) * BYTES_PER_MBIT
    chunk_bytes = args.chunk_kib * 1024
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, int(args.size_mb * 1e6), chunk_bytes, SCRATCH)
    total = snapshot.manifest.total_bytes

    results: list[Result] = []
    runs = [(mode, n) for mode in modes for n in sizes]
    with Progress(disable=args.json, transient=True) as progress:
        bar = progress.add_task("broadcast bench", total=len(runs))
        for mode, n in runs:
            progress.update(bar, description=f"{mode} N={n}")
            cpu = time.process_time()
            seconds = trio.run(run_once, mode, n, snapshot, hub_id, link_bps, hub_bps)
            results.append(
                Result(mode, n, seconds, ideal_s(mode, n, total, chunk_bytes, link_bps, hub_bps), time.process_time() - cpu)
            )
            progress.advance(bar)
    title = (
        f"{total / 1e6:.0f} MB, {args.chunk_kib} KiB chunks, Bw {args.link_mbps:g} Mbit/s, B0 {hub_bps / BYTES_PER_MBIT:g} Mbit/s"
    )
    plot(results, args.out, title)
    report = {
        "config": {
            "size_bytes": total,
            "chunk_bytes": chunk_bytes,
            "link_mbps": args.link_mbps,
            "hub_mbps": hub_bps / BYTES_PER_MBIT,
            "cpus": os.cpu_count(),
        },
        "results": [
            {
                "mode": r.mode,
                "nodes": r.nodes,
                "seconds": round(r.seconds, 3),
                "ideal_seconds": round(r.ideal_seconds, 3),
                "ratio": round(r.seconds / r.ideal_seconds, 3),
                "cpu_s": round(r.cpu_s, 2),
            }
            for r in results
        ],
        "checks": checks(results),
        "plot": str(args.out),
    }
    if args.json:
        print(json.dumps(report))
        return
    table = Table(title=f"T_bcast: {title}")
    for column in ("mode", "N", "seconds", "ideal s", "ratio", "cpu s"):
        table.add_column(column, justify="right")
    for r in report["results"]:
        table.add_row(
            r["mode"],
            str(r["nodes"]),
            f"{r['seconds']:.2f}",
            f"{r['ideal_seconds']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['cpu_s']:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(report["checks"], f"plot: {args.out}")


if __name__ == "__main__":
    main()
