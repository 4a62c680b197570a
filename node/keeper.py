"""The node's snapshot keeper: pulls each new snapshot from its upstream, verifies it, relays it, installs it.

A node pulls from its chain predecessor (or the hub, at a chain head or when it has no
predecessor), verifies every chunk against the hub-signed manifest before keeping it, serves
the chunks it already holds to its successor while the rest is still arriving, and installs
the snapshot in the rollout engine only once every chunk and the whole hash verify: no
partial snapshot is ever installed.

When the upstream leaves mid-transfer the keeper keeps what it has and resumes from the
first chunk it lacks, from whatever upstream the hub names next; a re-link from the hub
also abandons a pull in progress, and an upstream silent for shared.transfer.STALL_S is given
up on. A sender whose frame fails its commitment or verification is reported to the hub (with
the sender's own signed commitment as proof, when it gave one) and never pulled from again by
this keeper; one that keeps failing or stalling is avoided until the hub names another
upstream. Meanwhile the missing chunks come from the hub itself.

It serves only the successor the hub named (and the hub): a stranger cannot make a volunteer
upload its snapshots, or hold its streams open. It pulls no version above the newest the hub vouched for
(a heartbeat reply, the hub's offer, a manifest it signed), except once from an upstream that announced it
(`announce`), and makes no file for a signed manifest larger than its model or its free disk
(shared.snapshot.check_snapshot_size).

Deltas (shared/delta.py): each pull names the installed version as its base, so an upstream holding
the next version as a delta against it sends the delta. The keeper relays the delta chunks as they
arrive, applies the delta to its installed file once every chunk verified, and installs (and relays
in full) the result only if it matches the full manifest the hub signed, which the delta carries. A
delta that does not apply makes the next pull of that version ask for the full snapshot.

Snapshots live in files under `directory` (verified chunks written into a preallocated file,
relayed and installed from it): RAM holds the engine's model and a chunk window, not a
snapshot. Retention: the installed version (and the delta it came as) and the one in flight;
older files are deleted as soon as a newer version is installed or a transfer is superseded.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from shared.bulk import BulkChannel, BulkUnreachable, serving_stream
from shared.crypto import Identity
from shared.delta import DeltaError, apply_delta, delta_full_manifest
from shared.failures import plain_failure
from shared.logs import PeerLogLimiter
from shared.messages import (
    PEER_TEXT_CHARS,
    RELAY_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    BadChunkReport,
    Reject,
    RejectCode,
    RelayOffer,
    SnapshotRequest,
    TransferAck,
    printable_excerpt,
)
from shared.net import connect, open_stream, remote_peer_id
from shared.probe import InstallProbe
from shared.snapshot import (
    ChunkAssembler,
    Manifest,
    OversizedSnapshot,
    SignedManifest,
    SnapshotError,
    check_snapshot_size,
    delta_paths,
    read_chunk,
    snapshot_paths,
)
from shared.transfer import (
    RECEIVER_GONE,
    STALL_S,
    ChunkRejected,
    NotServable,
    UnusableDelta,
    Writer,
    receive_snapshot,
    servable,
    serve_snapshot,
)
from shared.wire import FrameError, StreamEOF, read_message, write_message

log = logging.getLogger("echo2.node.keeper")

RETRY_S = 0.5
UPSTREAM_FAILURES_BEFORE_HUB = 2
MANIFEST_WAIT_S = 20.0
# The hub tells a successor about us a heartbeat before it tells us: how long a pull from a peer we
# do not know as our successor waits for that news before it is refused.
DOWNSTREAM_WAIT_S = 5.0
CONNECT_TIMEOUT_S = 10.0
ANNOUNCE_TIMEOUT_S = 5.0
# node.log's install line, at INFO once per INSTALL_LINE_S at most (counting the installs since the last one), each
# install at DEBUG; the node's terminal says installs at the same pace (node/run.py). A run publishes a version every
# few seconds: a line each would bury everything else.
INSTALL_LINE_S = 60.0

# A pull that ends in one of these lost its upstream (left, refused, stalled): keep what we
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
    via: str = "libp2p"  # how its last pull came: "the bulk channel" or "libp2p"


@dataclass(frozen=True)
class Held:
    """The installed snapshot: its manifest and its file, open for serving our successor; with the delta
    it arrived as, when it did (served to a successor holding the same base)."""

    signed: SignedManifest
    manifest: Manifest
    path: Path
    fd: int
    delta: Held | None = None

    def remove(self) -> None:
        for held in (self, self.delta):
            if held is not None:
                os.close(held.fd)
                held.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Upstream:
    peer_id: str | None  # None: the hub
    addrs: tuple[str, ...]
    kind: str = "direct"  # hub.method.chains.link_kind: "holepunch" is reached through node/nat.py


HUB = Upstream(None, ())


class SnapshotKeeper:
    """Holds the newest verified snapshot (and the one in flight) for the engine and for downstream peers."""

    def __init__(
        self,
        host: IHost,
        identity: Identity,
        hub_peer_id: str,
        directory: Path,
        install: Callable[[Path, int, InstallProbe | None], Awaitable[None]],
        limiter: Writer | None,
        on_installed: Callable[[int], None],
        report: Callable[[BadChunkReport], Awaitable[TransferAck | Reject]],
        max_snapshot_bytes: int,
        stall_s: float = STALL_S,
        punch: Callable[[str], Awaitable[bool]] | None = None,
        bulk: BulkChannel | None = None,
    ) -> None:
        self.host = host
        self.bulk = bulk
        self.identity = identity
        self.hub_peer_id = hub_peer_id
        self.directory = Path(directory)
        # The most bytes a snapshot of this node's model takes (shared.snapshot.snapshot_bytes_bound): a signed
        # manifest promising more is refused before its file is made.
        self.max_snapshot_bytes = max_snapshot_bytes
        self._install = install
        self._send_report = report
        self.stall_s = stall_s
        self.limiter = limiter
        self.on_installed = on_installed
        self.held: Held | None = None
        self.transfer: Transfer | None = None
        # The newest version the hub vouched for: its replies' latest, its own offers, a manifest it signed
        # that verified here. What the keeper pulls never stays above it (see `announce`).
        self.hub_version = -1
        self.target_version = -1
        self.upstream = HUB
        self.downstream: str | None = None
        self.distrusted: set[str] = set()
        # Failed or stalled pulls from the current upstream; past a couple, the hub is asked instead
        # until the hub names a new upstream (an install does not forgive them: a stalling relay
        # would otherwise freeze every next version too).
        self.upstream_failures = 0
        self._changed = trio.Event()
        self._pull_scope: trio.CancelScope | None = None
        self._pulling_from: Upstream | None = None
        self._nursery: trio.Nursery | None = None
        self.bad_chunks_seen = 0
        self.resumes = 0
        self.relinks = 0
        # A version whose delta did not apply (or came against another base): pulled in full.
        self._full_for: int | None = None
        # A version whose signed manifest was refused as oversized: not asked for again.
        self._oversized: int | None = None
        self._install_lines = PeerLogLimiter(INSTALL_LINE_S, trio.current_time)
        # The newest install line logged at DEBUG only: at INFO when the keeper stops, so that node.log at its
        # default level still ends with the last install and where it came from.
        self._install_unsaid: str | None = None
        self.deltas_applied = 0
        self.bytes_served = 0  # chunk bytes handed to successors (and the hub) that pulled from us
        self._punch = punch
        # The NATed upstream our last hole punch with failed (the heartbeat tells the hub).
        self.punch_failed: str | None = None

    # -- state -----------------------------------------------------------------------

    @property
    def version_held(self) -> int:
        return self.held.manifest.version if self.held else -1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def update(
        self, latest_version: int, upstream: Upstream, downstream: str | None, downstream_addrs: tuple[str, ...] = ()
    ) -> None:
        """New orders from the hub (heartbeat reply): the version to get and where to get it; `downstream_addrs`:
        our successor cannot dial us (we are behind a NAT), so we dial it and it pulls over that connection."""
        relinked = upstream != self.upstream
        self.hub_version = max(self.hub_version, latest_version)
        # The hub's word replaces a version only an upstream named: one the hub never confirmed must not stick.
        changed = self.hub_version != self.target_version or relinked
        self.target_version = self.hub_version
        self.upstream = upstream
        if relinked:
            self.upstream_failures = 0
            if self._pull_scope is not None and self._pulling_from != self._source():
                self.relinks += 1
                self._pull_scope.cancel()
            if upstream.peer_id is not None and upstream.addrs and self._nursery is not None:
                # Dial now: our upstream's announce of its next version can then reach us at once.
                self._nursery.start_soon(self._dial, upstream)
        if downstream_addrs and self._nursery is not None and not self._connected(downstream):
            self._nursery.start_soon(self._dial, Upstream(downstream, downstream_addrs))
        if downstream != self.downstream:
            self.downstream = downstream
            changed = True  # a successor waiting to be served may be this one
            if downstream is not None and self.transfer is not None:
                self._announce_downstream(self.transfer.manifest.version)
        if changed:
            self._notify()

    def _connected(self, peer: str | None) -> bool:
        return peer is not None and bool(self.host.get_network().connections.get(ID.from_base58(peer)))

    def announce(self, version: int) -> None:
        """Our upstream says it has started on `version`: pull now rather than at the next heartbeat.

        Its word is a lead, not the hub's: the pull it starts must show the hub's signed manifest of
        `version` (which raises `hub_version`), and a pull that shows none, or the hub's next word, takes the
        target back to the newest version the hub vouched for."""
        if version > self.target_version:
            self.target_version = version
            self._notify()

    def vouch(self, version: int) -> None:
        """The hub itself names `version` (its offer to a chain head): the hub's word, like a heartbeat reply's."""
        self.hub_version = max(self.hub_version, version)
        self.announce(version)

    def _drop_unconfirmed(self, version: int) -> None:
        """A pull of `version` failed before the hub's manifest of it verified: if only an upstream named it,
        fall back to the hub's latest (a hostile relay's made-up version would otherwise be asked for forever)."""
        if version == self.target_version > self.hub_version:
            log.info("v%d was named by an upstream, never by the hub: back to the hub's v%d", version, self.hub_version)
            self.target_version = self.hub_version

    # -- serving downstream (a shared.transfer.ChunkSource) ------------------------------

    def held_manifest(self, version: int | None, base_version: int | None = None) -> tuple[SignedManifest, Manifest] | None:
        transfer, held = self.transfer, self.held
        if transfer is not None and version in (None, transfer.manifest.version):
            if transfer.manifest.kind == "full" or transfer.manifest.base_version == base_version:
                return transfer.signed, transfer.manifest
            return None  # a delta in flight is no use to a successor on another base: it waits for our result
        if held is not None and version in (None, held.manifest.version):
            if held.delta is not None and held.delta.manifest.base_version == base_version:
                return held.delta.signed, held.delta.manifest
            return held.signed, held.manifest
        return None

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        data = await self._chunk(version, index, delta)
        self.bytes_served += len(data)
        return data

    async def _chunk(self, version: int, index: int, delta: bool) -> bytes:
        """Chunk `index` of `version` (or of its delta) once we hold it: from the installed file or the transfer."""
        while True:
            held = self.held
            if held is not None and held.manifest.version == version:
                source = held.delta if delta else held
                if source is None:
                    raise LookupError(f"snapshot v{version} came in full: no delta to serve")
                return read_chunk(source.fd, source.manifest, index)
            transfer = self.transfer
            if transfer is None or transfer.manifest.version != version or (transfer.manifest.kind == "delta") != delta:
                raise LookupError(f"snapshot v{version}{' delta' if delta else ''} abandoned")
            if transfer.assembler.has(index):
                return transfer.assembler.chunk(index)
            await self._changed.wait()

    def _may_pull_from_us(self, peer: str) -> bool:
        return peer in (self.downstream, self.hub_peer_id)

    async def serve(self, stream: INetStream) -> None:
        """SNAPSHOT_PROTOCOL handler: our successor (or the hub) pulls what we hold or are still receiving."""
        peer = remote_peer_id(stream)
        with trio.fail_after(self.stall_s):
            req = await read_message(stream, SnapshotRequest)
        with trio.move_on_after(DOWNSTREAM_WAIT_S):
            while not self._may_pull_from_us(peer):
                await self._changed.wait()
        # A successor may ask before our own pull of that version has begun: give it a moment.
        with trio.move_on_after(MANIFEST_WAIT_S):
            while self._may_pull_from_us(peer) and (
                req.version is not None
                and req.version > self.version_held
                and self.held_manifest(req.version, req.base_version) is None
            ):
                await self._changed.wait()
        if not self._may_pull_from_us(peer):
            log.info("refused a snapshot pull from %s: not the successor the hub named", peer[-8:])
            await write_message(stream, Reject(code=RejectCode.NOT_UPSTREAM, reason="not the successor the hub named"))
            await stream.close()
            return
        try:
            servable(self, req)
            async with serving_stream(stream, req, self.bulk, peer) as transfer:
                ack = await serve_snapshot(transfer, self, req, self.limiter, self.identity, self.stall_s)
        except NotServable as exc:
            await write_message(stream, Reject(code=RejectCode.NOT_HELD, reason=str(exc)[:1000]))
            await stream.close()
            return
        except LookupError as exc:  # the version was abandoned mid-transfer (a newer one arrived)
            log.info("v%s to %s ended: %s", req.version, peer[-8:], exc)
            await stream.reset()
            return
        except (*RECEIVER_GONE, trio.TooSlowError) as exc:
            # The puller left, re-linked elsewhere or stopped reading mid-transfer: churn, not a failure here.
            log.info("v%s to %s ended early: %r", req.version, peer[-8:], exc)
            await stream.reset()
            return
        if not ack.ok:
            reason = printable_excerpt(ack.reason, PEER_TEXT_CHARS)
            log.warning("v%d to %s ended badly: %s", ack.version, remote_peer_id(stream)[-8:], reason)
        await stream.close()

    async def on_relay_offer(self, stream: INetStream) -> None:
        """RELAY_PROTOCOL handler: the hub or our upstream has a newer version for us.

        Offers from anyone else are ignored: a stranger could otherwise point us at a version
        that never comes.
        """
        with trio.fail_after(ANNOUNCE_TIMEOUT_S):
            offer = await read_message(stream, RelayOffer)
        await stream.close()
        sender = remote_peer_id(stream)
        if sender == self.hub_peer_id:
            self.vouch(offer.version)
        elif sender == self.upstream.peer_id:
            self.announce(offer.version)
        else:
            log.info("ignored relay offer of v%d from %s (not our upstream)", offer.version, sender[-8:])

    # -- receiving -------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                version = self.target_version
                if version <= self.version_held or version == self._oversized:
                    await self._changed.wait()
                    continue
                if await self._pull_once(version):
                    await self._complete(version)
        finally:
            if self._install_unsaid is not None:
                log.info("%s", self._install_unsaid)

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
        stalled = False
        with trio.CancelScope() as scope:
            self._pull_scope, self._pulling_from = scope, source
            try:
                await self._pull(version, source)
            except ChunkRejected as exc:
                rejected = exc
            except UnusableDelta as exc:
                log.info("v%d from %s: %s; asking for the full snapshot", version, self._name(source), exc)
                self._full_for = version
            except OversizedSnapshot as exc:
                log.warning("snapshot v%d refused before a byte of it was written: %s", version, exc)
                self._oversized = version
            except SnapshotError as exc:
                # The hub's own signature holds but the snapshot does not (or not the newest): retry.
                log.warning("snapshot v%d from %s refused: %s; asking again", version, self._name(source), exc)
            except trio.TooSlowError:
                log.info("snapshot v%d from %s: unreachable or silent for %.0fs", version, self._name(source), self.stall_s)
                stalled = True
            except _INTERRUPTED as exc:
                log.info("snapshot v%d from %s interrupted: %r", version, self._name(source), exc)
            except Exception as exc:  # noqa: BLE001 - libp2p dial errors share no base class
                log.info("snapshot v%d: cannot reach %s: %r", version, self._name(source), exc)
            finally:
                self._pull_scope = self._pulling_from = None
        transfer = self.transfer
        if transfer is not None and transfer.manifest.version == version and transfer.assembler.complete:
            return True
        self._drop_unconfirmed(version)
        if rejected is not None:
            await self._reject_source(source, rejected)
        elif scope.cancelled_caught:
            log.info("re-linked during v%d: pulling from %s next", version, self._name(self._source()))
        else:
            # Upstream gone, refusing or stalled: wait for new orders (a re-link) or retry shortly.
            if source.peer_id is not None:
                self.upstream_failures += 1
                if stalled:
                    await self._report(
                        BadChunkReport(
                            upstream=source.peer_id,
                            kind="unproven",
                            version=version,
                            reason=f"unreachable or silent for {self.stall_s:.0f}s",
                        )
                    )
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
        # The base we can apply a delta to: the installed version (None: send the full snapshot).
        base = None if self.held is None or self._full_for == version else self.held.manifest.version
        if transfer is not None and transfer.manifest.version == version:
            if transfer.manifest.kind == "full":
                base = None  # resume what we have

            from_chunk = transfer.assembler.first_missing() or 0
            transfer.source = self._name(source)
            if from_chunk > 0:
                self.resumes += 1
                log.info("resuming v%d from chunk %d via %s", version, from_chunk, self._name(source))
        if source.kind == "holepunch" and source.peer_id is not None:
            # Before the connect deadline: a punch waits for the relay and for both NATs (node/nat.py has its own).
            if self._punch is None or not await self._punch(source.peer_id):
                self.punch_failed = source.peer_id
                raise OSError(f"no direct connection to {source.peer_id[-8:]}: the hole punch failed")
            self.punch_failed = None
        sender = source.peer_id or self.hub_peer_id
        # Only a sender we dial can be dialed on its channel: a NATed one (it dials us, or we punch) serves on libp2p.
        bulk = self.bulk is not None and source.kind == "direct" and self.bulk.usable(sender)
        request = SnapshotRequest(version=version, from_chunk=from_chunk, base_version=base, bulk=bulk)
        try:
            await self._receive(source, request)
        except BulkUnreachable as exc:
            log.info("v%d: %s; taking it over libp2p (slower, more CPU)", version, exc)
            await self._receive(source, request.model_copy(update={"bulk": False}))

    async def _receive(self, source: Upstream, request: SnapshotRequest) -> None:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await self._open(source)
        dialed = self.bulk.dialed if self.bulk is not None else 0
        try:
            # No deadline on the whole transfer (a large model on a slow link takes long); a silent
            # sender is given up on after STALL_S.
            await receive_snapshot(
                stream,
                request,
                self.hub_peer_id,
                source.peer_id or self.hub_peer_id,
                newer_than=self.version_held,
                assembler_for=lambda signed, manifest: self._assembler_for(signed, manifest, source),
                on_chunk=self._on_chunk,
                stall_s=self.stall_s,
                bulk=self.bulk,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.reset()  # py-libp2p's reset swallows errors of an already broken stream
            raise
        if self.transfer is not None:
            self.transfer.via = "the bulk channel" if self.bulk is not None and self.bulk.dialed > dialed else "libp2p"

    def _assembler_for(self, signed: SignedManifest, manifest: Manifest, source: Upstream) -> ChunkAssembler:
        self.hub_version = max(self.hub_version, manifest.version)  # the hub signed it: it published this version
        transfer = self.transfer
        if transfer is None or transfer.manifest.version != manifest.version or transfer.manifest.kind != manifest.kind:
            check_snapshot_size(manifest, self.max_snapshot_bytes, shutil.disk_usage(self.directory).free)
            if transfer is not None:  # superseded by a newer version (or the other kind of it): its file goes
                transfer.assembler.discard()
            paths = delta_paths if manifest.kind == "delta" else snapshot_paths
            path, _ = paths(self.directory, manifest.version)
            transfer = self.transfer = Transfer(
                signed, manifest, ChunkAssembler(manifest, path), time.monotonic(), self._name(source)
            )
            self._notify()
            if self.downstream is not None:
                self._announce_downstream(manifest.version)
        return transfer.assembler

    async def _on_chunk(self, index: int) -> None:
        self._notify()

    async def _reject_source(self, source: Upstream, exc: ChunkRejected) -> None:
        """`source` sent a bad frame: never pull from it again, and tell the hub, with the sender's own
        commitment as proof when it gave one (the hub checks it, then bans)."""
        self.bad_chunks_seen += 1
        log.warning("bad frame from %s: %s", self._name(source), exc)
        if source.peer_id is None:
            # The hub's own frame fails: nothing to report to it, retry.
            await trio.sleep(RETRY_S)
            return
        self.distrusted.add(source.peer_id)
        proof = exc.proof
        if proof is None:
            report = BadChunkReport(
                upstream=source.peer_id, kind="unproven", version=exc.version, index=exc.index, reason=str(exc)[:300]
            )
        else:
            report = BadChunkReport(
                upstream=source.peer_id,
                kind=proof.kind,
                version=proof.version,
                index=proof.index,
                digest_hex=proof.digest_hex,
                commitment_hex=proof.signature.hex(),
            )
        await self._report(report)

    async def _report(self, report: BadChunkReport) -> None:
        try:
            reply = await self._send_report(report)
        except Exception as exc:  # noqa: BLE001 - the hub may be away; the repair goes on without it
            log.debug("report on %s not delivered: %r", report.upstream[-8:], exc)
            log.warning("could not report %s to the hub: the hub %s", report.upstream[-8:], plain_failure(exc))
            return
        log.info("reported %s (%s, v%d chunk %d): %s", report.upstream[-8:], report.kind, report.version, report.index, reply)

    async def _complete(self, version: int) -> None:
        transfer = self.transfer
        assert transfer is not None  # a chunk completed it
        # Hashing a whole model is seconds of CPU for a large one: off the event loop.
        path = await trio.to_thread.run_sync(transfer.assembler.finish)  # whole hash checked
        if transfer.manifest.kind == "delta":
            try:
                held = await trio.to_thread.run_sync(self._apply, transfer, path)
            except SnapshotError as exc:
                log.warning("v%d: the delta does not apply (%s); asking for the full snapshot", version, exc)
                transfer.assembler.discard()
                self.transfer, self._full_for = None, version
                self._notify()
                return
            self.deltas_applied += 1
        else:
            held = Held(transfer.signed, transfer.manifest, path, os.open(path, os.O_RDONLY))
        try:
            await self._install(held.path, version, held.manifest.probe)
        except BaseException:
            transfer.assembler.close()
            held.remove()
            raise
        previous = self.held
        self.held = held
        self.transfer = None
        # Closed only now: a successor was served from it until `held` took over.
        transfer.assembler.close()
        self._notify()
        if previous is not None:  # retention: the installed version and the one in flight, nothing older
            previous.remove()
        came_as = f"a delta of {held.delta.manifest.total_bytes} bytes" if held.delta else f"{held.manifest.total_bytes} bytes"
        self._log_install(f"v{version} ({time.monotonic() - transfer.started_at:.2f}s, {came_as}", transfer)
        self.on_installed(version)

    def _log_install(self, head: str, transfer: Transfer) -> None:
        """The install line (`head`: version, time, size): at INFO once per INSTALL_LINE_S, with how many installs
        came since the last such line, else at DEBUG."""
        tail = f"last from {transfer.source} over {transfer.via})"
        logged, held_back = self._install_lines.allow("installed", trio.current_time())
        if logged:
            since = f", {held_back} more installs since the last such line" if held_back else ""
            log.info("installed %s%s, %s", head, since, tail)
            self._install_unsaid = None
        else:
            self._install_unsaid = f"installed {head}, {tail}"
            log.debug("%s", self._install_unsaid)

    def _apply(self, transfer: Transfer, delta_path: Path) -> Held:
        """The full snapshot a verified delta makes of the installed one (blocking: reads and hashes the model)."""
        base = self.held
        if base is None or base.manifest.version != transfer.manifest.base_version:
            raise DeltaError(f"the delta's base v{transfer.manifest.base_version} is not installed here")
        signed, full, base_hash = delta_full_manifest(delta_path, self.hub_peer_id)
        if (
            full.version != transfer.manifest.version
            or full.whole_hash != transfer.manifest.result_hash
            or base_hash != base.manifest.whole_hash
        ):
            raise DeltaError("the full manifest inside the delta does not match the delta's own manifest")
        path, _ = snapshot_paths(self.directory, full.version)
        apply_delta(base.path, base.manifest.whole_hash, delta_path, full, path)
        delta = Held(transfer.signed, transfer.manifest, delta_path, os.open(delta_path, os.O_RDONLY))
        return Held(signed, full, path, os.open(path, os.O_RDONLY), delta)

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
        # Nothing carries over a restart (the hub names the newest version again): old files go, with the
        # temp files of an interrupted delta and the adapter folders a vLLM engine made.
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        self._nursery = nursery
        nursery.start_soon(self.run)
