"""Each experiment tracker writes real files offline, from the rows the hub's metrics writer hands it:
TensorBoard event files, a W&B offline run directory, a trackio local store. Each test is skipped, with the
reason, where its package is missing; a missing package named in --report-to is a one-line mistake."""

from __future__ import annotations

import importlib.util
import sqlite3
import time
from pathlib import Path

import pytest

from hub.config import TrackingConfig
from hub.training.metrics import MetricsWriter
from hub.training.trackers import missing_tracker_packages, open_trackers
from shared.layout import METRICS_FILE

ROWS = [
    {"step": 1, "reward_mean": 0.25, "loss": 0.5},
    {"step": 2, "reward_mean": 0.5, "loss": 0.25},
    {"eval_step": 2, "eval_reward": 0.75, "eval_pass_at_k": 1.0, "eval_k": 4},
]
CONFIG = {"steps": 2, "learner": {"lr": 3e-4}}


def needs(module: str) -> None:
    # Not importorskip: importing trackio here would fix its directory before the tracker sets it.
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (it comes with the dev and track extras: pip install 'echo2[track]')")


def log_rows(tmp_path: Path, tracker: str, run_name: str = "t") -> Path:
    data = tmp_path / "data"
    trackers = open_trackers(TrackingConfig(report_to=(tracker,), run_name=run_name), data, CONFIG)
    writer = MetricsWriter(data / METRICS_FILE, trackers)
    for row in ROWS:
        writer.append_row(row)
    trackers.close()
    return data


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in directory.iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_run_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("offline-run-*/run-*.wandb"))


def trackio_metrics(directory: Path, project: str, run_name: str | None = None) -> set[str]:
    db = sqlite3.connect(directory / f"{project}.db")
    try:
        rows = [r[0] for r in db.execute("SELECT metrics FROM metrics WHERE ? IS NULL OR run_name = ?", (run_name, run_name))]
    finally:
        db.close()
    import json

    return {key for row in rows for key in json.loads(row)}


def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    needs("tensorboard")
    scalars = tensorboard_scalars(log_rows(tmp_path, "tensorboard") / "tensorboard")
    assert scalars["train/reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["eval/eval_reward"] == [(2, 0.75)] and "train/step" not in scalars


def test_wandb_writes_an_offline_run(tmp_path: Path, monkeypatch) -> None:
    needs("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    data = log_rows(tmp_path, "wandb")
    (run_file,) = wandb_run_files(data / "wandb")
    # The run file is wandb's own record log (protobuf); no reader ships with wandb, so look for the
    # logged keys and values in its bytes.
    raw = run_file.read_bytes()
    for needle in (b"train/reward_mean", b"eval/eval_reward", b"eval_step", b"0.75", b'"lr"'):
        assert needle in raw, needle


def test_trackio_writes_a_local_store(tmp_path: Path) -> None:
    needs("trackio")
    run_name = f"t{time.time_ns()}"
    log_rows(tmp_path, "trackio", run_name)
    import trackio.utils

    # trackio fixes its directory at its first import: another test of this process may have chosen it (our run's
    # rows are told apart by its name).
    assert {"train/reward_mean", "eval/eval_reward"} <= trackio_metrics(trackio.utils.TRACKIO_DIR, "echo2", run_name)


def test_a_missing_tracker_package_is_named_with_the_extra(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_tracker_packages(TrackingConfig(report_to=("none", "wandb"))) == ["wandb"]
    assert missing_tracker_packages(TrackingConfig(report_to=("none",))) == []
