"""Snapshot transfer on one stream, used by the hub and by every relaying node alike.

Pull protocol (SNAPSHOT_PROTOCOL): the receiver sends a SnapshotRequest naming the version
and the first chunk it lacks (or one chunk, for repair); the sender writes the signed
manifest frame, then chunk frames in order, waiting for chunks it is itself still
receiving, so a relay forwards each verified chunk as soon as it has it. The receiver
verifies the manifest against the hub's key and every chunk against the manifest before it
keeps it, then answers with a TransferAck; the sender closes only after reading that ack
(closing without an ack, or resetting, could discard data still in flight).

Commitments: every frame a sender writes carries its own Ed25519 signature over what it sends
(`commitment`: the kind, the requested version, the chunk index and the blake3 of the bytes). A
receiver checks the commitment before anything else. A frame whose commitment does not verify
proves nothing to anyone (`proof` None): the receiver drops that sender. A frame whose commitment
verifies but whose bytes fail the hub's manifest is proof the sender lied, which the hub can
check with the sender's public key alone; and a report quoting a commitment to the right bytes
proves the reporter lied. Honest relays therefore cannot be framed, and lying ones are banned.

Deltas: a receiver names the version it holds (`base_version`); a sender holding a delta of the
asked version against exactly that base serves the delta (shared/delta.py), else the full snapshot.
Delta frames are committed to under their own kinds, so a delta chunk can never be judged against
the full snapshot's manifest. A delta against another base is refused (UnusableDelta) unkept.

Chunks arrive strictly in the order asked for (from_chunk, from_chunk + 1, ..., or the one
only_chunk): a sender that sends any other index is treated like one that sends a bad chunk.
A sender that stops sending is dropped after STALL_S without a byte (there is no deadline on a
whole transfer: a large model on a slow link takes as long as it takes).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import blake3
import trio
from libp2p.network.stream.exceptions import StreamError

from shared.bulk import BulkChannel
from shared.crypto import SIGNATURE_BYTES, Identity, public_key_from_peer_id, verify
from shared.messages import CHUNK_FRAME, MANIFEST_FRAME, MIN_LINK_BPS, BulkOffer, SnapshotRequest, TransferAck
from shared.net import remote_ip
from shared.snapshot import (
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    BadChunk,
    ChunkAssembler,
    Manifest,
    SignedManifest,
    SnapshotError,
    StoredChunk,
    chunk_header,
    decode_chunk,
    verify_manifest,
)
from shared.wire import (
    StreamEOF,
    decode_message,
    encode_frame,
    message_caps,
    read_frame,
    read_message,
    write_frame,
    write_message,
)

# What serving a snapshot raises when the receiver stops or re-links mid-transfer: a read that finds
# the stream ended (StreamEOF), or a write into a stream it reset (py-libp2p's StreamError; on a bulk
# channel, trio's BrokenResourceError).
RECEIVER_GONE = (StreamEOF, StreamError, trio.BrokenResourceError, trio.ClosedResourceError)

# A sender (or a receiver owing its ack) silent this long is given up on; a frame must also keep coming at
# MIN_TRANSFER_BPS at least (the slowest link a node may declare), so a trickle is a stall too.
STALL_S = 20.0
MIN_TRANSFER_BPS = MIN_LINK_BPS
CHUNK_FRAME_OVERHEAD_BYTES = 12 + SIGNATURE_BYTES
TRANSFER_CAPS = {
    MANIFEST_FRAME: MAX_MANIFEST_BYTES + 2 * SIGNATURE_BYTES,
    CHUNK_FRAME: MAX_CHUNK_BYTES + CHUNK_FRAME_OVERHEAD_BYTES,
}
CommitKind = Literal["manifest", "chunk", "delta-manifest", "delta-chunk"]
_COMMIT_DOMAIN = b"echo2/transfer-commitment/1|"
_COMMIT_FIELDS = struct.Struct(">QI")


def commitment_payload(kind: CommitKind, version: int, index: int, digest_hex: str) -> bytes:
    """What a sender signs for one frame: the kind, the requested version, the chunk index, the bytes' blake3."""
    return _COMMIT_DOMAIN + kind.encode() + b"|" + _COMMIT_FIELDS.pack(version, index) + bytes.fromhex(digest_hex)


def frame_kinds(manifest: Manifest) -> tuple[CommitKind, CommitKind]:
    """(manifest kind, chunk kind) a sender commits to for the frames of this snapshot."""
    return ("delta-manifest", "delta-chunk") if manifest.kind == "delta" else ("manifest", "chunk")


def commitment_holds(public_key: bytes, kind: CommitKind, version: int, index: int, digest_hex: str, sig: bytes) -> bool:
    return len(sig) == SIGNATURE_BYTES and verify(public_key, commitment_payload(kind, version, index, digest_hex), sig)


@dataclass(frozen=True)
class Proof:
    """A sender's valid signature over the blake3 of what it sent: enough for the hub to judge the sender."""

    kind: CommitKind
    version: int
    index: int
    digest_hex: str
    signature: bytes


class ChunkRejected(BadChunk):
    """The sender sent something other than the verified manifest or chunk it was asked for.

    `proof` is the sender's commitment to the bytes it sent, or None when its frame carried no
    valid commitment (then nothing can be proven to a third party).
    """

    def __init__(self, version: int, index: int, reason: str, proof: Proof | None) -> None:
        super().__init__(f"chunk {index} of v{version}: {reason}")
        self.version = version
        self.index = index
        self.proof = proof


class UnusableDelta(SnapshotError):
    """The sender offered a delta against a base the receiver did not name: nothing kept, nobody to blame
    (the manifest is the hub's own); the receiver asks for the full snapshot next."""


class NotServable(LookupError):
    """The request asks for a version or chunks the sender does not hold: refused before anything is sent.

    (A LookupError from the source later, mid-transfer, means the sender dropped the version meanwhile.)"""


def _committed_kind(sender_key: bytes, version: int, digest_hex: str, sig: bytes) -> CommitKind | None:
    """Which manifest kind the sender's commitment is to, if it holds for either."""
    for kind in ("manifest", "delta-manifest"):
        if commitment_holds(sender_key, kind, version, 0, digest_hex, sig):
            return kind
    return None


def wanted_chunks(request: SnapshotRequest, total: int) -> range:
    """The chunk indices a request asks for, in the order they must be sent (NotServable if out of range)."""
    if request.only_chunk is not None:
        if not 0 <= request.only_chunk < total:
            raise NotServable(f"chunk {request.only_chunk} out of range 0..{total - 1}")
        return range(request.only_chunk, request.only_chunk + 1)
    if request.from_chunk >= total:
        raise NotServable(f"from_chunk {request.from_chunk} out of range 0..{total - 1}")
    return range(request.from_chunk, total)


def servable(source: ChunkSource, request: SnapshotRequest) -> tuple[SignedManifest, Manifest, range]:
    """What `source` would serve for `request`: its manifest and the chunk indices (NotServable if nothing).
    Handlers ask before they offer a bulk channel, so a refusal goes back on the stream that asked."""
    held = source.held_manifest(request.version, request.base_version)
    if held is None:
        raise NotServable(f"snapshot {request.version if request.version is not None else 'newest'} not held")
    signed, manifest = held
    return signed, manifest, wanted_chunks(request, manifest.chunk_count)


class ChunkSource(Protocol):
    """Something that can serve a snapshot: the hub (everything at hand) or a relay (chunks still arriving)."""

    def held_manifest(self, version: int | None, base_version: int | None = None) -> tuple[SignedManifest, Manifest] | None:
        """The signed manifest of `version` (None: the newest) and its parsed form, if held: its delta
        against `base_version` when one is held, else the full snapshot's."""
        ...

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        """The verified chunk (of `version`'s delta when `delta`), waiting for it if it is still on its way;
        raises LookupError if it never will be."""
        ...


class Writer(Protocol):
    async def write(self, stream, data: bytes) -> None: ...


async def serve_snapshot(
    stream, source: ChunkSource, request: SnapshotRequest, limiter: Writer | None, identity: Identity, stall_s: float = STALL_S
) -> TransferAck:
    """Answer one SnapshotRequest on `stream`, committing to every frame as `identity`, and return the
    receiver's ack (NotServable if there is nothing to serve)."""
    signed, manifest, indices = servable(source, request)
    manifest_bytes = signed.to_bytes()
    digest = blake3.blake3(manifest_bytes).hexdigest()
    # Committed to the version asked for: sending another one's manifest in its place is then provable.
    asked = request.version if request.version is not None else manifest.version
    manifest_kind, chunk_kind = frame_kinds(manifest)
    await write_frame(stream, MANIFEST_FRAME, manifest_bytes + identity.sign(commitment_payload(manifest_kind, asked, 0, digest)))
    version, delta = manifest.version, manifest.kind == "delta"
    for index in indices:
        data = await source.chunk(version, index, delta)
        # The commitment is to the bytes sent: a chunk read back from a file it was verified into carries the
        # manifest's hash of it (should the file have rotted since, the receiver finds the commitment false and
        # drops us without a proof); any other bytes are hashed here (0.7 CPU-s per GB).
        digest = data.digest_hex if isinstance(data, StoredChunk) else blake3.blake3(data).hexdigest()
        sig = identity.sign(commitment_payload(chunk_kind, version, index, digest))
        frame = encode_frame(CHUNK_FRAME, chunk_header(version, index, len(data)), data, sig)
        if limiter is None:
            await stream.write(frame)
        else:
            await limiter.write(stream, frame)
    _, ack = await read_frame(stream, message_caps(TransferAck), stall_s, MIN_TRANSFER_BPS)
    return decode_message(TransferAck, ack)


async def receive_snapshot(
    stream,
    request: SnapshotRequest,
    hub_peer_id: str,
    sender_peer_id: str,
    newer_than: int | None,
    assembler_for: Callable[[SignedManifest, Manifest], ChunkAssembler],
    on_chunk: Callable[[int], Awaitable[None]] | None = None,
    stall_s: float = STALL_S,
    bulk: BulkChannel | None = None,
) -> ChunkAssembler:
    """Send `request`, check the sender's commitments, verify the manifest and every chunk, ack, and return
    the assembler holding them.

    `assembler_for` returns the assembler to fill (a fresh one, or a partial one to resume);
    a chunk it already holds is skipped unhashed. A frame failing its commitment or verification,
    or arriving out of the asked order, raises ChunkRejected (after telling the sender); nothing
    unverified is ever kept. `on_chunk` runs after each chunk is stored; a sender silent for
    `stall_s` raises trio.TooSlowError.

    A request with bulk=True takes the sender's bulk channel through `bulk` when the sender offers one
    (BulkUnreachable if it cannot be opened: ask again without bulk); both streams are closed at the end.
    """
    await write_message(stream, request)
    transfer = await _transfer_stream(stream, request, sender_peer_id, stall_s, bulk)
    try:
        sender_key = public_key_from_peer_id(sender_peer_id)
        signed, manifest, wanted = await _receive_manifest(transfer, request, hub_peer_id, sender_key, newer_than, stall_s)
        assembler = assembler_for(signed, manifest)
        received = await _receive_chunks(transfer, manifest, wanted, sender_key, assembler, on_chunk, stall_s)
        await write_message(transfer, TransferAck(version=manifest.version, chunks=received, ok=True))
        await transfer.close()
    finally:
        if transfer is not stream:
            with trio.CancelScope(shield=True):
                await transfer.close()
    if transfer is not stream:
        await stream.close()
    return assembler


async def _transfer_stream(stream, request: SnapshotRequest, sender_peer_id: str, stall_s: float, bulk: BulkChannel | None):
    """Where the frames will come: the sender's bulk channel when asked for and offered, else `stream`."""
    if not request.bulk:
        return stream
    if bulk is None:
        raise ValueError("a request for the bulk channel needs a BulkChannel to dial it")
    with trio.fail_after(stall_s):
        offer = await read_message(stream, BulkOffer)
    if offer.port is None:
        return stream
    return await bulk.dial(sender_peer_id, remote_ip(stream), offer)


async def _receive_manifest(
    transfer, request: SnapshotRequest, hub_peer_id: str, sender_key: bytes, newer_than: int | None, stall_s: float
) -> tuple[SignedManifest, Manifest, range]:
    """Read the manifest frame, check the sender's commitment to it and the hub's signature, and return it
    with the chunk indices to expect (ChunkRejected, or UnusableDelta for a delta against another base)."""
    _, body = await read_frame(transfer, {MANIFEST_FRAME: TRANSFER_CAPS[MANIFEST_FRAME]}, stall_s, MIN_TRANSFER_BPS)
    manifest_bytes, sig = body[:-SIGNATURE_BYTES], body[-SIGNATURE_BYTES:]
    digest = blake3.blake3(manifest_bytes).hexdigest()
    committed = _asked_commitment(sender_key, request, digest, sig)
    proof = None if committed is None or request.version is None else Proof(committed, request.version, 0, digest, sig)
    signed, manifest, wanted = _verified_manifest(manifest_bytes, request, hub_peer_id, newer_than, committed, proof)
    manifest_kind, _ = frame_kinds(manifest)
    if request.version is None and not commitment_holds(sender_key, manifest_kind, manifest.version, 0, digest, sig):
        raise ChunkRejected(manifest.version, 0, "manifest frame without a valid commitment", None)
    if manifest.kind == "delta" and manifest.base_version != request.base_version:
        raise UnusableDelta(f"offered a delta against v{manifest.base_version}; this node holds {request.base_version}")
    return signed, manifest, wanted


def _asked_commitment(sender_key: bytes, request: SnapshotRequest, digest_hex: str, sig: bytes) -> CommitKind | None:
    """The manifest kind the sender committed to for the version asked for (ChunkRejected if to neither); None
    when the request names no version, which binds the sender to nothing in particular."""
    if request.version is None:
        return None
    committed = _committed_kind(sender_key, request.version, digest_hex, sig)
    if committed is None:
        raise ChunkRejected(request.version, 0, "manifest frame without a valid commitment", None)
    return committed


def _verified_manifest(
    manifest_bytes: bytes,
    request: SnapshotRequest,
    hub_peer_id: str,
    newer_than: int | None,
    committed: CommitKind | None,
    proof: Proof | None,
) -> tuple[SignedManifest, Manifest, range]:
    """The hub-signed manifest the request asked for, matching the kind committed to, and the chunk indices
    it asks of it; ChunkRejected (with `proof`) for anything else."""
    try:
        signed = SignedManifest.from_bytes(manifest_bytes)
        manifest = verify_manifest(signed, hub_peer_id, newer_than)
        if request.version is not None and manifest.version != request.version:
            raise BadChunk(f"asked for v{request.version}, got a manifest for v{manifest.version}")
        if committed is not None and committed != frame_kinds(manifest)[0]:
            raise BadChunk(f"committed to a {committed} frame, sent a {manifest.kind} snapshot's manifest")
        return signed, manifest, wanted_chunks(request, manifest.chunk_count)
    except (SnapshotError, LookupError) as exc:
        raise ChunkRejected(request.version or 0, 0, f"manifest refused: {exc}", proof) from None


async def _receive_chunks(
    transfer,
    manifest: Manifest,
    wanted: range,
    sender_key: bytes,
    assembler: ChunkAssembler,
    on_chunk: Callable[[int], Awaitable[None]] | None,
    stall_s: float,
) -> int:
    """Receive the `wanted` chunks in order into `assembler` and return how many came; on a rejected frame,
    tell the sender (a failed TransferAck) and raise ChunkRejected."""
    received = 0
    try:
        for expected in wanted:
            index = await _receive_chunk(transfer, manifest, expected, sender_key, assembler, stall_s)
            received += 1
            if on_chunk is not None:
                await on_chunk(index)
    except ChunkRejected as exc:
        await write_message(transfer, TransferAck(version=manifest.version, chunks=received, ok=False, reason=str(exc)[:500]))
        raise
    return received


async def _receive_chunk(
    transfer, manifest: Manifest, expected: int, sender_key: bytes, assembler: ChunkAssembler, stall_s: float
) -> int:
    """Read chunk `expected`, check the sender's commitment, then the manifest's hash, and store it; its index."""
    _, frame = await read_frame(transfer, {CHUNK_FRAME: TRANSFER_CAPS[CHUNK_FRAME]}, stall_s, MIN_TRANSFER_BPS)
    body, sig = frame[:-SIGNATURE_BYTES], frame[-SIGNATURE_BYTES:]
    try:
        version, index, data = decode_chunk(body)
    except BadChunk as exc:
        raise ChunkRejected(manifest.version, expected, str(exc), None) from None
    if (version, index) != (manifest.version, expected):
        # Committed or not, a frame for another slot proves nothing about the one asked for.
        raise ChunkRejected(manifest.version, expected, f"sender sent chunk {index} of v{version} instead", None)
    digest = blake3.blake3(data).hexdigest()
    _, chunk_kind = frame_kinds(manifest)
    if not commitment_holds(sender_key, chunk_kind, version, index, digest, sig):
        raise ChunkRejected(manifest.version, expected, "chunk frame without a valid commitment", None)
    try:
        assembler.add(index, data, digest)
    except BadChunk as exc:
        raise ChunkRejected(manifest.version, expected, str(exc), Proof(chunk_kind, version, index, digest, sig)) from None
    return index
