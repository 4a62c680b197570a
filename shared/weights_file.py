"""Stream a state dict to and from a safetensors file, one tensor at a time, never the whole model in RAM.

safetensors' own `save`/`load` build the whole blob (or every tensor) in memory; at 8B
parameters that is 16-32 GB beside the model. Here the writer casts and writes one tensor at
a time, feeding every byte to `on_bytes` (the snapshot's chunk and whole hashes) as it goes,
and the reader copies each tensor from the file straight into the model's own storage
(`readinto`, no intermediate copy on CPU; one tensor's staging buffer on CUDA). Page-cache
reads do not count against a process's RSS, memory maps would.

The files are standard safetensors (8-byte little-endian header length, JSON header padded to
8 bytes, tensors back to back): `safetensors.torch.load_file` reads them and this reader reads
theirs. Headers are parsed defensively (size cap, dtype, shape, offsets inside the file,
contiguous and non-overlapping) although callers only open files whose hash they verified.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_ALIGN_BYTES = 8
# A tensor is written in pieces of this size so a cast or a CUDA copy stages at most this much.
_PIECE_BYTES = 16 << 20

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}


class WeightsFileError(ValueError):
    """A weights file whose header or contents cannot be what it claims."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes lie (absolute file offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def write_weights(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    on_bytes: Callable[[memoryview], None] = lambda _b: None,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write `tensors` (floating ones cast to `dtype` when given) to `path`; returns the file's length.

    `tensors` must hold no two names sharing storage (shared.model_io drops tied aliases first).
    Every byte written also goes to `on_bytes`, in file order. The caller makes the write atomic.
    `metadata`: extra string pairs for the header's __metadata__ (safetensors allows only strings).
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    plan: list[tuple[torch.Tensor, torch.dtype]] = []
    for name, tensor in tensors.items():
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if target not in DTYPES:
            raise WeightsFileError(f"{name}: dtype {target} has no safetensors name")
        nbytes = tensor.numel() * target.itemsize
        header[name] = {"dtype": DTYPES[target], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        plan.append((tensor, target))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN_BYTES)
    prefix = len(text).to_bytes(8, "little") + text
    # One staging buffer per target dtype, reused for every cast or device copy: allocating one per
    # tensor instead leaves the allocator holding tens of MB of freed blocks.
    staging: dict[torch.dtype, torch.Tensor] = {}
    with open(path, "wb") as f:
        f.write(prefix)
        on_bytes(memoryview(prefix))
        for tensor, target in plan:
            flat = tensor.detach().reshape(-1)
            step = max(1, _PIECE_BYTES // target.itemsize)
            for begin in range(0, flat.numel(), step):
                piece = flat[begin : begin + step]
                if piece.device.type != "cpu" or piece.dtype != target:
                    if target not in staging:
                        staging[target] = torch.empty(step, dtype=target)
                    piece = staging[target][: piece.numel()].copy_(piece)
                raw = _raw_bytes(piece.contiguous())
                f.write(raw)
                on_bytes(raw)
    return len(prefix) + offset


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header JSON, header length, file size) of a safetensors file; WeightsFileError if malformed."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsFileError(f"{path}: {len(head)} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise WeightsFileError(f"{path}: header of {n} bytes does not fit the {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsFileError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise WeightsFileError(f"{path}: header is not a JSON object")
    return header, n, size


def read_metadata(path: Path) -> dict[str, str]:
    """The header's __metadata__ string pairs (empty when there is none); WeightsFileError if malformed."""
    metadata = _read_header(path)[0].get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise WeightsFileError(f"{path}: __metadata__ is not a map of strings")
    return metadata


def read_entries(path: Path) -> list[Entry]:
    """The tensors a safetensors file holds, in file order; WeightsFileError for a malformed header."""
    header, n, size = _read_header(path)
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_NAME[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsFileError(f"{path}: bad header entry for {name!r}: {exc!r}") from exc
        if any(d < 0 for d in shape) or end - begin != math.prod(shape) * dtype.itemsize:
            raise WeightsFileError(f"{path}: {name} spans {end - begin} bytes, not {shape} of {dtype}")
        entries.append(Entry(name, dtype, shape, base + begin, base + end))
    entries.sort(key=lambda e: e.start)
    position = base
    for e in entries:
        if e.start != position:
            raise WeightsFileError(f"{path}: {e.name} starts at {e.start}, expected {position} (gap or overlap)")
        position = e.end
    if position != size:
        raise WeightsFileError(f"{path}: tensors end at {position}, the file at {size}")
    return entries


def read_exact_into(f, into: memoryview, where: str) -> None:
    """Fill `into` from the open file `f` (WeightsFileError naming `where` if the file ends first)."""
    got = 0
    while got < len(into):
        n = f.readinto(into[got:])
        if not n:
            raise WeightsFileError(f"{where}: file ends early")
        got += n


def read_tensor(f, entry: Entry) -> torch.Tensor:
    """A fresh CPU tensor holding `entry`'s bytes read from the open file `f`."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    f.seek(entry.start)
    read_exact_into(f, _raw_bytes(out), entry.name)
    return out


def copy_into(f, entry: Entry, target: torch.Tensor, staging: dict[torch.dtype, torch.Tensor]) -> None:
    """Read `entry` from `f` into `target` in place: straight into its storage when it is a contiguous
    CPU tensor, else (a CUDA or strided target) through `staging`, one reused buffer per dtype."""
    if target.dtype != entry.dtype:
        raise WeightsFileError(f"{entry.name}: file holds {entry.dtype}, target is {target.dtype}")
    f.seek(entry.start)
    if target.device.type == "cpu" and target.is_contiguous():
        read_exact_into(f, _raw_bytes(target), entry.name)
        return
    if not target.is_contiguous():  # rare: one staging copy of the whole tensor
        target.copy_(read_tensor(f, entry))
        return
    flat = target.view(-1)
    step = max(1, _PIECE_BYTES // entry.dtype.itemsize)
    if entry.dtype not in staging:
        staging[entry.dtype] = torch.empty(step, dtype=entry.dtype)
    for begin in range(0, flat.numel(), step):
        piece = staging[entry.dtype][: min(step, flat.numel() - begin)]
        read_exact_into(f, _raw_bytes(piece), entry.name)
        flat[begin : begin + piece.numel()].copy_(piece)


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `path`, one at a time (for loaders that take an iterator)."""
    entries = read_entries(path)
    with open(path, "rb") as f:
        for entry in entries:
            yield entry.name, read_tensor(f, entry)
