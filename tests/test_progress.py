"""What a hub tells its terminal when the learner stalls: the cause named from how recent groups were
settled (hand-computed cases), and the warning given once per stall, only while groups keep arriving; steps that
trickle ever slower and a flat reward warned as they happen; the progress line ending with the newest warning, on a
real hub whose reward saturates too."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import trio

from hub.cli.progress import (
    STALL_CHECK_S,
    flat_reward,
    grown_wait,
    rejection_cause,
    stall_cause,
    warning_tail,
    watch_for_stalls,
    watch_reward_signal,
    watch_step_waits,
)
from hub.records.buffer import REASON_STALE, REASON_ZERO_VARIANCE
from testbed.harness import start_hub, wait_until
from tests.test_first_contact import run


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
async def test_a_stall_is_warned_once_and_only_while_groups_arrive(capsys, autojump_clock, hub_warnings):
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


def test_a_wait_is_grown_at_four_times_the_first_steps_and_a_quarter_of_the_stall_threshold():
    assert grown_wait([30.0, 4, 4, 5, 4, 6, 8], 40.0) is None  # too few steps to judge
    # The first five's median (4 s: the very first waited for the start) against the newest three's.
    assert grown_wait([30.0, 4, 4, 5, 4, 6, 8, 12], 40.0) is None  # 8 s: under 4 x 4 s
    assert grown_wait([30.0, 4, 4, 5, 4, 6, 16, 20], 40.0) == (4.0, 16.0)
    assert grown_wait([30.0, 4, 4, 5, 4, 6, 16, 20], 120.0) is None  # under 30 s, a quarter of 120 s
    # After a resume the first steps may take refilled groups at once: a steady 12 s wait is no stall.
    assert grown_wait([0.1, 0.1, 0.1, 0.1, 0.1, 12.0, 12.0, 12.0], 120.0) is None
    assert grown_wait([0.1, 0.1, 0.1, 0.1, 0.1, 30.0, 30.0, 30.0], 120.0) == (0.1, 30.0)


def test_a_reward_is_flat_when_most_groups_score_every_completion_alike():
    assert flat_reward(0, 0, 0.0) is None
    assert flat_reward(32, 25, 0.9) is None  # 78%: under the 80% share
    said = flat_reward(32, 26, 1.0)
    assert said is not None and said.startswith("the reward is flat: 26 of the last 32 groups scored every completion")
    assert "(mean reward 1.00)" in said and "saturated" in said and "collapsed" in said


def test_the_progress_line_ends_with_the_newest_warning_and_its_age():
    from hub.cli.progress import progress_line
    from shared.messages import EventRecord
    from tests.test_tui import hub_status

    status = hub_status()
    assert warning_tail(status) == "" and "warning" not in progress_line(status)
    warned = status.model_copy(
        update={
            "warnings": (
                EventRecord(at=status.updated_at - 900, kind="learner_stalled", detail="no learner step for 130s ..."),
                EventRecord(at=status.updated_at - 65, kind="reward_flat", detail="the reward is flat: ..."),
            )
        }
    )
    assert progress_line(warned).endswith(" | warning: reward_flat (1 min 05 s ago)")


def test_echo_hub_status_heads_its_table_with_the_newest_warnings_newest_first():
    import io

    from rich.console import Console

    from hub.cli.status import render
    from shared.messages import EventRecord
    from tests.test_tui import hub_status

    def printed(status) -> list[str]:
        out = io.StringIO()
        render(status, Console(file=out, width=120))
        return out.getvalue().splitlines()

    status = hub_status()
    assert not [line for line in printed(status) if "warning" in line]
    warned = status.model_copy(
        update={
            "warnings": tuple(
                EventRecord(at=status.updated_at - age, kind=kind, detail=f"{kind} [said]")
                for age, kind in ((900, "learner_stalled"), (300, "steps_lost"), (200, "no_delta"), (65, "reward_flat"))
            )
        }
    )
    lines = printed(warned)
    shown = [line.split(None, 2)[2].rstrip() for line in lines if line.startswith("warning ")]
    assert shown == ["reward_flat: reward_flat [said]", "no_delta: no_delta [said]", "steps_lost: steps_lost [said]"]
    assert lines.index(next(ln for ln in lines if ln.startswith("warning "))) == 2  # under the hub and its state
    assert any("1 older warning: see --json, or hub.log" in line for line in lines), lines
    # A stranger's view (no operator key): their kinds only.
    stranger = [line.split()[2:] for line in printed(warned.redact()) if line.startswith("warning ")]
    assert stranger == [["reward_flat"], ["no_delta"], ["steps_lost"]]


@pytest.mark.trio
async def test_a_flat_reward_is_warned_once_per_flat_spell(autojump_clock, capsys, hub_warnings):
    hub = FakeHub()
    buffer = hub.state.buffer = SimpleNamespace(offered=0, offered_zero_std=0, offered_reward_sum=0.0)

    def offer(groups: int, flat: int, reward: float) -> None:
        buffer.offered += groups
        buffer.offered_zero_std += flat
        buffer.offered_reward_sum += groups * reward

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_reward_signal, hub)
        await trio.sleep(STALL_CHECK_S / 2)  # off the watcher's beat, every step below
        for groups, flat, reward in ((32, 10, 0.5), (20, 20, 1.0)):  # a mixed window, then one not full yet
            offer(groups, flat, reward)
            await trio.sleep(STALL_CHECK_S)
            assert hub.events == []
        offer(12, 12, 1.0)  # 32 of 32 alike: flat
        await trio.sleep(STALL_CHECK_S)
        assert [kind for kind, _ in hub.events] == ["reward_flat"] and "(mean reward 1.00)" in hub.events[0][1]
        offer(32, 30, 1.0)  # the same spell: said once
        await trio.sleep(STALL_CHECK_S)
        offer(32, 0, 0.5)  # over
        await trio.sleep(STALL_CHECK_S)
        offer(40, 40, 0.0)  # a new one: collapsed
        await trio.sleep(STALL_CHECK_S)
        nursery.cancel_scope.cancel()
    assert [kind for kind, _ in hub.events] == ["reward_flat", "reward_flat"] and "(mean reward 0.00)" in hub.events[1][1]
    assert capsys.readouterr().out.count("echo-hub: warning: the reward is flat:") == 2
    assert [w.kind for w in hub_warnings.newest()] == ["reward_flat", "reward_flat"]


@pytest.mark.trio
async def test_steps_that_trickle_ever_slower_are_a_stall_warned_as_they_grow(autojump_clock, capsys, hub_warnings):
    hub = FakeHub()
    hub.status = SimpleNamespace(history=[])
    hub.state.buffer = [None] * 3

    def steps(*waits: float) -> None:
        for wait in waits:
            hub.status.history.append(SimpleNamespace(step=len(hub.status.history) + 1, t_idle_s=wait))
        hub.state.totals.groups.accepted += 10 * len(waits)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_step_waits, hub, 120.0)
        steps(30, 4, 4, 5, 4, 6, 8, 12)  # the first steps (the very first waited for the start), then slower
        await trio.sleep(1.5 * STALL_CHECK_S)
        assert hub.events == []
        steps(20, 40, 68)  # 40 s: ten times the first steps' 4 s, no step-less 120 s in sight
        await trio.sleep(STALL_CHECK_S)
        assert [kind for kind, _ in hub.events] == ["steps_slowing"]
        assert hub.events[0][1].startswith("learner steps now wait 40s each for their groups, 10x what the first steps")
        assert "9 of the last 10 groups had equal rewards" in hub.events[0][1]
        steps(60)  # not twice the wait said: not again
        await trio.sleep(STALL_CHECK_S)
        steps(100, 120)  # 100 s: it doubled since
        await trio.sleep(STALL_CHECK_S)
        nursery.cancel_scope.cancel()
    assert [kind for kind, _ in hub.events] == ["steps_slowing", "steps_slowing"]
    assert capsys.readouterr().out.count("echo-hub: warning: learner steps now wait") == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_hub_whose_reward_saturates_says_so_on_its_progress_line_and_in_its_status(tmp_path):
    hub = start_hub(tmp_path / "data", "--local-nodes", "1", "--task", "testbed.tasks:SaturatedTask", "--prompts-per-step", "4")
    try:
        line = wait_until(
            lambda: next((ln for ln in hub.output().splitlines() if "| warning: reward_flat (" in ln), None),
            240,
            "a progress line that ends with the warning",
        )
        assert re.match(r"\d\d:\d\d:\d\d step 0/300 v0 ", line), line
        said = [ln for ln in hub.output().splitlines() if ln.startswith("echo-hub: warning: the reward is flat: ")]
        assert len(said) == 1 and "groups scored every completion the same (mean reward 1.00)" in said[0]
        status = wait_until(lambda: (s := hub.status()) and s.warnings and s, 30, "a status with the warning")
        assert [w.detail for w in status.warnings if w.kind == "reward_flat"] == [said[0].split("warning: ", 1)[1]]
        # Where else the operator looks: `echo-hub status`'s plain text, and the dashboard.
        table = run("hub.cli", "status", "--data-dir", str(tmp_path / "data"))
        # (on a pipe, 80 columns: the text folds under its value column)
        assert table.returncode == 0 and re.search(r"^warning\s+\d\d:\d\d:\d\d reward_flat: the reward is\s", table.stdout, re.M)
        shot = tmp_path / "dashboard.svg"
        dashboard = run("hub.cli", "dashboard", "--data-dir", str(tmp_path / "data"), "--screenshot", str(shot))
        svg = shot.read_text()  # its kind bold, then its text: spans of their own
        assert dashboard.returncode == 0 and re.search(r">⚠&#160;\d\d:\d\d:\d\d&#160;reward_flat<", svg)
        assert ">:&#160;the&#160;reward&#160;is&#160;flat:&#160;" in svg
    finally:
        hub.stop()


def test_rejection_cause_names_the_top_reason():
    cause = rejection_cause({"copy of an earlier group": 129, "tokens after EOS": 3}, rejected=140)
    assert cause.startswith('140 of them were rejected, most for "copy of an earlier group" (129 of the last 132')
    assert rejection_cause({}, rejected=4) == "4 of them were rejected"


@pytest.mark.timing
@pytest.mark.trio
async def test_groups_that_arrive_only_to_be_rejected_are_a_stall_named_by_its_top_reason(capsys, autojump_clock, hub_warnings):
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

    from hub.cli.progress import progress_line
    from hub.cli.status import render
    from shared.messages import RECENT_REWARD_STEPS
    from tests.test_tui import hub_status

    status = hub_status()
    window = status.history[-RECENT_REWARD_STEPS:]
    mean = sum(p.reward_mean for p in window) / len(window)
    assert f"rollout reward {mean:.2f} (last {len(window)} steps) |" in progress_line(status)
    out = io.StringIO()
    render(status, Console(file=out, width=200))
    assert any(
        line.startswith("rollout reward") and f"{mean:.3f} (last {len(window)} steps)" in line
        for line in out.getvalue().splitlines()
    ), out.getvalue()
    one_step = status.model_copy(update={"history": status.history[:1]})
    assert f"rollout reward {one_step.history[0].reward_mean:.2f} (last step) |" in progress_line(one_step)
    assert "rollout reward - |" in progress_line(status.model_copy(update={"history": ()}))


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
