"""Torch model I/O for snapshots: a model's state dict written as a snapshot, a snapshot copied into a model.

shared/snapshot.py knows snapshot files, manifests and chunks and imports no torch; this module is
where weights meet a `torch.nn.Module` (streamed one tensor at a time, shared/weights_file.py), and
where a model directory's config hash is read with transformers.

Tied weights: safetensors refuses tensors that share storage. `build_snapshot` keeps
the first name of each group of exact aliases (state-dict order, so `model.embed_tokens.weight`
survives and the tied `lm_head.weight` is dropped, as Hugging Face checkpoints and vLLM's
loaders expect) and clones tensors that merely overlap another's storage. `load_into` accepts
a missing key only when the model ties it to a key the snapshot does carry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from shared.crypto import Identity
from shared.probe import InstallProbe
from shared.snapshot import CHUNK_SIZE_BYTES, Snapshot, SnapshotError, model_config_hash, write_snapshot
from shared.weights_file import WeightsFileError, copy_into, read_entries, write_weights


def model_dir_config_hash(model_dir: str | Path) -> str:
    """model_config_hash of the config in a Hugging Face model directory (what a node compares to the hub's)."""
    from transformers import AutoConfig

    return model_config_hash(AutoConfig.from_pretrained(str(model_dir)).to_dict())


def model_dir_weights(model_dir: str | Path) -> int:
    """Parameters and buffers of the model a Hugging Face model directory's config describes, tied ones once: what
    a full snapshot of it holds, counted on a weightless copy (nothing is allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def _untied(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors with no shared storage: exact aliases dropped (first name kept), overlaps cloned.

    No copy otherwise: the writer reads each tensor as it writes it."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    storages: set[tuple[torch.device, int]] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage is not None:
            alias_key = (tensor.device, storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            if alias_key in seen:
                continue
            seen.add(alias_key)
            if (tensor.device, storage) in storages:
                tensor = tensor.clone()
            else:
                storages.add((tensor.device, storage))
        kept[name] = tensor
    return kept


def build_snapshot(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    identity: Identity,
    config_hash: str,
    directory: Path,
    dtype: torch.dtype | None = None,
    chunk_size: int = CHUNK_SIZE_BYTES,
    created_at: float | None = None,
    metadata: Mapping[str, str] | None = None,
    probe: Callable[[Path, str], InstallProbe] | None = None,
) -> Snapshot:
    """Stream the weights (floating ones in `dtype`, when given) into `directory` as snapshot `version`, signed
    with the hub's key (shared.snapshot.write_snapshot: hashes, manifest, crash safety). `probe(weights
    path, whole hash)`: the install probe of the written weights, signed in the manifest."""
    tensors = _untied(state_dict)
    return write_snapshot(
        directory,
        version,
        identity,
        config_hash,
        lambda path, on_bytes: write_weights(path, tensors, dtype, on_bytes, metadata),
        chunk_size=chunk_size,
        created_at=created_at,
        probe=probe,
    )


class PartialCopy(SnapshotError):
    """A copy that stopped after it began: the model now holds a mix of two versions."""


def tied_groups(model: torch.nn.Module) -> list[set[str]]:
    """Sets of state-dict names that are one parameter (tied embeddings), from the module tree alone
    (works on a meta-device model)."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return [group for group in names.values() if len(group) > 1]


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """The names a snapshot of `model` leaves out: all but the first of each tied group, in state-dict order
    (what build_snapshot keeps: the embedding, which vLLM's loaders expect)."""
    order = {name: i for i, name in enumerate(model.state_dict())}
    return {name for group in tied_groups(model) for name in sorted(group, key=order.__getitem__)[1:]}


def check_tied_copies(names: Iterable[str], groups: Iterable[set[str]]) -> None:
    """A snapshot carries one name per tied group: engines disagree on which copy wins (vLLM keeps the
    embedding, transformers whichever loads last), so two copies are refused, equal or not."""
    present = set(names)
    for group in groups:
        both = sorted(group & present)
        if len(both) > 1:
            raise SnapshotError(
                f"snapshot carries {' and '.join(both)}, which this model ties: a snapshot must carry one of them"
            )


def load_into(model: torch.nn.Module, path: Path, keys: Callable[[str], bool] | None = None) -> None:
    """Copy the snapshot file's weights into `model` in place (no re-instantiation), one tensor at a time.

    Strict except for tied weights: a key may be absent only if the model ties it to a key
    the snapshot carries, and at most one key of a tied group may be present. Shapes and dtypes
    must match exactly, so loaded values are bit-identical; everything is checked before the
    first byte is copied (SnapshotError, model untouched); a failure after that is PartialCopy.
    `keys`: the part of the model's state dict the snapshot holds, all of it (the adapters of a LoRA
    run, shared/adapters.py); None: the whole state dict.
    """
    try:
        entries = read_entries(path)
    except WeightsFileError as exc:
        raise SnapshotError(str(exc)) from exc
    current = model.state_dict()
    if keys is not None:
        current = {name: tensor for name, tensor in current.items() if keys(name)}
    names = {e.name for e in entries}
    unexpected = sorted(names - set(current))
    if unexpected:
        raise SnapshotError(f"snapshot has keys the model lacks: {unexpected[:10]}")
    check_tied_copies(names, tied_groups(model))
    loaded_storages = {current[name].untyped_storage().data_ptr() for name in names}
    untied_missing = sorted(
        name
        for name in set(current) - names
        if current[name].numel() == 0 or current[name].untyped_storage().data_ptr() not in loaded_storages
    )
    if untied_missing:
        raise SnapshotError(f"snapshot lacks keys the model needs: {untied_missing[:10]}")
    for entry in entries:
        target = current[entry.name]
        if tuple(target.shape) != entry.shape or target.dtype != entry.dtype:
            raise SnapshotError(
                f"{entry.name}: snapshot has {entry.shape} {entry.dtype}, model has {tuple(target.shape)} {target.dtype}"
            )
    staging: dict[torch.dtype, torch.Tensor] = {}
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a failure here has copied nothing
    except OSError as exc:
        raise SnapshotError(f"{path}: {exc}") from exc
    done = 0
    try:
        with torch.no_grad(), f:
            for entry in entries:
                copy_into(f, entry, current[entry.name], staging)
                done += 1
    except Exception as exc:
        raise PartialCopy(f"{path}: copy stopped at tensor {done + 1} of {len(entries)} ({exc!r})") from exc
