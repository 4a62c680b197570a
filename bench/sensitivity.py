"""The unknowns of the ECHO-2 paper's Qwen3-8B run, mapped: $/step of its full run (and of its two ablations) over
the learner's size and the per-worker rate, which the paper does not give, through the simulator itself.

    python bench/sensitivity.py [--config bench/presets/echo2-qwen3-8b.toml] [--learners 2,3,4,5,6,7,8]
                                [--rates 0.1,0.15,...,0.6] [--tolerance 0.02] [--set KEY=VALUE ...]
                                [--json | --markdown]

Each cell is the preset with two values changed, run by bench/simulate.py's own `run_rows` (the hub's capacity
model, scheduler and chain planner, as every simulated row): the learner's price is `learner GPUs x --gpu-price`
(the paper's A100 at $3.06/h), and the first `[[fleet.gpu]]` class (the preset's RTX 5090) produces `rate`
rollouts/s, every other class scaled by the same factor (what sets a rate here is the completion length and the
decode speed, which move every GPU alike; their prices stay). Every capacity rule the preset runs (`run.capacity_rule`)
gets its own grid. A cell matches the paper when its full run's $/step is within --tolerance of the paper's 8.098
(relative); its ablation deltas are then what the simulator says the paper should have seen at that learner and
rate, beside the paper's +4.1% / +6.6% (no peer broadcast, 9 / 10 machines) and +15.3% (no cost-aware
activation).

`--set KEY=VALUE` (a dotted key, a TOML value; repeatable) changes any other key of the preset for every cell:
`--set 'run.capacity_rule=["paper"]'` or `--set run.seeds=1` is one flag. A bad key or value is one line and exit 2.
The default grid (7 x 11 cells, the preset's 3 seeds and 2 rules: 462 simulated runs) took 18 minutes on the loaded
2-core reference machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sim_config import SimConfig, SimConfigError, load_sim_config, with_settings  # noqa: E402
from bench.simulate import EXIT_USAGE_ERROR, ablation, run_rows  # noqa: E402
from hub.method.capacity import InfeasibleCapacity  # noqa: E402
from shared.config import ConfigError, validated  # noqa: E402

PRESET = ROOT / "bench" / "presets" / "echo2-qwen3-8b.toml"
# The paper's ablation, $/step, as the preset quotes it ([[paper_figure]]): the full system, without peer broadcast (9 and
# 10 machines), without cost-aware activation.
_PAPER = {(figure.scenario, figure.nodes): figure.cost_per_step for figure in load_sim_config(PRESET).paper_figure}
PAPER_FULL = _PAPER[("cost-aware", 10)]
PAPER_NO_PEER_BROADCAST = {nodes: cost for (scenario, nodes), cost in sorted(_PAPER.items()) if scenario == "star"}
PAPER_NO_COST_AWARE = _PAPER[("all-on", 10)]
A100_PRICE_PER_HOUR = 3.06  # the paper's learner GPU (Google Cloud)
# The scenarios of the paper's ablation (bench/presets/echo2-qwen3-8b.toml says why), named as bench/simulate.py
# names them (bench.simulate.VARIANTS: full, no_peer_broadcast, no_cost_aware).
ABLATION = ("cost-aware", "star", "all-on")


def cell_config(base: SimConfig, learner_gpus: int, rate: float, gpu_price: float, rule: str) -> SimConfig:
    """`base` with a learner of `learner_gpus` GPUs and its first GPU class at `rate` (the others scaled alike),
    running the three variants under one capacity rule."""
    tree = base.model_dump()
    scale = rate / base.fleet.gpu[0].rollouts_per_s
    tree["learner"]["price_per_hour"] = learner_gpus * gpu_price
    tree["fleet"]["gpu"] = [{**gpu, "rollouts_per_s": gpu["rollouts_per_s"] * scale} for gpu in tree["fleet"]["gpu"]]
    tree["run"]["scenarios"] = list(ABLATION)
    tree["run"]["capacity_rule"] = [rule]
    return validated(SimConfig, tree, f"learner {learner_gpus} GPUs, rate {rate:g}")


def cell(cfg: SimConfig, learner_gpus: int, rate: float, tolerance: float) -> dict:
    """One cell: bench/simulate.py's ablation table for it (the variants' means over the seeds), as the full run's
    $/step, bubble, workers and stale drops, and the other variants' $/step, deltas and workers."""
    rows = {row["variant"]: row for row in ablation(run_rows(cfg, quiet=True))}
    full = rows["full"]
    return {
        "capacity_rule": cfg.run.capacity_rule[0],
        "learner_gpus": learner_gpus,
        "rate_5090": rate,
        "cost_per_step": full["cost_per_step"],
        "off_paper": round(full["cost_per_step"] / PAPER_FULL - 1, 4),
        "matches_paper": abs(full["cost_per_step"] / PAPER_FULL - 1) <= tolerance,
        "bubble": full["bubble_simulated"],
        "nodes_active": full["nodes_active"],
        "stale_dropped_fraction": full["stale_dropped_fraction"],
        **{
            name: {key: rows[name][key] for key in ("cost_per_step", "delta_vs_full", "nodes_active")}
            for name in ("no_peer_broadcast", "no_cost_aware")
        },
    }


def sweep(args: argparse.Namespace) -> dict:
    base = with_settings(load_sim_config(args.config), args.set)
    if base.fleet.file is not None or len(base.fleet.nodes) != 1:
        raise SimConfigError(f"{args.config}: the sweep needs one drawn fleet size (fleet.nodes = [N], no fleet.file)")
    if len(base.run.staleness) != 1:
        raise SimConfigError(f"{args.config}: the sweep needs one S (run.staleness = [S]): a cell is one run's ablation")
    grid = []
    for rule in base.run.capacity_rule:
        for learner_gpus in args.learners:
            for rate in args.rates:
                cfg = cell_config(base, learner_gpus, rate, args.gpu_price, rule)
                grid.append(cell(cfg, learner_gpus, rate, args.tolerance))
                print(
                    f"{rule} rule, learner {learner_gpus} x A100, 5090 {rate:g}/s: ${grid[-1]['cost_per_step']:.3f}/step",
                    file=sys.stderr,
                    flush=True,
                )
    return {
        "config": str(args.config),
        "set": args.set,
        "nodes": base.fleet.nodes[0],
        "seeds": base.run.seeds,
        "tolerance": args.tolerance,
        "paper": {
            "full": PAPER_FULL,
            "no_peer_broadcast": PAPER_NO_PEER_BROADCAST,
            "no_cost_aware": PAPER_NO_COST_AWARE,
            "delta_no_peer_broadcast": {n: round(c / PAPER_FULL - 1, 4) for n, c in PAPER_NO_PEER_BROADCAST.items()},
            "delta_no_cost_aware": round(PAPER_NO_COST_AWARE / PAPER_FULL - 1, 4),
        },
        "grid": grid,
        "matches": [c for c in grid if c["matches_paper"]],
    }


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def markdown(out: dict) -> str:
    """Per capacity rule, the grid of the full run's $/step (matches in bold); then every matching cell with its
    ablation deltas."""
    paper = out["paper"]
    lines = []
    for rule in sorted({c["capacity_rule"] for c in out["grid"]}):
        grid = [c for c in out["grid"] if c["capacity_rule"] == rule]
        rates = sorted({c["rate_5090"] for c in grid})
        at = {(c["learner_gpus"], c["rate_5090"]): c for c in grid}
        lines += [
            f"{rule} capacity rule: $/step of the full run, learner A100s (rows) x rollouts/s of one 5090 (columns); "
            f"**bold**: within {100 * out['tolerance']:g}% of the paper's {paper['full']} ({out['nodes']} workers, "
            f"{out['seeds']} seed(s)).",
            "",
            "| A100s | " + " | ".join(f"{r:g}" for r in rates) + " |",
            "| --- |" + " --- |" * len(rates),
        ]
        for k in sorted({c["learner_gpus"] for c in grid}):
            shown = [
                f"**{c['cost_per_step']:.2f}**" if c["matches_paper"] else f"{c['cost_per_step']:.2f}"
                for c in (at[(k, r)] for r in rates)
            ]
            lines.append(f"| {k} | " + " | ".join(shown) + " |")
        lines.append("")
    no_peer = " / ".join(pct(d) for d in paper["delta_no_peer_broadcast"].values())
    lines += [
        f"The matching cells, and what each implies for the ablation (paper: no peer broadcast {no_peer} at 9 / 10 "
        f"machines, no cost-aware activation {pct(paper['delta_no_cost_aware'])}):",
        "",
        "| rule | A100s | 5090 rollouts/s | $/step | vs 8.098 | learner bubble | workers on | stale dropped "
        "| no peer broadcast | no cost-aware |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in out["matches"]:
        lines.append(
            f"| {c['capacity_rule']} | {c['learner_gpus']} | {c['rate_5090']:g} | {c['cost_per_step']:.3f} | "
            f"{pct(c['off_paper'])} | {c['bubble']:.3f} | {c['nodes_active']:g} | {c['stale_dropped_fraction']:.3f} | "
            f"{pct(c['no_peer_broadcast']['delta_vs_full'])} | {pct(c['no_cost_aware']['delta_vs_full'])} |"
        )
    if not out["matches"]:
        lines.append("| (none within the tolerance) | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def number_list(kind: type, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=PRESET, metavar="SIM.toml", help="the run to vary (default: the paper's)")
    parser.add_argument(
        "--learners", type=lambda t: number_list(int, t), default=[2, 3, 4, 5, 6, 7, 8], help="learner GPU counts"
    )
    parser.add_argument(
        "--rates",
        type=lambda t: number_list(float, t),
        default=[round(0.1 + 0.05 * i, 2) for i in range(11)],
        help="rollouts/s of one worker of the first GPU class (the 5090)",
    )
    parser.add_argument("--gpu-price", type=float, default=A100_PRICE_PER_HOUR, help="$/h of one learner GPU")
    parser.add_argument(
        "--tolerance", type=float, default=0.02, help="a full run within this share of the paper's $8.098/step matches"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a sim.toml key for every cell (TOML value)"
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print the JSON result (the default)")
    shown.add_argument("--markdown", action="store_true", help="print the tables for docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not args.learners or not args.rates or min(args.learners) < 1 or min(args.rates) <= 0:
        print("error: --learners and --rates need positive values", file=sys.stderr)
        return EXIT_USAGE_ERROR
    try:
        out = sweep(args)
    except (ConfigError, InfeasibleCapacity) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    print(markdown(out) if args.markdown else json.dumps(out, sort_keys=True), end="" if args.markdown else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
