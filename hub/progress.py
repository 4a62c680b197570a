"""Live terminal progress of a hub run (rich): steps, reward, fleet, staleness, bubble, cost."""

from __future__ import annotations

import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

REFRESH_S = 0.5


def _line(status) -> str:
    states = [n.state for n in status.nodes]
    reward = f"{status.reward_mean:.2f}" if status.reward_mean is not None else "-"
    bubble = f"{status.bubble:.2f}" if status.bubble is not None else "-"
    return (
        f"v{status.version} reward {reward} | nodes {states.count('active')} active "
        f"{states.count('standby')} standby | accepted {status.totals.accepted} | bubble {bubble} | ${status.cost_usd:.4f}"
    )


async def live_progress(hub) -> None:
    total = hub.config.steps or None
    with Progress(
        SpinnerColumn(), TextColumn("[bold]learner steps"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("{task.description}"), transient=False,
    ) as progress:
        task = progress.add_task("starting", total=total)
        while True:
            status = hub.status.snapshot(0)
            progress.update(task, completed=status.step, description=_line(status))
            await trio.sleep(REFRESH_S)
