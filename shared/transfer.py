"""Snapshot transfer on one stream, used by the hub and by every relaying node alike.

Pull protocol (SNAPSHOT_PROTOCOL): the receiver sends a SnapshotRequest naming the version
and the first chunk it lacks (or one chunk, for repair); the sender writes the signed
manifest frame, then chunk frames in order, waiting for chunks it is itself still
receiving, so a relay forwards each verified chunk as soon as it has it. The receiver
verifies the manifest against the hub's key and every chunk against the manifest before it
keeps it, then answers with a TransferAck; the sender closes only after reading that ack
(closing without an ack, or resetting, could discard data still in flight).

Chunks arrive strictly in the order asked for (from_chunk, from_chunk + 1, ..., or the one
only_chunk): a sender that sends any other index is treated like one that sends a bad chunk,
so a relay cannot pass off a valid chunk of another index, or repeat one, in place of the one
it was asked for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import blake3
from libp2p.network.stream.exceptions import StreamError

from shared.crypto import SIGNATURE_BYTES
from shared.messages import CHUNK_FRAME, MANIFEST_FRAME, SnapshotRequest, TransferAck
from shared.snapshot import (
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    BadChunk,
    ChunkAssembler,
    Manifest,
    SignedManifest,
    decode_chunk,
    encode_chunk,
    verify_manifest,
)
from shared.wire import StreamEOF, encode_frame, read_frame, read_message, write_frame, write_message

# What serving a snapshot raises when the receiver stops or re-links mid-transfer: a read that finds
# the stream ended (StreamEOF), or a write into a stream it reset (py-libp2p's StreamError).
RECEIVER_GONE = (StreamEOF, StreamError)

CHUNK_FRAME_OVERHEAD_BYTES = 12
TRANSFER_CAPS = {MANIFEST_FRAME: MAX_MANIFEST_BYTES + SIGNATURE_BYTES, CHUNK_FRAME: MAX_CHUNK_BYTES + CHUNK_FRAME_OVERHEAD_BYTES}


class ChunkRejected(BadChunk):
    """The sender sent something other than the verified chunk `index` of `version` it was asked for."""

    def __init__(self, version: int, index: int, received_blake3: str, reason: str) -> None:
        super().__init__(f"chunk {index} of v{version}: {reason}")
        self.version = version
        self.index = index
        self.received_blake3 = received_blake3


def wanted_chunks(request: SnapshotRequest, total: int) -> range:
    """The chunk indices a request asks for, in the order they must be sent (LookupError if out of range)."""
    if request.only_chunk is not None:
        if not 0 <= request.only_chunk < total:
            raise LookupError(f"chunk {request.only_chunk} out of range 0..{total - 1}")
        return range(request.only_chunk, request.only_chunk + 1)
    if request.from_chunk >= total:
        raise LookupError(f"from_chunk {request.from_chunk} out of range 0..{total - 1}")
    return range(request.from_chunk, total)


class ChunkSource(Protocol):
    """Something that can serve a snapshot: the hub (everything at hand) or a relay (chunks still arriving)."""

    def held_manifest(self, version: int | None) -> tuple[SignedManifest, Manifest] | None:
        """The signed manifest of `version` (None: the newest) and its parsed form, if held."""
        ...

    async def chunk(self, version: int, index: int) -> bytes:
        """The verified chunk, waiting for it if it is still on its way; raises LookupError if it never will be."""
        ...


class Writer(Protocol):
    async def write(self, stream, data: bytes) -> None: ...


async def serve_snapshot(stream, source: ChunkSource, request: SnapshotRequest, limiter: Writer | None) -> TransferAck:
    """Answer one SnapshotRequest on `stream` and return the receiver's ack (LookupError if nothing to serve)."""
    held = source.held_manifest(request.version)
    if held is None:
        raise LookupError(f"snapshot {request.version if request.version is not None else 'newest'} not held")
    signed, manifest = held
    indices = wanted_chunks(request, manifest.chunk_count)
    await write_frame(stream, MANIFEST_FRAME, signed.to_bytes())
    version = manifest.version
    for index in indices:
        frame = encode_frame(CHUNK_FRAME, encode_chunk(version, index, await source.chunk(version, index)))
        if limiter is None:
            await stream.write(frame)
        else:
            await limiter.write(stream, frame)
    return await read_message(stream, TransferAck)


async def receive_snapshot(
    stream,
    request: SnapshotRequest,
    hub_peer_id: str,
    newer_than: int | None,
    assembler_for: Callable[[SignedManifest, Manifest], ChunkAssembler],
    on_chunk: Callable[[int], Awaitable[None]] | None = None,
) -> ChunkAssembler:
    """Send `request`, verify the manifest and every chunk, ack, and return the assembler holding them.

    `assembler_for` returns the assembler to fill (a fresh one, or a partial one to resume);
    a chunk it already holds is skipped unhashed. A chunk failing verification, or arriving
    out of the asked order, raises ChunkRejected (after telling the sender); nothing
    unverified is ever kept. `on_chunk` runs after each chunk is stored.
    """
    await write_message(stream, request)
    _, body = await read_frame(stream, {MANIFEST_FRAME: TRANSFER_CAPS[MANIFEST_FRAME]})
    signed = SignedManifest.from_bytes(body)
    manifest = verify_manifest(signed, hub_peer_id, newer_than)
    if request.version is not None and manifest.version != request.version:
        raise BadChunk(f"asked for v{request.version}, got a manifest for v{manifest.version}")
    try:
        wanted = wanted_chunks(request, manifest.chunk_count)
    except LookupError as exc:
        raise BadChunk(f"request outside the manifest: {exc}") from None
    assembler = assembler_for(signed, manifest)
    received = 0
    try:
        for expected in wanted:
            _, frame = await read_frame(stream, {CHUNK_FRAME: TRANSFER_CAPS[CHUNK_FRAME]})
            try:
                version, index, data = decode_chunk(frame)
            except BadChunk as exc:
                raise ChunkRejected(manifest.version, expected, blake3.blake3(frame).hexdigest(), str(exc)) from None
            if (version, index) != (manifest.version, expected):
                raise ChunkRejected(
                    manifest.version, expected, blake3.blake3(data).hexdigest(),
                    f"sender sent chunk {index} of v{version} instead",
                )
            try:
                assembler.add(index, data)
            except BadChunk as exc:
                raise ChunkRejected(manifest.version, expected, blake3.blake3(data).hexdigest(), str(exc)) from None
            received += 1
            if on_chunk is not None:
                await on_chunk(index)
    except ChunkRejected as exc:
        await write_message(stream, TransferAck(version=manifest.version, chunks=received, ok=False, reason=str(exc)[:500]))
        raise
    await write_message(stream, TransferAck(version=manifest.version, chunks=received, ok=True))
    await stream.close()
    return assembler
