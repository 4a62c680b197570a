"""`echo-hub report`: reward (training and held-out; a tool-using run's tool calls per rollout beside it), loss and KL, staleness and bubble ratio over learner steps,
plotted to a PNG from metrics.jsonl, with the steps a crash lost as weights shaded and named in the title."""

from __future__ import annotations

from pathlib import Path

from hub.training.metrics import lost_text, policy_reward, read_evals, read_lost, read_metrics
from shared.checks import UserError
from shared.layout import METRICS_FILE, REPORT_FILE
from shared.tools import TOOL_CALLS_METRIC


def _loss_and_kl(ax, steps: list[float], rows: list[dict[str, float]]) -> None:
    """The GRPO loss on the left axis, the KL to the initial policy on the right (its scale is another)."""
    ax.plot(steps, [r.get("loss", float("nan")) for r in rows], label="loss", color="tab:blue")
    ax.set_ylabel("loss")
    kl_axis = ax.twinx()
    kl_axis.plot(steps, [r.get("kl", float("nan")) for r in rows], label="KL", color="tab:red", alpha=0.7)
    kl_axis.set_ylabel("KL to the initial policy")
    lines = ax.get_lines() + kl_axis.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")


def _mark_lost(axes, lost: list[tuple[int, int]]) -> str:
    """Shade the steps each crash lost as weights on every panel (labelled once, on the reward's); the title's words
    for them ("" for none)."""
    for index, (first, last) in enumerate(lost):
        for ax in axes:
            label = "lost in a crash (redone from a checkpoint)" if ax is axes[0] and index == 0 else None
            ax.axvspan(first - 0.5, last + 0.5, color="tab:red", alpha=0.15, label=label)
    if not lost:
        return ""
    return f"\n{', '.join(lost_text(span) for span in lost)} lost in a crash, redone from a checkpoint"


def write_report(data_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(data_dir) / METRICS_FILE)
    if not rows:
        raise SystemExit(f"echo-hub report: no learner steps in {Path(data_dir) / METRICS_FILE}")
    out = Path(out) if out is not None else Path(data_dir) / REPORT_FILE
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 10.5), sharex=True)
    rewards = [policy_reward(r) for r in rows]
    axes[0].plot(steps, rewards, label="rollout reward", alpha=0.6)
    axes[0].plot(steps, [r["reward_mean"] for r in rows], label="reward of trained groups", alpha=0.4)
    window = max(1, len(rows) // 10)
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(rows))]
    axes[0].plot(steps, smooth, label=f"moving mean ({window} steps)", linewidth=2)
    evals = read_evals(Path(data_dir) / METRICS_FILE)
    if evals:
        axes[0].plot(
            [e["eval_step"] for e in evals],
            [e["eval_reward"] for e in evals],
            "o-",
            color="black",
            label=f"held-out reward ({int(evals[-1]['eval_prompts'])} prompts)",
            linewidth=2,
        )
    if any(TOOL_CALLS_METRIC in r for r in rows):  # a tool-using run: its calls rise as its reward does
        calls = [r.get(TOOL_CALLS_METRIC, float("nan")) for r in rows]
        axes[0].plot(steps, calls, label="tool calls per rollout", color="tab:purple", linestyle=":")
    lost = _mark_lost(axes, read_lost(Path(data_dir) / METRICS_FILE))
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    _loss_and_kl(axes[1], steps, rows)
    axes[2].plot(steps, [r["staleness_mean"] for r in rows], label="mean")
    axes[2].plot(steps, [r["staleness_max"] for r in rows], label="max", linestyle="--")
    axes[2].set_ylabel("staleness (versions)")
    axes[2].legend(loc="upper right")
    axes[3].plot(steps, [r["bubble"] for r in rows], label="measured")
    if any("predicted_bubble" in r for r in rows):
        axes[3].plot(steps, [r.get("predicted_bubble", float("nan")) for r in rows], label="capacity model", linestyle="--")
    axes[3].set_ylabel("bubble ratio")
    axes[3].set_xlabel("learner step")
    axes[3].set_ylim(0, 1)
    axes[3].legend(loc="upper right")
    fig.suptitle(f"echo2 run: {Path(data_dir).resolve().name}{lost}")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:  # a read-only data dir (a finished run on a shared mount), a full disk...
        raise UserError(f"{out}: cannot write it ({exc.strerror}); pass --out PATH in a directory you can write to") from None
    finally:
        plt.close(fig)
    return out
