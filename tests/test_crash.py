"""SIGKILL the learner mid-run, restart it, and check that no acknowledged trajectory is lost; SIGKILL a real hub,
restart it, and check that it names the steps the crash lost and that metrics mark the gap."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub.cli.report import write_report
from hub.records.store import Store
from hub.training.checkpoint import latest_checkpoint, list_checkpoints
from hub.training.metrics import read_lost, read_metrics
from shared.layout import HUB_STORE_FILE, METRICS_FILE
from testbed.harness import free_port, query, start_hub, wait_until

HELPER = Path(__file__).resolve().parents[1] / "testbed" / "crash_hub.py"
REPO_ROOT = HELPER.parent.parent
FIRST_RUN_MIN_STEPS = 3
TOTAL_STEPS = 9
STARTUP_TIMEOUT_S = 120.0


def start(data_dir: Path, steps: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(HELPER), str(data_dir), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.mark.slow
def test_sigkill_mid_run_loses_no_acknowledged_trajectory(tmp_path):
    rng = random.Random()
    proc = start(tmp_path, TOTAL_STEPS + 100)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("STEP ") and int(line.split()[1]) >= FIRST_RUN_MIN_STEPS:
                break
            assert time.monotonic() < deadline, "".join(output[-20:])
        else:
            pytest.fail("helper exited early:\n" + "".join(output[-30:]))
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # What was committed at the moment of the kill (opening the store replays the WAL).
    store = Store(tmp_path / HUB_STORE_FILE)
    assert store.integrity_check() == "ok"
    rows = store.groups.trajectories()
    pending = {r.id for r in rows if r.verdict == "accepted" and r.consumed_step is None and r.discard_reason is None}
    killed_at_step = store.training.latest_step()
    versions_before = [s.version for s in store.shelf.snapshots()]
    store.close()
    assert killed_at_step >= FIRST_RUN_MIN_STEPS

    second = start(tmp_path, TOTAL_STEPS + killed_at_step)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    refill = json.loads((tmp_path / f"refill-{second.pid}.json").read_text())

    store = Store(tmp_path / HUB_STORE_FILE)
    assert store.integrity_check() == "ok"
    after = {r.id: r for r in store.groups.trajectories()}
    # Every accepted, untrained row was put back into the buffer, or refused by it with a
    # recorded reason (a crash between the row's commit and its buffer admission).
    back = set(refill)
    refused = {i for i in pending - back if after[i].discard_reason is not None}
    assert pending == back | refused, (sorted(pending), sorted(back))
    assert all(after[i].discard_reason == "zero reward variance" for i in refused)
    # Rows pending at the kill can only be trained on by steps after it.
    assert all(after[i].consumed_step is None or after[i].consumed_step > killed_at_step for i in pending)
    steps = [s.step for s in store.training.steps()]
    assert steps == list(range(1, TOTAL_STEPS + killed_at_step + 1))
    versions = [s.version for s in store.shelf.snapshots()]
    assert versions[: len(versions_before)] == versions_before
    assert versions == sorted(set(versions)) and versions[-1] > versions_before[-1]
    published = sorted(store.shelf.snapshots(), key=lambda s: s.published_at)
    assert [s.version for s in published] == versions
    metrics = read_metrics(tmp_path / METRICS_FILE)
    assert [m["step"] for m in metrics] == sorted({m["step"] for m in metrics})
    assert (tmp_path / "final" / "config.json").exists()
    print(
        f"\nkilled after step {killed_at_step}; {len(pending)} pending rows, {len(back)} back in the buffer, "
        f"{len(refused)} refused on refill; snapshot versions {versions}"
    )


HUB_ARGS = ("--local-nodes", "1", "--steps", "0", "--prompts-per-step", "4", "--group-size", "4")


def latest_step(data_dir: Path) -> int:
    return query(data_dir, "SELECT COALESCE(MAX(step), 0) FROM steps")[0][0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_hub_names_the_steps_it_lost_and_metrics_mark_the_gap(tmp_path):
    """A real hub checkpoints by time (--checkpoint-every-s) long before its step count is due. Killed, restarted
    without time-due checkpoints, killed again after two more steps: the third start names, in its terminal, on its
    progress line and in its status, the steps since the newest checkpoint, and metrics.jsonl and the report mark them."""
    data, port = tmp_path / "data", free_port()
    hub = start_hub(data, *HUB_ARGS, "--checkpoint-every", "1000", "--checkpoint-every-s", "1", port=port)
    try:
        wait_until(lambda: list_checkpoints(data / "checkpoints"), 240, "a checkpoint due by time")
    finally:
        hub.kill()
    assert latest_checkpoint(data / "checkpoints").step < 1000
    assert re.search(r"checkpoint of step \d+ in \d+\.\d+s", (data / "hub.log").read_text())
    killed_at = latest_step(data)

    # Steps but no checkpoint: the second start resumes the newest one, trains past the first kill, and is killed.
    hub = start_hub(data, *HUB_ARGS, "--checkpoint-every", "1000", "--checkpoint-every-s", "3600", port=port)
    try:
        wait_until(lambda: latest_step(data) >= killed_at + 2, 240, "two steps past the first kill")
    finally:
        hub.kill()
    checkpoint, last = latest_checkpoint(data / "checkpoints").step, latest_step(data)
    lost = f"steps {killed_at + 1}-{last} lost in a crash"

    hub = start_hub(data, *HUB_ARGS, "--checkpoint-every", "1000", port=port)
    try:
        out = hub.output()
        assert f"at step {last} from the checkpoint of step {checkpoint} " in out, out[-3000:]
        assert f"echo-hub: warning: {lost}" in out and f"its next step is {last + 1}" in out, out[-3000:]
        # The plain progress line ends with it, and the status the dashboard reads carries it.
        shown = lambda: re.findall(r"step \d+/∞ .* \| warning: (\w+) \(", hub.output())  # noqa: E731
        wait_until(shown, 240, "a progress line with a warning")
        status = wait_until(lambda: (s := hub.status()) and s.warnings and s, 30, "a status with the warning")
        said = [w for w in status.warnings if w.kind == "steps_lost"]
        assert len(said) == 1 and said[0].detail.startswith(lost)
        # The line ends with the newest warning: this one, or one that came after it (on a busy machine the learner's
        # wait may grow enough to warn before the first plain line).
        assert shown()[0] in {w.kind for w in status.warnings if w.at >= said[0].at}, hub.output()[-3000:]
    finally:
        hub.stop()
    assert read_lost(data / METRICS_FILE)[-1] == (killed_at + 1, last)
    assert write_report(data).exists()
