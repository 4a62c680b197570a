"""Capacity model against a real run: measured learner bubble vs predicted_bubble over a sweep of
pool throughputs, and cost per step with cost-aware activation vs every node active.

Usage: python bench/capacity.py [--json] [--out bench/out/capacity.png] [--target-se 0.02] [--settle-steps 3]

Sweep: one hub (`echo-hub start`, [scheduler] enabled = false, so every node works) and real
`echo-node join` processes on loopback throttled with --max-rollouts-per-s, at a lower CPU priority than
the hub (NODE_NICE). The first node (--first-rollouts-per-s) gets the learner stepping; from the measured T_train and T_bcast the
bench computes mu_min and adds one node per point so that the pool reaches the --fractions of
mu_min. Each point waits until the new node is measured and active, lets --settle-steps learner
steps pass (the new node slows the learner on a small machine, and T_train is a recent mean), then
averages over the next learner steps, at least --steps-per-point and until the measured bubble's
standard error is at most --target-se (per-step bubbles range from 0 to 0.7 near mu_min, so 30 steps
leave an error of about 0.05): measured bubble = sum(T_idle) / sum(T_idle + T_train)
(metrics.jsonl), predicted = hub.method.capacity.predicted_bubble(kappa, R / usable, mean T_train, mean
T_bcast, mu_pool) with mu_pool the hub's measured pool throughput and usable the share the hub sizes by
(metrics.jsonl), over the same steps: the per-period balance, every node charged T_bcast's stall, under each
capacity rule (refined: only past (S - kappa) T_train; paper: all of it), whose mean absolute errors
`rule_errors` gives: the hub's default rule is the one that measures closer; hub_predicted_bubble is the mean of the hub's own per-step predictions
(metrics.jsonl), which charge each node its own install's stall (hub.method.capacity.pool_stall_s) and also
count the first step that needs the newest version (hub.method.capacity.first_step_idle_s), both from when
heartbeats showed each node holding it.

Cost: two hubs with the same fleet (one unthrottled node at $0.35/h, three throttled ones at
$0.30-0.80/h), one with the scheduler on and one with [scheduler] enabled = false; cost per
step = (learner $/h * wall time + node ledger) over the steps --cost-steps after --cost-warmup
steps (differences of status.json's cost_usd, so start-up time is not counted).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from hub.method.capacity import InfeasibleCapacity, mu_min, predicted_bubble, rule_staleness
from hub.training.metrics import read_metrics
from shared.layout import METRICS_FILE
from shared.messages import HubStatus
from testbed.harness import HubProc, Proc, node_peer_id, start_hub, start_node

STALENESS = 4
KAPPA = 3
PROMPTS_PER_STEP = 2
GROUP_SIZE = 64
ROLLOUTS_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE
LEARNER_PRICE_PER_HOUR = 3.06
NODE_START_S = 240.0
POINT_TIMEOUT_S = 240.0
POLL_S = 0.5
# Nodes run at a lower CPU priority than the hub: deployed, the learner has its own GPU, while here up to
# five node processes share two cores with it and would otherwise slow the learner and the hub's event loop
# in a way the capacity model (which takes T_train and each node's throughput as given) does not describe.
NODE_NICE = 5
# Batches for the measured bubble's standard error: two broadcast periods of kappa steps each, and at
# least MIN_SE_BATCHES of them before the error is trusted (from 6 batches it is itself off by ~30%).
SE_BATCH_STEPS = 2 * KAPPA
MIN_SE_BATCHES = 10
# name -> (price $/h, --max-rollouts-per-s or None: unthrottled)
COST_FLEET = {"fast": (0.35, None), "slow-a": (0.30, 20.0), "slow-b": (0.50, 30.0), "slow-c": (0.80, 50.0)}


def hub_toml(scheduler_enabled: bool) -> str:
    return f"""
steps = 0
local_nodes = 0
[learner]
staleness = {STALENESS}
kappa = {KAPPA}
prompts_per_step = {PROMPTS_PER_STEP}
group_size = {GROUP_SIZE}
checkpoint_every = 100000
learner_price_per_hour = {LEARNER_PRICE_PER_HOUR}
[lease]
prompts_per_lease = 1
lease_timeout_s = 60
max_inflight_steps = 4
[scheduler]
enabled = {"true" if scheduler_enabled else "false"}
control_period_s = 0.5
heartbeat_timeout_s = 10
"""


@dataclass(frozen=True)
class Point:
    mu_pool: float
    measured_bubble: float
    measured_se: float  # standard error of measured_bubble (batch means of SE_BATCH_STEPS steps)
    predicted_bubble: float  # the refined rule's (the broadcast stalls only past (S - kappa) T_train)
    predicted_bubble_paper: float  # the paper's rule's (the whole T_bcast stalls every period)
    # The hub's own per-step prediction (metrics.jsonl), which also models the first step that needs the
    # newest version from when the pool got it (hub.method.capacity.first_step_idle_s); None if it made none.
    hub_predicted_bubble: float | None
    t_train_s: float
    t_bcast_s: float
    mu_min: float | None  # None: kappa*T_train <= T_bcast at this point, no pool keeps the learner busy
    usable_fraction: float  # the share the hub sizes by (stale drops counted as usable); the model plans for R / this
    steps: int


class Run:
    """One hub and its nodes; everything is stopped on exit."""

    def __init__(self, root: Path, scheduler_enabled: bool) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config = root / "hub.toml"
        config.write_text(hub_toml(scheduler_enabled))
        self.root = root
        self.hub: HubProc = start_hub(root / "hub", "--config", str(config))
        self.nodes: dict[str, Proc] = {}
        self.ids: dict[str, str] = {}

    def add_node(self, name: str, price: float, rollouts_per_s: float | None) -> None:
        args = ("--max-rollouts-per-s", f"{rollouts_per_s:.2f}") if rollouts_per_s else ()
        self.nodes[name] = start_node(self.hub.addr, self.root / name, *args, price=price, nice=NODE_NICE)

    def wait_ids(self) -> None:
        for name, proc in self.nodes.items():
            if name not in self.ids:
                self.ids[name] = node_peer_id(proc, timeout_s=NODE_START_S)

    def wait(self, predicate, what: str, timeout_s: float = POINT_TIMEOUT_S) -> HubStatus:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.hub.process.poll() is not None:
                raise RuntimeError(f"hub exited: {self.hub.output()[-2000:]}")
            status = self.hub.status()
            if status is not None and predicate(status):
                return status
            time.sleep(POLL_S)
        raise TimeoutError(f"timed out waiting for {what}")

    def state(self, status: HubStatus, name: str) -> str | None:
        return next((n.state for n in status.nodes if n.peer_id == self.ids.get(name)), None)

    def close(self) -> None:
        for proc in self.nodes.values():
            proc.kill()
        self.hub.stop()


def bubble_and_se(rows: list[dict], batch: int) -> tuple[float, float]:
    """Measured bubble sum(T_idle) / sum(T_idle + T_train) over metrics rows, and its standard error from the
    means of consecutive batches of `batch` steps (per-step bubbles are far from independent: with kappa
    steps per broadcast they repeat in a pattern, so a batch spans whole patterns); inf with < 2 batches."""
    idle = sum(m["t_idle_s"] for m in rows)
    bubble = idle / (idle + sum(m["t_train_s"] for m in rows))
    batches = [rows[i : i + batch] for i in range(0, len(rows) - batch + 1, batch)]
    if len(batches) < 2:
        return bubble, math.inf
    means = [sum(m["t_idle_s"] for m in b) / sum(m["t_idle_s"] + m["t_train_s"] for m in b) for b in batches]
    return bubble, statistics.stdev(means) / math.sqrt(len(means))


def collect(run: Run, min_steps: int, max_steps: int, target_se: float) -> tuple[list[HubStatus], list[dict]]:
    """Status samples and metrics rows over the next learner steps: at least `min_steps`, then until the
    measured bubble's standard error is at most `target_se` or `max_steps` have passed."""
    first = run.hub.status().step
    samples: list[HubStatus] = []
    last_step, last_change = first, time.monotonic()
    while True:
        status = run.wait(lambda s: True, "status")
        samples.append(status)
        if status.step == last_step:
            if time.monotonic() - last_change > POINT_TIMEOUT_S:
                raise RuntimeError(f"no learner step for {POINT_TIMEOUT_S:.0f}s after step {status.step}")
        elif status.step >= first + min_steps:  # the error changes only with a new step: read metrics then
            rows = [m for m in read_metrics(run.hub.data_dir / METRICS_FILE) if first < m["step"] <= status.step]
            if status.step >= first + max_steps or bubble_and_se(rows, SE_BATCH_STEPS)[1] <= target_se:
                return samples, rows
        if status.step != last_step:
            last_step, last_change = status.step, time.monotonic()
        time.sleep(POLL_S)


def measure_point(run: Run, settle_steps: int, min_steps: int, max_steps: int, target_se: float) -> Point:
    # A new node slows the learner too (this machine's cores run both), and the hub's T_train is a recent
    # mean: measure once that has caught up, not the transient.
    start = run.hub.status().step
    run.wait(lambda s: s.step >= start + settle_steps, f"{settle_steps} steps to settle")
    samples, rows = collect(run, min_steps, max_steps, target_se)
    bubble, se = bubble_and_se(rows, SE_BATCH_STEPS)
    t_train = sum(m["t_train_s"] for m in rows) / len(rows)
    mu_pool = sum(s.mu_pool for s in samples) / len(samples)
    # The usable share the hub's scheduler plans by (metrics.jsonl's: hub.method.capacity.fresh_usable_fraction).
    usable = sum(m["usable_fraction"] for m in rows) / len(rows)
    rollouts_per_step = ROLLOUTS_PER_STEP / usable
    bcasts = [s.t_bcast_s for s in samples if s.t_bcast_s is not None]
    t_bcast = sum(bcasts) / len(bcasts)
    hub_predicted = [m["predicted_bubble"] for m in rows if m.get("predicted_bubble") is not None]
    return Point(
        mu_pool=mu_pool,
        measured_bubble=bubble,
        measured_se=se,
        predicted_bubble=predicted_bubble(
            KAPPA, rollouts_per_step, t_train, t_bcast, mu_pool, rule_staleness("refined", STALENESS)
        ),
        predicted_bubble_paper=predicted_bubble(
            KAPPA, rollouts_per_step, t_train, t_bcast, mu_pool, rule_staleness("paper", STALENESS)
        ),
        hub_predicted_bubble=sum(hub_predicted) / len(hub_predicted) if hub_predicted else None,
        t_train_s=t_train,
        t_bcast_s=t_bcast,
        mu_min=feasible_mu_min(rollouts_per_step, t_train, t_bcast),
        usable_fraction=usable,
        steps=len(rows),
    )


def feasible_mu_min(rollouts_per_step: float, t_train: float, t_bcast: float) -> float | None:
    try:
        return mu_min(KAPPA, rollouts_per_step, t_train, t_bcast, STALENESS)
    except InfeasibleCapacity:
        return None


def rule_errors(points: list[Point]) -> dict[str, float]:
    """Each capacity rule's mean absolute error against the measured bubble: the default rule is the one that
    measures closer (hub/config.py's scheduler.capacity_rule)."""
    return {
        "refined": statistics.fmean(abs(p.predicted_bubble - p.measured_bubble) for p in points),
        "paper": statistics.fmean(abs(p.predicted_bubble_paper - p.measured_bubble) for p in points),
    }


def describe(point: Point) -> str:
    needed = "infeasible" if point.mu_min is None else f"{point.mu_min:.1f}/s"
    return (
        f"mu_pool {point.mu_pool:.1f}/s (mu_min {needed}): "
        f"bubble {point.measured_bubble:.3f} ± {point.measured_se:.3f} measured over {point.steps} steps, "
        f"{point.predicted_bubble:.3f} predicted ({point.predicted_bubble_paper:.3f} by the paper's rule)"
        + ("" if point.hub_predicted_bubble is None else f" ({point.hub_predicted_bubble:.3f} by the hub)")
    )


def measured_broadcast(status: HubStatus) -> bool:
    # v0 goes out before any node is there; the first real T_bcast is that of v_kappa.
    return status.step > KAPPA + 1 and status.t_bcast_s is not None


def sweep(root: Path, first_mu: float, fractions: list[float], measure, say) -> list[Point]:
    run = Run(root / "sweep", scheduler_enabled=False)
    points: list[Point] = []
    try:
        run.add_node("n0", 0.35, first_mu)
        run.wait_ids()
        run.wait(lambda s: measured_broadcast(s) and run.state(s, "n0") == "active", "the first node and T_bcast")
        points.append(measure(run))
        say(describe(points[-1]))
        estimate = points[0].mu_min
        if estimate is None:
            raise RuntimeError(f"cannot size the sweep: {describe(points[0])}; T_bcast too close to kappa*T_train")
        pool = first_mu
        for index, fraction in enumerate(fractions, start=1):
            extra = fraction * estimate - pool
            if extra <= 1.0:
                continue
            name = f"n{index}"
            run.add_node(name, 0.35, extra)
            run.wait_ids()
            run.wait(lambda s, name=name: run.state(s, name) == "active", f"{name} to be measured and active")
            pool += extra
            points.append(measure(run))
            say(describe(points[-1]))
    finally:
        run.close()
    return points


def cost_per_step(root: Path, scheduler_enabled: bool, warmup: int, steps: int) -> float:
    run = Run(root / ("cost-aware" if scheduler_enabled else "all-on"), scheduler_enabled)
    try:
        for name, (price, throttle) in COST_FLEET.items():
            run.add_node(name, price, throttle)
        run.wait_ids()
        start = run.wait(
            lambda s: s.step >= warmup and all(run.state(s, n) is not None for n in COST_FLEET),
            "warm-up steps",
            timeout_s=POINT_TIMEOUT_S * 2,
        )
        end = run.wait(lambda s: s.step >= start.step + steps, "measured steps", timeout_s=POINT_TIMEOUT_S * 2)
        return (end.cost_usd - start.cost_usd) / (end.step - start.step)
    finally:
        run.close()


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(points, key=lambda p: p.mu_pool)
    # Absolute throughput: mu_min moves with the measured T_bcast and can be undefined at a point.
    x = [p.mu_pool for p in ordered]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [p.predicted_bubble for p in ordered], "o--", label="predicted, refined rule (per-period balance)")
    ax.plot(x, [p.predicted_bubble_paper for p in ordered], "s--", label="predicted, paper's rule (whole T_bcast stalls)")
    if all(p.hub_predicted_bubble is not None for p in ordered):
        ax.plot(x, [p.hub_predicted_bubble for p in ordered], "^:", label="predicted by the hub (own installs, first step)")
    ax.errorbar(
        x,
        [p.measured_bubble for p in ordered],
        yerr=[2 * p.measured_se for p in ordered],
        fmt="s-",
        capsize=3,
        label="measured (learner T_idle), ± 2 standard errors",
    )
    ax.set_xlabel("mu_pool, accepted rollouts/s (measured)")
    ax.set_ylabel("bubble ratio")
    ax.set_ylim(-0.02, 1.0)
    usable = sum(p.usable_fraction for p in ordered) / len(ordered)
    ax.set_title(
        f"learner bubble vs pool throughput\nkappa={KAPPA}, R={ROLLOUTS_PER_STEP}, sized by {usable:.0%} of accepted groups usable",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out" / "capacity.png")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep data dirs here (default: a temp dir)")
    parser.add_argument("--first-rollouts-per-s", type=float, default=40.0)
    parser.add_argument("--fractions", default="0.5,0.8,1.3,2.0", help="pool throughputs to reach, as fractions of mu_min")
    parser.add_argument(
        "--steps-per-point", type=int, default=MIN_SE_BATCHES * SE_BATCH_STEPS, help="learner steps measured per point, at least"
    )
    parser.add_argument("--max-steps-per-point", type=int, default=240, help="at most, if the target error is not met")
    parser.add_argument(
        "--target-se", type=float, default=0.02, help="measure a point until its bubble's standard error is at most this"
    )
    parser.add_argument("--settle-steps", type=int, default=3, help="steps skipped after each new node, before measuring")
    parser.add_argument("--cost-warmup", type=int, default=10)
    parser.add_argument("--cost-steps", type=int, default=15)
    parser.add_argument("--skip-cost", action="store_true", help="only the bubble sweep")
    args = parser.parse_args()
    if args.steps_per_point < MIN_SE_BATCHES * SE_BATCH_STEPS:
        parser.error(
            f"--steps-per-point {args.steps_per_point}: at least {MIN_SE_BATCHES * SE_BATCH_STEPS} "
            f"({MIN_SE_BATCHES} batches of {SE_BATCH_STEPS} steps) for a standard error to trust"
        )
    if args.max_steps_per_point < args.steps_per_point:
        parser.error(f"--max-steps-per-point {args.max_steps_per_point}: at least --steps-per-point ({args.steps_per_point})")

    import tempfile

    from rich.console import Console

    console = Console(stderr=True, quiet=args.json)

    def say(line: str) -> None:
        console.log(line)

    root = args.work_dir or Path(tempfile.mkdtemp(prefix="echo2-capacity-"))
    fractions = [float(f) for f in args.fractions.split(",")]
    with console.status("bubble sweep"):
        points = sweep(
            root,
            args.first_rollouts_per_s,
            fractions,
            lambda run: measure_point(run, args.settle_steps, args.steps_per_point, args.max_steps_per_point, args.target_se),
            say,
        )
    plot(points, args.out)
    result: dict[str, object] = {
        "sweep": [
            {
                "mu_pool": p.mu_pool,
                "measured_bubble": p.measured_bubble,
                "measured_se": p.measured_se,
                "predicted_bubble": p.predicted_bubble,
                "predicted_bubble_paper": p.predicted_bubble_paper,
                "hub_predicted_bubble": p.hub_predicted_bubble,
            }
            for p in points
        ],
        "points": [asdict(p) for p in points],
        "rule_errors": rule_errors(points),
        "plot": str(args.out),
    }
    if not args.skip_cost:
        with console.status("cost: cost-aware activation"):
            result["cost_aware_cost_per_step"] = cost_per_step(root, True, args.cost_warmup, args.cost_steps)
        say(f"cost-aware: ${result['cost_aware_cost_per_step']:.6f}/step")
        with console.status("cost: every node active"):
            result["all_on_cost_per_step"] = cost_per_step(root, False, args.cost_warmup, args.cost_steps)
        say(f"all on: ${result['all_on_cost_per_step']:.6f}/step")
    if args.json:
        print(json.dumps(result))
    else:
        console.print_json(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
