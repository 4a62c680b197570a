"""Experiment trackers (`--report-to`): TensorBoard, Weights & Biases and trackio, each optional.

Each is imported only when chosen; a missing package is a user mistake caught before the run
starts (`check_trackers`). All three run offline: TensorBoard and trackio write local files,
W&B runs in offline mode unless WANDB_MODE says otherwise (sync later with `wandb sync`). Local
files go under DATA_DIR/<tracker>/ unless tracking.dir is set. Every tracker gets the run
config once and every metrics.jsonl row: learner steps by `step`, evaluations by `eval_step`; the sample
completions of --log-completions as a table (TensorBoard: a markdown text, W&B and trackio: a Table).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from hub.config import TrackingConfig
from shared.logs import for_operator

log = logging.getLogger("echo2.hub.trackers")

TRACK_EXTRA = "pip install 'echo2[track]'"
# tracker -> the module it needs
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


@dataclass(frozen=True)
class LoggedCompletion:
    """One sample completion of a step, as --log-completions logs it."""

    prompt: str
    completion: str
    reward: float
    version: int
    extra: Mapping[str, str | float | None] = field(default_factory=dict)  # the reward functions' log_extra columns


COMPLETION_COLUMNS = ["step"] + [f.name for f in fields(LoggedCompletion) if f.name != "extra"]


def _columns(completions: Sequence[LoggedCompletion]) -> list[str]:
    """A step's table columns: ours, then every log_extra column one of its completions has, as TRL adds them."""
    return COMPLETION_COLUMNS + list(dict.fromkeys(k for c in completions for k in c.extra))


def _table_rows(step: int, completions: Sequence[LoggedCompletion]) -> list[list[Any]]:
    extra = _columns(completions)[len(COMPLETION_COLUMNS) :]
    return [[step, c.prompt, c.completion, c.reward, c.version, *(c.extra.get(k) for k in extra)] for c in completions]


def _markdown_table(step: int, completions: Sequence[LoggedCompletion]) -> str:
    """The completions as a markdown table (TensorBoard renders text as markdown); cells on one line each."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    columns = _columns(completions)
    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in _table_rows(step, completions)]
    return "\n".join(lines)


class Tracker(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...

    def log_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None: ...

    def close(self) -> None: ...


def chosen(cfg: TrackingConfig) -> list[str]:
    return [name for name in dict.fromkeys(cfg.report_to) if name != "none"]


def missing_tracker_packages(cfg: TrackingConfig) -> list[str]:
    """Trackers asked for whose package is not installed."""
    return [name for name in chosen(cfg) if importlib.util.find_spec(TRACKER_MODULES[name]) is None]


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _row_step(row: Mapping[str, Any]) -> tuple[str, int]:
    """('train', step) for a learner step's row, ('eval', step) for an evaluation's."""
    return ("eval", int(row["eval_step"])) if "eval_step" in row else ("train", int(row["step"]))


class TensorBoardTracker:
    def __init__(self, directory: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / run_name))
        self.writer.add_text("config", "```\n" + _pretty(config) + "\n```", 0)

    def log(self, row: Mapping[str, Any]) -> None:
        kind, step = _row_step(row)
        for key, value in _numbers(row).items():
            if key not in ("step", "eval_step"):
                self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.writer.flush()

    def log_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None:
        self.writer.add_text("train/completions", _markdown_table(step, completions), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, directory: Path, project: str, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=str(directory),
            config=dict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]  # wandb checks it
        )
        # Evaluations finish after later steps were logged: they get their own x axis.
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("eval_step")
        self.run.define_metric("eval/*", step_metric="eval_step")

    def log(self, row: Mapping[str, Any]) -> None:
        kind, step = _row_step(row)
        axis = "eval_step" if kind == "eval" else "step"
        self.run.log({axis: step, **{f"{kind}/{k}": v for k, v in _numbers(row).items() if k != axis}})

    def log_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None:
        table = self.wandb.Table(columns=list[str | int](_columns(completions)), data=_table_rows(step, completions))
        self.run.log({"step": step, "train/completions": table})

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the run file out; teardown waits for it.
        self.wandb.teardown()


class TrackioTracker:
    def __init__(self, directory: Path, project: str, run_name: str, config: Mapping[str, Any]) -> None:
        # trackio reads its directory once, at import.
        os.environ["TRACKIO_DIR"] = str(directory)
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=run_name, config=dict(config), embed=False)

    def log(self, row: Mapping[str, Any]) -> None:
        kind, step = _row_step(row)
        self.run.log({f"{kind}/{k}": v for k, v in _numbers(row).items()}, step=step)

    def log_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None:
        table = self.trackio.Table(columns=_columns(completions), data=_table_rows(step, completions))
        self.run.log({"train/completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _pretty(config: Mapping[str, Any]) -> str:
    import json

    return json.dumps(config, indent=2, sort_keys=True, default=str)


class Trackers:
    """The chosen trackers, fed together; a tracker that fails to log is reported, then dropped."""

    def __init__(self, trackers: Sequence[tuple[str, Tracker]]) -> None:
        self.trackers = list(trackers)

    def log(self, row: Mapping[str, Any]) -> None:
        self._each(lambda tracker: tracker.log(row))

    def log_completions(self, step: int, completions: Sequence[LoggedCompletion]) -> None:
        self._each(lambda tracker: tracker.log_completions(step, completions))

    def _each(self, call) -> None:
        """`call` on every tracker; one that fails is reported, then dropped."""
        for name, tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 -- a tracker's own failure must not stop training
                log.warning(
                    "--report-to %s failed (%s); training goes on without it", name, exc, extra=for_operator("tracker_dropped")
                )
                self.trackers.remove((name, tracker))

    def close(self) -> None:
        """Finish every tracker; one that fails to is reported and the others still finish."""
        for name, tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 -- the run's own state is saved whatever a tracker does
                log.error("tracker %s failed to close: %r", name, exc)
                print(f"echo-hub: --report-to {name} failed to finish ({exc})", flush=True)
        self.trackers.clear()


def open_trackers(cfg: TrackingConfig, data_dir: Path, config: Mapping[str, Any]) -> Trackers:
    """Start every chosen tracker (their packages were checked before the run started)."""
    run_name = cfg.run_name or Path(data_dir).resolve().name
    opened: list[tuple[str, Tracker]] = []
    for name in chosen(cfg):
        directory = Path(cfg.dir or data_dir) / name
        if name == "tensorboard":
            opened.append((name, TensorBoardTracker(directory, run_name, config)))
        elif name == "wandb":
            opened.append((name, WandbTracker(directory.parent, cfg.project, run_name, config)))  # it adds wandb/
        else:
            opened.append((name, TrackioTracker(directory, cfg.project, run_name, config)))
        log.info("tracker %s writes to %s", name, directory)
    return Trackers(opened)
