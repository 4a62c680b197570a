"""A collapse run (issue 66's evidence): three honest volunteers serve a real hub whose reward pays one fixed
phrase, until the policy says little else and the run has taken tens of thousands of groups. No honest group may
be refused or counted against its node: a collapsed policy repeats itself honestly, so neither the copy rule nor
the sampling test may call it a cheat.

    python bench/collapse.py [--groups 20000] [--lr 2e-3] [--json]

The hub is `echo-hub start` with no local nodes; the volunteers are three `echo-node join` processes on
loopback (not the operator's own nodes: every rule a stranger meets applies to them). The reward is a TRL-style
function paying the share of the phrase a completion starts with, and 1 for the phrase alone, so the policy
collapses onto it: every completion of a group alike, equal rewards, nothing left to learn (the hub warns
`learner_stalled`), while the volunteers go on serving and repeating themselves honestly. The run ends once `--groups` were accepted. Prints JSON: groups accepted, refused by reason (copies apart),
each node's tallies and sampling evidence beside the hub's bar, audits passed and failed, how collapsed the
newest accepted groups are (all alike, the phrase's share, distinct completions), the reward's first and last
fifth, and the wall time.
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
from shared.layout import METRICS_FILE  # noqa: E402
from shared.messages import GroupReason  # noqa: E402
from shared.rollout import Group  # noqa: E402
from testbed.harness import query, start_hub, start_node, stop_all, wait_until  # noqa: E402

PHRASE = "aaaa"
REWARD = f'''
PHRASE = {PHRASE!r}


def one_phrase(completions, **kwargs):
    """1 for the phrase alone; else the share of its letter in the completion, halved: a slope to climb."""
    return [1.0 if text.strip() == PHRASE else 0.5 * text.count(PHRASE[0]) / max(len(text), 1) for text in completions]
'''
# Accepted groups (the newest) read back from the store to measure the collapse.
COLLAPSE_SAMPLE = 1000
PROMPTS_PER_STEP = 32
GROUP_SIZE = 8


def run(base: Path, groups: int, quiet: bool, lr: float | None) -> dict:
    (base / "collapse_reward.py").write_text(REWARD)
    hub = start_hub(
        base / "hub",
        "--local-nodes",
        "0",
        "--steps",
        "0",
        "--reward",
        f"{base / 'collapse_reward.py'}:one_phrase",
        "--prompts-per-step",
        str(PROMPTS_PER_STEP),
        "--group-size",
        str(GROUP_SIZE),
        "--max-new-tokens",
        "6",
        "--no-progress",
        *(("--lr", str(lr)) if lr is not None else ()),
    )
    nodes = [start_node(hub.addr, base / f"node-{i}", "--name", f"honest-{i}") for i in range(3)]
    started = time.monotonic()
    try:

        def done():
            status = hub.status()
            if status is not None and not quiet:
                print(f"\r{status.totals.accepted} of {groups} groups accepted", end="", file=sys.stderr, flush=True)
            return status if status is not None and status.totals.accepted >= groups else None

        status = wait_until(done, 6 * 3600, f"{groups} groups accepted", poll_s=2.0)
    finally:
        stop_all([*nodes, hub])
    wall = time.monotonic() - started
    rows = read_metrics(base / "hub" / METRICS_FILE)
    first, last = fifth_means([policy_reward(r) for r in rows])
    refused = status.reasons
    return {
        "groups_accepted": status.totals.accepted,
        "steps": len(rows),
        "warnings": sorted({w.kind for w in status.warnings}),
        "refused": {k: v for k, v in refused.items() if k != GroupReason.LATE},
        "late": refused.get(GroupReason.LATE, 0),
        "copies_refused": refused.get(GroupReason.COPY, 0),
        "nodes": [
            {
                "name": n.name,
                "state": n.state,
                "accepted": n.tallies.accepted,
                "rejected": n.tallies.rejected,
                "audits_passed": n.audits_passed,
                "sampling_nats": n.sampling_nats,
            }
            for n in status.nodes
        ],
        "sampling_threshold_nats": status.sampling_threshold_nats,
        "audits_passed": status.audits_passed,
        "audits_failed": status.audits_failed,
        **collapse(base / "hub"),
        "reward_first": round(first, 4),
        "reward_last": round(last, 4),
        "wall_s": round(wall, 1),
    }


def collapse(hub_dir: Path) -> dict:
    """How collapsed the newest accepted groups are: the share whose completions are all alike, the share of
    completions that are the phrase, and the distinct completions among them."""
    rows = query(hub_dir, "SELECT group_json FROM payloads ORDER BY id DESC LIMIT ?", (COLLAPSE_SAMPLE,))
    groups = [Group.model_validate_json(row[0]) for row in rows]
    texts = [c.text for g in groups for c in g.completions]
    return {
        "groups_sampled": len(groups),
        "groups_all_alike": round(sum(len({c.text for c in g.completions}) == 1 for g in groups) / len(groups), 4),
        "phrase_share": round(sum(t.strip() == PHRASE for t in texts) / len(texts), 4),
        "distinct_completions": len(set(texts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=20_000, help="groups the run takes (steps x prompts per step)")
    parser.add_argument("--lr", type=float, help="the learner's rate (default: echo-hub's); 2e-3 collapses in a few steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-collapse-") as tmp:
        out = run(Path(tmp), args.groups, args.json, args.lr)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
