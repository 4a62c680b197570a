"""Learner metrics as JSON lines in DATA_DIR/metrics.jsonl: one object per committed step (with "step")
and one per held-out evaluation (with "eval_step"), each also sent to the run's trackers; and one per crash that lost
steps as weights (with "lost_steps_from", the file's only), which plots and the report mark as a gap.

The store is the source of truth; this file is the cheap, append-only view that plots and
benchmarks read. A line is appended only after its step is committed, so a crash can lose
the newest line but never invent one; a torn last line is cut off when the file is reopened.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from hub.records.schema import StepRecord
from hub.training.trackers import LoggedCompletion, Trackers
from shared.rollout import Group
from shared.tasks.rewards import mean_applied, std_applied


def sample_completions(groups: Sequence[Group], n: int) -> list[LoggedCompletion]:
    """Up to `n` of a step's completions, spread over its prompts: each group's first, then each one's second...;
    each with the columns the reward functions logged for it (TRL's log_extra)."""
    picked: list[LoggedCompletion] = []
    width = max((len(g.completions) for g in groups), default=0)
    for index in range(width):
        for group in groups:
            if len(picked) == n:
                return picked
            if index < len(group.completions):
                completion = group.completions[index]
                extra = {column: values[index] for column, values in group.logged_columns}
                picked.append(
                    LoggedCompletion(group.prompt_text, completion.text, group.rewards[index], completion.version, extra)
                )
    return picked


def logged_metric_means(groups: Sequence[Group]) -> dict[str, float]:
    """Each metric the reward functions logged (TRL's log_metric) while scoring `groups`, averaged over its calls
    as TRL averages over a logging step."""
    values: dict[str, list[float]] = {}
    for group in groups:
        for name, value in group.logged_metrics:
            values.setdefault(name, []).append(value)
    return {name: math.fsum(logged) / len(logged) for name, logged in values.items()}


# Past this share of a step's completions cut at max_new_tokens, most rewards score unfinished answers.
CUT_WARNING_SHARE = 0.5


def cut_completions_warning(step: int, clipped_ratio: float, max_new_tokens: int) -> str | None:
    """The one line that says most of a step's completions were cut at --max-new-tokens (None: at most half were)."""
    if clipped_ratio <= CUT_WARNING_SHARE:
        return None
    return (
        f"{clipped_ratio:.0%} of step {step}'s completions were cut at --max-new-tokens {max_new_tokens}, so their "
        "rewards score unfinished answers: raise --max-new-tokens (TRL's --max-completion-length)"
    )


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
        with self._lock:
            self._write(json.dumps(row, sort_keys=True))
            if self.trackers is not None:
                self.trackers.log(row)

    def append_lost(self, first: int, last: int, checkpoint_step: int) -> None:
        """One line {"lost_steps_from": first, "lost_steps_to": last, "resumed_from_checkpoint": checkpoint_step}: a
        resume from that checkpoint (0: the starting model) lost those steps as weights. Not sent to the trackers,
        whose rows are steps."""
        row = {"lost_steps_from": first, "lost_steps_to": last, "resumed_from_checkpoint": checkpoint_step}
        with self._lock:
            self._write(json.dumps(row, sort_keys=True))

    def append_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None:
        """One line {"completions_step": step, "completions": [...]}, and a table in each tracker."""
        with self._lock:
            self._write(json.dumps({"completions_step": step, "completions": [_completion_json(c) for c in completions]}))
            if self.trackers is not None:
                self.trackers.log_completions(step, completions)

    def _write(self, line: str) -> None:
        """One line appended and fsynced (under the lock)."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def _completion_json(completion: LoggedCompletion) -> dict[str, object]:
    """A sample completion as metrics.jsonl holds it: its log_extra columns under "extra", when it has any."""
    out = asdict(completion)
    if not completion.extra:
        del out["extra"]
    return out


def _rows(path: Path) -> list[dict[str, float]]:
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The learner steps' rows of a metrics file, in order."""
    return [row for row in _rows(path) if "step" in row]


def read_completions(path: Path) -> list[dict]:
    """The sample completions' rows of a metrics file (--log-completions), in order."""
    return [row for row in _rows(path) if "completions_step" in row]


def read_lost(path: Path) -> list[tuple[int, int]]:
    """The (first, last) steps each resume of a metrics file lost as weights, in order (only those lines are parsed:
    a resume reads them from a file of every step)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if '"lost_steps_from"' in line]
    return [(int(row["lost_steps_from"]), int(row["lost_steps_to"])) for row in rows if "step" not in row]


def lost_text(lost: tuple[int, int] | None) -> str:
    """Steps lost as weights, as said: "steps 121-129", "step 130", "none"."""
    if lost is None:
        return "none"
    first, last = lost
    return f"step {first}" if first == last else f"steps {first}-{last}"


def read_evals(path: Path) -> list[dict[str, float]]:
    """The evaluations' rows of a metrics file, by step."""
    return sorted((row for row in _rows(path) if "eval_step" in row), key=lambda row: row["eval_step"])


def policy_reward(row: Mapping[str, float]) -> float:
    """What the policy scores at a step: the mean over every rollout offered since the previous step
    (zero-variance groups included), falling back to the mean over the groups trained on."""
    return row.get("rollout_reward_mean", row["reward_mean"])


def reward_means(groups: Sequence[Group]) -> dict[str, float]:
    """Each reward function's mean and standard deviation over the completions of `groups` it applies to, by TRL's
    keys "rewards/<name>/mean" and "rewards/<name>/std" (a dataset's reward functions name their values; a function
    that applied to none, or a task of its own class, logs nothing; the std needs two values)."""
    values: dict[str, list[float | None]] = {}
    for group in groups:
        for name, part in group.reward_parts:
            values.setdefault(name, []).extend(part)
    out: dict[str, float] = {}
    for name, applied in values.items():
        mean, std = mean_applied(applied), std_applied(applied)
        if mean is not None:
            out[f"rewards/{name}/mean"] = mean
        if std is not None:
            out[f"rewards/{name}/std"] = std
    return out
