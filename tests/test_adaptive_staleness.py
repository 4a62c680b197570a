"""`--staleness auto` end to end: the flag, and a real hub whose S follows the drift guard down while its status,
events and metrics say when and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from hub.cli.main import START_FLAGS, build_parser
from hub.config import HubConfig, LearnerConfig
from hub.method.drift import MIN_DRIFT_STEPS
from shared.config import load_config
from shared.staleness import StalenessReason
from testbed.harness import query, start_hub

# From S = 3 the drift's first reading comes MIN_DRIFT_STEPS steps in (S -> 2), the next MIN_DRIFT_STEPS steps later
# (S -> 1), and one more step trains at S = 1.
STEPS = 2 * MIN_DRIFT_STEPS + 1


def test_staleness_auto_flag_and_config():
    args = build_parser().parse_args(["start", "--staleness", "auto", "--staleness-max", "6"])
    overrides = {dotted: getattr(args, flag) for flag, (dotted, _) in START_FLAGS.items()}
    lc = load_config(HubConfig, None, overrides).learner
    assert (lc.staleness_auto, lc.staleness, lc.staleness_max, lc.effective_kappa, lc.staleness_bound) == (True, 1, 6, 1, 6)
    assert LearnerConfig(staleness=4).staleness_bound == 4
    with pytest.raises(ValidationError, match="leave kappa unset"):
        LearnerConfig(staleness="auto", kappa=2)
    with pytest.raises(ValidationError, match="staleness_max"):
        LearnerConfig(staleness_auto=True, staleness=5, staleness_max=4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["start", "--staleness", "often"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_auto_staleness_lowers_s_when_drift_nears_its_bound(tmp_path: Path):
    # Starting at S = 3 with a drift bound no stale rollout stays under: S falls one version per drift reading, to 1.
    config = tmp_path / "hub.toml"
    config.write_text("[learner]\nstaleness_auto = true\nstaleness = 3\nstaleness_max = 3\ndrift_max = 0.0001\n")
    data = tmp_path / "data"
    hub = start_hub(
        data, "--config", str(config), "--local-nodes", "2", "--steps", str(STEPS), "--prompts-per-step", "8", "--group-size", "4"
    )
    try:
        assert hub.process.wait(timeout=500) == 0, hub.output()[-3000:]
    finally:
        hub.kill()
    rows = [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]
    budgets = [int(r["staleness_budget"]) for r in rows]
    assert budgets[0] == 3 and budgets[-1] == 1, budgets
    assert budgets == sorted(budgets, reverse=True)
    assert all(r["abs_log_ratio"] >= 0 for r in rows)
    # No step trains on a group older than the window allows: the S in force, or the one it replaced for its grace.
    assert max(r["staleness_max"] for r in rows) <= 3
    status = hub.status()
    assert status is not None and (status.staleness, status.kappa) == (1, 1)
    assert [m.reason for m in status.staleness_moves] == [StalenessReason.START, StalenessReason.DRIFT, StalenessReason.DRIFT]
    assert [m.staleness for m in status.staleness_moves] == [3, 2, 1]
    events = [d for (d,) in query(data, "SELECT detail FROM events WHERE kind = 'staleness' ORDER BY id")]
    assert len(events) == 2 and all(StalenessReason.DRIFT.value in d for d in events), events
    assert events[0].startswith("S 3 -> 2, kappa 2 -> 1")


def test_resume_goes_on_at_the_s_in_force(tmp_path: Path):
    # A run under auto stepped at S = 3 (kappa 2) last: a LearnerComponent started on its data dir goes on at 3, within
    # the window of 3 (no grace left from the start's S), and a new data dir starts at 1.
    import torch
    import trio

    from hub.records.schema import StepRecord
    from hub.records.store import Store
    from hub.service.state import HubState
    from hub.training.loop import LearnerComponent
    from shared.crypto import Identity
    from shared.default_model import ensure_default_model
    from shared.model_identity import load_model_identity
    from shared.rollout import SamplingParams
    from shared.tasks.reverse import ReverseTask

    torch.set_num_threads(1)
    model = load_model_identity(ensure_default_model(progress=False))
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)

    def learner_on(data_dir: Path, staleness_max: int) -> LearnerComponent:
        cfg = LearnerConfig(staleness="auto", staleness_max=staleness_max, prompts_per_step=2, group_size=2)
        state = HubState(Store(data_dir / "hub.db"), HubConfig(learner=cfg, sampling=sampling), ReverseTask())
        send, _ = trio.open_memory_channel(1)
        return LearnerComponent(cfg, sampling, model, data_dir, state, Identity.generate(), send, 10, 1 << 20)

    fresh = learner_on(tmp_path / "fresh", 4)
    assert (fresh.staleness, fresh.kappa) == (1, 1)
    data = tmp_path / "resumed"
    data.mkdir()
    store = Store(data / "hub.db")
    for step, budget in ((1, 1), (2, 2), (3, 3)):
        record = StepRecord(step, step, 0.5, 0.5, 0.0, 0, 0, 0.1, 0.0, 0.0, 10, 0.0, staleness_budget=budget)
        store.training.commit_step(record, [])
    newest = store.training.latest_step_record()
    assert (newest.staleness_budget, newest.extra) == (3, {})
    store.close()
    resumed = learner_on(data, 4)
    assert (resumed.step, resumed.staleness, resumed.kappa, resumed.window_staleness()) == (3, 3, 2, 3)
    assert learner_on(data, 2).staleness == 2  # never past staleness_max


def test_status_and_dashboard_show_s_over_time_and_why():
    import io

    from rich.console import Console

    from hub.cli.status import render
    from shared.staleness import StalenessMove
    from tests.test_tui import hub_status
    from tui.hub_app import learner_text

    moves = (
        StalenessMove(step=0, staleness=1, kappa=1, reason=StalenessReason.START),
        StalenessMove(step=6, staleness=2, kappa=1, reason=StalenessReason.POOL_SHORT, drift=0.01),
        StalenessMove(step=9, staleness=1, kappa=1, reason=StalenessReason.DRIFT, drift=0.09),
    )
    status = hub_status().model_copy(update={"staleness_moves": moves, "staleness": 1, "kappa": 1})
    expected = "S=1 at step 0 (start), S=2 at step 6 (pool short of mu_min), S=1 at step 9 (drift near its bound)"
    out = io.StringIO()
    render(status, Console(file=out, width=200))
    assert expected in out.getvalue()
    assert "S=2 at step 6 (pool short of mu_min), S=1 at step 9 (drift near its bound)" in learner_text(status).plain
    assert "at step" not in learner_text(status.model_copy(update={"staleness_moves": moves[:1]})).plain
