"""The node's snapshot keeper: pulls each new snapshot from its upstream, verifies it, relays it, installs it.

A node pulls from its chain predecessor (or the hub, at a chain head or when it has no
predecessor), verifies every chunk against the hub-signed manifest before keeping it, serves
the chunks it already holds to its successor while the rest is still arriving, and installs
the snapshot in the rollout engine only once every chunk and the whole hash verify: no
partial snapshot is ever installed. When the upstream leaves mid-transfer the keeper
resumes from the first chunk it lacks, from whatever upstream the hub names next. A chunk
that fails verification is reported with its upstream, and fetched again from the hub.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream

from shared.messages import (
    REPORT_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    BadChunkReport,
    Reject,
    RelayOffer,
    SnapshotRequest,
    TransferAck,
)
from shared.net import connect, open_stream, request
from shared.snapshot import BadChunk, ChunkAssembler, Manifest, SignedManifest
from shared.transfer import receive_snapshot, serve_snapshot
from shared.wire import FrameError, StreamEOF, read_message, write_message

log = logging.getLogger("echo2.node.keeper")

FETCH_TIMEOUT_S = 600.0
RETRY_S = 0.5
MANIFEST_WAIT_S = 20.0
CONNECT_TIMEOUT_S = 10.0


@dataclass
class Transfer:
    """A snapshot being received (and relayed while it arrives)."""

    signed: SignedManifest
    manifest: Manifest
    assembler: ChunkAssembler
    started_at: float
    source: str


@dataclass(frozen=True)
class Upstream:
    peer_id: str | None  # None: the hub
    addrs: tuple[str, ...]


class SnapshotKeeper:
    """Holds the newest verified snapshot (and the one in flight) for the engine and for downstream peers."""

    def __init__(
        self,
        host: IHost,
        hub_peer_id: str,
        install: Callable[[bytes, int], Awaitable[None]],
        limiter,
        on_installed: Callable[[int], None],
    ) -> None:
        self.host = host
        self.hub_peer_id = hub_peer_id
        self._install = install
        self.limiter = limiter
        self.on_installed = on_installed
        self.held: tuple[SignedManifest, Manifest, bytes] | None = None
        self.transfer: Transfer | None = None
        self.target_version = -1
        self.upstream = Upstream(None, ())
        self.downstream: str | None = None
        self._changed = trio.Event()
        self.bad_chunks_seen = 0
        self.resumes = 0

    # -- state -----------------------------------------------------------------------

    @property
    def version_held(self) -> int:
        return self.held[1].version if self.held else -1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def update(self, latest_version: int, upstream: Upstream, downstream: str | None) -> None:
        """New orders from the hub (heartbeat reply): the version to get and where to get it."""
        changed = latest_version > self.target_version or upstream != self.upstream
        self.target_version = max(self.target_version, latest_version)
        self.upstream = upstream
        self.downstream = downstream
        if changed:
            self._notify()

    def announce(self, version: int) -> None:
        """Our upstream says it has started on `version`: pull now rather than at the next heartbeat."""
        if version > self.target_version:
            self.target_version = version
            self._notify()

    # -- serving downstream (a shared.transfer.ChunkSource) ------------------------------

    def held_manifest(self, version: int | None) -> tuple[SignedManifest, Manifest] | None:
        if self.transfer is not None and version in (None, self.transfer.manifest.version):
            return self.transfer.signed, self.transfer.manifest
        if self.held is not None and version in (None, self.held[1].version):
            return self.held[0], self.held[1]
        return None

    async def chunk(self, version: int, index: int) -> bytes:
        while True:
            if self.held is not None and self.held[1].version == version:
                from shared.snapshot import chunk_of

                return bytes(chunk_of(self.held[2], self.held[1], index))
            transfer = self.transfer
            if transfer is None or transfer.manifest.version != version:
                raise LookupError(f"snapshot v{version} abandoned")
            if transfer.assembler.has(index):
                return transfer.assembler.chunk(index)
            await self._changed.wait()

    async def serve(self, stream: INetStream) -> None:
        """SNAPSHOT_PROTOCOL handler: a downstream peer pulls what we hold or are receiving."""
        req = await read_message(stream, SnapshotRequest)
        with trio.move_on_after(MANIFEST_WAIT_S):
            while req.version is not None and self.held_manifest(req.version) is None and req.version > self.version_held:
                await self._changed.wait()
        try:
            await serve_snapshot(stream, self, req, self.limiter)
        except LookupError as exc:
            await write_message(stream, Reject(reason=str(exc)))
        await stream.close()

    async def on_relay_offer(self, stream: INetStream) -> None:
        offer = await read_message(stream, RelayOffer)
        await stream.close()
        self.announce(offer.version)

    # -- receiving -------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if self.target_version <= self.version_held:
                await self._changed.wait()
                continue
            try:
                await self._fetch(self.target_version)
            except (StreamEOF, FrameError, OSError, trio.TooSlowError, LookupError, ValueError) as exc:
                # Upstream gone or refusing: the hub re-links us at the next heartbeat; resume then.
                log.info("snapshot v%d from %s interrupted: %s", self.target_version, self._source_name(), exc)
                self.resumes += 1
                with trio.move_on_after(RETRY_S * 4):
                    await self._changed.wait()
                await trio.sleep(RETRY_S)
            except Exception as exc:  # noqa: BLE001 - libp2p dial errors have no common base
                log.info("snapshot v%d: cannot reach %s: %r", self.target_version, self._source_name(), exc)
                await trio.sleep(RETRY_S)

    def _source_name(self) -> str:
        return self.upstream.peer_id[-8:] if self.upstream.peer_id else "hub"

    async def _open_source(self, upstream: Upstream) -> INetStream:
        peer = upstream.peer_id or self.hub_peer_id
        if upstream.peer_id is not None and upstream.addrs:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await connect(self.host, upstream.addrs[0])
        return await open_stream(self.host, peer, SNAPSHOT_PROTOCOL)

    def _assembler_for(self, signed: SignedManifest, manifest: Manifest) -> ChunkAssembler:
        if self.transfer is None or self.transfer.manifest.version != manifest.version:
            self.transfer = Transfer(signed, manifest, ChunkAssembler(manifest), time.monotonic(), self._source_name())
            self._notify()
            if self.downstream is not None:
                self._announce_downstream(manifest.version)
        return self.transfer.assembler

    def _announce_downstream(self, version: int) -> None:
        downstream = self.downstream
        nursery = self._nursery

        async def announce() -> None:
            try:
                await request_no_reply(self.host, downstream, version)
            except Exception as exc:  # noqa: BLE001 - best effort; the heartbeat covers a lost announce
                log.debug("announce v%d to %s failed: %r", version, downstream, exc)

        nursery.start_soon(announce)

    async def _on_chunk(self, index: int) -> None:
        self._notify()

    async def _fetch(self, version: int) -> None:
        upstream = self.upstream
        from_chunk = 0
        if self.transfer is not None and self.transfer.manifest.version == version:
            missing = self.transfer.assembler.first_missing()
            from_chunk = 0 if missing is None else missing
        stream = await self._open_source(upstream)
        try:
            with trio.fail_after(FETCH_TIMEOUT_S):
                await receive_snapshot(
                    stream,
                    SnapshotRequest(version=version, from_chunk=from_chunk),
                    self.hub_peer_id,
                    newer_than=self.version_held,
                    assembler_for=self._assembler_for,
                    on_chunk=self._on_chunk,
                )
        except BadChunk as exc:
            await stream.reset()
            await self._repair(version, upstream, exc)
            return
        await self._complete(version)

    async def _repair(self, version: int, upstream: Upstream, exc: BadChunk) -> None:
        """A chunk failed verification: report the upstream, then take the missing chunks from the hub."""
        self.bad_chunks_seen += 1
        transfer = self.transfer
        index = transfer.assembler.first_missing() if transfer else 0
        log.warning("bad chunk %s of v%d from %s: %s", index, version, self._source_name(), exc)
        if upstream.peer_id is not None:
            report = BadChunkReport(version=version, index=index or 0, upstream=upstream.peer_id, chunk_hex_blake3="")
            try:
                await request(self.host, self.hub_peer_id, REPORT_PROTOCOL, report, TransferAck, Reject, timeout_s=30)
            except Exception as report_exc:  # noqa: BLE001 - the hub may be down; the repair goes on
                log.warning("could not report %s: %r", upstream.peer_id, report_exc)
        stream = await open_stream(self.host, self.hub_peer_id, SNAPSHOT_PROTOCOL)
        with trio.fail_after(FETCH_TIMEOUT_S):
            await receive_snapshot(
                stream,
                SnapshotRequest(version=version, from_chunk=index or 0),
                self.hub_peer_id,
                newer_than=self.version_held,
                assembler_for=self._assembler_for,
                on_chunk=self._on_chunk,
            )
        await self._complete(version)

    async def _complete(self, version: int) -> None:
        transfer = self.transfer
        if transfer is None or not transfer.assembler.complete:
            raise LookupError(f"snapshot v{version} incomplete after transfer")
        data = bytes(transfer.assembler.data())  # verifies the whole hash; never a partial snapshot
        await self._install(data, version)
        self.held = (transfer.signed, transfer.manifest, data)
        self.transfer = None
        self._notify()
        log.info("installed v%d (%.2fs from %s)", version, time.monotonic() - transfer.started_at, transfer.source)
        self.on_installed(version)

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self.run)


async def request_no_reply(host: IHost, peer_id: str, version: int) -> None:
    from shared.messages import RELAY_PROTOCOL

    stream = await open_stream(host, peer_id, RELAY_PROTOCOL)
    await write_message(stream, RelayOffer(version=version))
    await stream.close()
