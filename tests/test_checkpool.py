"""Submission checks in worker processes and in threads (hub/trust/checkpool.py), against a real HubState, store,
tokenizer and spawned workers: a killed worker loses no submission (nor is one accepted unchecked), a reward that
hangs on everything stops the run with one line naming it, one that a node's text makes slow or hang is charged to
that node and never delays another node, the copy detector still catches a copy whose two halves were checked by
different workers, and a real hub with --check-procs 2 trains."""

from __future__ import annotations

import logging
import os
import pickle
import signal
from pathlib import Path

import pytest
import trio

from hub.service.intake import HubBusy
from hub.service.state import HubState
from hub.trust.checkpool import CheckPool, NodeShares, ThreadChecks, dump_answer, load_answer, resolved_check_procs
from hub.trust.submissions import REASON_OVER_BUDGET, GroupVerdict
from shared.crypto import Identity
from shared.messages import Submission, SubmittedGroup, Tallies
from shared.rollout import Completion, Group
from shared.tasks.base import RewardError
from testbed.poisoned_tasks import POISON
from tests.test_state import CONFIG, join_request, reopen, running, tokenizer  # noqa: F401 -- a fixture

# Far below any honest sampler's odds: two identical such groups are a copy, whichever prompt they answer.
COPY_LOGPROB = -3.0


def pool_config(procs: int, task: str = "reverse", timeout_s: float = 20.0, budget_s: float = 1.0):
    trust = CONFIG.trust.model_copy(update={"check_procs": procs, "check_timeout_s": timeout_s, "reward_budget_s": budget_s})
    return CONFIG.model_copy(update={"task": task, "trust": trust})


def answer(tok, lease, node_id: str, texts_of=None) -> Submission:
    """Right answers to every prompt of the lease (or `texts_of(prompt)`), each token at COPY_LOGPROB."""
    groups = []
    for p in lease.prompts:
        word = p.text[:-1]
        completions = []
        for text in texts_of(p) if texts_of else (word[::-1], word):
            ids = (*tok.encode(text), tok.eos_token_id)
            completions.append(
                Completion(token_ids=ids, logprobs=(COPY_LOGPROB,) * len(ids), finish_reason="stop", version=0, text=text)
            )
        groups.append(SubmittedGroup(prompt_id=p.id, completions=tuple(completions)))
    return Submission(lease_id=lease.lease_id, node_id=node_id, groups=tuple(groups))


async def ready(state: HubState, procs: int) -> CheckPool:
    """The state's pool once all its workers are idle."""
    pool = state.intake.checks
    assert isinstance(pool, CheckPool)
    with trio.fail_after(120):
        while pool._idle.statistics().current_buffer_used < procs:
            await trio.sleep(0.05)
    return pool


async def joined(state: HubState, n: int = 0):
    node = Identity.generate().peer_id
    await state.membership.join(node, join_request(state), f"10.0.0.{n + 1}")
    return node, (await state.leasing.grant(node, 0)).lease


def test_a_workers_answer_refers_to_the_hubs_own_submission_instead_of_copying_it_back():
    node = Identity.generate().peer_id
    completion = Completion(token_ids=tuple(range(2, 1002)), logprobs=(-0.5,) * 1000, finish_reason="length", version=3, text="")
    submission = Submission(lease_id="a" * 24, node_id=node, groups=(SubmittedGroup(prompt_id="p", completions=(completion,)),))
    in_worker = pickle.loads(pickle.dumps(submission))
    (submitted,) = in_worker.groups
    checked = submitted.completions[0].model_copy(update={"text": "words"})  # as _score re-decodes it
    group = Group(prompt_id="p", prompt_text="prompt", version=3, completions=(checked,), rewards=(1.0,), node_id=node)
    answer = ("ok", [GroupVerdict("p", True, "", submitted, group)])
    data = dump_answer(answer, in_worker)
    assert len(data) * 10 < len(pickle.dumps(answer))
    loaded = load_answer(data, submission)
    assert loaded == answer and loaded[1][0].submitted is submission.groups[0]
    assert loaded[1][0].group.completions[0].token_ids is completion.token_ids


def test_the_default_leaves_the_trio_process_a_core_and_checks_a_light_reward_in_its_thread():
    assert resolved_check_procs(None, light_reward=False) == max(1, len(os.sched_getaffinity(0)) - 1)
    assert resolved_check_procs(None, light_reward=True) == 0
    assert resolved_check_procs(0, light_reward=False) == 0 and resolved_check_procs(3, light_reward=True) == 3
    # The embedded default's reverse task is light, also as the training part of its split; math is not.
    from shared.tasks.dataset import MathTask
    from shared.tasks.reverse import ReverseTask
    from shared.tasks.split import split_task

    assert ReverseTask().light_reward and split_task(ReverseTask(), 0.1)[0].light_reward
    assert not MathTask.light_reward


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_check_worker_ignores_ctrl_c_mid_job(tmp_path, default_model_dir, tokenizer):
    """The terminal's Ctrl-C reaches the whole process group: a worker must not die printing `Process echo2-check:`
    and a traceback; it finishes its job, and the hub stops it."""
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.tasks:SlowRewardTask"))
    async with running(state):
        pool = await ready(state, 1)
        node, lease = await joined(state)
        (first,) = pool._workers
        outcome = None

        async def submit() -> None:
            nonlocal outcome
            outcome = await state.intake.accept(node, answer(tokenizer, lease, node), "h")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            await trio.sleep(0.5)  # its check is in the worker now: each group's reward takes a second
            os.kill(first.process.pid, signal.SIGINT)
        assert outcome.accepted == len(lease.prompts)
        assert set(pool._workers) == {first} and first.process.is_alive()
    state.store.close()


@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_clean_stop_under_a_running_check_logs_no_dead_worker(tmp_path, default_model_dir, tokenizer, caplog):
    """Ctrl-C of a hub with a user reward: the pool kills its workers on the way out while a check runs in one (the
    submission's handler belongs to the libp2p host, which outlives the pool). That is a clean stop: no "a check worker
    died" line, no error; the node is told the hub is stopping."""
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.tasks:SlowRewardTask"))
    node, lease = await joined(state)
    with trio.fail_after(60):  # a check that outlived its pool would wait for a worker for good
        async with trio.open_nursery() as handlers:  # the host's handlers: outside the state's nursery
            async with running(state):
                pool = await ready(state, 1)
                refused: list[HubBusy] = []

                async def submit() -> None:
                    with pytest.raises(HubBusy) as caught:
                        await state.intake.accept(node, answer(tokenizer, lease, node), "h")
                    refused.append(caught.value)

                handlers.start_soon(submit)
                while pool._idle.statistics().current_buffer_used:  # its check took the one worker: it runs now
                    await trio.sleep(0.05)
            # The state's nursery is closed: the pool killed its worker under the check.
    (stopped,) = refused
    assert str(stopped) == "the hub is stopping: send the answer again once it is back"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [line for line in said if "died" in line or "lost" in line], said
    state.store.close()


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_killed_check_worker_loses_no_submission(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.tasks:SlowRewardTask"))
    async with running(state):
        pool = await ready(state, 1)
        node, lease = await joined(state)
        (first,) = pool._workers
        outcome = None

        async def submit() -> None:
            nonlocal outcome
            outcome = await state.intake.accept(node, answer(tokenizer, lease, node), "h")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            await trio.sleep(0.5)  # its check is in the worker now: each group's reward takes a second
            os.kill(first.process.pid, signal.SIGKILL)
        assert outcome.accepted == len(lease.prompts) and outcome.rejected == ()
        assert first not in pool._workers and len(pool._workers) == 1 and state.intake.reward_failure is None
        # The replacement also survives an idle worker's death: the next check goes to a fresh one.
        await ready(state, 1)
        (second,) = pool._workers
        os.kill(second.process.pid, signal.SIGKILL)
        node2, lease2 = await joined(state, 1)
        outcome = await state.intake.accept(node2, answer(tokenizer, lease2, node2), "h2")
        assert outcome.accepted == len(lease2.prompts)
    state.store.close()


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_submission_every_worker_dies_on_is_refused_as_busy_never_accepted(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.tasks:DyingRewardTask"))
    async with running(state):
        await ready(state, 1)
        node, lease = await joined(state)
        with pytest.raises(HubBusy, match="lost this submission's checks"):
            await state.intake.accept(node, answer(tokenizer, lease, node), "h")
        assert state.totals.groups == Tallies() and state.fleet.get(node).tallies == Tallies()
        assert state.intake.reward_failure is None and lease.lease_id in state.leasing.book.open  # the node may send it again
    state.store.close()


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_reward_that_hangs_on_everything_stops_the_run_and_blames_no_node(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.tasks:HangingRewardTask", timeout_s=1.0))
    async with running(state, ends_with=RewardError):
        pool = await ready(state, 1)
        (hung,) = pool._workers
        node, lease = await joined(state)
        # The node's work timed out, and so did the operator's probe, in the worker started in its place.
        with trio.fail_after(60), pytest.raises(HubBusy, match="the hub is stopping"):
            await state.intake.accept(node, answer(tokenizer, lease, node), "h")
        message = str(state.intake.reward_failure)
        assert message.startswith("reward testbed.tasks:HangingRewardTask.rewards did not return within 1s")
        assert "\n" not in message and "fix the reward function" in message
        assert state.fleet.get(node).tallies == Tallies() and state.totals.groups == Tallies()
        assert not hung.process.is_alive() and hung not in pool._workers  # killed, and another one started
    state.store.close()


def poisoned(tok, lease, node: str) -> Submission:
    """An answer to every prompt of the lease whose groups each hold POISON."""
    return answer(tok, lease, node, texts_of=lambda _prompt: (POISON, "x"))


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_group_that_runs_the_reward_past_its_cpu_budget_is_rejected_and_the_worker_kept(
    tmp_path, default_model_dir, tokenizer
):
    state = reopen(tmp_path, default_model_dir, pool_config(1, "testbed.poisoned_tasks:SpinningRewardTask", budget_s=0.1))
    async with running(state):
        pool = await ready(state, 1)
        (worker,) = pool._workers
        node, lease = await joined(state)
        outcome = await state.intake.accept(node, poisoned(tokenizer, lease, node), "h")
        assert outcome.accepted == 0 and {reason for _, reason in outcome.rejected} == {REASON_OVER_BUDGET}
        assert state.fleet.get(node).tallies == Tallies(rejected=len(lease.prompts))
        honest, lease2 = await joined(state, 1)
        outcome = await state.intake.accept(honest, answer(tokenizer, lease2, honest), "h2")
        assert outcome.accepted == len(lease2.prompts) and state.intake.reward_failure is None
        assert pool._workers == {worker} and worker.process.is_alive()  # interrupted by its CPU timer, not killed
    state.store.close()


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_a_submission_whose_checks_run_past_the_time_limit_is_charged_and_another_node_is_not_delayed(
    tmp_path, default_model_dir, tokenizer
):
    """A reward waiting without CPU on a node's text (no CPU timer fires) is stopped by the wall clock: the worker
    is killed, the groups rejected and counted against the node, and the reward, passing its probe, runs on."""
    state = reopen(tmp_path, default_model_dir, pool_config(2, "testbed.poisoned_tasks:SleepingRewardTask", timeout_s=1.0))
    async with running(state):
        pool = await ready(state, 2)
        node, lease = await joined(state)
        honest, lease2 = await joined(state, 1)
        outcomes = {}

        async def submit(peer: str, submission: Submission) -> None:
            outcomes[peer] = await state.intake.accept(peer, submission, peer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, node, poisoned(tokenizer, lease, node))
            await trio.sleep(0.2)
            nursery.start_soon(submit, honest, answer(tokenizer, lease2, honest))
            with trio.fail_after(30):
                while honest not in outcomes:
                    await trio.sleep(0.01)
            assert node not in outcomes  # the other worker took the honest node's work at once
        assert outcomes[honest].accepted == len(lease2.prompts)
        assert outcomes[node].accepted == 0 and {r for _, r in outcomes[node].rejected} == {REASON_OVER_BUDGET}
        assert state.fleet.get(node).tallies == Tallies(rejected=len(lease.prompts)) and state.intake.reward_failure is None
        await ready(state, 2)  # the killed worker replaced
        assert len(pool._workers) == 2
    state.store.close()


@pytest.mark.trio
async def test_a_nodes_checks_take_turns_and_never_wait_for_another_nodes(autojump_clock):
    shares, order = NodeShares(), []

    async def check(node: str, tag: str, seconds: float) -> None:
        async with shares.turn(node):
            order.append(f"{tag} in")
            await trio.sleep(seconds)
            order.append(f"{tag} out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(check, "a", "a1", 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(check, "a", "a2", 0.1)
        nursery.start_soon(check, "b", "b1", 0.1)
    assert order == ["a1 in", "b1 in", "b1 out", "a1 out", "a2 in", "a2 out"]
    assert shares._turns == {}


@pytest.mark.trio
@pytest.mark.timeout(120)
async def test_in_a_thread_an_overrun_is_charged_and_the_nodes_next_checks_wait_for_its_thread(
    tmp_path, default_model_dir, tokenizer
):
    """--check-procs 0: a thread cannot be killed. A check past the time limit is abandoned and charged; its node's
    next submission is charged unchecked while that thread runs; another node's is checked meanwhile."""
    from testbed.poisoned_tasks import SLEEP_S

    state = reopen(tmp_path, default_model_dir, pool_config(0, "testbed.poisoned_tasks:SleepingRewardTask", timeout_s=1.0))
    checks = state.intake.checks
    assert isinstance(checks, ThreadChecks)
    node, lease = await joined(state)
    outcome = await state.intake.accept(node, poisoned(tokenizer, lease, node), "h")
    assert outcome.accepted == 0 and {r for _, r in outcome.rejected} == {REASON_OVER_BUDGET}
    lease_b = (await state.leasing.grant(node, 0)).lease
    outcome = await state.intake.accept(node, answer(tokenizer, lease_b, node), "h-b")
    assert outcome.accepted == 0  # its first check still runs: it gets no second thread
    honest, lease2 = await joined(state, 1)
    outcome = await state.intake.accept(honest, answer(tokenizer, lease2, honest), "h2")
    assert outcome.accepted == len(lease2.prompts)
    with trio.fail_after(SLEEP_S * 5):
        while node in checks._overrunning:
            await trio.sleep(0.1)
    lease_c = (await state.leasing.grant(node, 0)).lease
    outcome = await state.intake.accept(node, answer(tokenizer, lease_c, node), "h-c")
    assert outcome.accepted == len(lease_c.prompts) and state.intake.reward_failure is None
    state.store.close()


@pytest.mark.trio
@pytest.mark.timeout(120)
async def test_in_a_thread_an_honest_check_waiting_for_a_thread_an_overrun_holds_is_not_charged(
    tmp_path, default_model_dir, tokenizer
):
    """The time limit counts from the thread's start: waiting for one (here the only thread, held by an abandoned
    check) is no node's doing."""
    from testbed.poisoned_tasks import SLEEP_S

    state = reopen(tmp_path, default_model_dir, pool_config(0, "testbed.poisoned_tasks:SleepingRewardTask", timeout_s=1.0))
    state.intake.checks = checks = ThreadChecks(state.intake.rules, timeout_s=1.0, threads=1)
    node, lease = await joined(state)
    honest, lease2 = await joined(state, 1)
    outcome = await state.intake.accept(node, poisoned(tokenizer, lease, node), "h")
    assert outcome.accepted == 0 and node in checks._overrunning  # its thread sleeps on, holding the only one
    with trio.fail_after(SLEEP_S * 5):
        outcome = await state.intake.accept(honest, answer(tokenizer, lease2, honest), "h2")
    assert outcome.accepted == len(lease2.prompts) and state.fleet.get(honest).tallies.rejected == 0
    state.store.close()


@pytest.mark.trio
@pytest.mark.timeout(120)
async def test_in_a_thread_a_group_past_its_cpu_budget_is_measured_and_rejected(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir, pool_config(0, "testbed.poisoned_tasks:SpinningRewardTask", budget_s=0.1))
    node, lease = await joined(state)
    outcome = await state.intake.accept(node, poisoned(tokenizer, lease, node), "h")
    assert outcome.accepted == 0 and {r for _, r in outcome.rejected} == {REASON_OVER_BUDGET}
    assert state.fleet.get(node).tallies == Tallies(rejected=len(lease.prompts)) and state.intake.reward_failure is None
    state.store.close()


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.timeout(180)
async def test_copies_checked_by_different_workers_are_still_caught(tmp_path, default_model_dir, tokenizer):
    state = reopen(tmp_path, default_model_dir, pool_config(2))
    async with running(state):
        await ready(state, 2)
        (a, lease_a), (b, lease_b) = await joined(state, 0), await joined(state, 1)
        original = answer(tokenizer, lease_a, a)
        copied = iter([c.text for c in g.completions] for g in original.groups)
        copy = answer(tokenizer, lease_b, b, texts_of=lambda _prompt: next(copied))
        outcomes = {}

        async def submit(node: str, submission: Submission) -> None:
            outcomes[node] = await state.intake.accept(node, submission, node)

        # Both at once: the two idle workers take one each.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, a, original)
            nursery.start_soon(submit, b, copy)
        refused = [reason for outcome in outcomes.values() for _, reason in outcome.rejected]
        assert refused == ["copy of an earlier group"] * len(lease_a.prompts)
        assert state.totals.groups.accepted == len(lease_a.prompts)
    state.store.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_real_hub_with_two_check_processes_trains(tmp_path: Path) -> None:
    from testbed.harness import start_hub

    hub = start_hub(
        tmp_path / "data",
        "--local-nodes",
        "1",
        "--check-procs",
        "2",
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
    )
    try:
        code = hub.process.wait(timeout=360)
    finally:
        hub.kill()
    assert code == 0, hub.output()[-3000:]
    status = hub.status()
    assert status is not None and status.totals.accepted >= 4
