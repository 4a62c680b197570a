"""The node's snapshot keeper: pulls each new snapshot from its upstream, verifies it, relays it, installs it.

A node pulls from its chain predecessor (or the hub, at a chain head or when it has no
predecessor), verifies every chunk against the hub-signed manifest before keeping it, serves
the chunks it already holds to its successor while the rest is still arriving, and installs
the snapshot in the rollout engine only once every chunk and the whole hash verify: no
partial snapshot is ever installed.

When the upstream leaves mid-transfer the keeper keeps what it has and resumes from the
first chunk it lacks, from whatever upstream the hub names next; a re-link from the hub
also abandons a pull in progress (an upstream that stalls rather than leaves would
otherwise hold it). A sender that sends a chunk failing verification is reported to the hub
(which checks and bans it) and, like one that sends a manifest the hub did not sign, never
pulled from again by this keeper: until the hub names another upstream, the missing chunks
come from the hub itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream

from shared.messages import (
    RELAY_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    BadChunkReport,
    Reject,
    RejectCode,
    RelayOffer,
    SnapshotRequest,
    TransferAck,
)
from shared.net import connect, open_stream, remote_peer_id
from shared.snapshot import ChunkAssembler, Manifest, SignedManifest, SnapshotError, chunk_of
from shared.transfer import RECEIVER_GONE, ChunkRejected, Writer, receive_snapshot, serve_snapshot
from shared.wire import FrameError, StreamEOF, read_message, write_message

log = logging.getLogger("echo2.node.keeper")

FETCH_TIMEOUT_S = 600.0
RETRY_S = 0.5
UPSTREAM_FAILURES_BEFORE_HUB = 2
MANIFEST_WAIT_S = 20.0
CONNECT_TIMEOUT_S = 10.0
ANNOUNCE_TIMEOUT_S = 5.0

# A pull that ends in one of these lost its upstream (left, refused, too slow): keep what we
# have and resume when the hub names an upstream again.
_INTERRUPTED = (StreamEOF, FrameError, OSError, trio.TooSlowError, LookupError)


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


HUB = Upstream(None, ())


class SnapshotKeeper:
    """Holds the newest verified snapshot (and the one in flight) for the engine and for downstream peers."""

    def __init__(
        self,
        host: IHost,
        hub_peer_id: str,
        install: Callable[[bytes, int], Awaitable[None]],
        limiter: Writer | None,
        on_installed: Callable[[int], None],
        report: Callable[[BadChunkReport], Awaitable[TransferAck | Reject]],
    ) -> None:
        self.host = host
        self.hub_peer_id = hub_peer_id
        self._install = install
        self._report = report
        self.limiter = limiter
        self.on_installed = on_installed
        self.held: tuple[SignedManifest, Manifest, bytes] | None = None
        self.transfer: Transfer | None = None
        self.target_version = -1
        self.upstream = HUB
        self.downstream: str | None = None
        self.distrusted: set[str] = set()
        # Consecutive failed pulls from the current upstream; past a couple, the hub is asked instead
        # until the hub names a new upstream (it re-links only after a heartbeat timeout).
        self.upstream_failures = 0
        self._changed = trio.Event()
        self._pull_scope: trio.CancelScope | None = None
        self._pulling_from: Upstream | None = None
        self._nursery: trio.Nursery | None = None
        self.bad_chunks_seen = 0
        self.resumes = 0
        self.relinks = 0

    # -- state -----------------------------------------------------------------------

    @property
    def version_held(self) -> int:
        return self.held[1].version if self.held else -1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def update(self, latest_version: int, upstream: Upstream, downstream: str | None) -> None:
        """New orders from the hub (heartbeat reply): the version to get and where to get it."""
        relinked = upstream != self.upstream
        changed = latest_version > self.target_version or relinked
        self.target_version = max(self.target_version, latest_version)
        self.upstream = upstream
        if relinked:
            self.upstream_failures = 0
            if self._pull_scope is not None and self._pulling_from != self._source():
                self.relinks += 1
                self._pull_scope.cancel()
            if upstream.peer_id is not None and upstream.addrs and self._nursery is not None:
                # Dial now: our upstream's announce of its next version can then reach us at once.
                self._nursery.start_soon(self._dial, upstream)
        if downstream != self.downstream:
            self.downstream = downstream
            if downstream is not None and self.transfer is not None:
                self._announce_downstream(self.transfer.manifest.version)
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
                return bytes(chunk_of(self.held[2], self.held[1], index))
            transfer = self.transfer
            if transfer is None or transfer.manifest.version != version:
                raise LookupError(f"snapshot v{version} abandoned")
            if transfer.assembler.has(index):
                return bytes(transfer.assembler.chunk(index))
            await self._changed.wait()

    async def serve(self, stream: INetStream) -> None:
        """SNAPSHOT_PROTOCOL handler: a peer pulls what we hold or are still receiving."""
        req = await read_message(stream, SnapshotRequest)
        # A successor may ask before our own pull of that version has begun: give it a moment.
        with trio.move_on_after(MANIFEST_WAIT_S):
            while req.version is not None and req.version > self.version_held and self.held_manifest(req.version) is None:
                await self._changed.wait()
        try:
            ack = await serve_snapshot(stream, self, req, self.limiter)
        except LookupError as exc:
            await write_message(stream, Reject(code=RejectCode.NOT_HELD, reason=str(exc)[:1000]))
            await stream.close()
            return
        except RECEIVER_GONE as exc:
            # The puller left or re-linked elsewhere mid-transfer: ordinary churn, not a failure here.
            log.info("v%s to %s ended early: %r", req.version, remote_peer_id(stream)[-8:], exc)
            await stream.reset()
            return
        if not ack.ok:
            log.warning("v%d to %s ended badly: %s", ack.version, remote_peer_id(stream)[-8:], ack.reason)
        await stream.close()

    async def on_relay_offer(self, stream: INetStream) -> None:
        """RELAY_PROTOCOL handler: the hub or our upstream has a newer version for us.

        Offers from anyone else are ignored: a stranger could otherwise point us at a version
        that never comes.
        """
        offer = await read_message(stream, RelayOffer)
        await stream.close()
        sender = remote_peer_id(stream)
        if sender in (self.hub_peer_id, self.upstream.peer_id):
            self.announce(offer.version)
        else:
            log.info("ignored relay offer of v%d from %s (not our upstream)", offer.version, sender[-8:])

    # -- receiving -------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            version = self.target_version
            if version <= self.version_held:
                await self._changed.wait()
                continue
            if await self._pull_once(version):
                await self._complete(version)

    def _source(self) -> Upstream:
        """Where to pull from now: the hub's choice, unless that peer sent us a bad chunk or keeps failing."""
        if self.upstream.peer_id in self.distrusted or self.upstream_failures >= UPSTREAM_FAILURES_BEFORE_HUB:
            return HUB
        return self.upstream

    @staticmethod
    def _name(upstream: Upstream) -> str:
        return upstream.peer_id[-8:] if upstream.peer_id else "hub"

    async def _pull_once(self, version: int) -> bool:
        """One pull of `version` from the current source; True when the transfer is complete.

        Any failure leaves the verified chunks in place for the next attempt.
        """
        source = self._source()
        rejected: ChunkRejected | None = None
        with trio.CancelScope() as scope:
            self._pull_scope, self._pulling_from = scope, source
            try:
                await self._pull(version, source)
            except ChunkRejected as exc:
                rejected = exc
            except SnapshotError as exc:
                # A manifest that is not the hub's, or not the one asked for: an honest relay
                # forwards the hub's signed bytes unchanged, so this sender is lying. The hub can
                # only check chunks, so there is nothing to report; just never ask it again.
                log.warning("snapshot v%d from %s refused: %r", version, self._name(source), exc)
                if source.peer_id is not None:
                    self.distrusted.add(source.peer_id)
            except _INTERRUPTED as exc:
                log.info("snapshot v%d from %s interrupted: %r", version, self._name(source), exc)
            except Exception as exc:  # noqa: BLE001 - libp2p dial errors share no base class
                log.info("snapshot v%d: cannot reach %s: %r", version, self._name(source), exc)
            finally:
                self._pull_scope = self._pulling_from = None
        transfer = self.transfer
        if transfer is not None and transfer.manifest.version == version and transfer.assembler.complete:
            return True
        if rejected is not None:
            await self._reject_source(source, rejected)
        elif scope.cancelled_caught:
            log.info("re-linked during v%d: pulling from %s next", version, self._name(self._source()))
        else:
            # Upstream gone or refusing: wait for new orders (a re-link) or retry shortly.
            if source.peer_id is not None:
                self.upstream_failures += 1
            with trio.move_on_after(RETRY_S * 4):
                await self._changed.wait()
            await trio.sleep(RETRY_S)
        return False

    async def _connect(self, upstream: Upstream) -> None:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await connect(self.host, upstream.addrs[0])

    async def _open(self, source: Upstream) -> INetStream:
        if source.peer_id is None:
            return await open_stream(self.host, self.hub_peer_id, SNAPSHOT_PROTOCOL)
        if source.addrs:
            await self._connect(source)
        return await open_stream(self.host, source.peer_id, SNAPSHOT_PROTOCOL)

    async def _dial(self, upstream: Upstream) -> None:
        try:
            await self._connect(upstream)
        except Exception as exc:  # noqa: BLE001 - the pull dials again and reports what fails
            log.debug("dial of upstream %s failed: %r", self._name(upstream), exc)

    async def _pull(self, version: int, source: Upstream) -> None:
        from_chunk = 0
        transfer = self.transfer
        if transfer is not None and transfer.manifest.version == version:
            from_chunk = transfer.assembler.first_missing() or 0
            transfer.source = self._name(source)
            if from_chunk > 0:
                self.resumes += 1
                log.info("resuming v%d from chunk %d via %s", version, from_chunk, self._name(source))
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await self._open(source)
        try:
            with trio.fail_after(FETCH_TIMEOUT_S):
                await receive_snapshot(
                    stream,
                    SnapshotRequest(version=version, from_chunk=from_chunk),
                    self.hub_peer_id,
                    newer_than=self.version_held,
                    assembler_for=lambda signed, manifest: self._assembler_for(signed, manifest, source),
                    on_chunk=self._on_chunk,
                )
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.reset()  # py-libp2p's reset swallows errors of an already broken stream
            raise

    def _assembler_for(self, signed: SignedManifest, manifest: Manifest, source: Upstream) -> ChunkAssembler:
        if self.transfer is None or self.transfer.manifest.version != manifest.version:
            self.transfer = Transfer(signed, manifest, ChunkAssembler(manifest), time.monotonic(), self._name(source))
            self._notify()
            if self.downstream is not None:
                self._announce_downstream(manifest.version)
        return self.transfer.assembler

    async def _on_chunk(self, index: int) -> None:
        self._notify()

    async def _reject_source(self, source: Upstream, exc: ChunkRejected) -> None:
        """`source` sent a bad chunk: never pull from it again, and tell the hub (which checks, then bans)."""
        self.bad_chunks_seen += 1
        log.warning("bad chunk from %s: %s", self._name(source), exc)
        if source.peer_id is None:
            # The hub's own signature holds but its chunk does not: nothing to report, retry.
            await trio.sleep(RETRY_S)
            return
        self.distrusted.add(source.peer_id)
        report = BadChunkReport(
            version=exc.version, index=exc.index, upstream=source.peer_id, chunk_hex_blake3=exc.received_blake3
        )
        try:
            reply = await self._report(report)
        except Exception as report_exc:  # noqa: BLE001 - the hub may be away; the repair goes on without it
            log.warning("could not report %s: %r", source.peer_id[-8:], report_exc)
            return
        log.info("reported %s for chunk %d of v%d: %s", source.peer_id[-8:], exc.index, exc.version, reply)

    async def _complete(self, version: int) -> None:
        transfer = self.transfer
        # Hashing and copying a whole model is seconds of CPU for a large one: off the event loop.
        data = await trio.to_thread.run_sync(lambda: bytes(transfer.assembler.data()))  # whole hash checked
        await self._install(data, version)
        self.upstream_failures = 0  # the next version is tried from the hub's choice of upstream again
        self.held = (transfer.signed, transfer.manifest, data)
        self.transfer = None
        self._notify()
        log.info("installed v%d (%.2fs, last from %s)", version, time.monotonic() - transfer.started_at, transfer.source)
        self.on_installed(version)

    # -- announcing downstream ----------------------------------------------------------

    def _announce_downstream(self, version: int) -> None:
        if self._nursery is not None and self.downstream is not None:
            self._nursery.start_soon(self._announce, self.downstream, version)

    async def _announce(self, peer_id: str, version: int) -> None:
        try:
            with trio.fail_after(ANNOUNCE_TIMEOUT_S):
                stream = await open_stream(self.host, peer_id, RELAY_PROTOCOL)
                await write_message(stream, RelayOffer(version=version))
                await stream.close()
        except Exception as exc:  # noqa: BLE001 - best effort; the successor's heartbeat covers a lost announce
            log.debug("announce v%d to %s failed: %r", version, peer_id[-8:], exc)

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self.run)
