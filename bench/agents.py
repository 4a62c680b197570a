"""The embedded tool task end to end (issue 68's evidence): `echo-hub start --task calc` as a user runs it, with its
local nodes, on this machine. The embedded tool model can call its calculator but seldom does; the reward pays the
exact product, which only the tool gives. Every turn goes through the hub's tool loop and sandbox, every group
through the hub's checks and audits.

    python bench/agents.py [--steps 60] [--json] [--plot PNG]

First builds the embedded tool model if it is not cached (timed apart). Prints JSON: the build's seconds and what
its warm-up left (tool calls on the first turn, exact calls when it calls), the run's wall time, the reward's and
the tool calls per rollout's first and last fifth of steps (TRL's tools/call_frequency, over every rollout offered,
not only those trained on), groups accepted and rejected by the checks (all honest here), audits passed, nodes
banned. `--plot` draws both curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.cli.summary import fifth_means  # noqa: E402
from hub.training.metrics import policy_reward, read_metrics  # noqa: E402
from shared.default_model import BUILD_STATS_FILE, ensure_default_model  # noqa: E402
from shared.layout import METRICS_FILE  # noqa: E402
from shared.tool_model import TOOL_MODEL_RECIPE  # noqa: E402
from shared.tools import TOOL_CALLS_METRIC as CALLS  # noqa: E402
from testbed.harness import query, start_hub  # noqa: E402

RUN_TIMEOUT_S = 3600


def run(work: Path, steps: int, quiet: bool) -> dict:
    started = time.monotonic()
    model = ensure_default_model(progress=not quiet and sys.stderr.isatty(), recipe=TOOL_MODEL_RECIPE)
    build_s = time.monotonic() - started
    built = json.loads((model / BUILD_STATS_FILE).read_text())["stats"]
    started = time.monotonic()
    hub = start_hub(work / "hub", "--task", "calc", "--steps", str(steps))
    code = hub.wait_or_kill(RUN_TIMEOUT_S)
    wall = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"echo-hub start --task calc exited with {code}:\n{hub.output()[-3000:]}")
    # A step with no group offered since the one before logs no rollout figures: its curve point is the previous one's.
    rows = [r for r in read_metrics(work / "hub" / METRICS_FILE) if CALLS in r]
    reward_first, reward_last = fifth_means([policy_reward(r) for r in rows])
    calls_first, calls_last = fifth_means([r[CALLS] for r in rows])
    verdicts = dict(query(work / "hub", "SELECT verdict, count(*) FROM trajectories GROUP BY verdict"))
    ((audits, banned),) = query(work / "hub", "SELECT sum(audits_passed), count(banned_reason) FROM nodes")
    return {
        "steps": len(rows),
        "model_build_s": round(build_s, 1),  # ~0 when the model was cached
        "model_build": {k: round(v, 4) if isinstance(v, float) else v for k, v in built.items()},
        "wall_s": round(wall, 1),
        "reward_first": round(reward_first, 4),
        "reward_last": round(reward_last, 4),
        "reward_gain": round(reward_last - reward_first, 4),
        "tool_calls_per_rollout_first": round(calls_first, 4),
        "tool_calls_per_rollout_last": round(calls_last, 4),
        "accepted": verdicts.get("accepted", 0),
        "honest_rejected": verdicts.get("rejected", 0),
        "audits_passed": audits or 0,
        "nodes_banned": banned,
        "curve": [(r["step"], round(policy_reward(r), 4), round(r[CALLS], 4)) for r in rows],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards, calls = zip(*result["curve"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, label="reward (every rollout offered)")
    ax.plot(steps, calls, label="tool calls per rollout")
    ax.set_xlabel("learner step")
    ax.set_ylim(0, 1.05)
    ax.set_title(
        f"echo-hub start --task calc: {result['wall_s']:.0f} s, {result['accepted']} groups, {result['honest_rejected']} rejected"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="learner steps of the run")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--plot", type=Path, help="draw the reward and tool calls per rollout to this PNG")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-agents-") as tmp:
        out = run(Path(tmp), args.steps, args.json)
    if args.plot is not None:
        plot(out, args.plot)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
