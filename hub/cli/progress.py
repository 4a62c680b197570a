"""What a running hub tells the terminal: a live rich progress bar on a terminal, plain lines every few seconds
otherwise (a log file, a pipe, `--no-progress`), and a warning when the learner stalls while work arrives
(accepted or rejected: a fleet whose every group is rejected is a stall too, named by its top reason)."""

from __future__ import annotations

import logging
import time

import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hub.records.buffer import REASON_STALE, REASON_ZERO_VARIANCE
from shared.messages import HubStatus

log = logging.getLogger("echo2.hub.progress")

REFRESH_S = 0.5
PLAIN_PERIOD_S = 10.0
STALL_CHECK_S = 10.0
ZERO_VARIANCE_SHARE = 0.8
# The newest groups a stall's cause is read from (rejections, or what became of accepted ones).
RECENT_GROUPS = 256


def _line(status: HubStatus) -> str:
    states = [n.state for n in status.nodes]
    bubble = f"{status.bubble:.2f}" if status.bubble is not None else "-"
    return (
        f"v{status.version} rollout reward {status.recent_reward_text(2)} | nodes {states.count('active')} active "
        f"{states.count('standby')} standby | accepted {status.totals.accepted} | bubble {bubble} | ${status.cost_usd:.4f}"
    )


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
            progress.update(task, completed=status.step, description=_line(status))
            await trio.sleep(REFRESH_S)


async def plain_progress(hub, period_s: float = PLAIN_PERIOD_S) -> None:
    """One line every `period_s`: for output that is not a terminal (no cursor tricks, nothing truncated)."""
    while True:
        await trio.sleep(period_s)
        status = hub.status.snapshot(0)
        print(f"{time.strftime('%H:%M:%S')} step {_steps(status)} {_line(status)}", flush=True)


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
        log.warning(detail)
        print(f"echo-hub: warning: {detail}", flush=True)
        await hub.state.event("learner_stalled", None, detail)
        warned = True
