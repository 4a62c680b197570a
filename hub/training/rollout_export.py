"""Rollouts as data (`echo-hub start --save-rollouts DIR`): each learner step's groups as one Parquet shard.

One row per completion, with what the step trained on: the prompt, the completion's text and token ids, its
reward and the advantage the learner gave it, the version that sampled it, its staleness at the step, the node
that made it and the step. `datasets.load_dataset("parquet", data_dir=DIR)` and `pandas.read_parquet(DIR)` read
the directory as one table. Retention: past `max_bytes` the oldest shards are deleted, the newest one always kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hub.method.grpo import group_advantages
from shared.rollout import Group

log = logging.getLogger("echo2.hub.rollouts")

SHARD_SUFFIX = ".parquet"
SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("version", pa.int64()),
        ("staleness", pa.int64()),
        ("node", pa.string()),
    ]
)


def shard_name(step: int) -> str:
    """A step's shard: zero-padded, so names sort as steps do."""
    return f"step-{step:09d}{SHARD_SUFFIX}"


def rollout_columns(groups: Sequence[Group], step: int, staleness: Sequence[int], advantage_scale: str) -> dict[str, list]:
    """The step's rows as columns (SCHEMA's order), advantages as the learner computes them (hub/method/grpo.py)."""
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    n = len(groups[0].completions)
    advantages = group_advantages(rewards, n, scale=advantage_scale).tolist()
    columns: dict[str, list] = {name: [] for name in SCHEMA.names}
    row = 0
    for group, age in zip(groups, staleness, strict=True):
        for completion, reward in zip(group.completions, group.rewards, strict=True):
            for name, value in (
                ("step", step),
                ("prompt_id", group.prompt_id),
                ("prompt", group.prompt_text),
                ("completion", completion.text),
                ("token_ids", list(completion.token_ids)),
                ("finish_reason", completion.finish_reason),
                ("reward", reward),
                ("advantage", advantages[row]),
                ("version", completion.version),
                ("staleness", age),
                ("node", group.node_id),
            ):
                columns[name].append(value)
            row += 1
    return columns


def shards_to_delete(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[str]:
    """Oldest shards first (`sizes` in name order) until the rest fits in `max_bytes`; the newest always stays."""
    total = sum(size for _, size in sizes)
    doomed = []
    for name, size in sizes[:-1]:
        if total <= max_bytes:
            break
        doomed.append(name)
        total -= size
    return doomed


class RolloutExport:
    """Writes each step's shard into `directory` (atomically: a reader never sees half a file) and keeps the
    directory under `max_bytes`. Blocking: the training loop calls `save` in a worker thread."""

    def __init__(self, directory: Path, max_bytes: int, advantage_scale: str) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.advantage_scale = advantage_scale
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f".*{SHARD_SUFFIX}.tmp"):  # a write a crash cut short
            leftover.unlink()

    def save(self, groups: Sequence[Group], step: int, staleness: Sequence[int]) -> Path:
        table = pa.table(rollout_columns(groups, step, staleness, self.advantage_scale), schema=SCHEMA)
        path = self.directory / shard_name(step)
        # A dot name: the readers skip hidden files, so a shard cut short by a crash is never read.
        temporary = self.directory / f".{path.name}.tmp"
        pq.write_table(table, temporary, compression="zstd")
        os.replace(temporary, path)
        self._prune()
        return path

    def _prune(self) -> None:
        shards = sorted(p for p in self.directory.iterdir() if p.name.endswith(SHARD_SUFFIX) and not p.name.startswith("."))
        doomed = shards_to_delete([(p.name, p.stat().st_size) for p in shards], self.max_bytes)
        for name in doomed:
            (self.directory / name).unlink(missing_ok=True)
        if doomed:
            log.info("--save-rollouts: deleted %d oldest shards (cap %d bytes)", len(doomed), self.max_bytes)
