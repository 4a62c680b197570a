"""What a hub tells its terminal when the learner stalls: the cause named from how recent groups were
settled (hand-computed cases), and the warning given once per stall, only while groups keep arriving."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio

from hub.cli.progress import STALL_CHECK_S, rejection_cause, stall_cause, watch_for_stalls
from hub.records.buffer import REASON_STALE, REASON_ZERO_VARIANCE


def test_stall_cause_names_the_dominant_reason():
    # 80 of 100 with equal rewards: the task, not the fleet.
    cause = stall_cause({REASON_ZERO_VARIANCE: 80, "trained": 20}, waiting=3, needed=8)
    assert cause.startswith("80 of the last 100 groups had equal rewards") and "--group-size" in cause
    # 79 of 100 is under the 80 % share; half stale is the broadcast or S.
    cause = stall_cause({REASON_ZERO_VARIANCE: 29, REASON_STALE: 50, "trained": 21}, waiting=3, needed=8)
    assert cause.startswith("50 of the last 100 groups arrived too stale") and "--staleness" in cause
    # Neither: too little work.
    assert stall_cause({}, waiting=3, needed=8) == (
        "only 3 usable groups waiting, 8 needed per step: the fleet is too slow or too small"
    )
    assert stall_cause({REASON_STALE: 1, "trained": 2}, waiting=0, needed=8).startswith("only 0 usable")


class FakeHub:
    """The few attributes watch_for_stalls reads, moved by the test."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.learner = SimpleNamespace(step=0)
        totals = SimpleNamespace(groups=SimpleNamespace(accepted=0, rejected=0))

        async def event(kind, peer, detail):
            self.events.append((kind, detail))

        async def recent_discards(limit):
            return {REASON_ZERO_VARIANCE: 9, "trained": 1}

        async def recent_rejections(limit):
            return {"copy of an earlier group": 7, "tokens after EOS": 2}

        self.state = SimpleNamespace(
            totals=totals,
            buffer=[],
            event=event,
            intake=SimpleNamespace(recent_discards=recent_discards, recent_rejections=recent_rejections),
        )
        self.config = SimpleNamespace(learner=SimpleNamespace(prompts_per_step=8))


@pytest.mark.timing
@pytest.mark.trio
async def test_a_stall_is_warned_once_and_only_while_groups_arrive(capsys, autojump_clock):
    hub = FakeHub()

    async def events(n: int) -> None:
        # The watcher reads the store in a thread, which the autojump clock does not wait for: while it
        # runs, virtual time races ahead, so the bound is on real time (a busy machine is slow, not wrong).
        deadline = time.monotonic() + 30
        while len(hub.events) < n:
            assert time.monotonic() < deadline, f"no event {n} after 30 s"
            await trio.sleep(0.01)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_stalls, hub, 60.0)
            await trio.sleep(300)  # nothing arrives: waiting for work is not a stall
            assert hub.events == []
            hub.state.totals.groups.accepted += 5
            await trio.sleep(60 - 2 * STALL_CHECK_S)  # work arrives, but not for long enough yet
            assert hub.events == []
            await trio.sleep(3 * STALL_CHECK_S)
            await events(1)
            assert [kind for kind, _ in hub.events] == ["learner_stalled"]
            assert "while 5 groups arrived: 9 of the last 10 groups had equal rewards" in hub.events[0][1]
            await trio.sleep(600)  # the same stall is not repeated
            assert len(hub.events) == 1
            hub.learner.step = 1  # a step ends it; a new stall warns again
            # Off the watcher's beat, whose phase the first warning's thread shifted: groups arriving on the very
            # instant it sees the step would count as before it (CI saw that tie, and no second warning).
            await trio.sleep(1.5 * STALL_CHECK_S)
            hub.state.totals.groups.accepted += 5
            await trio.sleep(60 + 2 * STALL_CHECK_S)
            await events(2)
            nursery.cancel_scope.cancel()

    await scenario()
    assert capsys.readouterr().out.count("echo-hub: warning: no learner step") == 2


def test_rejection_cause_names_the_top_reason():
    cause = rejection_cause({"copy of an earlier group": 129, "tokens after EOS": 3}, rejected=140)
    assert cause.startswith('140 of them were rejected, most for "copy of an earlier group" (129 of the last 132')
    assert rejection_cause({}, rejected=4) == "4 of them were rejected"


@pytest.mark.timing
@pytest.mark.trio
async def test_groups_that_arrive_only_to_be_rejected_are_a_stall_named_by_its_top_reason(capsys, autojump_clock):
    hub = FakeHub()
    deadline = time.monotonic() + 30
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_for_stalls, hub, 60.0)
        await trio.sleep(STALL_CHECK_S)
        hub.state.totals.groups.rejected += 9  # nothing accepted: before, this never counted as work arriving
        await trio.sleep(60 + 2 * STALL_CHECK_S)
        while not hub.events:
            assert time.monotonic() < deadline, "no stall warning"
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert 'while 9 groups arrived: 9 of them were rejected, most for "copy of an earlier group"' in hub.events[0][1]
    assert "echo-hub: warning: no learner step" in capsys.readouterr().out


# -- what each "reward" number averages, named where it is shown ------------------------------------------


def test_the_bar_and_status_name_the_rollout_reward_and_its_window(tmp_path):
    import io

    from rich.console import Console

    from hub.cli.progress import _line
    from hub.cli.status import render
    from shared.messages import RECENT_REWARD_STEPS
    from tests.test_tui import hub_status

    status = hub_status()
    window = status.history[-RECENT_REWARD_STEPS:]
    mean = sum(p.reward_mean for p in window) / len(window)
    assert f"rollout reward {mean:.2f} (last {len(window)} steps) |" in _line(status)
    out = io.StringIO()
    render(status, Console(file=out, width=200))
    assert any(
        line.startswith("rollout reward") and f"{mean:.3f} (last {len(window)} steps)" in line
        for line in out.getvalue().splitlines()
    ), out.getvalue()
    one_step = status.model_copy(update={"history": status.history[:1]})
    assert f"rollout reward {one_step.history[0].reward_mean:.2f} (last step) |" in _line(one_step)
    assert "rollout reward - |" in _line(status.model_copy(update={"history": ()}))


def test_the_summary_names_the_fifths_it_compares(tmp_path, capsys):
    import json

    from hub.cli.summary import print_summary
    from shared.layout import METRICS_FILE

    rows = [
        {
            "step": s,
            "reward_mean": 0.5,
            "rollout_reward_mean": s / 10,
            "staleness_mean": 1.0,
            "staleness_max": 2,
            "bubble": 0.1,
            "t_train_s": 1.0,
        }
        for s in range(1, 11)
    ]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_summary(tmp_path)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "first fifth" in ln)
    assert "rollout reward, first fifth -> last fifth (2 steps each)" in line and "0.150 -> 0.950" in line


def test_a_run_stopped_before_its_first_step_names_no_final_policy(tmp_path, capsys):
    from hub.cli.summary import print_summary
    from shared.layout import FINAL_DIR

    (tmp_path / FINAL_DIR).mkdir()  # even a final/ left by something else is not this run's policy
    print_summary(tmp_path)
    out = capsys.readouterr().out
    assert "final policy" not in out and "no learner step was taken: there is no trained policy yet" in out
