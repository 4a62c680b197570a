"""In-process snapshot peers for tests: a hub-like source (SnapshotShelf served over the real pull protocol)
and relays/sinks running the real SnapshotKeeper, each on its own real libp2p host on loopback."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream

from hub.distribution.broadcast import HubUplink
from hub.records.snapshots import SnapshotShelf
from node.client import HubClient
from node.keeper import SnapshotKeeper, Upstream
from shared.bulk import BulkChannel, serving_stream
from shared.crypto import Identity
from shared.messages import RELAY_PROTOCOL, REPORT_PROTOCOL, SNAPSHOT_PROTOCOL, BadChunkReport, SnapshotRequest, TransferAck
from shared.model_io import build_snapshot
from shared.net import RateLimiter, connect, remote_peer_id, running_host, set_handler
from shared.snapshot import Snapshot
from shared.transfer import STALL_S, ChunkSource, serve_snapshot
from shared.wire import read_message, write_message

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
CONFIG_HASH = "0" * 64
# The model a test peer stands for: the random snapshots tests publish are far below it.
PEER_MAX_SNAPSHOT_BYTES = 64 << 20
log = logging.getLogger("testbed.peers")


# Snapshot files and keeper directories of this test process; each in its own folder (versions repeat).
_SCRATCH = Path(tempfile.mkdtemp(prefix="echo2-peers-"))
atexit.register(shutil.rmtree, _SCRATCH, True)


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(dir=_SCRATCH))


def random_snapshot(identity: Identity, version: int, size_bytes: int, chunk_bytes: int) -> Snapshot:
    """Random bytes as the one tensor of a real, signed snapshot file (about size_bytes of safetensors)."""
    import torch

    tensor = torch.frombuffer(bytearray(os.urandom(size_bytes)), dtype=torch.uint8)
    return build_snapshot({"w": tensor}, version, identity, CONFIG_HASH, scratch_dir(), chunk_size=chunk_bytes)


def evolving_snapshots(
    identity: Identity, versions: int, elements: int, changed: int, chunk_bytes: int, seed: int = 0
) -> list[tuple[Snapshot, Snapshot | None]]:
    """`versions` bf16 snapshots of one random tensor, `changed` elements moved between consecutive ones,
    each after the first with its signed delta against the one before (what the hub's learner publishes)."""
    import torch

    from shared.delta import build_delta_snapshot

    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(elements, generator=generator)
    directory = scratch_dir()
    out: list[tuple[Snapshot, Snapshot | None]] = []
    for version in range(versions):
        if version:
            where = torch.randperm(elements, generator=generator)[:changed]
            weights[where] += 0.5 + torch.rand(changed, generator=generator)  # far above bf16's resolution
        snapshot = build_snapshot(
            {"w": weights}, version, identity, CONFIG_HASH, directory, dtype=torch.bfloat16, chunk_size=chunk_bytes
        )
        built = build_delta_snapshot(out[-1][0], snapshot, identity, directory, 1.0) if out else None
        out.append((snapshot, None if built is None else built[0]))
    return out


@dataclass
class HubPeer:
    """A hub-like source: serves its shelf like hub/service/handlers.py does and records what it was asked and told."""

    identity: Identity
    host: IHost
    addr: str
    shelf: SnapshotShelf
    source: ChunkSource
    uplink: HubUplink
    bulk: BulkChannel | None = None
    requests: list[tuple[str, SnapshotRequest]] = field(default_factory=list)
    reports: list[tuple[str, BadChunkReport]] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def serve(self, stream: INetStream) -> None:
        request = await read_message(stream, SnapshotRequest)
        self.requests.append((remote_peer_id(stream), request))
        async with serving_stream(stream, request, self.bulk, remote_peer_id(stream)) as transfer:
            await serve_snapshot(transfer, self.source, request, self.uplink.for_stream(), self.identity)
        await stream.close()

    async def on_report(self, stream: INetStream) -> None:
        report = await read_message(stream, BadChunkReport)
        self.reports.append((remote_peer_id(stream), report))
        await write_message(stream, TransferAck(version=report.version, chunks=0, ok=True))
        await stream.close()


@asynccontextmanager
async def hub_peer(
    identity: Identity, uplink: HubUplink | None = None, source: ChunkSource | None = None, bulk: bool = False
) -> AsyncIterator[HubPeer]:
    """`bulk`: serve on a bulk channel (shared/bulk.py) to receivers that ask for it."""
    shelf = SnapshotShelf(keep=4)
    async with running_host(identity, [LOOPBACK]) as (host, addrs), trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0) if bulk else None
        if channel is not None:
            await channel.start(nursery)
        peer = HubPeer(identity, host, addrs[0], shelf, source or shelf, uplink or HubUplink(None, None), channel)
        set_handler(host, SNAPSHOT_PROTOCOL, peer.serve, log)
        set_handler(host, REPORT_PROTOCOL, peer.on_report, log)
        yield peer
        nursery.cancel_scope.cancel()


@dataclass
class NodePeer:
    """A relay or sink: a real SnapshotKeeper on its own host, recording what it installed and when."""

    identity: Identity
    host: IHost
    addr: str
    keeper: SnapshotKeeper
    installed: dict[int, object] = field(default_factory=dict)
    installed_at: dict[int, float] = field(default_factory=dict)
    first_chunk_at: float | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def upstream(self) -> Upstream:
        """How a successor names this node as its upstream."""
        return Upstream(self.peer_id, (self.addr,))


@asynccontextmanager
async def node_peer(
    hub: HubPeer,
    limiter: RateLimiter | None = None,
    keeper_class: type[SnapshotKeeper] = SnapshotKeeper,
    stall_s: float = STALL_S,
    read: Callable[[Path], object] = Path.read_bytes,
    bulk: bool = False,
    max_snapshot_bytes: int = PEER_MAX_SNAPSHOT_BYTES,
) -> AsyncIterator[NodePeer]:
    """A node connected to `hub` (as its hub link would be), keeper running; leaving the block kills it.

    `read`: what `installed` keeps of each installed file (its bytes; a hash for large snapshots).
    `bulk`: run a bulk channel (shared/bulk.py): ask senders for theirs, and serve on it. `max_snapshot_bytes`:
    what its model takes at most (SnapshotKeeper's bound)."""
    identity = Identity.generate()
    async with running_host(identity, [LOOPBACK]) as (host, addrs), trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0) if bulk else None
        if channel is not None:
            await channel.start(nursery)
        node: NodePeer

        async def install(path: Path, version: int, probe) -> None:
            node.installed[version] = await trio.to_thread.run_sync(read, path)
            node.installed_at[version] = time.monotonic()

        client = HubClient(host, identity, hub.addr)
        keeper = keeper_class(
            host,
            identity,
            hub.peer_id,
            scratch_dir(),
            install,
            limiter,
            on_installed=lambda version: None,
            report=client.report,
            max_snapshot_bytes=max_snapshot_bytes,
            stall_s=stall_s,
            bulk=channel,
        )
        node = NodePeer(identity, host, addrs[0], keeper)
        on_chunk = keeper._on_chunk

        async def first_chunk_timed(index: int) -> None:
            if node.first_chunk_at is None:
                node.first_chunk_at = time.monotonic()
            await on_chunk(index)

        keeper._on_chunk = first_chunk_timed
        set_handler(host, SNAPSHOT_PROTOCOL, keeper.serve, log)
        set_handler(host, RELAY_PROTOCOL, keeper.on_relay_offer, log)
        await connect(host, hub.addr)
        await keeper.start(nursery)
        yield node
        nursery.cancel_scope.cancel()


class FlippingKeeper(SnapshotKeeper):
    """A relay that flips a byte of chunk BAD_INDEX of whatever it serves (it receives honestly)."""

    BAD_INDEX = 5

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        data = await super().chunk(version, index, delta)
        return bytes([data[0] ^ 0x01]) + data[1:] if index == self.BAD_INDEX else data


async def wait_installed(nodes: list[NodePeer], version: int, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not all(version in n.installed for n in nodes):
            await trio.sleep(0.02)
