"""The end-of-run summary printed by `echo-hub start`, from the data dir alone."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from hub.training.metrics import policy_reward, read_evals, read_metrics
from shared.layout import FINAL_DIR, HUB_STATUS_FILE, METRICS_FILE
from shared.messages import HubStatus, NodeStatus, short_id


def fifth_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last fifth (at least one value each)."""
    k = fifth(len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def fifth(n: int) -> int:
    """How many of `n` values a fifth is (at least one)."""
    return max(1, n // 5)


def _node_text(node: NodeStatus) -> str:
    """A node as the summary names it: its --name (whole) with its short id, or the short id alone."""
    short = short_id(node.peer_id)
    who = f"{node.name} ({short})" if node.name not in ("", short) else short
    return f"{who}: {node.state}, {node.tallies.accepted}"


def print_summary(data_dir: Path, interrupted: bool = False) -> None:
    console = Console()
    rows = read_metrics(Path(data_dir) / METRICS_FILE)
    status_path = Path(data_dir) / HUB_STATUS_FILE
    status = HubStatus.model_validate_json(status_path.read_text()) if status_path.exists() else None
    table = Table(title="echo2 run summary" + (" (interrupted)" if interrupted else ""), show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    if rows:
        first, last = fifth_means([policy_reward(r) for r in rows])
        table.add_row("learner steps", str(rows[-1]["step"]))
        k = fifth(len(rows))
        table.add_row(
            f"rollout reward, first fifth -> last fifth ({k} step{'s' if k > 1 else ''} each)", f"{first:.3f} -> {last:.3f}"
        )
        table.add_row(
            "staleness mean / max",
            f"{sum(r['staleness_mean'] for r in rows) / len(rows):.2f} / {max(r['staleness_max'] for r in rows)}",
        )
        table.add_row("bubble ratio (mean)", f"{sum(r['bubble'] for r in rows) / len(rows):.3f}")
        table.add_row("T_train mean", f"{sum(r['t_train_s'] for r in rows) / len(rows):.3f} s")
    else:
        table.add_row("learner steps", "0")
    evals = read_evals(Path(data_dir) / METRICS_FILE)
    if evals:
        first_eval, last_eval = evals[0], evals[-1]
        k = int(last_eval["eval_k"])
        table.add_row(
            f"held-out reward (step {first_eval['eval_step']} -> {last_eval['eval_step']})",
            f"{first_eval['eval_reward']:.3f} -> {last_eval['eval_reward']:.3f}",
        )
        if k > 1:
            table.add_row(
                f"held-out pass@1 / pass@{k} (last)", f"{last_eval['eval_pass_at_1']:.3f} / {last_eval['eval_pass_at_k']:.3f}"
            )
    if status is not None:
        t = status.totals
        table.add_row("groups accepted / rejected / late", f"{t.accepted} / {t.rejected} / {t.late}")
        table.add_row("dropped as stale", str(status.dropped_stale))
        table.add_row("T_bcast (last)", f"{status.t_bcast_s:.2f} s" if status.t_bcast_s is not None else "-")
        table.add_row("cost (learner + nodes)", f"${status.cost_usd:.4f}")
        if status.cost_per_step_usd is not None:
            table.add_row("cost per step", f"${status.cost_per_step_usd:.5f}")
        table.add_row("nodes: state, groups accepted", ", ".join(_node_text(n) for n in status.nodes) or "-")
    console.print(table)
    final = Path(data_dir) / FINAL_DIR
    if rows and final.exists():
        console.print(f"final policy: {final.resolve()}  (load with from_pretrained)")
    elif not rows:
        console.print("no learner step was taken: there is no trained policy yet")
    console.print(f"reward curve: echo-hub report --data-dir {data_dir}")
