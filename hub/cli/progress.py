"""What a running hub tells the terminal: a live rich progress bar on a terminal, plain lines every few seconds
otherwise (a log file, a pipe, `--no-progress`), each ending with the newest warning for the operator; and the
watchers that give three of those warnings:
- no learner step while work arrives (accepted or rejected: a fleet whose every group is rejected is a stall too,
  named by its top reason);
- steps that still come, but each waits several times longer than the first steps of this start did (that stall
  never reaches the no-step threshold);
- a flat reward: most groups score every completion the same (a saturated reward or a collapsed policy), so they
  teach nothing.
Each is logged for the operator (shared.logs.for_operator: printed once, shown on the progress line and the
dashboard) and recorded as an event."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hub.records.buffer import REASON_STALE, REASON_ZERO_VARIANCE
from shared.logs import for_operator
from shared.messages import HubStatus
from shared.units import duration

log = logging.getLogger("echo2.hub.progress")

REFRESH_S = 0.5
PLAIN_PERIOD_S = 10.0
STALL_CHECK_S = 10.0
ZERO_VARIANCE_SHARE = 0.8
# The newest groups a stall's cause is read from (rejections, or what became of accepted ones).
RECENT_GROUPS = 256
# A step's wait (T_idle) grown to WAIT_GROWTH times the first steps' of this start, and to at least WAIT_SHARE of the
# no-step threshold (stall_warning_s: 30 s of 120), is a stall although steps still come: the median of the newest
# RECENT_STEPS against that of the first BASELINE_STEPS. (The first steps after a resume may take refilled groups at
# once: a steady wait under the share is no stall however it compares.)
WAIT_GROWTH = 4.0
WAIT_SHARE = 0.25
BASELINE_STEPS = 5
RECENT_STEPS = 3
# The flat-reward watcher judges the groups offered to the buffer this many at a time (2 default steps' worth).
SIGNAL_WINDOW_GROUPS = 32


def progress_line(status: HubStatus) -> str:
    states = [n.state for n in status.nodes]
    bubble = f"{status.bubble:.2f}" if status.bubble is not None else "-"
    calls = status.recent_tool_calls()
    tools = f" | tool calls {calls:.2f}/rollout" if calls is not None else ""
    return (
        f"v{status.version} rollout reward {status.recent_reward_text(2)}{tools} | nodes {states.count('active')} active "
        f"{states.count('standby')} standby | accepted {status.totals.accepted} | bubble {bubble} | ${status.cost_usd:.4f}"
        f"{warning_tail(status)}"
    )


def warning_tail(status: HubStatus) -> str:
    """The newest warning for the operator, as the progress line ends with it ("" without one): its kind and age,
    since its whole text was printed when it came."""
    if not status.warnings:
        return ""
    newest = status.warnings[-1]
    return f" | warning: {newest.kind} ({duration(status.updated_at - newest.at)} ago)"


def _steps(status: HubStatus) -> str:
    return f"{status.step}/{status.steps_target or '∞'}"


async def live_progress(hub) -> None:
    total = hub.config.steps or None
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]learner steps"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        transient=False,
    ) as progress:
        task = progress.add_task("starting", total=total)
        while True:
            status = hub.status.snapshot(0)
            progress.update(task, completed=status.step, description=progress_line(status))
            await trio.sleep(REFRESH_S)


async def plain_progress(hub, period_s: float = PLAIN_PERIOD_S) -> None:
    """One line every `period_s`: for output that is not a terminal (no cursor tricks, nothing truncated)."""
    while True:
        await trio.sleep(period_s)
        status = hub.status.snapshot(0)
        print(f"{time.strftime('%H:%M:%S')} step {_steps(status)} {progress_line(status)}", flush=True)


def stall_cause(discards: dict[str, int], waiting: int, needed: int) -> str:
    """Why the learner has not stepped although groups arrive, from how recent groups were settled."""
    total = sum(discards.values())
    zero = discards.get(REASON_ZERO_VARIANCE, 0)
    if total and zero >= ZERO_VARIANCE_SHARE * total:
        return (
            f"{zero} of the last {total} groups had equal rewards, so they teach nothing: the task may be too "
            "hard (or too easy) for this model; try an easier task, a larger --group-size, or a higher --temperature"
        )
    stale = discards.get(REASON_STALE, 0)
    if total and stale >= total / 2:
        return (
            f"{stale} of the last {total} groups arrived too stale to train on: raise --staleness, or shrink "
            "the snapshot / speed up the broadcast"
        )
    return f"only {waiting} usable groups waiting, {needed} needed per step: the fleet is too slow or too small"


def rejection_cause(reasons: dict[str, int], rejected: int) -> str:
    """Why the groups that arrive are refused: the most frequent reason among the recent rejections."""
    total = sum(reasons.values())
    if not total:
        return f"{rejected} of them were rejected"
    top = max(reasons, key=reasons.__getitem__)
    return (
        f'{rejected} of them were rejected, most for "{top}" ({reasons[top]} of the last {total} rejections): '
        "the nodes' work fails the hub's checks (each node is told why)"
    )


def _groups_in(hub) -> tuple[int, int]:
    """(accepted, rejected) groups received so far."""
    groups = hub.state.totals.groups
    return groups.accepted, groups.rejected


async def _cause(hub, accepted: int, rejected: int) -> str:
    """Why no step came of the groups that arrived: mostly rejected, or accepted but not enough to train on."""
    if rejected >= accepted:
        return rejection_cause(await hub.state.intake.recent_rejections(RECENT_GROUPS), rejected)
    discards = await hub.state.intake.recent_discards(RECENT_GROUPS)
    return stall_cause(discards, len(hub.state.buffer), hub.config.learner.prompts_per_step)


async def watch_for_stalls(hub, threshold_s: float) -> None:
    """Warn (log, event, terminal) when no learner step for `threshold_s` while groups keep arriving."""
    last_step, since = hub.learner.step, trio.current_time()
    then = _groups_in(hub)
    warned = False
    while True:
        await trio.sleep(STALL_CHECK_S)
        if hub.learner.step != last_step:
            last_step, since, warned = hub.learner.step, trio.current_time(), False
            then = _groups_in(hub)
            continue
        now = _groups_in(hub)
        accepted, rejected = now[0] - then[0], now[1] - then[1]
        if accepted + rejected == 0:
            since = trio.current_time()  # waiting for work is not a stall: the clock runs once work arrives
            continue
        if warned or trio.current_time() - since < threshold_s:
            continue
        cause = await _cause(hub, accepted, rejected)
        detail = f"no learner step for {trio.current_time() - since:.0f}s while {accepted + rejected} groups arrived: {cause}"
        await _warn(hub, "learner_stalled", detail)
        warned = True


async def _warn(hub, kind: str, detail: str) -> None:
    """A warning for the operator: hub.log, the terminal, the progress line and the dashboard, and an event."""
    log.warning(detail, extra=for_operator(kind))
    await hub.state.event(kind, None, detail)


def grown_wait(waits: Sequence[float], threshold_s: float) -> tuple[float, float] | None:
    """(the first steps' wait, the newest steps' wait) of this start's steps' waits in order, when the newest grew to
    WAIT_GROWTH times the first and to WAIT_SHARE of the no-step `threshold_s` (medians of BASELINE_STEPS and
    RECENT_STEPS); None when they did not, or too few steps came yet."""
    if len(waits) < BASELINE_STEPS + RECENT_STEPS:
        return None
    baseline, recent = statistics.median(waits[:BASELINE_STEPS]), statistics.median(waits[-RECENT_STEPS:])
    if recent < WAIT_SHARE * threshold_s or recent < WAIT_GROWTH * baseline:
        return None
    return baseline, recent


async def watch_step_waits(hub, threshold_s: float) -> None:
    """Warn (log, event, terminal) when steps still come but each waits far longer for its groups than the first
    steps of this start did (`grown_wait`); again once the wait doubled since, or after it recovered and grew anew."""
    start_step = last = hub.learner.step
    then = _groups_in(hub)
    first: list[float] = []
    recent: list[float] = []
    warned_at: float | None = None  # the newest steps' wait the last warning named
    while True:
        await trio.sleep(STALL_CHECK_S)
        for point in hub.status.history:
            if point.step > last:
                last = point.step
                (first if len(first) < BASELINE_STEPS else recent).append(point.t_idle_s)
        del recent[:-RECENT_STEPS]
        grown = grown_wait(first + recent, threshold_s) if last > start_step else None
        if grown is None:
            warned_at = None
            continue
        baseline, wait = grown
        if warned_at is not None and wait < 2 * warned_at:
            continue
        now = _groups_in(hub)
        cause = await _cause(hub, now[0] - then[0], now[1] - then[1])
        detail = (
            f"learner steps now wait {wait:.0f}s each for their groups, {wait / max(baseline, 0.1):.0f}x what the first "
            f"steps of this start waited ({baseline:.1f}s): {cause}"
        )
        await _warn(hub, "steps_slowing", detail)
        warned_at = wait


def flat_reward(groups: int, zero_std: int, reward_mean: float) -> str | None:
    """Why `groups` offered to the buffer teach nothing, when at least ZERO_VARIANCE_SHARE of them (`zero_std`) scored
    every completion the same (their advantages are all 0); None otherwise."""
    if groups == 0 or zero_std < ZERO_VARIANCE_SHARE * groups:
        return None
    return (
        f"the reward is flat: {zero_std} of the last {groups} groups scored every completion the same (mean reward "
        f"{reward_mean:.2f}), so they teach nothing: a saturated reward (every completion already scores the top: the "
        "task is learned, or too easy) or a collapsed policy (all score the bottom: try a higher --temperature, a "
        "lower --lr, or an easier task)"
    )


async def watch_reward_signal(hub) -> None:
    """Warn (log, event, terminal) when the groups offered to the buffer, judged SIGNAL_WINDOW_GROUPS at a time, are
    mostly flat (`flat_reward`); once per flat spell."""
    buffer = hub.state.buffer
    start = (buffer.offered, buffer.offered_zero_std, buffer.offered_reward_sum)
    warned = False
    while True:
        await trio.sleep(STALL_CHECK_S)
        groups = buffer.offered - start[0]
        if groups < SIGNAL_WINDOW_GROUPS:
            continue
        zero_std, reward_sum = buffer.offered_zero_std - start[1], buffer.offered_reward_sum - start[2]
        start = (buffer.offered, buffer.offered_zero_std, buffer.offered_reward_sum)
        detail = flat_reward(groups, zero_std, reward_sum / groups)
        if detail is not None and not warned:
            await _warn(hub, "reward_flat", detail)
        warned = detail is not None


async def watch(hub, stall_threshold_s: float) -> None:
    """Every watcher above, for the hub's run."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_for_stalls, hub, stall_threshold_s)
        nursery.start_soon(watch_step_waits, hub, stall_threshold_s)
        nursery.start_soon(watch_reward_signal, hub)
