"""Snapshot transfer on one stream, used by the hub and by every relaying node alike.

Pull protocol (SNAPSHOT_PROTOCOL): the receiver sends a SnapshotRequest naming the version
and the first chunk it lacks (or one chunk, for repair); the sender writes the signed
manifest frame, then chunk frames in order, waiting for chunks it is itself still
receiving, so a relay forwards each verified chunk as soon as it has it. The receiver
verifies the manifest against the hub's key and every chunk against the manifest before it
keeps it, then answers with a TransferAck; the sender closes only after reading that ack
(closing without an ack, or resetting, could discard data still in flight).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

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
from shared.crypto import SIGNATURE_BYTES
from shared.wire import encode_frame, read_frame, read_message, write_frame, write_message

CHUNK_FRAME_OVERHEAD_BYTES = 12
TRANSFER_CAPS = {MANIFEST_FRAME: MAX_MANIFEST_BYTES + SIGNATURE_BYTES, CHUNK_FRAME: MAX_CHUNK_BYTES + CHUNK_FRAME_OVERHEAD_BYTES}


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
    await write_frame(stream, MANIFEST_FRAME, signed.to_bytes())
    version, total = manifest.version, len(manifest.chunk_hashes)
    indices = [request.only_chunk] if request.only_chunk is not None else range(request.from_chunk, total)
    for index in indices:
        if not 0 <= index < total:
            raise LookupError(f"chunk {index} out of range 0..{total - 1}")
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

    `assembler_for` returns the assembler to fill (a fresh one, or a partial one to resume).
    A chunk failing verification raises BadChunk (after telling the sender); nothing
    unverified is ever kept.
    """
    await write_message(stream, request)
    _, body = await read_frame(stream, {MANIFEST_FRAME: TRANSFER_CAPS[MANIFEST_FRAME]})
    signed = SignedManifest.from_bytes(body)
    manifest = verify_manifest(signed, hub_peer_id, newer_than)
    if request.version is not None and manifest.version != request.version:
        raise BadChunk(f"asked for v{request.version}, got a manifest for v{manifest.version}")
    assembler = assembler_for(signed, manifest)
    total = len(manifest.chunk_hashes)
    expected = 1 if request.only_chunk is not None else total - request.from_chunk
    received = 0
    try:
        while received < expected:
            _, frame = await read_frame(stream, {CHUNK_FRAME: TRANSFER_CAPS[CHUNK_FRAME]})
            version, index, data = decode_chunk(frame)
            if version != manifest.version:
                raise BadChunk(f"chunk of v{version} inside a transfer of v{manifest.version}")
            assembler.add(index, data)
            received += 1
            if on_chunk is not None:
                await on_chunk(index)
    except BadChunk as exc:
        await write_message(stream, TransferAck(version=manifest.version, chunks=received, ok=False, reason=str(exc)[:500]))
        raise
    await write_message(stream, TransferAck(version=manifest.version, chunks=received, ok=True))
    await stream.close()
    return assembler
