"""The main job end to end, timed: `echo-hub start` with 3 local nodes, default recipe, against the same run with S = 0.

    python bench/e2e.py [--json] [--steps 300] [--nodes 3]

Prints {"default": {...}, "s0": {...}} with reward of the first and last fifth of steps (the
rollout reward: every group the policy produced, zero-variance ones included), wall time,
mean bubble ratio, trajectories accepted and steps. S = 0 is the synchronous baseline: every
rollout is made by the current policy, so nodes wait for each snapshot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.cli.summary import fifth_means  # noqa: E402
from hub.training.metrics import policy_reward, read_metrics  # noqa: E402
from shared.layout import HUB_STATUS_FILE, METRICS_FILE  # noqa: E402
from shared.messages import HubStatus  # noqa: E402


def run(data_dir: Path, steps: int, nodes: int, extra: list[str], quiet: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "hub.cli",
        "start",
        "--data-dir",
        str(data_dir),
        "--steps",
        str(steps),
        "--local-nodes",
        str(nodes),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        *extra,
    ]
    if quiet:
        cmd.append("--no-progress")
    started = time.monotonic()
    result = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.STDOUT if quiet else None
    )
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"echo-hub start failed with {result.returncode} (data dir {data_dir})")
    rows = read_metrics(data_dir / METRICS_FILE)
    first, last = fifth_means([policy_reward(r) for r in rows])
    status = HubStatus.model_validate_json((data_dir / HUB_STATUS_FILE).read_text())
    return {
        "reward_first": round(first, 4),
        "reward_last": round(last, 4),
        "wall_s": round(wall, 1),
        "bubble": round(sum(r["bubble"] for r in rows) / len(rows), 4),
        "accepted": status.totals.accepted,
        "steps": len(rows),
        "staleness_mean": round(sum(r["staleness_mean"] for r in rows) / len(rows), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-e2e-") as tmp:
        out = {
            "default": run(Path(tmp) / "default", args.steps, args.nodes, [], args.json),
            "s0": run(Path(tmp) / "s0", args.steps, args.nodes, ["--staleness", "0"], args.json),
        }
    out["default"]["reward_gain"] = round(out["default"]["reward_last"] - out["default"]["reward_first"], 4)
    out["s0"]["reward_gain"] = round(out["s0"]["reward_last"] - out["s0"]["reward_first"], 4)
    out["wall_ratio_s0_over_default"] = round(out["s0"]["wall_s"] / out["default"]["wall_s"], 3)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
