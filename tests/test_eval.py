"""Held-out evaluation: pass@k by hand, a split that never trains on an eval prompt, the evaluator on the real
model, and a default run that evaluates every 10 steps while it trains (`echo-hub start`, `echo-hub eval`)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
import trio

from hub.config import EvalConfig
from hub.training.evaluation import Evaluator, pass_at_k, summarize
from hub.training.metrics import read_evals, read_metrics
from shared.layout import HUB_STORE_FILE, METRICS_FILE
from shared.messages import HubStatus
from shared.model_identity import load_model_identity
from shared.rollout import SamplingParams
from shared.tasks.base import Prompt, Task
from shared.tasks.reverse import ReverseTask
from shared.tasks.split import excluding, is_held_out, split_task
from testbed.harness import start_hub
from tests.test_first_contact import assert_one_line_mistake, run, snapshot_of


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_summary_of_rewards_by_hand() -> None:
    row = summarize(7, [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.0]], success_reward=1.0, seconds=2.0)
    assert row.step == 7 and row.k == 2 and row.prompts == 4 and row.seconds == 2.0
    assert row.reward == pytest.approx(3.5 / 8)
    assert row.pass_at_1 == pytest.approx((0.5 + 0 + 1 + 0) / 4)
    assert row.pass_at_k == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert summarize(1, [[0.5]], success_reward=0.5, seconds=0).pass_at_1 == 1.0
    with pytest.raises(ValueError):
        summarize(1, [[1.0], [1.0, 0.0]], 1.0, 0)


class Repeated(Task):
    """Prompt texts repeated under different ids: a split must keep each text on one side."""

    def prompts(self) -> list[Prompt]:
        return [Prompt(id=f"p{i}", text=f"text {i % 50}") for i in range(400)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 0.0


def test_split_is_by_text_deterministic_and_disjoint() -> None:
    train, held = split_task(ReverseTask(), 0.1)
    train_texts, held_texts = {p.text for p in train.prompts()}, {p.text for p in held.prompts()}
    assert not train_texts & held_texts and len(train_texts) + len(held_texts) == len(ReverseTask().prompts())
    assert 0.07 < len(held_texts) / (len(train_texts) + len(held_texts)) < 0.13
    assert [p.id for p in split_task(ReverseTask(), 0.1)[1].prompts()] == [p.id for p in held.prompts()]
    assert all(is_held_out(t, 0.1) for t in held_texts) and not any(is_held_out(t, 0.1) for t in train_texts)
    train, held = split_task(Repeated(), 0.2)
    assert not {p.text for p in train.prompts()} & {p.text for p in held.prompts()}
    assert len(held.prompts()) % 8 == 0  # each held-out text brings all 8 of its copies
    with pytest.raises(KeyError):
        train.get(held.prompts()[0].id)  # a held-out prompt can never be leased for training
    with pytest.raises(ValueError, match="leaves none to evaluate on"):
        split_task(ReverseTask(size=3), 1e-6)
    eval_only = excluding(Repeated(), split_task(Repeated(), 0.5)[0])
    assert {p.text for p in eval_only.prompts()} == {p.text for p in split_task(Repeated(), 0.5)[1].prompts()}


def test_evaluator_on_the_real_model_greedy_and_sampled(default_model_dir: Path) -> None:
    import torch

    _, held = split_task(ReverseTask(), 0.05)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10)
    model = load_model_identity(default_model_dir)
    greedy = Evaluator(model, held, EvalConfig(every=1, prompts=32, temperature=0.0), sampling, "float32", "cpu", seed=0)
    first, again = greedy.evaluate(1), greedy.evaluate(2)
    assert first.prompts == 32 and first.k == 1 and first.reward == again.reward  # greedy: deterministic
    assert 0.0 < first.reward <= 1.0  # the warmed-up default model solves some held-out words
    sampled = Evaluator(model, held, EvalConfig(every=1, prompts=32, samples=4), sampling, "float32", "cpu", seed=0)
    row = sampled.evaluate(3)
    assert row.k == 4 and row.pass_at_1 <= row.pass_at_k and row.pass_at_1 == pytest.approx(row.reward)
    # Weights copied in from a (here: zeroed) learner state are what it evaluates.
    state = {k: torch.zeros_like(v) for k, v in greedy.model.state_dict().items()}
    greedy.load_weights(state)
    assert greedy.evaluate(4).reward == 0.0


def test_eval_mistakes_are_one_line(tmp_path: Path) -> None:
    before = snapshot_of(tmp_path)
    data = str(tmp_path / "data")
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--eval-every", "5", "--eval-split", "1e-9"),
        "--eval-split",
        "leaves none to evaluate on",
    )
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--eval-every", "5", "--eval-samples", "4", "--eval-temperature", "0"),
        "eval",
        "greedy",
    )
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--eval-every", "5", "--eval-task", "nosuch.jsonl"),
        "--eval-task",
        "no such file",
    )
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--report-to", "tensorbored"), "tracking.report_to", "tensorboard"
    )
    assert_one_line_mistake(run("hub.cli", "eval", "--model", str(tmp_path / "none")), "--model", "no such directory")
    assert snapshot_of(tmp_path) == before


def test_eval_of_a_users_model_without_a_run_config_samples_as_trl_would(tmp_path: Path, default_model_dir: Path) -> None:
    """A policy directory with no echo2.toml beside it, not the embedded default: TRL's max_completion_length, said
    in one line (the embedded default's own directory is no user's model: tests/test_flags.py)."""
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(default_model_dir, mine)
    result = run("hub.cli", "eval", "--model", str(mine), "--eval-prompts", "2", "--device", "cpu", "--json", timeout_s=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "echo-hub eval: your own model: TRL's defaults --max-new-tokens 512 (" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_default_run_evaluates_held_out_prompts_every_10_steps(tmp_path: Path) -> None:
    """30 steps with --eval-every 10: three eval rows, none of their prompts ever trained on, the last beating
    the first; the status, summary, report and trackers all carry them; `echo-hub eval` scores the final policy."""
    data = tmp_path / "data"
    trackers = [t for t in ("tensorboard", "wandb", "trackio") if _installed(t)]
    # Held-out reward of a default run here: 0.235, 0.305, 0.36 at steps 10, 20, 30 (0.465 at 60).
    hub = start_hub(
        data,
        "--steps",
        "30",
        "--eval-every",
        "10",
        "--eval-prompts",
        "200",
        *(["--report-to", ",".join(trackers)] if trackers else []),
    )
    try:
        assert hub.process.wait(timeout=500) == 0, hub.output()[-3000:]
    finally:
        hub.kill()
    evals = read_evals(data / METRICS_FILE)
    assert [e["eval_step"] for e in evals] == [10, 20, 30], evals
    assert all(e["eval_prompts"] == 200 for e in evals)
    assert evals[-1]["eval_reward"] > evals[0]["eval_reward"], evals
    assert [r["step"] for r in read_metrics(data / METRICS_FILE)] == list(range(1, 31))
    # Every prompt trained on is from the training side of the split; the eval prompts are all held out.
    db = sqlite3.connect(data / HUB_STORE_FILE)
    leased = {pid for (pid,) in db.execute("SELECT DISTINCT prompt_id FROM trajectories WHERE verdict = 'accepted'")}
    db.close()
    task = ReverseTask()
    assert len(leased) > 100 and not any(is_held_out(task.get(pid).text, 0.05) for pid in leased)
    status = HubStatus.model_validate_json((data / "status.json").read_text())
    assert [e.step for e in status.evals] == [10, 20, 30]
    assert "held-out reward (step 10 -> 30)" in hub.output()
    shown = run("hub.cli", "status", "--data-dir", str(data))
    assert shown.returncode == 0 and "held-out" in shown.stdout and "at step 30 (200 prompts)" in shown.stdout
    assert run("hub.cli", "report", "--data-dir", str(data)).returncode == 0
    _check_trackers(data, trackers)
    result = run("hub.cli", "eval", "--model", str(data / "final"), "--eval-prompts", "200", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    alone = json.loads(result.stdout.strip().splitlines()[-1])
    assert alone["eval_prompts"] == 200 and abs(alone["eval_reward"] - evals[-1]["eval_reward"]) < 0.15


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _check_trackers(data: Path, trackers: list[str]) -> None:
    from tests.test_trackers import tensorboard_scalars, trackio_metrics, wandb_run_files

    if "tensorboard" in trackers:
        scalars = tensorboard_scalars(data / "tensorboard")
        assert [step for step, _ in scalars["eval/eval_reward"]] == [10, 20, 30]
        assert len(scalars["train/reward_mean"]) == 30
    if "wandb" in trackers:
        assert wandb_run_files(data / "wandb")
    if "trackio" in trackers:
        metrics = trackio_metrics(data / "trackio", "echo2")
        assert "eval/eval_reward" in metrics and "train/reward_mean" in metrics


class ScriptedEvaluator:
    """Stands in for Evaluator in the runner's unit tests: each evaluate() does what the script says."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.loaded = 0

    def load_weights(self, state) -> None:
        self.loaded += 1

    def evaluate(self, step: int, stop=None):
        what = self.script.pop(0)
        if what == "raise":
            raise ValueError("the reward function broke")
        if what == "slow":
            while not stop.is_set():
                time.sleep(0.01)
            return None
        return summarize(step, [[1.0], [0.0]], 1.0, 0.01)


async def run_runner(evaluator, body):
    from hub.training.evaluation import EvalRunner

    recorded, events = [], []

    async def record(row):
        recorded.append(row.step)

    async def event(kind, node, detail):
        events.append(kind)

    runner = EvalRunner(evaluator, 10, record, event)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await body(runner, nursery)
        nursery.cancel_scope.cancel()
    return runner, recorded, events


@pytest.mark.trio
async def test_a_failed_evaluation_is_an_event_and_the_final_step_is_evaluated_once() -> None:
    async def body(runner, nursery):
        await runner.start(10, dict)  # raises inside: an event, not a crash
        await runner.drain()
        await runner.start(20, dict)
        await runner.drain()
        await runner.finish(20, dict)  # already evaluated: not again
        await runner.finish(25, dict)  # a final step that was not due: evaluated

    runner, recorded, events = await run_runner(ScriptedEvaluator("raise", "ok", "ok"), body)
    assert events == ["eval_failed"] and recorded == [20, 25] and runner.running is None


@pytest.mark.trio
async def test_cancelling_the_hub_stops_an_evaluation_at_its_next_batch() -> None:
    evaluator = ScriptedEvaluator("slow")

    async def body(runner, nursery):
        await runner.start(10, dict)
        await trio.sleep(0.05)

    with trio.fail_after(5):  # without the stop flag the thread would run forever
        runner, recorded, events = await run_runner(evaluator, body)
    assert recorded == [] and events == []
