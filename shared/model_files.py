"""The model's config and tokenizer files, offered by the hub and written by a node that brings no model.

The hub lists the non-weight files of its model directory (config, generation config, tokenizer, vocabulary,
chat template), each with its size and blake3; a node asks for the list, then for each file it lacks, checks
every file's size and hash against the list before it lands in place (a temporary file, renamed), and builds
its engine from that directory. The weights come as the first snapshot, as for every node.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from shared.messages import MODEL_FILE_MAX_BYTES, MODEL_FILE_NAME_PATTERN, ModelFile, ModelFiles
from shared.snapshot import blake3_hex

log = logging.getLogger("echo2.model_files")

# What a transformers or vLLM model directory needs besides its weights: configs, tokenizers (JSON, vocab and
# merges, sentencepiece, tiktoken), chat templates. Code (*.py, trust_remote_code) is never offered.
OFFERED_SUFFIXES = frozenset({".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab"})
# A weight index names weight files the node does not have: with it present, loaders would look for them.
WEIGHT_INDEX_SUFFIX = ".index.json"
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"})
_NAME_RE = re.compile(MODEL_FILE_NAME_PATTERN)


class ModelFilesRefused(Exception):
    """The hub's model files cannot be used: refused by the hub, or not what its list says."""

    def __str__(self) -> str:
        return f"cannot use the hub's model files: {self.args[0]}"


def model_label(model_dir: Path, config) -> str:
    """How people know the model: its name (`_name_or_path`'s last part), architecture and vocabulary size."""
    name = Path(str(getattr(config, "_name_or_path", "") or model_dir)).name or str(model_dir)
    arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", "?")
    return f"{name} ({arch}, vocab {vocab})"


def plain_model_file(name: str) -> bool:
    """A name a node writes: plain (no directory part), of a config or tokenizer kind, never weights, a weight index
    or code; a hub that lists another is refused whole."""
    return (
        bool(_NAME_RE.match(name))
        and name == Path(name).name
        and Path(name).suffix in OFFERED_SUFFIXES
        and not name.endswith(WEIGHT_INDEX_SUFFIX)
    )


def _offered(path: Path) -> bool:
    """A non-weight file of the model directory (a link too: Hugging Face's cache links to its blobs) with a name
    any node may write."""
    return path.is_file() and plain_model_file(path.name) and path.stat().st_size <= MODEL_FILE_MAX_BYTES


@dataclass(frozen=True)
class ModelOffer:
    """What the hub serves on MODEL_PROTOCOL: the list and the bytes it hashed (at most MODEL_FILES_MAX_BYTES, kept:
    a request costs no disk read, and a file changed on disk since is never served against its old hash)."""

    listing: ModelFiles
    data: Mapping[str, bytes]

    def entry(self, name: str) -> ModelFile | None:
        return next((f for f in self.listing.files if f.name == name), None)

    def read(self, entry: ModelFile) -> bytes:
        return self.data[entry.name]


def model_offer(
    model_dir: Path, label: str, weights_in_snapshots: bool, max_price_per_hour: float | None = None
) -> ModelOffer | None:
    """The hub's offer of `model_dir`'s non-weight files, its list saying the hub's price ceiling
    (`max_price_per_hour`); None (logged) when they break the bounds nodes check."""
    data = {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if _offered(p)}
    files = [ModelFile(name=name, size=len(body), blake3=blake3_hex(body)) for name, body in data.items()]
    try:
        listing = ModelFiles(
            model=label, weights_in_snapshots=weights_in_snapshots, files=tuple(files), max_price_per_hour=max_price_per_hour
        )
    except ValidationError as exc:
        log.warning("the model's files cannot be offered to nodes (they must bring --model): %s", str(exc).splitlines()[:3])
        return None
    return ModelOffer(listing, data)


def has_weights(model_dir: Path) -> bool:
    """Whether `model_dir` holds weight files (a node's own --model), not only configs and tokenizer."""
    return any(p.suffix in WEIGHT_SUFFIXES for p in Path(model_dir).iterdir())


def held(directory: Path, entry: ModelFile) -> bool:
    """Whether `directory` already holds exactly this file (a node restarted on the same hub fetches nothing)."""
    path = directory / entry.name
    return path.is_file() and path.stat().st_size == entry.size and blake3_hex(path.read_bytes()) == entry.blake3


def write_model_file(directory: Path, entry: ModelFile, data: bytes) -> None:
    """Write `data` as `entry` in `directory` once its size and blake3 match the list: to a temporary file in
    the same directory, renamed into place. ModelFilesRefused otherwise, and nothing is left behind."""
    if not plain_model_file(entry.name):
        raise ModelFilesRefused(f"{entry.name!r} is not a plain config or tokenizer file name")
    if len(data) != entry.size:
        raise ModelFilesRefused(f"{entry.name} has {len(data)} bytes, the list says {entry.size}")
    if blake3_hex(data) != entry.blake3:
        raise ModelFilesRefused(f"{entry.name} does not match its blake3 in the list")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / entry.name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prune_unlisted(directory: Path, listing: ModelFiles) -> None:
    """Remove files the hub's list does not name (another model's tokenizer files would be loaded with these)."""
    names = {f.name for f in listing.files}
    for path in directory.iterdir():
        if path.is_file() and path.name not in names:
            path.unlink()
