"""The operator's reward is the operator's responsibility: it is called once per group (a task written per
completion still works), anything but one finite number per completion is a RewardError naming the function,
the start check finds it before the run, and a reward that fails mid-run stops the run with a checkpoint
without counting the failure against the node whose work it scored."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import trio

from hub.service.intake import HubBusy
from hub.training.tasks import check_reward
from shared.crypto import Identity
from shared.layout import CHECKPOINTS_DIR, HUB_LOG_FILE, HUB_STORE_FILE
from shared.messages import Tallies
from shared.tasks.base import Prompt, RewardError, Task, checked_rewards
from shared.tasks.reverse import ReverseTask
from testbed.tasks import LATE_FAILURE_GROUPS, NanRewardTask, OneRewardTask, RaisingRewardTask
from tests.test_state import CONFIG, answer, join_request, reopen

PROMPT = Prompt("p-0", "abc>", "cba")


class PerCompletion(Task):
    """A task written for the per-completion API: still accepted, scored one completion at a time."""

    def prompts(self) -> list[Prompt]:
        return [PROMPT]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion == prompt.answer else 0.0


class Counting(ReverseTask):
    def __init__(self) -> None:
        super().__init__(size=8)
        self.calls: list[int] = []

    def rewards(self, prompt, completions):
        self.calls.append(len(completions))
        return super().rewards(prompt, completions)


class Returns(ReverseTask):
    """Returns what the test puts in `out` (or raises it)."""

    out: object = None

    def rewards(self, prompt, completions):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


def test_a_group_is_scored_in_one_call_and_a_per_completion_task_still_works() -> None:
    task = Counting()
    assert checked_rewards(task, PROMPT, ["cba", "abc", " cba "]) == (1.0, 0.0, 1.0)
    assert task.calls == [3]
    assert task.reward(PROMPT, "cba") == 1.0  # one completion: a group of one
    assert task.reward_name == f"{__name__}:Counting.rewards"
    old = PerCompletion()
    assert checked_rewards(old, PROMPT, ["cba", "x"]) == (1.0, 0.0)
    assert old.reward_name == f"{__name__}:PerCompletion.reward"
    with pytest.raises(TypeError, match="abstract"):
        type("NoReward", (Task,), {"prompts": lambda self: []})()


NAME = f"{__name__}:Returns.rewards"


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (KeyError("answer"), f"reward {NAME} raised KeyError: 'answer' (prompt p-0); fix the reward function"),
        ([1.0, float("nan")], f"reward {NAME} returned nan for completion 2 of 2; rewards must be finite numbers (prompt p-0)"),
        ([float("inf"), 0.0], f"reward {NAME} returned inf for completion 1 of 2; rewards must be finite numbers"),
        (["1.0", 0.0], f"reward {NAME} returned '1.0' (str) for completion 1 of 2; rewards must be numbers"),
        ([None, 0.0], f"reward {NAME} returned None (NoneType) for completion 1 of 2"),
        ([1.0], f"reward {NAME} returned 1 value for 2 completions; it must return one number per completion"),
        (0.5, f"reward {NAME} returned 0.5 (float); it must return a list of one number per completion"),
        (np.float64(0.5), f"reward {NAME} returned np.float64(0.5) (float64); it must return a list"),
    ],
)
def test_every_bad_reward_is_one_line_naming_the_function(out, message) -> None:
    task = Returns()
    task.out = out
    with pytest.raises(RewardError) as raised:
        checked_rewards(task, PROMPT, ["a", "b"])
    text = str(raised.value)
    assert "\n" not in text and text.startswith(message.split(" (prompt")[0]), text


def test_numpy_rewards_and_bools_are_numbers() -> None:
    task = Returns()
    task.out = np.array([0.25, 1.0])
    assert checked_rewards(task, PROMPT, ["a", "b"]) == (0.25, 1.0)
    task.out = [True, False]
    assert checked_rewards(task, PROMPT, ["a", "b"]) == (1.0, 0.0)


def test_the_start_check_calls_the_reward_as_a_run_does() -> None:
    task = Counting()
    check_reward(task, group_size=4)
    assert task.calls == [4, 4, 4]  # a few prompts, one call per group
    check_reward(task, group_size=1)
    assert task.calls[-1] == 2  # a group of one cannot tell one value per group from one per completion
    for bad, words in (
        (RaisingRewardTask(), "raised KeyError"),
        (NanRewardTask(), "returned nan"),
        (OneRewardTask(), "returned 1 value for 4 completions"),
    ):
        with pytest.raises(RewardError, match=words):
            check_reward(bad, group_size=4)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.trio
async def test_a_reward_failure_is_never_the_nodes_fault_and_stops_the_run(
    tmp_path, default_model_dir, tokenizer, caplog
) -> None:
    config = CONFIG.model_copy(update={"task": "testbed.tasks:RaisingRewardTask"})
    state = reopen(tmp_path, default_model_dir, config)
    node = Identity.generate().peer_id
    await state.membership.join(node, join_request(state), "10.0.0.1")
    caplog.set_level(logging.ERROR)
    grant = await state.leasing.grant(node, 0)
    for n in range(3):  # the lease stays open: the node may answer it again
        with pytest.raises(HubBusy, match="the task's reward failed"):
            await state.intake.accept(node, answer(tokenizer, grant.lease, node), f"h{n}")
    assert state.fleet.get(node).tallies == Tallies() and state.totals.groups == Tallies()
    assert "raised KeyError" in str(state.intake.reward_failure)
    assert sum(r.exc_info is not None for r in caplog.records) == 1  # the traceback once, not per group
    # The state's own task ends the run with it.
    with pytest.raises(BaseException) as stopped:  # noqa: PT011 -- trio wraps it in an exception group
        with trio.fail_after(10):
            await state.run()
    found = stopped.value
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    assert isinstance(found, RewardError)
    state.store.close()
    db = sqlite3.connect(tmp_path / HUB_STORE_FILE)
    assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 0
    db.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_that_fails_mid_run_stops_it_with_a_checkpoint_and_blames_no_node(tmp_path: Path) -> None:
    from testbed.harness import start_hub

    data = tmp_path / "data"
    hub = start_hub(
        data,
        "--local-nodes",
        "1",
        "--task",
        "testbed.tasks:LateFailingTask",
        "--steps",
        "200",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
    )
    try:
        code = hub.process.wait(timeout=240)
    finally:
        hub.kill()
    output = hub.output()
    assert code == 1, output[-3000:]
    lines = [ln for ln in output.splitlines() if "reward testbed.tasks:LateFailingTask.rewards raised ValueError" in ln]
    assert len(lines) == 1 and "the run stopped at step" in lines[0] and "checkpoint" in lines[0], output[-3000:]
    assert "Traceback" not in output
    assert any((data / CHECKPOINTS_DIR).iterdir())
    log = (data / HUB_LOG_FILE).read_text()
    assert log.count("Traceback") == 1, log[-3000:]
    status = hub.status()
    assert status is not None and not status.running
    assert all(n.tallies.rejected == 0 for n in status.nodes) and status.totals.rejected == 0
    assert status.totals.accepted <= LATE_FAILURE_GROUPS


@pytest.mark.trio
async def test_the_probe_blames_the_node_while_the_reward_passes_it_and_stops_the_run_once_it_fails(autojump_clock):
    """A failure on a node's text is the node's while the reward passes the operator's own probe; a passed probe
    stands PROBE_VALID_S (nodes cannot make the hub probe on every submission); a failed one is a RewardError."""
    from hub.trust.checkpool import PROBE_VALID_S, RewardProbe

    calls, problem = [], [None]

    async def probe() -> str | None:
        calls.append(trio.current_time())
        return problem[0]

    gate = RewardProbe(probe)
    await gate.blame("node", "the reward raised")
    await gate.blame("node", "the reward raised")
    assert len(calls) == 1
    problem[0] = "reward x raised KeyError (prompt p); fix the reward function"
    await gate.blame("other", "the reward raised")  # the passed probe still stands
    with trio.move_on_after(PROBE_VALID_S):
        await trio.sleep_forever()
    with pytest.raises(RewardError, match="raised KeyError"):
        await gate.blame("node", "the reward raised")
    assert len(calls) == 2


@pytest.mark.trio
async def test_nodes_cannot_stop_the_run_with_text_the_reward_chokes_on_and_are_charged_for_it(
    tmp_path, default_model_dir, tokenizer
) -> None:
    """Round four: three nodes on probation sending text the reward raised on stopped the run. Now however
    many nodes do, their groups are rejected and counted against them, and honest work is still taken."""
    from hub.trust.submissions import REASON_REWARD_FAILED
    from testbed.poisoned_tasks import POISON
    from tests.test_checkpool import answer as answer_with

    # Vouched nodes (no audits), whose failures stopped the run at once: on probation or not, the probe decides.
    config = CONFIG.model_copy(update={"task": "testbed.poisoned_tasks:ChokingRewardTask"})
    state = reopen(tmp_path, default_model_dir, config)
    for n in range(5):
        node = Identity.generate().peer_id
        await state.membership.join(node, join_request(state), f"10.0.0.{n + 1}")
        grant = await state.leasing.grant(node, 0)
        poisoned = answer_with(tokenizer, grant.lease, node, texts_of=lambda _p: (POISON, "x"))
        outcome = await state.intake.accept(node, poisoned, f"h{n}")
        groups = len(grant.lease.prompts)
        assert outcome.accepted == 0 and outcome.rejected == tuple((p.id, REASON_REWARD_FAILED) for p in grant.lease.prompts)
        assert state.fleet.get(node).tallies == Tallies(rejected=groups) and state.intake.reward_failure is None
    honest = Identity.generate().peer_id
    await state.membership.join(honest, join_request(state), "10.0.1.1")
    grant = await state.leasing.grant(honest, 0)
    outcome = await state.intake.accept(honest, answer(tokenizer, grant.lease, honest), "honest")
    assert outcome.accepted == len(grant.lease.prompts) and state.intake.reward_failure is None
    state.store.close()
    db = sqlite3.connect(tmp_path / HUB_STORE_FILE)
    assert db.execute("SELECT COUNT(*) FROM events WHERE kind = 'reward_charged'").fetchone()[0] == 5
    db.close()


def test_a_subclass_that_overrides_reward_only_is_scored_by_its_own_reward():
    class Halves(ReverseTask):
        def reward(self, prompt: Prompt, completion: str) -> float:
            return 0.5

    prompt = Halves().prompts()[0]
    assert list(checked_rewards(Halves(), prompt, ["a", "b"])) == [0.5, 0.5]
    assert Halves().reward_name.endswith("Halves.reward")
