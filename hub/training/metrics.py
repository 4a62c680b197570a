"""Learner metrics as JSON lines in DATA_DIR/metrics.jsonl: one object per committed step (with "step")
and one per held-out evaluation (with "eval_step"), each also sent to the run's trackers.

The store is the source of truth; this file is the cheap, append-only view that plots and
benchmarks read. A line is appended only after its step is committed, so a crash can lose
the newest line but never invent one; a torn last line is cut off when the file is reopened.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from hub.records.store import StepRecord
from hub.training.trackers import Trackers


def bubble_ratio(t_idle_s: float, t_train_s: float) -> float:
    """T_idle / (T_idle + T_train) for one step (0 when both are 0)."""
    total = t_idle_s + t_train_s
    return t_idle_s / total if total > 0 else 0.0


class MetricsWriter:
    """Appends rows to a JSON-lines file (from any thread) and hands each to the trackers."""

    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = trackers
        self._lock = threading.Lock()
        self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, record: StepRecord) -> None:
        self.append_row(record.as_json_dict())

    def append_row(self, row: Mapping[str, float | int]) -> None:
        line = json.dumps(row, sort_keys=True) + "\n"
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            if self.trackers is not None:
                self.trackers.log(row)


def _rows(path: Path) -> list[dict[str, float]]:
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The learner steps' rows of a metrics file, in order."""
    return [row for row in _rows(path) if "step" in row]


def read_evals(path: Path) -> list[dict[str, float]]:
    """The evaluations' rows of a metrics file, by step."""
    return sorted((row for row in _rows(path) if "eval_step" in row), key=lambda row: row["eval_step"])


def policy_reward(row: Mapping[str, float]) -> float:
    """What the policy scores at a step: the mean over every rollout offered since the previous step
    (zero-variance groups included), falling back to the mean over the groups trained on."""
    return row.get("rollout_reward_mean", row["reward_mean"])
