"""Learner checkpoints: model (save_pretrained, with tokenizer) + optimizer state, one directory per step.

A LoRA run's checkpoint holds its adapters (ADAPTER_FILE) instead of the model: the base never changes.
A learner sharded over several ranks writes a torch.distributed.checkpoint directory (SHARDED_SUBDIR:
every rank its shard of the weights and optimizer state), which any number of ranks can resume.
Beside the weights, a checkpoint holds the text files it is given: the run card (hub/cli/card.py) that says
which run's policy it is.

A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed
into place and the parent fsynced, so a directory named `step-NNNNNNNN` is always complete.
The newest complete directory wins; older ones beyond `keep` are removed by first renaming
them back to a temporary name, so a kill in the middle of the removal leaves a temporary (cleared
at the next start), never a `step-NNNNNNNN` directory with files missing.

When one is due (`checkpoint_due`): every `checkpoint_every` steps, and after any step once `checkpoint_every_s`
seconds passed since the last one, so that a crash loses a bounded span of learning whatever a step takes. A crash
loses the steps after the newest checkpoint as weights (`lost_steps`): their rows stay in the record, and the resumed
learner numbers its steps after them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.files import fsync_dir
from shared.logs import for_operator
from shared.weights_file import write_weights

log = logging.getLogger("echo2.hub.checkpoint")

CHECKPOINT_PREFIX = "step-"
MODEL_SUBDIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_FILE = "adapter.safetensors"
SHARDED_SUBDIR = "dcp"
STATE_FILE = "state.json"
CHECKPOINTS_KEPT = 2
# A checkpoint due by time waits at least 1 / CHECKPOINT_TIME_SHARE times the last one's duration: those checkpoints
# take at most this share of the learner's time, however large the model (a 7B model's takes minutes).
CHECKPOINT_TIME_SHARE = 0.05


def checkpoint_due(step: int, every_steps: int, since_s: float, every_s: float, last_took_s: float) -> bool:
    """Whether the policy after `step` is checkpointed: every `every_steps` steps, or once `since_s` (the seconds since
    the last checkpoint, or since the start) reached `every_s` and 1 / CHECKPOINT_TIME_SHARE times the last
    checkpoint's duration `last_took_s`."""
    return step % every_steps == 0 or since_s >= max(every_s, last_took_s / CHECKPOINT_TIME_SHARE)


def lost_steps(latest_step: int, checkpoint_step: int, reported: Sequence[tuple[int, int]] = ()) -> tuple[int, int] | None:
    """(first, last) of the steps a resume loses as weights: those after the checkpoint it loads (`checkpoint_step`, 0
    for none) up to the newest committed one, less those an earlier resume from the same checkpoint already reported
    lost (`reported`: its (first, last) spans); None when none is lost."""
    first = max([checkpoint_step, *(last for _, last in reported if last > checkpoint_step)]) + 1
    return (first, latest_step) if first <= latest_step else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    version: int
    path: Path

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL_SUBDIR

    @property
    def optimizer_path(self) -> Path:
        return self.path / OPTIMIZER_FILE

    @property
    def adapter_path(self) -> Path:
        return self.path / ADAPTER_FILE

    @property
    def sharded_dir(self) -> Path:
        return self.path / SHARDED_SUBDIR

    @property
    def sharded(self) -> bool:
        return self.sharded_dir.is_dir()


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def save_checkpoint(
    root: Path,
    step: int,
    version: int,
    model,
    tokenizer,
    optimizer,
    keep: int = CHECKPOINTS_KEPT,
    adapter: Mapping[str, torch.Tensor] | None = None,
    sharded: Callable[[Path], None] | None = None,
    adapter_metadata: Mapping[str, str] | None = None,
    files: Mapping[str, str] | None = None,
) -> CheckpointInfo:
    """Atomically write the checkpoint of `step` (`adapter`: a LoRA run's adapters, saved instead of the
    model, with `adapter_metadata`, their spec; `sharded`: writes every rank's shard into the directory it is given, instead of the model and
    optimizer; `files`: text files written beside them, name -> text); returns where it lives."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        if sharded is not None:
            sharded(tmp / SHARDED_SUBDIR)
        elif adapter is None:
            model.save_pretrained(tmp / MODEL_SUBDIR)
        else:
            write_weights(tmp / ADAPTER_FILE, adapter, None, metadata=adapter_metadata)
        tokenizer.save_pretrained(tmp / MODEL_SUBDIR)
        if sharded is None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "version": version}))
        write_text_files(tmp, files or {})
        _fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        try:
            _remove_checkpoint(old.path)
        except OSError as exc:  # the new checkpoint is committed; an old one left behind is retried next save
            log.warning("could not remove old checkpoint %s: %s", old.path, exc, extra=for_operator("checkpoint_kept"))
    return CheckpointInfo(step=step, version=version, path=final)


def write_text_files(directory: Path, files: Mapping[str, str]) -> None:
    """Each of `files` (name -> text) into `directory`, each whole or not at all."""
    for name, text in files.items():
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, directory / name)


def _remove_checkpoint(path: Path) -> None:
    # A fresh empty directory as the target: rename replaces it atomically, and the name is unique.
    doomed = Path(tempfile.mkdtemp(prefix=f".{path.name}.removing.", dir=path.parent))
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX):
            if not (path / STATE_FILE).exists():
                # Not written by save_checkpoint (which renames whole directories): never resume from it.
                log.warning(
                    "ignoring %s: no %s, not a complete checkpoint", path, STATE_FILE, extra=for_operator("checkpoint_ignored")
                )
                continue
            state = json.loads((path / STATE_FILE).read_text())
            out.append(CheckpointInfo(step=int(state["step"]), version=int(state["version"]), path=path))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def remove_stale_temporaries(root: Path) -> int:
    """Delete half-written checkpoint directories left by a crash; how many were removed."""
    root = Path(root)
    if not root.is_dir():
        return 0
    removed = 0
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(f".{CHECKPOINT_PREFIX}"):
            shutil.rmtree(path)
            removed += 1
    return removed
