"""Policy snapshot format: one safetensors file, fixed-size chunks, a hub-signed manifest.

A snapshot is written once (streamed, shared/weights_file.py), cut into chunks and described
by a manifest carrying the blake3 hash of every chunk and of the whole. The hub signs the
manifest's exact JSON bytes; every hop checks the signature before parsing the JSON and checks
each chunk against the manifest before storing, forwarding or loading it (docs/DESIGN.md
§8). Snapshots live on disk at every hop: the hub serves chunks from its file, a node writes
verified chunks into a preallocated file, relays from it and installs from it, so no process
holds a whole snapshot in RAM. Nothing here hands out a partial snapshot:
`ChunkAssembler.finish()` returns the file only once every chunk and the whole hash verified.

Sizes: a manifest costs about 67 bytes per chunk (64 hex digits, quotes, comma), so
MAX_MANIFEST_BYTES = 8 MiB admits about 125,000 chunks: about 122 GiB of weights at the
default 1 MiB chunk and about 1.9 TiB at MAX_CHUNK_BYTES. A Qwen3-8B bf16 snapshot (16.4 GB)
needs about 15,600 chunks, a 1 MiB manifest.

Nothing here imports torch: a model's weights go in and out of snapshot files in shared/model_io.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.crypto import SIGNATURE_BYTES, Identity, verify_from_peer
from shared.files import atomic_write_bytes
from shared.probe import InstallProbe

SNAPSHOT_FORMAT_VERSION = 2  # 2: manifests of delta snapshots (shared/delta.py)
CHUNK_SIZE_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 8 << 20
_HASH_HEX_CHARS = 64
_MANIFEST_BYTES_PER_CHUNK = _HASH_HEX_CHARS + 3
MAX_CHUNKS = MAX_MANIFEST_BYTES // _MANIFEST_BYTES_PER_CHUNK
MAX_PEER_ID_CHARS = 128
CHUNK_HEADER = struct.Struct(">QI")  # snapshot version u64, chunk index u32
_HEX_RE = re.compile(r"[0-9a-f]{64}")


class SnapshotError(ValueError):
    """A snapshot, manifest or chunk that must not be used."""


class BadSignature(SnapshotError):
    """The manifest is not signed by the expected hub."""


class StaleSnapshot(SnapshotError):
    """The manifest's version is not newer than the one already held."""


class MalformedManifest(SnapshotError):
    """The manifest bytes are oversized, not valid JSON or violate the schema."""


class BadChunk(SnapshotError):
    """A chunk (or the assembled whole) does not match the manifest."""


class OversizedSnapshot(SnapshotError):
    """A signed manifest promises more bytes than this node's model can take, or than its disk holds."""


# A snapshot's weights take its model's parameter count x its dtype's bytes; beyond that, the safetensors header
# (a few hundred bytes per tensor), a LoRA run's adapters (smaller than the model) or a delta (at most
# delta_max_ratio of the full snapshot, plus the full manifest it embeds). The margin leaves room for all of it and
# for the few tensors a config does not count; what it refuses is a manifest no model of this config could need.
SNAPSHOT_SIZE_MARGIN = 1.1
SNAPSHOT_OVERHEAD_BYTES = MAX_MANIFEST_BYTES + (1 << 20)
# What a node leaves free on the disk that holds its snapshots, once the next one is written.
DISK_KEEP_FREE_BYTES = 256 << 20


def snapshot_bytes_bound(parameters: int, bytes_per_parameter: int) -> int:
    """The most bytes a snapshot of a model with `parameters` weights of `bytes_per_parameter` bytes takes."""
    return math.ceil(parameters * bytes_per_parameter * SNAPSHOT_SIZE_MARGIN) + SNAPSHOT_OVERHEAD_BYTES


def check_snapshot_size(manifest: Manifest, max_bytes: int, free_bytes: int) -> None:
    """OversizedSnapshot unless `manifest`'s snapshot is within the model's bound `max_bytes` and leaves
    DISK_KEEP_FREE_BYTES of the disk's `free_bytes`: checked before a byte of it is written."""
    if manifest.total_bytes > max_bytes:
        raise OversizedSnapshot(
            f"snapshot v{manifest.version} claims {manifest.total_bytes} bytes; this node's model takes at most {max_bytes}"
        )
    if manifest.total_bytes + DISK_KEEP_FREE_BYTES > free_bytes:
        raise OversizedSnapshot(
            f"snapshot v{manifest.version} of {manifest.total_bytes} bytes does not fit the {free_bytes} bytes free "
            f"here with {DISK_KEEP_FREE_BYTES} to spare"
        )


def _hex_hash(value: str) -> str:
    if not _HEX_RE.fullmatch(value):
        raise ValueError(f"expected {_HASH_HEX_CHARS} lowercase hex digits, got {value[:80]!r}")
    return value


class Manifest(BaseModel):
    """What a snapshot is: its version, its size, and the blake3 hash of each chunk and of the whole."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format_version: int = Field(description="snapshot format; only SNAPSHOT_FORMAT_VERSION is accepted")
    version: int = Field(ge=0, description="policy version (learner step) of the weights")
    total_bytes: int = Field(ge=1, description="length of the serialized safetensors blob")
    chunk_size: int = Field(ge=1, le=MAX_CHUNK_BYTES, description="bytes per chunk; the last one may be shorter")
    chunk_hashes: tuple[str, ...] = Field(max_length=MAX_CHUNKS, description="blake3 hex of each chunk")
    whole_hash: str = Field(description="blake3 hex of all bytes")
    config_hash: str = Field(description="model_config_hash of the model the weights belong to")
    created_at: float = Field(ge=0.0, allow_inf_nan=False, description="unix seconds")
    signer: str = Field(min_length=1, max_length=MAX_PEER_ID_CHARS, description="peer id of the signing hub")
    kind: Literal["full", "delta"] = Field("full", description="full: safetensors weights; delta: shared/delta.py")
    base_version: int | None = Field(None, ge=0, description="delta: the version it applies to")
    base_hash: str | None = Field(None, description="delta: whole hash of the base version's weights file")
    result_hash: str | None = Field(None, description="delta: whole hash of the weights file it produces")
    probe: InstallProbe | None = Field(
        None, description="full: reference log-probs every engine reproduces after installing (shared/probe.py)"
    )

    @field_validator("format_version")
    @classmethod
    def _known_format(cls, value: int) -> int:
        # Format 1 (full snapshots only) is format 2 without its delta fields: snapshots of a run started
        # before deltas still resume.
        if value not in (1, SNAPSHOT_FORMAT_VERSION):
            raise ValueError(f"unsupported snapshot format {value}; this build reads {SNAPSHOT_FORMAT_VERSION}")
        return value

    @field_validator("chunk_hashes")
    @classmethod
    def _chunk_hashes_hex(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for h in value:
            _hex_hash(h)
        return value

    @field_validator("whole_hash", "config_hash", "base_hash", "result_hash")
    @classmethod
    def _hash_hex(cls, value: str | None) -> str | None:
        return None if value is None else _hex_hash(value)

    @model_validator(mode="after")
    def _delta_fields(self) -> Manifest:
        fields = (self.base_version, self.base_hash, self.result_hash)
        if self.kind == "full" and fields != (None, None, None):
            raise ValueError("a full snapshot's manifest names no base or result")
        if self.kind == "delta" and (self.base_version is None or None in fields or self.base_version >= self.version):
            raise ValueError("a delta's manifest names an older base version, the base's hash and the result's hash")
        return self

    @model_validator(mode="after")
    def _chunk_count(self) -> Manifest:
        expected = math.ceil(self.total_bytes / self.chunk_size)
        if len(self.chunk_hashes) != expected:
            raise ValueError(
                f"{len(self.chunk_hashes)} chunk hashes for {self.total_bytes} bytes "
                f"in chunks of {self.chunk_size}: expected {expected}"
            )
        return self

    @property
    def chunk_count(self) -> int:
        return len(self.chunk_hashes)

    def chunk_length(self, index: int) -> int:
        """Bytes in chunk `index` (IndexError outside 0..chunk_count-1)."""
        if not 0 <= index < self.chunk_count:
            raise IndexError(f"chunk index {index} outside 0..{self.chunk_count - 1}")
        return min(self.chunk_size, self.total_bytes - index * self.chunk_size)


@dataclass(frozen=True)
class SignedManifest:
    """The exact manifest JSON bytes the hub signed, with its 64-byte Ed25519 signature."""

    body: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        """Wire and file form: signature, then body."""
        return self.signature + self.body

    @classmethod
    def from_bytes(cls, raw: bytes) -> SignedManifest:
        """Split the wire form; size-capped, nothing is parsed or trusted yet."""
        if len(raw) > SIGNATURE_BYTES + MAX_MANIFEST_BYTES:
            raise MalformedManifest(f"signed manifest of {len(raw)} bytes exceeds the cap")
        if len(raw) <= SIGNATURE_BYTES:
            raise MalformedManifest(f"signed manifest of {len(raw)} bytes has no body")
        return cls(body=bytes(raw[SIGNATURE_BYTES:]), signature=bytes(raw[:SIGNATURE_BYTES]))


def sign_manifest(manifest: Manifest, identity: Identity) -> SignedManifest:
    if manifest.signer != identity.peer_id:
        raise ValueError(f"manifest names signer {manifest.signer}, signing key is {identity.peer_id}")
    body = manifest.model_dump_json().encode()
    if len(body) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest of {len(body)} bytes exceeds MAX_MANIFEST_BYTES; use larger chunks")
    return SignedManifest(body=body, signature=identity.sign(body))


def verify_manifest(signed: SignedManifest, hub_peer_id: str, newer_than: int | None = None) -> Manifest:
    """The manifest, if `hub_peer_id` signed these exact bytes and (when given) it is newer than `newer_than`.

    Order matters: size cap, then signature, and only then is any JSON parsed.
    """
    if len(signed.body) > MAX_MANIFEST_BYTES:
        raise MalformedManifest(f"manifest body of {len(signed.body)} bytes exceeds {MAX_MANIFEST_BYTES}")
    if not verify_from_peer(hub_peer_id, signed.body, signed.signature):
        raise BadSignature(f"manifest is not signed by hub {hub_peer_id}")
    try:
        manifest = Manifest.model_validate_json(signed.body)
    except ValidationError as exc:
        raise MalformedManifest(f"signed manifest fails the schema: {exc}") from exc
    if manifest.signer != hub_peer_id:
        raise BadSignature(f"manifest names signer {manifest.signer}, expected hub {hub_peer_id}")
    if newer_than is not None and manifest.version <= newer_than:
        raise StaleSnapshot(f"snapshot version {manifest.version} is not newer than held version {newer_than}")
    return manifest


def blake3_hex(data: bytes | bytearray | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


# Config keys that say where, with which library version or in which precision a model was
# loaded, not what it is: the hub and a node load the same model from different paths, often in
# different dtypes, and must still agree on its hash.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "dtype", "torch_dtype"})


def _architecture_only(value: object) -> object:
    if isinstance(value, Mapping):
        return {
            k: _architecture_only(v)
            for k, v in value.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in _VOLATILE_CONFIG_KEYS))
        }
    if isinstance(value, (list, tuple)):
        return [_architecture_only(v) for v in value]
    return value


def model_config_hash(config_dict: Mapping[str, object]) -> str:
    """The one model identity: blake3 hex of a model config (`PretrainedConfig.to_dict()`, or a config.json as
    written: shared.checks.model_fingerprint) as sorted, compact JSON.

    Private keys (`_name_or_path`, ...), `transformers_version` and the dtype are left out, at
    every nesting level. TypeError (ValueError for NaN) for values JSON cannot hold.
    """
    text = json.dumps(_architecture_only(config_dict), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return blake3_hex(text.encode())


@dataclass(frozen=True)
class Snapshot:
    """A verified (or self-built) snapshot: the signed manifest, its parsed form and the weights file."""

    signed: SignedManifest
    manifest: Manifest
    path: Path


class ChunkHasher:
    """blake3 of every chunk_size piece and of the whole, fed bytes in order in pieces of any size."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.whole = blake3.blake3()
        self._current = blake3.blake3()
        self._filled = 0
        self.chunk_hashes: list[str] = []

    def update(self, data: memoryview) -> None:
        self.whole.update(data)
        while len(data):
            take = min(len(data), self.chunk_size - self._filled)
            self._current.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.chunk_size:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.chunk_hashes.append(self._current.hexdigest())
        self._current = blake3.blake3()
        self._filled = 0

    def finish(self) -> tuple[tuple[str, ...], str]:
        if self._filled:
            self._close_chunk()
        return tuple(self.chunk_hashes), self.whole.hexdigest()


def write_snapshot(
    directory: Path,
    version: int,
    identity: Identity,
    config_hash: str,
    write_weights: Callable[[Path, Callable[[memoryview], None]], int],
    chunk_size: int = CHUNK_SIZE_BYTES,
    created_at: float | None = None,
    probe: Callable[[Path, str], InstallProbe] | None = None,
) -> Snapshot:
    """Write `version`'s weights file into `directory` with `write_weights(path, on_bytes)` (which feeds every
    byte it writes to `on_bytes` and returns the file's length), hashing every chunk and the whole on the way,
    then sign the manifest with the hub's key and write it. `probe(weights path, whole hash)`: the install
    probe of the written weights, signed in the manifest.

    Crash-safe: the weights go to a temp file renamed into place, and the manifest is written
    last, so a manifest on disk means its weights file is complete.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights_path, manifest_path = snapshot_paths(directory, version)
    hasher = ChunkHasher(chunk_size)
    tmp = weights_path.with_name(f".{weights_path.name}.tmp")
    try:
        total = write_weights(tmp, hasher.update)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, weights_path)
    finally:
        tmp.unlink(missing_ok=True)
    chunk_hashes, whole_hash = hasher.finish()
    manifest = Manifest(
        probe=None if probe is None else probe(weights_path, whole_hash),
        format_version=SNAPSHOT_FORMAT_VERSION,
        version=version,
        total_bytes=total,
        chunk_size=chunk_size,
        chunk_hashes=chunk_hashes,
        whole_hash=whole_hash,
        config_hash=config_hash,
        created_at=time.time() if created_at is None else created_at,
        signer=identity.peer_id,
    )
    signed = sign_manifest(manifest, identity)
    atomic_write_bytes(manifest_path, signed.to_bytes())
    return Snapshot(signed=signed, manifest=manifest, path=weights_path)


def verify_chunk(manifest: Manifest, index: int, data: bytes | bytearray | memoryview, digest_hex: str | None = None) -> bool:
    """True iff `data` is exactly chunk `index` of the snapshot `manifest` describes."""
    if not 0 <= index < manifest.chunk_count:
        return False
    if len(data) != manifest.chunk_length(index):
        return False
    return (digest_hex or blake3_hex(data)) == manifest.chunk_hashes[index]


class StoredChunk(bytes):
    """A chunk read back from a file its manifest describes: one the hub wrote, or one a node verified as it
    stored it. `digest_hex` is the manifest's hash of it, so a sender commits to it without hashing it again
    (shared/transfer.py). Anything derived from it (a slice, a concatenation) is plain bytes again."""

    digest_hex: str


def read_chunk(fd: int, manifest: Manifest, index: int) -> StoredChunk:
    """Chunk `index` of the weights file open as `fd` (BadChunk for an index the manifest lacks or a short file).

    Only for files whose chunks were verified against (or written with) `manifest`: the chunk is returned as
    holding the manifest's hash."""
    if not 0 <= index < manifest.chunk_count:
        raise BadChunk(f"chunk index {index} outside 0..{manifest.chunk_count - 1}")
    length = manifest.chunk_length(index)
    data = StoredChunk(os.pread(fd, length, index * manifest.chunk_size))
    if len(data) != length:
        raise BadChunk(f"chunk {index}: the file holds {len(data)} of its {length} bytes")
    data.digest_hex = manifest.chunk_hashes[index]
    return data


def hash_chunks(path: Path, chunk_size: int) -> tuple[tuple[str, ...], str]:
    """(blake3 of each chunk_size piece, blake3 of the whole) of a file, read a chunk at a time."""
    hasher = ChunkHasher(chunk_size)
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk_size):
            hasher.update(memoryview(data))
    return hasher.finish()


def file_hash(path: Path, piece_bytes: int = 4 << 20) -> str:
    """blake3 hex of a file read in pieces (page cache, not a memory map: RSS stays flat)."""
    hasher = blake3.blake3()
    buffer = bytearray(piece_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
    return hasher.hexdigest()


class ChunkAssembler:
    """Collects verified chunks in any order into a preallocated file; the file is handed out only when
    every chunk and the whole hash verify. Holds no chunk in RAM: serving reads back from the file."""

    def __init__(self, manifest: Manifest, path: Path) -> None:
        self.manifest = manifest
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, manifest.total_bytes)
        self._have = bytearray(manifest.chunk_count)
        self._missing = manifest.chunk_count
        self._whole_verified = False

    def add(self, index: int, data: bytes | bytearray | memoryview, digest_hex: str | None = None) -> bool:
        """Store a chunk; False for a duplicate (ignored unhashed), BadChunk for a wrong index or content.

        `digest_hex`: blake3 of `data` when the caller has just computed it (so it is not hashed twice)."""
        if not 0 <= index < self.manifest.chunk_count:
            raise BadChunk(f"chunk index {index} outside 0..{self.manifest.chunk_count - 1}")
        if self._have[index]:
            return False
        if not verify_chunk(self.manifest, index, data, digest_hex):
            raise BadChunk(f"chunk {index} of version {self.manifest.version} fails its hash or length")
        view = memoryview(data)
        offset = index * self.manifest.chunk_size
        while len(view):
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        self._have[index] = 1
        self._missing -= 1
        return True

    def has(self, index: int) -> bool:
        return 0 <= index < self.manifest.chunk_count and bool(self._have[index])

    def first_missing(self) -> int | None:
        index = self._have.find(0)
        return None if index < 0 else index

    @property
    def missing_count(self) -> int:
        return self._missing

    @property
    def complete(self) -> bool:
        return self._missing == 0

    def chunk(self, index: int) -> bytes:
        """A stored chunk, read back from the file for forwarding (BadChunk if not held)."""
        if not self.has(index):
            raise BadChunk(f"chunk {index} is not held")
        return read_chunk(self._fd, self.manifest, index)

    def finish(self) -> Path:
        """The weights file, once complete and the whole hash matches (else BadChunk). Blocking: hashes the file."""
        if not self.complete:
            raise BadChunk(f"snapshot version {self.manifest.version} still lacks {self._missing} chunks")
        if not self._whole_verified:
            if file_hash(self.path) != self.manifest.whole_hash:
                raise BadChunk(f"snapshot version {self.manifest.version} fails its whole hash")
            self._whole_verified = True
        return self.path

    def close(self) -> None:
        """Stop writing; the file stays (the caller owns it once finished)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Close and delete the file (an abandoned or superseded transfer)."""
        self.close()
        self.path.unlink(missing_ok=True)


def chunk_header(version: int, index: int, length: int) -> bytes:
    """What precedes `length` chunk bytes in a relay frame body: version u64, index u32, big-endian."""
    if length > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk of {length} bytes exceeds MAX_CHUNK_BYTES")
    return CHUNK_HEADER.pack(version, index)


def encode_chunk(version: int, index: int, data: bytes | bytearray | memoryview) -> bytes:
    """Relay frame body: the chunk header, then the chunk bytes."""
    return chunk_header(version, index, len(data)) + data


def decode_chunk(body: bytes | bytearray | memoryview) -> tuple[int, int, memoryview]:
    """(version, index, chunk bytes) of a relay frame body; BadChunk when short, empty or oversized."""
    if len(body) <= CHUNK_HEADER.size:
        raise BadChunk(f"chunk frame of {len(body)} bytes has no payload after its {CHUNK_HEADER.size}-byte header")
    if len(body) - CHUNK_HEADER.size > MAX_CHUNK_BYTES:
        raise BadChunk(f"chunk frame of {len(body)} bytes exceeds MAX_CHUNK_BYTES")
    view = memoryview(body)
    version, index = CHUNK_HEADER.unpack(view[: CHUNK_HEADER.size])
    return version, index, view[CHUNK_HEADER.size :]


def snapshot_paths(directory: Path, version: int) -> tuple[Path, Path]:
    """(weights file, signed manifest file) of `version` in `directory`."""
    stem = f"v{version:08d}"
    return directory / f"{stem}.safetensors", directory / f"{stem}.manifest"


def delta_paths(directory: Path, version: int) -> tuple[Path, Path]:
    """(delta file, signed manifest file) of `version`'s delta against the version before it."""
    stem = f"v{version:08d}"
    return directory / f"{stem}.delta", directory / f"{stem}.delta-manifest"


def remove_snapshot_files(directory: Path, version: int) -> None:
    """Delete `version`'s files (full and delta), manifests first: a crash in between leaves an orphan
    data file (pruned at the next start), never a manifest promising bytes that are gone."""
    for data_path, manifest_path in (snapshot_paths(Path(directory), version), delta_paths(Path(directory), version)):
        manifest_path.unlink(missing_ok=True)
        data_path.unlink(missing_ok=True)


def _read_capped(path: Path, limit: int) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise MalformedManifest(f"{path} holds {size} bytes, more than the {limit}-byte cap")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def read_snapshot_files(directory: Path, version: int, hub_peer_id: str) -> Snapshot:
    """`version` from `directory`, re-verifying the signature, every chunk and the whole hash (streamed)."""
    weights_path, manifest_path = snapshot_paths(Path(directory), version)
    signed = SignedManifest.from_bytes(_read_capped(manifest_path, SIGNATURE_BYTES + MAX_MANIFEST_BYTES))
    manifest = verify_manifest(signed, hub_peer_id)
    if manifest.version != version:
        raise MalformedManifest(f"{manifest_path} describes version {manifest.version}, not {version}")
    size = weights_path.stat().st_size
    if size != manifest.total_bytes:
        raise BadChunk(f"{weights_path} holds {size} bytes, manifest says {manifest.total_bytes}")
    chunk_hashes, whole_hash = hash_chunks(weights_path, manifest.chunk_size)
    bad = next((i for i, (a, b) in enumerate(zip(chunk_hashes, manifest.chunk_hashes, strict=True)) if a != b), None)
    if bad is not None:
        raise BadChunk(f"{weights_path}: chunk {bad} fails its hash")
    if whole_hash != manifest.whole_hash:
        raise BadChunk(f"{weights_path} fails its whole hash")
    return Snapshot(signed=signed, manifest=manifest, path=weights_path)
