"""Reward vs learner step under bounded staleness S, with and without the clipped importance ratio.

The paper's staleness question at small scale: the default recipe (LearnerConfig and
sampling defaults, default model, ReverseTask) trained by the real LearnerComponent on
groups from in-process LocalRollouts, for S in --staleness (kappa = max(1, S - 1) as by
default) with the ratio to the sampling log-probs, plus the runs in --no-is-ratio with
use_is_ratio=False (stale rollouts treated as on-policy). Each run gets a snapshot install
delay of --delay-steps x S learner steps (step time measured once before the sweep), so the
rollouts really sample with old policies and the learner's staleness reaches S; every run
reports the staleness it actually trained at.

Reward at a step is the mean reward of every group sampled by policy versions in that
window (zero-variance and stale-dropped groups included: they measure the policy too),
averaged over windows of --window steps. reward_eval_final is the exact-match rate of the
final policy on a fixed 512-prompt sample (one completion each, the same sampling).

    python bench/staleness.py [--json] [--steps 200] [--out bench/out/staleness.png] [--optimizers adamw adamw8bit]

--adaptive runs `--staleness auto` against fixed S instead, with real processes: `echo-hub start` (the embedded
default, --local-nodes 0) and --nodes `echo-node join` volunteers at --node-price $/h, for --steps steps each.
Scenario `steady`: S = 0 and auto on the whole fleet (reward_last: auto should be within 0.05 of S = 0's).
Scenario `half_leave`: each S of --fixed and auto, half the nodes stopped once half the steps are done (cost_per_step:
auto should be at or below the best fixed S). One row per run: scenario, staleness, reward_last (mean rollout reward
of the last --window steps), cost_per_step (the hub's own: learner time at its price plus what the nodes were paid,
per step), bubble (mean learner bubble), the S in force at the end, drift_mean and drift_over_bound (the share of
steps whose mean |log-ratio| passed --drift-max, the hub's default when not given). --repeats runs every setting that
many times, round after round, since run-to-run noise on a shared machine is large; `comparison` takes each setting's
median: steady auto's reward gap to S = 0, and half_leave's `fixed_rows` (each fixed S's cost_per_step,
drift_over_bound, reward_last, and `eligible`: past the drift bound at most 5 points more often than auto, and reward
within 0.05 of steady S = 0's), auto's saving against the cheapest eligible S (`auto_within_eligible`: auto at most
1.02x its cost; bench/simulate.py's auto_against_fixed) and against the cheapest of all.

    python bench/staleness.py --adaptive --json [--steps 24] [--nodes 4] [--fixed 1 2 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import trio  # noqa: E402

CHUNK_SIZE_BYTES = 1 << 20
EVAL_PROMPTS = 512
EVAL_SEED = 1
# A step count no run reaches: checkpoints cost disk time and do not change learning.
NO_CHECKPOINTS = 100_000
PROGRESS_POLL_S = 0.2
CALIBRATION_STEPS = 2
ADAPTIVE_RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class RunSpec:
    staleness: int
    is_ratio: bool
    optimizer: str = "adamw"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    parser.add_argument("--steps", type=int, default=200, help="learner steps per run")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 3, 6, 11], help="S values run with the ratio")
    parser.add_argument("--no-is-ratio", type=int, nargs="*", default=[6], help="S values also run without the ratio")
    parser.add_argument(
        "--delay-steps", type=float, default=0.5, help="snapshot install delay per unit of S, in measured learner steps"
    )
    parser.add_argument("--window", type=int, default=None, help="reward window in steps (default steps // 10)")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="override LearnerConfig's default")
    parser.add_argument("--group-size", type=int, default=None, help="override LearnerConfig's default")
    parser.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS)
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=["adamw"],
        choices=["adamw", "adamw8bit"],
        help="every run once with each (LearnerConfig.optimizer): 8-bit moments against fp32 ones",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/staleness.png"), help="reward vs step plot")
    parser.add_argument("--adaptive", action="store_true", help="--staleness auto against fixed S, real processes")
    parser.add_argument("--nodes", type=int, default=4, help="--adaptive: volunteer node processes")
    parser.add_argument("--node-price", type=float, default=0.35, help="--adaptive: each node's price, $/h")
    parser.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 4, 8], help="--adaptive: fixed S of half_leave")
    parser.add_argument("--staleness-max", type=int, default=8, help="--adaptive: the auto runs' --staleness-max")
    parser.add_argument("--drift-max", type=float, default=None, help="--adaptive: the auto runs' --drift-max")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["steady", "half_leave"],
        choices=["steady", "half_leave"],
        help="--adaptive: the scenarios to run",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--adaptive: runs of each setting, interleaved (round k of every setting, then k + 1)",
    )
    return parser.parse_args(argv)


def learner_config(spec: RunSpec, args: argparse.Namespace):
    from hub.config import LearnerConfig

    overrides = {
        "staleness": spec.staleness,
        "use_is_ratio": spec.is_ratio,
        "checkpoint_every": NO_CHECKPOINTS,
        "optimizer": spec.optimizer,
    }
    if args.prompts_per_step is not None:
        overrides["prompts_per_step"] = args.prompts_per_step
    if args.group_size is not None:
        overrides["group_size"] = args.group_size
    return LearnerConfig(**overrides)


def measure_step_s(model_dir: Path, cfg, sampling) -> float:
    """Seconds of one learner step plus the generation of its groups, at this run's sizes."""
    import random

    from hub.training.learner import Learner
    from node.hf_engine import HFEngine
    from shared.model_identity import load_model_identity
    from shared.rollout import Group
    from shared.tasks.reverse import ReverseTask

    task = ReverseTask()
    engine = HFEngine(model_dir)
    learner = Learner(load_model_identity(model_dir), cfg, sampling)
    rng = random.Random(cfg.seed)
    seconds = []
    for step in range(CALIBRATION_STEPS):
        started = time.perf_counter()
        prompts = task.sample(rng, cfg.prompts_per_step)
        outputs = engine.generate([p.text for p in prompts], cfg.group_size, sampling)
        groups = [
            Group(
                prompt_id=p.id,
                prompt_text=p.text,
                version=0,
                completions=tuple(cs),
                rewards=tuple(task.rewards(p, [c.text for c in cs])),
            )
            for p, cs in zip(prompts, outputs, strict=True)
        ]
        learner.train_step(groups, step + 1)
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def run_one(spec: RunSpec, args: argparse.Namespace, model_dir: Path, sampling, delay_s: float, data_dir: Path, on_step) -> dict:
    from hub.config import HubConfig
    from hub.records.store import Store
    from hub.service.local_rollouts import LocalRollouts
    from hub.service.state import HubState
    from hub.training.loop import LearnerComponent
    from hub.training.metrics import read_metrics
    from node.hf_engine import HFEngine
    from shared.crypto import Identity
    from shared.default_model import sample_accuracy
    from shared.layout import HUB_STORE_FILE, METRICS_FILE
    from shared.model_identity import load_model_identity
    from shared.tasks.reverse import ReverseTask

    cfg = learner_config(spec, args)
    state = HubState(Store(data_dir / HUB_STORE_FILE), HubConfig(learner=cfg, sampling=sampling), ReverseTask())
    store = state.store
    send, receive = trio.open_memory_channel(64)
    learner = LearnerComponent(
        cfg, sampling, load_model_identity(model_dir), data_dir, state, Identity.generate(), send, args.steps, CHUNK_SIZE_BYTES
    )
    rollouts = LocalRollouts(
        HFEngine(model_dir),
        ReverseTask(),
        sampling,
        cfg.group_size,
        state,
        receive,
        learner.min_useful_version,
        max_pending_groups=2 * cfg.prompts_per_step,
        install_delay_s=delay_s,
        seed=cfg.seed,
    )

    async def drive() -> None:
        async def report() -> None:
            while True:
                on_step(learner.step)
                await trio.sleep(PROGRESS_POLL_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollouts.run)
            nursery.start_soon(report)
            await learner.run()
            nursery.cancel_scope.cancel()
        on_step(learner.step)

    started = time.perf_counter()
    trio.run(drive)
    wall_s = time.perf_counter() - started

    metrics = read_metrics(data_dir / METRICS_FILE)
    rows = [r for r in store.groups.trajectories() if r.verdict == "accepted"]
    store.close()
    curve = reward_curve([(r.version, r.reward_mean) for r in rows], args.steps, args.window or max(1, args.steps // 10))
    final = learner.learner
    return {
        "staleness": spec.staleness,
        "is_ratio": spec.is_ratio,
        "optimizer": spec.optimizer,
        "kappa": cfg.effective_kappa,
        "install_delay_s": round(delay_s, 3),
        "reward_first": curve[min(curve)],
        "reward_last": curve[max(curve)],
        "reward_at_step": curve,
        "reward_eval_final": sample_accuracy(
            final.model, final.tokenizer, ReverseTask(), args.eval_prompts, EVAL_SEED, sampling.max_new_tokens
        ),
        "staleness_mean": round(statistics.fmean(m["staleness_mean"] for m in metrics), 3),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "dropped_stale_groups": sum(m["dropped_stale"] for m in metrics),
        "bubble_mean": round(statistics.fmean(m["bubble"] for m in metrics), 3),
        "drift_mean": round(statistics.fmean(m["abs_log_ratio"] for m in metrics), 5),
        "t_train_s_mean": round(statistics.fmean(m["t_train_s"] for m in metrics), 4),
        "steps": len(metrics),
        "wall_s": round(wall_s, 1),
    }


def reward_curve(samples: Sequence[tuple[int, float]], steps: int, window: int) -> dict[int, float]:
    """Mean group reward by sampling version, per window [lo, lo + window), keyed by the window's end step.

    Windows without a sampled version (possible when kappa > window) are left out.
    """
    sums: dict[int, list[float]] = {}
    for version, reward in samples:
        lo = min(version, steps - 1) // window * window
        sums.setdefault(lo, []).append(reward)
    return {min(lo + window, steps): round(statistics.fmean(xs), 4) for lo, xs in sorted(sums.items())}


def plot(runs: list[dict], out: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        xs = list(run["reward_at_step"])
        ys = list(run["reward_at_step"].values())
        label = (
            f"S={run['staleness']} {'with' if run['is_ratio'] else 'without'} IS ratio, {run['optimizer']} "
            f"(mean staleness {run['staleness_mean']:.1f})"
        )
        ax.plot(xs, ys, marker="o", markersize=3, linestyle="-" if run["is_ratio"] else "--", label=label)
    ax.set_xlabel("learner step (end of window)")
    ax.set_ylabel("reward of sampled groups")
    ax.set_xlim(0, steps)
    ax.set_title("GRPO on ReverseTask under bounded staleness")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def adaptive_run(scenario: str, staleness: int | str, args: argparse.Namespace, tmp: Path, drift_max: float) -> dict:
    """One real hub and its nodes for --steps steps; in `half_leave`, half the nodes stop halfway."""
    from shared.layout import METRICS_FILE
    from testbed.harness import start_hub, start_node, stop_all, wait_until

    steps, window = args.steps, args.window or max(1, args.steps // 4)
    hub_args = [
        "--local-nodes",
        "0",
        "--steps",
        str(steps),
        "--staleness",
        str(staleness),
        "--prompts-per-step",
        str(args.prompts_per_step or 8),
        "--group-size",
        str(args.group_size or 4),
    ]
    if staleness == "auto":
        hub_args += ["--staleness-max", str(args.staleness_max)]
        if args.drift_max is not None:
            hub_args += ["--drift-max", str(args.drift_max)]
    metrics_path = tmp / "hub" / METRICS_FILE

    def steps_done() -> int:
        return len(metrics_path.read_text().splitlines()) if metrics_path.exists() else 0

    started = time.perf_counter()
    hub = start_hub(tmp / "hub", *hub_args)
    nodes = [start_node(hub.addr, tmp / f"node{i}", price=args.node_price) for i in range(args.nodes)]
    try:
        if scenario == "half_leave":
            wait_until(lambda: steps_done() >= steps // 2, ADAPTIVE_RUN_TIMEOUT_S, "half the steps")
            stop_all(nodes[: len(nodes) // 2])
        if hub.process.wait(timeout=ADAPTIVE_RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"hub failed:\n{hub.output()[-3000:]}")
    finally:
        stop_all(nodes)
        hub.kill()
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rewards = [r["rollout_reward_mean"] for r in rows[-window:] if "rollout_reward_mean" in r]
    return {
        "scenario": scenario,
        "staleness": staleness,
        "reward_last": round(statistics.fmean(rewards), 4) if rewards else None,
        "cost_per_step": rows[-1]["cost_per_step_usd"],
        "bubble": round(statistics.fmean(r["bubble"] for r in rows), 3),
        "staleness_final": int(rows[-1]["staleness_budget"]),
        # (step, S) at the start and at each step where the S in force changed
        "staleness_path": [
            (r["step"], int(r["staleness_budget"]))
            for i, r in enumerate(rows)
            if i == 0 or r["staleness_budget"] != rows[i - 1]["staleness_budget"]
        ],
        "staleness_trained_mean": round(statistics.fmean(r["staleness_mean"] for r in rows), 3),
        "drift_mean": round(statistics.fmean(r["abs_log_ratio"] for r in rows), 5),
        "drift_over_bound": round(sum(r["abs_log_ratio"] > drift_max for r in rows) / len(rows), 4),
        "steps": len(rows),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def adaptive_main(args: argparse.Namespace) -> dict:
    """The --adaptive comparison: steady (S = 0 vs auto) and half_leave (each fixed S vs auto), --repeats rounds."""
    from hub.config import LearnerConfig

    drift_max = args.drift_max if args.drift_max is not None else LearnerConfig().drift_max
    runs = [("steady", 0), ("steady", "auto")] + [("half_leave", s) for s in args.fixed] + [("half_leave", "auto")]
    runs = [(scenario, s) for scenario, s in runs if scenario in args.scenarios]
    rows = []
    for repeat in range(args.repeats):
        for scenario, staleness in runs:
            with tempfile.TemporaryDirectory(prefix="echo2-bench-adaptive-") as tmp:
                rows.append({**adaptive_run(scenario, staleness, args, Path(tmp), drift_max), "repeat": repeat})
            if not args.json:
                print(rows[-1], flush=True)
    return {
        "steps": args.steps,
        "nodes": args.nodes,
        "node_price": args.node_price,
        "drift_max": drift_max,
        "runs": rows,
        "comparison": adaptive_comparison(rows),
    }


def adaptive_comparison(rows: Sequence[dict]) -> dict:
    """What the --adaptive rows say, each setting by its median over repeats: steady auto's reward against S = 0's
    (reward_gap: S = 0's less auto's); half_leave auto's cost per step against every fixed S by bench/simulate.py's
    auto_against_fixed, which marks a fixed S eligible when it passed the drift bound at most 5 points more often than
    auto and its reward ended within 0.05 of steady S = 0's."""
    from bench.simulate import FixedRun, auto_against_fixed

    def median(scenario: str, staleness: int | str, key: str) -> float | None:
        values = [r[key] for r in rows if (r["scenario"], r["staleness"]) == (scenario, staleness) and r[key] is not None]
        return statistics.median(values) if values else None

    out: dict = {}
    s0, auto = median("steady", 0, "reward_last"), median("steady", "auto", "reward_last")
    if s0 is not None and auto is not None:
        out["steady"] = {"reward_s0": s0, "reward_auto": auto, "reward_gap": round(s0 - auto, 4)}
    auto_cost = median("half_leave", "auto", "cost_per_step")
    fixed = sorted({r["staleness"] for r in rows if r["scenario"] == "half_leave" and r["staleness"] != "auto"})
    auto_over = median("half_leave", "auto", "drift_over_bound")
    if auto_cost is None or auto_over is None or not fixed:
        return out
    runs = {}
    for s in fixed:
        cost, over = median("half_leave", s, "cost_per_step"), median("half_leave", s, "drift_over_bound")
        if cost is not None and over is not None:
            runs[s] = FixedRun(cost, over, median("half_leave", s, "reward_last"))
    auto_reward = median("half_leave", "auto", "reward_last")
    out["half_leave"] = {
        "auto_cost_per_step": auto_cost,
        "auto_drift_over_bound": auto_over,
        "auto_reward_gap": None if auto_reward is None or s0 is None else round(s0 - auto_reward, 4),
        **auto_against_fixed(auto_cost, auto_over, runs, s0),
    }
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.adaptive:
        result = adaptive_main(args)
        print(json.dumps(result) if args.json else result)
        return result

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from hub.config import HubConfig
    from shared.default_model import ensure_default_model, sample_accuracy

    hf_logging.disable_progress_bar()
    model_dir = ensure_default_model(progress=not args.json)
    sampling = HubConfig().sampling
    specs = [
        RunSpec(s, ratio, optimizer)
        for optimizer in args.optimizers
        for s, ratio in [(s, True) for s in args.staleness] + [(s, False) for s in args.no_is_ratio]
    ]
    step_s = measure_step_s(model_dir, learner_config(specs[0], args), sampling)
    runs = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=args.json,
        transient=True,
    ) as progress:
        for spec in specs:
            label = f"S={spec.staleness} {'ratio' if spec.is_ratio else 'no ratio'} {spec.optimizer}"
            bar = progress.add_task(label, total=args.steps)
            with tempfile.TemporaryDirectory(prefix="echo2-bench-staleness-") as tmp:
                run = run_one(
                    spec,
                    args,
                    model_dir,
                    sampling,
                    args.delay_steps * spec.staleness * step_s,
                    Path(tmp),
                    lambda step, bar=bar: progress.update(bar, completed=step),
                )
            runs.append(run)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.tasks.reverse import ReverseTask

    initial = sample_accuracy(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
        ReverseTask(),
        args.eval_prompts,
        EVAL_SEED,
        sampling.max_new_tokens,
    )
    plot(runs, args.out, args.steps)
    result = {
        "steps": args.steps,
        "calibrated_step_s": round(step_s, 4),
        "delay_steps": args.delay_steps,
        "reward_eval_initial": initial,
        "plot": str(args.out),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
    else:
        from rich import print as rprint

        rprint(result)
    return result


if __name__ == "__main__":
    main()
