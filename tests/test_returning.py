"""A user who comes back to a run: a finished run started again says there is nothing to do, changed
hyperparameters are listed and refused unless --resume-anyway, and final/ (like each checkpoint) holds the
run's config (echo2.toml) and a model card, which `echo-hub eval` reads for the run's task and sampling."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from hub.cli.eval import saved_run_config
from hub.config import HubConfig
from shared.config import load_config
from shared.layout import HUB_STORE_FILE, RUN_CONFIG_FILE
from tests.test_first_contact import ROOT, assert_one_line_mistake, run, snapshot_of

TASK = "testbed.tasks:EchoTask"  # not the default task: a reader of final/ that ignores the run's config scores another
# What identifies this run: every later start repeats it (eval on: the held-out split is part of the run).
RUN_ARGS = (
    "--task",
    TASK,
    "--eval-every",
    "2",
    "--eval-prompts",
    "8",
    "--max-new-tokens",
    "8",
    "--local-nodes",
    "1",
    "--listen",
    "/ip4/127.0.0.1/tcp/0",
    "--no-progress",
)


def start(data: Path, *args: str) -> subprocess.CompletedProcess:
    return run("hub.cli", "start", "--data-dir", str(data), *RUN_ARGS, *args, timeout_s=240)


# Each test starts real `echo-hub` runs on the tiny model.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The data dir of a run of 2 steps that finished."""
    data = tmp_path_factory.mktemp("returning") / "data"
    result = start(data, "--steps", "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return data


def test_a_finished_run_started_again_has_nothing_to_do_and_loads_no_model(finished: Path) -> None:
    before = snapshot_of(finished)
    code = (
        "import sys, hub.cli.main as m\n"
        f"code = m.main(['start', '--data-dir', {str(finished)!r}, *{list(RUN_ARGS)!r}, '--steps', '2',"
        " '--log-level', 'debug', '--bulk-port', '-1', '--checkpoints-kept', '3'])\n"  # harmless: never refused
        "assert 'torch' not in sys.modules, 'torch imported for a run with nothing to do'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "nothing to do: the run is at step 2; pass --steps M > 2" in out and "Traceback" not in out, out
    assert "resuming" not in out
    assert snapshot_of(finished) == before


def test_changed_hyperparameters_on_resume_are_listed_and_refused(finished: Path) -> None:
    before = snapshot_of(finished)
    line = assert_one_line_mistake(
        start(finished, "--steps", "4", "--lr", "3e-5", "--group-size", "4"),
        "on resume:",
        "lr 0.0003 -> 3e-05",
        "group_size 8 -> 4",
        "--resume-anyway",
        "--fresh",
    )
    assert "max_new_tokens" not in line and "steps" not in line.split("on resume:")[1].split(";")[0]
    assert snapshot_of(finished) == before


def test_resume_anyway_goes_on_with_the_new_settings(finished: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(finished, data)
    # The groups waiting were made 8 to a prompt: they cannot share a step with groups of 4.
    result = start(data, "--steps", "3", "--lr", "3e-5", "--group-size", "4", "--resume-anyway")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "resuming the run" in result.stdout and "lr 0.0003 -> 3e-05, group_size 8 -> 4" in result.stdout, result.stdout
    db = sqlite3.connect(data / HUB_STORE_FILE)
    try:
        assert db.execute("SELECT MAX(step) FROM steps").fetchone()[0] == 3
        resumed = [d for (d,) in db.execute("SELECT detail FROM events WHERE kind = 'learner_resume'")]
    finally:
        db.close()
    assert resumed and resumed[-1].endswith("steps lost as weights: 0"), resumed  # the finished run left a checkpoint
    assert load_config(HubConfig, data / "final" / "echo2.toml", {}).learner.lr == 3e-5
    # The new settings are the run's now: the same start again has nothing to do.
    again = start(data, "--steps", "3", "--lr", "3e-5", "--group-size", "4")
    assert again.returncode == 0 and "nothing to do: the run is at step 3" in again.stdout + again.stderr


def test_final_and_each_checkpoint_hold_the_run_config_and_a_model_card(finished: Path) -> None:
    asked = load_config(
        HubConfig,
        None,
        {
            "data_dir": finished,
            "task": TASK,
            "eval.every": 2,
            "eval.prompts": 8,
            "sampling.max_new_tokens": 8,
            "local_nodes": 1,
            "steps": 2,
            "listen": "/ip4/127.0.0.1/tcp/0",
        },
    )
    checkpoints = sorted((finished / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step-00000002"]
    for where in (finished / "final", checkpoints[-1]):
        # As asked (devices "auto", not this machine's resolution): the file starts the run on another machine.
        assert load_config(HubConfig, where / "echo2.toml", {}) == asked
        card = (where / "README.md").read_text()
        for field in ("base model", "task", TASK, "steps", "2", "rollout reward", "held-out reward"):
            assert field in card, (field, card)
    # `echo-hub eval --model` a checkpoint's model/ finds its run config one level up.
    assert saved_run_config(checkpoints[-1] / "model") == checkpoints[-1] / "echo2.toml"
    assert saved_run_config(finished / "final") == finished / "final" / "echo2.toml"
    metrics = [json.loads(line) for line in (finished / "metrics.jsonl").read_text().splitlines()]
    last_eval = [m for m in metrics if "eval_step" in m][-1]
    assert f"{last_eval['eval_reward']:.3f}" in (finished / "final" / "README.md").read_text()


def test_eval_of_a_final_policy_scores_the_run_task_by_default(finished: Path) -> None:
    result = run(
        "hub.cli", "eval", "--model", str(finished / "final"), "--eval-prompts", "4", "--device", "cpu", "--json", timeout_s=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "echo2.toml" in result.stderr and TASK in result.stderr and "max_new_tokens 8" in result.stderr, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["eval_prompts"] == 4


def test_the_run_card_names_the_runs_files_absolutely(tmp_path: Path, monkeypatch) -> None:
    """final/echo2.toml read from elsewhere (`echo-hub eval --model final`) still finds the task, reward and model."""
    from hub.cli.card import absolute_spec, run_card

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (work / "rewards.py").write_text("def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    monkeypatch.chdir(work)
    config = HubConfig.model_validate(
        {
            "task": "math:data/train.jsonl",
            "data_dir": "run",
            "dataset": {"reward": "math,rewards.py:score"},
            "eval": {"task": "data/train.jsonl"},
        }
    )
    saved = tmp_path / RUN_CONFIG_FILE
    saved.write_text(run_card(config, work, 0)[RUN_CONFIG_FILE])
    monkeypatch.chdir(tmp_path)
    loaded = load_config(HubConfig, saved, {})
    assert loaded.task == f"math:{work / 'data' / 'train.jsonl'}"
    assert loaded.eval.task == str(work / "data" / "train.jsonl")
    assert loaded.dataset.reward == f"math,{work / 'rewards.py'}:score"
    assert loaded.data_dir == work / "run"
    # Names that are no file here stay as they are.
    assert [absolute_spec(s) for s in ("reverse", "shared.tasks.reverse:ReverseTask", "math")] == [
        "reverse",
        "shared.tasks.reverse:ReverseTask",
        "math",
    ]
    # A package of the user's, here: made absolute it would not import.
    (tmp_path / "mytasks").mkdir()
    assert absolute_spec("mytasks:MyTask") == "mytasks:MyTask"
