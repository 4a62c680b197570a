"""Sparse deltas between two snapshot files of one model: built by the hub, applied by a node, a piece at a time.

Between two published versions a few steps apart most low-precision elements are bit-identical
(RL updates are sparse and small next to bf16's resolution), so version v also ships as a delta
against the previous published version. Each tensor is cut into pieces of at most PIECE_ELEMENTS
elements; each piece goes as the cheapest of:

  same    nothing changed: no bytes
  sparse  zstd(gaps between changed element positions, uint32 LE || the new elements)
  xor     zstd(old bits XOR new bits)
  whole   zstd(the new elements), when more than DENSE_FRACTION of the piece changed

A delta file is: the full snapshot's hub-signed manifest, then the pieces, then a JSON footer and
its length (8 bytes LE), so the hub writes it in one streaming pass. The footer names the hash of
the base file it applies to. Applying writes the full safetensors file (base header, then every
tensor) to a temp file while hashing it chunk by chunk against the embedded full manifest, and
renames it into place only if every hash matches: a node never installs or relays a result the hub
did not sign. Memory: a few pieces (PIECE_ELEMENTS elements each) at a time, never a snapshot.

Deltas pay off only when few elements change (bf16 snapshots at small learning rates); fp32
snapshots change almost everywhere every step, and the hub then publishes the full snapshot alone
(hub/training/loop.py compares the delta's size to the full one's).
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from shared.crypto import SIGNATURE_BYTES, Identity
from shared.files import atomic_write_bytes
from shared.snapshot import (
    MAX_MANIFEST_BYTES,
    SNAPSHOT_FORMAT_VERSION,
    ChunkHasher,
    Manifest,
    SignedManifest,
    Snapshot,
    SnapshotError,
    delta_paths,
    hash_chunks,
    sign_manifest,
    verify_manifest,
)
from shared.weights_file import Entry, WeightsFileError, read_entries, read_exact_into

DELTA_FORMAT_VERSION = 1
PIECE_ELEMENTS = 1 << 22  # 8 MiB of bf16 per piece: a few of these are all a build or an apply holds
DENSE_FRACTION = 0.5
ZSTD_LEVEL = 3
MAX_FOOTER_BYTES = 16 << 20
_FOOTER_LEN_BYTES = 8
_GAP_DTYPE = np.dtype("<u4")
_UINT_BY_WIDTH: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
KINDS = ("same", "sparse", "xor", "whole")


class DeltaError(SnapshotError):
    """A delta that cannot be applied to this base, or whose result fails the hub's hashes."""


@dataclass
class DeltaStats:
    """What a built delta holds: its size and how many pieces went each way."""

    bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    pieces: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


def _pieces(entry: Entry) -> list[tuple[int, int]]:
    """(first element, element count) of each piece of a tensor."""
    count = math.prod(entry.shape)
    return [(start, min(PIECE_ELEMENTS, count - start)) for start in range(0, count, PIECE_ELEMENTS)]


def _read_piece(f, entry: Entry, start: int, count: int) -> np.ndarray:
    width = entry.dtype.itemsize
    out = np.empty(count, dtype=_UINT_BY_WIDTH[width])
    f.seek(entry.start + start * width)
    try:
        read_exact_into(f, out.data.cast("B"), entry.name)
    except WeightsFileError as exc:
        raise DeltaError(str(exc)) from exc
    return out


def _header_prefix(path: Path, entries: list[Entry]) -> bytes:
    with open(path, "rb") as f:
        return f.read(entries[0].start if entries else os.path.getsize(path))


def _encode(old: np.ndarray, new: np.ndarray, zstd: zstandard.ZstdCompressor) -> tuple[str, bytes, int]:
    """(kind, payload, changed elements) of the cheapest encoding of one piece."""
    changed = old != new
    count = int(np.count_nonzero(changed))
    if count == 0:
        return "same", b"", 0
    if count > DENSE_FRACTION * len(new):
        return "whole", zstd.compress(new.tobytes()), count
    positions = np.flatnonzero(changed)
    gaps = np.diff(positions, prepend=0).astype(_GAP_DTYPE)
    sparse = zstd.compress(gaps.tobytes() + new[positions].tobytes())
    xor = zstd.compress((old ^ new).tobytes())
    return ("sparse", sparse, count) if len(sparse) <= len(xor) else ("xor", xor, count)


def build_delta(
    base_path: Path, new_path: Path, full_signed: SignedManifest, base_hash: str, out_path: Path
) -> DeltaStats | None:
    """Write the delta turning `base_path` into `new_path` to `out_path` (atomically); None when the two
    files do not share one layout (another model, a dtype change): such a version goes full only.

    `full_signed`: the new version's signed manifest, embedded so a node that applies the delta holds
    it (to verify its result and to serve the full snapshot onward). `base_hash`: the base's whole hash.
    """
    base_entries, new_entries = read_entries(base_path), read_entries(new_path)
    layout = [(e.name, e.dtype, e.shape, e.start, e.end) for e in base_entries]
    if layout != [(e.name, e.dtype, e.shape, e.start, e.end) for e in new_entries]:
        return None
    if _header_prefix(base_path, base_entries) != _header_prefix(new_path, new_entries):
        return None
    manifest_bytes = full_signed.to_bytes()
    stats = DeltaStats()
    records: list[list[object]] = []
    zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    try:
        with open(base_path, "rb") as fb, open(new_path, "rb") as fn, open(tmp, "wb") as out:
            out.write(manifest_bytes)
            for entry in base_entries:
                for start, count in _pieces(entry):
                    kind, payload, changed = _encode(
                        _read_piece(fb, entry, start, count), _read_piece(fn, entry, start, count), zstd
                    )
                    out.write(payload)
                    records.append([kind, len(payload), changed])
                    stats.pieces[kind] += 1
                    stats.changed_elements += changed
                    stats.total_elements += count
            footer = json.dumps(
                {
                    "format": DELTA_FORMAT_VERSION,
                    "base_hash": base_hash,
                    "manifest_bytes": len(manifest_bytes),
                    "pieces": records,
                },
                separators=(",", ":"),
            ).encode()
            out.write(footer)
            out.write(len(footer).to_bytes(_FOOTER_LEN_BYTES, "little"))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    stats.bytes = os.path.getsize(out_path)
    return stats


@dataclass(frozen=True)
class _Footer:
    base_hash: str
    manifest_bytes: int
    pieces: list[tuple[str, int, int]]


def _read_footer(f, size: int) -> _Footer:
    if size < _FOOTER_LEN_BYTES:
        raise DeltaError(f"delta of {size} bytes has no footer")
    f.seek(size - _FOOTER_LEN_BYTES)
    length = int.from_bytes(f.read(_FOOTER_LEN_BYTES), "little")
    if length > min(MAX_FOOTER_BYTES, size - _FOOTER_LEN_BYTES):
        raise DeltaError(f"delta footer of {length} bytes does not fit the {size}-byte file")
    f.seek(size - _FOOTER_LEN_BYTES - length)
    try:
        raw = json.loads(f.read(length))
        if raw["format"] != DELTA_FORMAT_VERSION:
            raise DeltaError(f"delta format {raw['format']!r}; this build reads {DELTA_FORMAT_VERSION}")
        pieces = [(str(k), int(n), int(c)) for k, n, c in raw["pieces"]]
        footer = _Footer(str(raw["base_hash"]), int(raw["manifest_bytes"]), pieces)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: a length of Infinity
        raise DeltaError(f"delta footer is malformed: {exc!r}") from exc
    payload = sum(n for _, n, _ in footer.pieces)
    if (
        not 0 < footer.manifest_bytes <= SIGNATURE_BYTES + MAX_MANIFEST_BYTES
        or any(n < 0 for _, n, _ in footer.pieces)
        or footer.manifest_bytes + payload + length + _FOOTER_LEN_BYTES != size
    ):
        raise DeltaError("delta footer's lengths do not add up to the file")
    return footer


def delta_full_manifest(delta_path: Path, hub_peer_id: str) -> tuple[SignedManifest, Manifest, str]:
    """(signed full manifest, its parsed form, base hash) a delta file carries; the manifest re-verified."""
    with open(delta_path, "rb") as f:
        footer = _read_footer(f, os.path.getsize(delta_path))
        f.seek(0)
        signed = SignedManifest.from_bytes(f.read(footer.manifest_bytes))
    return signed, verify_manifest(signed, hub_peer_id), footer.base_hash


def _decompress(payload: bytes, expected: int, where: str) -> bytes:
    """Exactly `expected` bytes out of one zstd frame; read through a stream so a frame that claims or
    holds more can never make us allocate more than `expected` + 1 bytes."""
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)).read(expected + 1)
    if len(raw) != expected:
        raise DeltaError(f"{where}: piece holds {len(raw)}{'+' if len(raw) > expected else ''} bytes, expected {expected}")
    return raw


def _decode(kind: str, payload: bytes, count: int, old: np.ndarray, where: str) -> np.ndarray:
    """The new elements of one piece (DeltaError for anything that is not exactly one valid piece)."""
    n, dtype = len(old), old.dtype
    try:
        if kind == "same":
            if payload or count:
                raise DeltaError(f"{where}: an unchanged piece carries bytes")
            return old
        if kind in ("xor", "whole"):
            raw = _decompress(payload, n * dtype.itemsize, where)
            values = np.frombuffer(raw, dtype=dtype)
            return old ^ values if kind == "xor" else values
        if kind == "sparse":
            if not 0 < count <= n:
                raise DeltaError(f"{where}: {count} changed elements in a piece of {n}")
            raw = _decompress(payload, count * (_GAP_DTYPE.itemsize + dtype.itemsize), where)
            gaps = np.frombuffer(raw, dtype=_GAP_DTYPE, count=count).astype(np.int64)
            if (gaps[1:] == 0).any():
                raise DeltaError(f"{where}: sparse positions repeat")
            positions = np.cumsum(gaps)
            if positions[-1] >= n:
                raise DeltaError(f"{where}: sparse position {positions[-1]} outside the piece of {n}")
            out = old.copy()
            out[positions] = np.frombuffer(raw, dtype=dtype, offset=count * _GAP_DTYPE.itemsize)
            return out
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{where}: {kind} piece does not decompress: {exc}") from exc
    raise DeltaError(f"{where}: unknown piece kind {kind!r}")


def apply_delta(base_path: Path, base_hash: str, delta_path: Path, full: Manifest, out_path: Path) -> None:
    """Write the full snapshot `full` describes to `out_path` from the base file (whose whole hash is
    `base_hash`) and the delta; DeltaError, and nothing at `out_path`, unless every chunk hash and the
    whole hash of the result match `full`. Blocking (reads and hashes the whole model)."""
    try:
        entries = read_entries(base_path)
    except WeightsFileError as exc:
        raise DeltaError(str(exc)) from exc
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    try:
        with open(delta_path, "rb") as fd, open(base_path, "rb") as fb, open(tmp, "wb") as out:
            footer = _read_footer(fd, os.path.getsize(delta_path))
            if footer.base_hash != base_hash:
                raise DeltaError(f"delta applies to base {footer.base_hash[:12]}, this node holds {base_hash[:12]}")
            plan = [(entry, start, count) for entry in entries for start, count in _pieces(entry)]
            if len(plan) != len(footer.pieces):
                raise DeltaError(f"delta has {len(footer.pieces)} pieces, the base's layout {len(plan)}")
            hasher = ChunkHasher(full.chunk_size)

            def emit(data: bytes | memoryview) -> None:
                out.write(data)
                hasher.update(memoryview(data))

            emit(_header_prefix(base_path, entries))
            fd.seek(footer.manifest_bytes)
            for (entry, start, count), (kind, length, changed) in zip(plan, footer.pieces, strict=True):
                old = _read_piece(fb, entry, start, count)
                new = _decode(kind, fd.read(length), changed, old, f"{entry.name}[{start}:{start + count}]")
                emit(np.ascontiguousarray(new).data.cast("B"))
            chunk_hashes, whole_hash = hasher.finish()
            if whole_hash != full.whole_hash or chunk_hashes != full.chunk_hashes:
                raise DeltaError(f"delta result fails the hashes of v{full.version}")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


def build_delta_snapshot(
    base: Snapshot, new: Snapshot, identity: Identity, directory: Path, max_ratio: float
) -> tuple[Snapshot, DeltaStats] | None:
    """`new` as a signed delta against `base` in `directory` (chunked and hashed like a full snapshot), or
    None, leaving no file, when the two do not share a layout or the delta would exceed `max_ratio` of
    the full snapshot's bytes (then receivers are better served by the full one alone)."""
    data_path, manifest_path = delta_paths(Path(directory), new.manifest.version)
    stats = build_delta(base.path, new.path, new.signed, base.manifest.whole_hash, data_path)
    if stats is None:
        return None
    if stats.bytes > max_ratio * new.manifest.total_bytes:
        data_path.unlink(missing_ok=True)
        return None
    chunk_hashes, whole_hash = hash_chunks(data_path, new.manifest.chunk_size)
    manifest = Manifest(
        format_version=SNAPSHOT_FORMAT_VERSION,
        version=new.manifest.version,
        total_bytes=stats.bytes,
        chunk_size=new.manifest.chunk_size,
        chunk_hashes=chunk_hashes,
        whole_hash=whole_hash,
        config_hash=new.manifest.config_hash,
        created_at=time.time(),
        signer=identity.peer_id,
        kind="delta",
        base_version=base.manifest.version,
        base_hash=base.manifest.whole_hash,
        result_hash=new.manifest.whole_hash,
    )
    signed = sign_manifest(manifest, identity)
    atomic_write_bytes(manifest_path, signed.to_bytes())
    return Snapshot(signed=signed, manifest=manifest, path=data_path), stats
