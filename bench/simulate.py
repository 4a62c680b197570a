"""Fleet simulator: the method at 10 to 10,000 volunteers in simulated time, driven by the project's own code.

    python bench/simulate.py [--config SIM.toml] [--set KEY=VALUE ...] [--fleet FLEET.toml] [--nodes 10,100,1000,10000]
                             [--seeds 1] [--fleet-seed K] [--steps K] [--json] [--plot PNG]

`--config` sets everything below that is drawn or fixed (bench/sim_config.py: the GPU mix with rates and prices,
links, churn, NAT share, T_train, snapshot size, R, S (ints or `auto`), kappa, gamma, price changes over time and
fleet changes mid-run); `--set KEY=VALUE` (a dotted key, a TOML value; repeatable, as in bench/sensitivity.py)
changes one key of it, and the other flags override both; a bad value is one line and exit 2.

It prints the ablation table (per fleet size and S: $/step of each variant under each capacity rule, its change
against the full run and the workers on, beside the paper's figures where sim.toml's [[paper_figure]] gives them) and
cost-aware's saving over the seeds; `--json` prints every row instead (`ablation`: the table's rows). A fleet
size outside the one the links were fitted to (links.fitted_nodes) gets a warning line and is listed in the
JSON's `links_outside_fit`: its T_bcast is the broadcast model's extrapolation.
`--fleet` (or fleet.file) takes `echo-hub plan`'s FLEET.toml as the fleet; `--help` ends with every section and
key of sim.toml. bench/presets/ holds the ECHO-2 paper's Qwen3-8B ablation and its broadcast-scaling figure (every
value quoted from the paper, derived, or marked as an assumption) and a fleet that halves mid-run. Rows carry their
`staleness` setting; `auto` rows choose S each publish period through the hub's own rule
(hub.control.staleness.choose_staleness over staleness_costs), the drift being drift_per_version times the mean
age of the rollouts a step trained on, read as the hub reads its own (hub.method.drift; no model runs here). Every
row gets that drift per second-half step (drift_mean, and drift_over_bound: the share of steps above drift_max),
and `staleness_comparison` sets auto against the cheapest fixed S that stayed within the bound, and against the
cheapest fixed S whatever its drift. A price change is paid at once and ranked as the hub ranks it
(hub.method.prices.ranking_price, scheduler.price_band); a NATed pair on a chain waits for a hole punch
(hub.method.chains.link_kind).

Unchanged project code decides: the hub scheduler's capacity model (`hub.control.policy.capacity_view`) and its own
policy `hub.control.policy.decide` (activate everything until T_train is known, then per control period one
set of nodes activated at once or released once it has been wanted for release RELEASE_HOLD_PERIODS periods
on end), `hub.method.chains.plan_chains` (who relays to whom), `hub.method.capacity.default_kappa`, the
learner's version floor (`hub.records.measurements.oldest_useful_version`: a node holding a version older than
the learner can use gets no lease) and the buffer's cutoff (`hub.records.buffer.usable_from`: a group of version
x is used at step t only if (t - 1) - x <= S, with S the window's: a lowered S keeps the old one for S_old more
steps, `hub.records.measurements.grace_staleness` and `grace_after_lowering`, as the learner keeps it); the buffer is
consumed oldest first.

What is drawn by default (per seed; documented so the figures can be argued with):
- Volunteers: a GPU mix of 35% RTX 3060-class (6 rollouts/s at $0.10/h), 35% RTX 4090-class
  (20/s, $0.35/h), 20% A100-class (35/s, $1.10/h), 10% H100-class (60/s, $2.50/h), each rate and
  price times a lognormal factor (sigma 0.25). Links: lognormal, median 500 Mbit/s (sigma 0.5),
  clipped to [100, 2000] (a slower volunteer could not take a snapshot within kappa * T_train). Churn: online sessions Exp(mean 2 h), offline spells Exp(mean 30 min); 80% online
  at start. A joining node is measured by a probe lease (30 s) before the scheduler may use it.
- Learner: T_train ~ Normal(60 s, 10%), S = 4, kappa = default_kappa(S) = 3, usable fraction 0.7,
  $3.06/h. Snapshot 1.2 GB (a 0.6B model in bf16), 1 MiB chunks, hub uplink 10 Gbit/s, 50 ms per hop.
- Demand scales with the fleet: R is set so that mu_min (the hub's, at the whole fleet's chain
  broadcast time) is --demand (0.3) of its expected online throughput, so cost-aware activation
  has the same choice to make at every N; the scheduler asks for gamma = 1.1 times that over the
  usable fraction it measures. Above about 0.6 the fleet falls short and the learner idles, which
  is where the bubble model is tested hardest.

Broadcast: a node at position j of its chain holds version v at publish + M / b + j * (c / b + hop
latency), b the slowest rate on its path (its own link, every link before it, the hub's share
B0 / N_ch); in the star scenario each node gets M / min(Bw, B0 / N). A node that joins mid-run
pulls the newest snapshot at its own link rate; chains are re-planned at each publish.

Production is fluid: between events each producing node adds rate * dt rollouts of the version it
holds (times the usable fraction). A node switches to a new version one lease (prompts_per_lease *
group_size rollouts at its rate) after the snapshot arrives: it finishes its lease with the version it
had, and hands the new one's rollouts in a lease at a time. Request rates at the hub: joins and leaves as drawn, heartbeats
at the period the hub tells its online nodes (`hub.records.fleet.heartbeat_period`: every 2 s up to
scheduler.heartbeats_per_s in all), one lease-carrying submission per prompts_per_lease *
group_size rollouts (4 x 16).

The predicted bubble is hub.method.capacity.predicted_bubble with each active node's start on the newest
version, as the hub times it (the per-period stall is their throughput-weighted mean, pool_stall_s), and
half a lease of lag per active node (hub.method.capacity.first_step_idle_s:
the first step that can use nothing older waits for that version's rollouts; at 1,000+ nodes that
step, not the per-period balance, is where the learner idles).

Scenarios: cost-aware (the scheduler as above), all-on (every measured node active), star
(cost-aware with a star broadcast) and sync (S = 0, kappa = 1: every step waits for the broadcast
of the previous one). Figures are taken over the second half of the steps (the first half is the
ramp); `ramp_s` says when the active pool first reached the target.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pydantic import ValidationError  # noqa: E402

from bench.sim_config import PaperFigure, SimConfig, SimConfigError, load_sim_config, with_settings  # noqa: E402
from hub.cli.plan import PlanError, load_fleet  # noqa: E402
from hub.config import LeaseConfig, SchedulerConfig  # noqa: E402
from hub.control.policy import CapacityView, FleetView, capacity_view, decide  # noqa: E402
from hub.control.staleness import StalenessHold, choose_staleness, staleness_costs  # noqa: E402
from hub.method.capacity import (  # noqa: E402
    Arrival,
    CapacityRule,
    InfeasibleCapacity,
    NodeOffer,
    default_kappa,
    mu_min,
    predicted_bubble,
    rule_staleness,
    turned_rollouts_per_s,
)
from hub.method.chains import link_kind, plan_chains  # noqa: E402
from hub.method.drift import DriftMeter  # noqa: E402
from hub.method.prices import ranking_price  # noqa: E402
from hub.records.buffer import fresh_room, usable_from  # noqa: E402
from hub.records.fleet import heartbeat_period  # noqa: E402
from hub.records.measurements import grace_after_lowering, grace_staleness, next_take, oldest_useful_version, takes_served  # noqa: E402
from shared.config import reference_markdown  # noqa: E402
from shared.units import BYTES_PER_MBIT  # noqa: E402

# The simulator's documented fleet (the docstring's), unless --config says otherwise.
DEFAULT = SimConfig()
STALENESS = DEFAULT.run.staleness[0]
NODE_STEPS_MEASURED = 200_000
EXIT_USAGE_ERROR = 2
# The decision on adaptive staleness (issue 40): auto is held against the fixed S that keep the drift bound as well
# as it does, give or take this share of steps, and whose reward ends within REWARD_GAP_MAX of S = 0's; its cost
# must be at most AUTO_COST_SLACK times the cheapest of those.
DRIFT_SHARE_SLACK = 0.05
REWARD_GAP_MAX = 0.05
AUTO_COST_SLACK = 1.02


@dataclass
class Node:
    name: str
    rate: float
    price: float
    link_bps: float
    reach: str = "public"  # or "nated": hub.method.chains.link_kind says how its chain hop connects
    online: bool = False
    state: str = "offline"  # offline | probing | standby | active
    held: int = -1  # version installed
    session: int = 0  # online sessions so far: a leave drawn for an earlier one (ended early) is dropped
    away_until: float = 0.0  # a fleet change took it away until then (math.inf: for good)
    offer: NodeOffer = field(init=False)  # what the scheduler sees: measured rate, price at its ranking (band)

    def __post_init__(self) -> None:
        self.offer = NodeOffer(self.name, self.price, self.rate)

    def reprice(self, price: float, band: float) -> None:
        """A new declared price: paid from now on, ranked as the hub ranks it (hub.method.prices.ranking_price)."""
        self.price = price
        self.offer = NodeOffer(self.name, ranking_price(self.offer.price_per_hour, price, band), self.rate)


@dataclass(frozen=True)
class Scenario:
    name: str
    staleness: int | str  # an int, or "auto" (hub.control.staleness chooses it each publish period)
    broadcast: str
    scheduler: bool
    capacity_rule: CapacityRule = "refined"  # how the scheduler's capacity model charges the broadcast


# The paper's ablation names for the scenarios (its "full system", "without peer broadcast", "without cost-aware
# activation"); sync has none there.
VARIANTS = {"cost-aware": "full", "star": "no_peer_broadcast", "all-on": "no_cost_aware", "sync": "sync"}
# The printed table's rows (in this order) and columns (each capacity rule run, the hub's default first).
VARIANT_LABELS = {
    "full": "full ECHO-2",
    "no_peer_broadcast": "no peer broadcast",
    "no_cost_aware": "no cost-aware activation",
    "sync": "sync (S = 0)",
}
RULE_LABELS: dict[CapacityRule, str] = {"refined": "hub's refined rule (default)", "paper": "paper's capacity rule"}

SCENARIOS = {
    "cost-aware": Scenario("cost-aware", STALENESS, "chain", True),
    "all-on": Scenario("all-on", STALENESS, "chain", False),
    "star": Scenario("star", STALENESS, "star", True),
    "sync": Scenario("sync", 0, "chain", True),
}


def class_counts(n: int, cfg: SimConfig = DEFAULT) -> list[int]:
    """How many volunteers of each GPU mix class a fleet of n has: the shares, rounded by largest remainder
    (ties to the earlier class), so every fleet of one size has the same mix."""
    exact = [g.share * n for g in cfg.fleet.gpu]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def draw_fleet(n: int, rng: random.Random, cfg: SimConfig = DEFAULT) -> list[Node]:
    classes = [i for i, count in enumerate(class_counts(n, cfg)) for _ in range(count)]
    rng.shuffle(classes)
    nodes = []
    sigma = cfg.fleet.jitter_sigma
    for i, c in enumerate(classes):
        gpu = cfg.fleet.gpu[c]
        link_bps = draw_link_bps(rng, cfg)
        nodes.append(
            Node(
                f"n{i:05d}",
                node_rate(gpu.rollouts_per_s * math.exp(rng.gauss(0, sigma)), cfg),
                gpu.price_per_hour * math.exp(rng.gauss(0, sigma)),
                link_bps,
            )
        )
    draw_nat(nodes, rng, cfg)
    return nodes


def node_rate(rollouts_per_s: float, cfg: SimConfig) -> float:
    """A node's rate in the run: a tool-using run's turns wait for the hub's answers ([agents])."""
    return turned_rollouts_per_s(rollouts_per_s, cfg.learner.rollouts_per_lease, cfg.agents.turns, cfg.agents.turn_wait_s)


def draw_link_bps(rng: random.Random, cfg: SimConfig) -> float:
    """One node's link: lognormal around the median, clipped to the configured range."""
    links = cfg.links
    return min(links.max_mbps, max(links.min_mbps, links.median_mbps * math.exp(rng.gauss(0, links.sigma)))) * BYTES_PER_MBIT


def draw_nat(nodes: list[Node], rng: random.Random, cfg: SimConfig) -> None:
    """Put fleet.nat_share of the nodes behind a NAT (their own stream of dice, so a share of 0 draws none)."""
    if cfg.fleet.nat_share > 0:
        for node in nodes:
            node.reach = "nated" if rng.random() < cfg.fleet.nat_share else "public"


def fleet_from_file(path: Path, rng: random.Random, cfg: SimConfig) -> list[Node]:
    """echo-hub plan's FLEET.toml as the fleet: its names, prices and rates; links and NAT drawn as configured."""
    nodes = [
        Node(offer.name, node_rate(offer.rollouts_per_s, cfg), offer.price_per_hour, draw_link_bps(rng, cfg))
        for offer in load_fleet(path)
    ]
    draw_nat(nodes, rng, cfg)
    return nodes


@dataclass
class Result:
    nodes: int
    scenario: str
    seed: int
    feasible: bool
    bubble_simulated: float
    bubble_predicted: float | None
    cost_per_step: float
    t_bcast_s: float
    steps: int
    sim_hours: float
    active_mean: float
    ramp_s: float | None
    rollouts_per_step: float
    staleness_mean: float
    staleness_p95: float
    staleness_max: int
    stale_dropped_fraction: float  # of the rollouts made, the share dropped as too stale
    requests_per_s: dict[str, float] = field(default_factory=dict)
    staleness: int | str = STALENESS  # the row's setting: an int, or "auto"
    # The S in force at the end, and every move auto made: (step, S, why)
    staleness_final: int = STALENESS
    staleness_moves: list[tuple[int, int, str]] = field(default_factory=list)
    # The drift model auto decides on (drift_per_version x a step's mean age), for every row: its mean over the
    # second half, and the share of those steps above drift_max (a fixed S the guard would not have allowed).
    drift_mean: float = 0.0
    drift_over_bound: float = 0.0
    capacity_rule: CapacityRule = "refined"
    variant: str = ""  # the paper's ablation name for the scenario (VARIANTS)


class Simulation:
    def __init__(
        self, fleet: list[Node], scenario: Scenario, steps: int, seed: int, rollouts_per_step: float, cfg: SimConfig = DEFAULT
    ) -> None:
        self.nodes = {n.name: n for n in fleet}
        for node in fleet:  # a fleet may be run again (scenarios of one seed): its sessions count from here
            node.session, node.away_until = 0, 0.0
        self.sc = scenario
        self.cfg = cfg
        self.seed = seed
        self.steps = steps
        self.auto = scenario.staleness == "auto"
        # S in force: auto starts at 1 (the freshest) and moves as hub.control.staleness.choose_staleness says.
        self.S = 1 if self.auto else int(scenario.staleness)
        self.staleness_moves: list[tuple[int, int, str]] = []
        self.grace = (self.S, 0)  # the learner's: (S before a lowering, until which step its window still holds)
        self.staleness_hold = StalenessHold()  # what choose_staleness's hysteresis counts over publish periods
        self.last_publish = 0
        self.drift = DriftMeter()  # what auto decides on, as the hub reads it from its steps
        # Common random numbers: every scenario of one seed sees the same T_train of step k and the same
        # online and offline spells of each node, so scenarios differ only in what the method decides.
        self.train_rng = random.Random(seed * 7919 + len(fleet))
        self.churn_rng = {n.name: churn_stream(seed, n.name) for n in fleet}
        self.kappa = self.kappa_for(self.S)
        self.R = rollouts_per_step
        self.inflight_cap = LeaseConfig().max_inflight_steps * rollouts_per_step
        # all-on is the hub's scheduler switched off: every measured node works.
        self.sched = SchedulerConfig(enabled=scenario.scheduler, gamma=cfg.run.gamma)
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        # Production: version -> summed rate of producing nodes holding it.
        self.rate_by_version: dict[int, float] = {}
        self.producers: dict[int, int] = {}  # version -> producing nodes holding it
        self.buffer: dict[int, float] = {}
        self.step = 0
        self.training = False
        self.idle_since: float | None = 0.0
        self.pending_idle = 0.0  # the idle time before the step in training
        self.t_train_recent: list[float] = []
        self.t_bcast_last: float | None = None
        self.t_arrive_last: float | None = None  # the active pool's throughput-weighted mean arrival
        self.installs_last: tuple[tuple[float, float], ...] = ()  # (rate, seconds) per active node: pool_stall_s
        self.publish_at: dict[int, float] = {}
        self.release_wanted: Mapping[str, float] = {}  # as hub.control.scheduler keeps it
        self.ramp_s: float | None = None
        # Per step, from the second half on: (idle, train, predicted bubble or None, active count, cost $)
        self.records: list[tuple[float, float, float | None, int, float]] = []
        self.staleness: list[tuple[int, float]] = []
        self.step_drifts: list[float] = []  # each second-half step's modelled drift (every row, auto or fixed S)
        self.dropped = 0.0
        self.consumed = 0.0
        self.t_bcasts: list[float] = []
        self.requests = {"join": 0, "leave": 0}
        self.active_rate = 0.0
        self.active_price = 0.0
        self.online_count = 0
        self.spent = 0.0
        self.cost_mark = 0.0
        self.integrated_heartbeats = 0.0
        self.integrated_leases = 0.0

    # -- events ---------------------------------------------------------------------------
    def push(self, at: float, kind: str, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, kind, payload))

    def kappa_for(self, staleness: int) -> int:
        """The publish period at S: run.kappa when set, else the hub's default."""
        return default_kappa(staleness) if self.cfg.run.kappa is None or staleness == 0 else self.cfg.run.kappa

    def min_useful(self) -> int:
        return oldest_useful_version(self.step, self.training, self.window())

    def producing(self, node: Node) -> bool:
        return node.state == "active" and node.held >= 0

    def _set_production(self, node: Node, on: bool) -> None:
        version = node.held
        if on:
            self.rate_by_version[version] = self.rate_by_version.get(version, 0.0) + node.rate
            self.producers[version] = self.producers.get(version, 0) + 1
            self.active_rate += node.rate
        else:
            self.producers[version] -= 1
            if self.producers[version] == 0:  # gone, not a float residue that every later event iterates over
                del self.producers[version], self.rate_by_version[version]
            else:
                self.rate_by_version[version] -= node.rate
            self.active_rate -= node.rate

    def set_state(self, node: Node, state: str) -> None:
        was = self.producing(node)
        if node.state == "active":
            self.active_price -= node.price
        node.state = state
        if state == "active":
            self.active_price += node.price
        now_on = self.producing(node)
        if was != now_on:
            self._set_production(node, now_on)

    def install(self, node: Node, version: int) -> None:
        if version <= node.held or not node.online:
            return
        if self.producing(node):
            self._set_production(node, False)
        node.held = version
        if self.producing(node):
            self._set_production(node, True)

    def advance(self, to: float) -> None:
        dt = to - self.now
        if dt <= 0:
            return
        cutoff = self.min_useful()
        made = {
            v: rate * dt * self.cfg.learner.usable_fraction
            for v, rate in self.rate_by_version.items()
            if v >= cutoff and rate > 1e-12
        }
        # The hub leases no more than max_inflight_steps steps of work ahead, and none a take would find too stale
        # (hub.service.leasing): nodes past either wait. Oldest version first, as a take goes. Both count the work
        # trained on (hub.records.buffer.leasable), so what is made counts after the usable share.
        queued = sum(self.buffer.values())
        first = next_take(self.step, self.training)
        for version in sorted(made):
            takes = takes_served(version, first, self.S, self.grace)
            room = min(self.inflight_cap - queued, fresh_room(takes, self.R, queued))
            amount = max(0.0, min(made[version], room))
            self.buffer[version] = self.buffer.get(version, 0.0) + amount
            queued += amount
        self.spent += (self.active_price + self.cfg.learner.price_per_hour) * dt / 3600.0
        period_s = heartbeat_period(self.online_count, self.sched.heartbeat_period_s, self.sched.heartbeats_per_s)
        self.integrated_heartbeats += self.online_count * dt / period_s
        self.integrated_leases += self.active_rate * dt / self.cfg.learner.rollouts_per_lease
        self.now = to

    def window(self) -> int:
        """The S the buffer's cutoff and the version floor use now (the learner's window_staleness)."""
        return grace_staleness(self.S, self.grace, self.step)

    def usable_rate(self) -> float:
        cutoff = self.min_useful()
        return sum(rate for v, rate in self.rate_by_version.items() if v >= cutoff) * self.cfg.learner.usable_fraction

    def prune(self) -> None:
        """Drop what the next take cannot use, as the learner does whenever it looks at its buffer, waiting or not
        (hub.records.buffer.ReplayBuffer.prune): stale rollouts must not hold the in-flight cap's room."""
        cutoff = usable_from(self.step, self.window())
        self.dropped += sum(self.buffer.pop(v) for v in [v for v in self.buffer if v < cutoff])

    def buffered(self) -> float:
        cutoff = usable_from(self.step, self.window())  # usable by the next step (t = step + 1)
        return sum(amount for v, amount in self.buffer.items() if v >= cutoff)

    # -- learner --------------------------------------------------------------------------
    def start_step(self) -> None:
        t = self.step + 1
        self.prune()
        need = self.R
        step_ages = []
        for v in sorted(self.buffer):
            take = min(need, self.buffer[v])
            self.buffer[v] -= take
            need -= take
            step_ages.append(((t - 1) - v, take))
            if need <= 1e-9:
                break
        weight = sum(w for _, w in step_ages)
        if weight > 0:
            age = sum(a * w for a, w in step_ages) / weight
            self.drift.add(self.cfg.run.drift_per_version * age, age)
            if t > self.steps // 2:
                self.step_drifts.append(self.cfg.run.drift_per_version * age)
        if t > self.steps // 2:
            self.staleness.extend(step_ages)
        self.consumed += self.R
        idle = self.now - (self.idle_since or self.now)
        self.idle_since = None
        self.training = True
        t_train = max(
            1.0, self.train_rng.gauss(self.cfg.learner.t_train_s, self.cfg.learner.t_train_s * self.cfg.learner.t_train_cv)
        )
        self.pending_idle = idle
        self.push(self.now + t_train, "step_done", t_train)

    def step_done(self, t_train: float) -> None:
        self.training = False
        self.step += 1
        self.t_train_recent = (self.t_train_recent + [t_train])[-10:]
        if self.step > self.steps // 2:
            self.records.append((self.pending_idle, t_train, self.predicted(), self.active_count(), self.spent - self.cost_mark))
        self.cost_mark = self.spent
        self.idle_since = self.now
        if self.step - self.last_publish >= self.kappa:
            self.last_publish = self.step
            if self.auto:
                self.adapt_staleness()
            self.publish(self.step)

    def adapt_staleness(self) -> None:
        """One publish period of `--staleness auto`, through the hub's own rule (hub.control.staleness): the drift
        of a step is drift_per_version times the mean age of the rollouts it trained on, read as the hub reads its own
        (hub.method.drift.DriftMeter)."""
        drift, drift_per_version, age = self.drift.read()
        costs = {}
        offers = [n.offer for n in self.nodes.values() if n.online and n.state in ("standby", "active")]
        if offers and self.t_train_recent:
            costs = staleness_costs(
                offers,
                self.cfg.run.staleness_max,
                self.R / self.usable(),
                self.t_train_mean(),
                self.t_bcast_last or 0.0,
                self.sched.gamma,
                self.cfg.learner.price_per_hour,
                self.sc.capacity_rule,
            )
        choice = choose_staleness(
            self.S, self.cfg.run.staleness_max, drift, self.cfg.run.drift_max, costs, drift_per_version, self.staleness_hold, age
        )
        self.staleness_hold = self.staleness_hold.after(choice)
        if choice.staleness != self.S:
            self.drift.moved()
            if choice.staleness < self.S:
                self.grace = grace_after_lowering(self.grace, self.window(), self.step, self.S)
            self.S, self.kappa = choice.staleness, self.kappa_for(choice.staleness)
            self.staleness_moves.append((self.step, self.S, choice.reason.value if choice.reason else ""))

    def t_train_mean(self) -> float:
        return sum(self.t_train_recent) / len(self.t_train_recent)

    def active_count(self) -> int:
        return sum(1 for n in self.nodes.values() if n.state == "active")

    def usable(self) -> float:
        """The usable fraction the hub sizes the fleet by (hub.method.capacity.fresh_usable_fraction): a stale drop
        counts as usable there, which leaves the configured loss, the only other one simulated."""
        return self.cfg.learner.usable_fraction

    def arrival(self) -> Arrival | None:
        """The newest version's arrival at the active pool, as the hub measures it (LearnerTiming.t_arrive_s)."""
        # The first step that needs the newest version needs R / usable of it: stale drops come from the
        # old version's overproduction, not from that step.
        return (
            None
            if self.t_arrive_last is None
            else Arrival(
                self.t_arrive_last,
                self.R / self.cfg.learner.usable_fraction,
                self.active_count() * self.cfg.learner.rollouts_per_lease / 2,
                self.installs_last,
            )
        )

    def predicted(self) -> float | None:
        return predicted_bubble(
            self.kappa,
            self.R / self.usable(),
            self.t_train_mean(),
            self.t_bcast_last or 0.0,
            self.active_rate,
            rule_staleness(self.sc.capacity_rule, self.S),
            self.arrival(),
        )

    # -- broadcast ------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        online = [n for n in self.nodes.values() if n.online]
        self.publish_at[version] = self.now
        if not online:
            return
        arrivals = broadcast_arrivals(online, self.sc.broadcast, self.cfg)
        # A node finishes the lease it holds with the version it had (half a lease on average), asks for work
        # on the new one (when the hub times its arrival), and hands that work in a lease at a time (half a
        # lease behind a steady flow): in this fluid model, it switches one lease after the snapshot arrived.
        lease_s = {node.name: self.cfg.learner.rollouts_per_lease / node.rate for node, _ in arrivals}
        # What the hub measures: when each active node asks for work on the new version.
        installs = tuple((node.rate, seconds + lease_s[node.name] / 2) for node, seconds in arrivals if node.state == "active")
        weight = sum(w for w, _ in installs)
        if weight > 0:
            self.installs_last = installs
            self.t_arrive_last = sum(w * seconds for w, seconds in installs) / weight
        for node, seconds in arrivals:
            self.push(self.now + seconds + lease_s[node.name], "switch", (node.name, version))
        self.push(self.now + max(seconds for _, seconds in arrivals), "broadcast_done", version)

    def broadcast_done(self, version: int) -> None:
        self.t_bcast_last = self.now - self.publish_at[version]
        self.t_bcasts.append(self.t_bcast_last)

    # -- fleet ----------------------------------------------------------------------------
    def come_online(self, node: Node) -> None:
        if self.now < node.away_until:  # a fleet change took it away: it comes back when that ends
            return
        node.online = True
        node.session += 1
        self.online_count += 1
        self.requests["join"] += 1
        node.state = "probing"
        self.push(self.now + self.cfg.churn.probe_s, "probed", node.name)
        self.push(
            self.now + self.churn_rng[node.name].expovariate(1 / self.cfg.churn.session_mean_s),
            "leave",
            (node.name, node.session),
        )
        newest = max(self.publish_at, default=None)
        if newest is not None:
            self.push(self.now + self.cfg.snapshot.bytes / node.link_bps, "catch_up", (node.name, newest))

    def go_offline(self, node: Node) -> None:
        self.set_state(node, "offline")
        node.online = False
        node.held = -1
        self.online_count -= 1
        self.requests["leave"] += 1
        self.push(self.now + self.churn_rng[node.name].expovariate(1 / self.cfg.churn.offline_mean_s), "join", node.name)

    def _leave(self, payload: tuple[str, int]) -> None:
        node = self.nodes[payload[0]]
        if node.online and node.session == payload[1]:
            self.go_offline(node)

    def fleet_change(self, index: int) -> None:
        """A configured share of the online nodes leave at once (the same ones in every scenario of a seed)."""
        change = self.cfg.fleet_change[index]
        online = sorted(n.name for n in self.nodes.values() if n.online)
        random.Random(f"fleet_change:{index}:{self.seed}").shuffle(online)
        for name in online[: round(change.leave_share * len(online))]:
            node = self.nodes[name]
            node.away_until = math.inf if change.away_s is None else self.now + change.away_s
            self.go_offline(node)
            if node.away_until < math.inf:  # back when the change ends (its own offline spell is dropped)
                self.push(node.away_until, "join", node.name)

    def price_change(self, index: int) -> None:
        """A configured share of the nodes multiply their price: paid at once, ranked as the hub ranks it."""
        change = self.cfg.price_change[index]
        names = sorted(self.nodes)
        random.Random(f"price_change:{index}:{self.seed}").shuffle(names)
        for name in names[: round(change.share * len(names))]:
            node = self.nodes[name]
            if node.state == "active":
                self.active_price -= node.price
            node.reprice(node.price * change.factor, self.sched.price_band)
            if node.state == "active":
                self.active_price += node.price

    def capacity(self) -> CapacityView:
        """The capacity model through the hub scheduler's own function (hub.control.policy.capacity_view)."""
        if not self.t_train_recent:
            return CapacityView(self.active_rate, None, None, None, "learner has not stepped yet")
        return capacity_view(
            self.active_rate,
            self.kappa,
            self.R,
            self.t_train_mean(),
            self.t_bcast_last or 0.0,
            self.usable(),
            self.S,
            self.arrival(),
            self.sched.gamma,
            self.sc.capacity_rule,
        )

    def control(self) -> None:
        """One control period of the hub's policy (probes are moved to standby by their own event)."""
        capacity = self.capacity()
        if (
            self.sc.scheduler
            and self.ramp_s is None
            and capacity.mu_target is not None
            and self.active_rate >= capacity.mu_target
        ):
            self.ramp_s = self.now
        measured = [n for n in self.nodes.values() if n.online and n.state in ("standby", "active")]
        fleet = FleetView(
            tuple(n.offer for n in measured if n.state == "active"), tuple(n.offer for n in measured if n.state == "standby")
        )
        decision = decide(fleet, capacity, self.sched, self.release_wanted, self.now)
        self.release_wanted = decision.release_wanted
        for move in decision.moves:
            self.set_state(self.nodes[move.node], move.state)

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> None:
        churn = self.cfg.churn
        for node in self.nodes.values():
            if self.churn_rng[node.name].random() < churn.online_at_start:
                self.come_online(node)
            else:
                self.push(self.churn_rng[node.name].expovariate(1 / churn.offline_mean_s), "join", node.name)
        self.push(self.sched.control_period_s, "control")
        for i, change in enumerate(self.cfg.fleet_change):
            self.push(change.at_s, "fleet_change", i)
        for i, change in enumerate(self.cfg.price_change):
            self.push(change.at_s, "price_change", i)
        self.publish(0)
        handlers = {
            "step_done": lambda p: self.step_done(p),
            "broadcast_done": self.broadcast_done,
            "switch": lambda p: self.install(self.nodes[p[0]], p[1]),
            "catch_up": lambda p: self.install(self.nodes[p[0]], p[1]) if self.nodes[p[0]].online else None,
            "probed": self._probed,
            "leave": self._leave,
            "join": lambda p: self.come_online(self.nodes[p]) if not self.nodes[p].online else None,
            "control": self._control_event,
            "fleet_change": self.fleet_change,
            "price_change": self.price_change,
        }
        horizon = self.steps * self.cfg.learner.t_train_s * 50  # a learner that never gets data stops the run
        while self.step < self.steps and self.now < horizon:
            next_at = self.events[0][0] if self.events else horizon
            if not self.training:
                self.prune()
                deficit = self.R - self.buffered()
                if deficit <= 1e-9:
                    self.start_step()
                    continue
                rate = self.usable_rate()
                if rate > 0 and self.now + deficit / rate <= next_at:
                    self.advance(self.now + deficit / rate)
                    self.start_step()
                    continue
            at, _, kind, payload = heapq.heappop(self.events)
            self.advance(at)
            handlers[kind](payload)

    def _probed(self, name: str) -> None:
        node = self.nodes[name]
        if node.online and node.state == "probing":
            self.set_state(node, "standby")

    def _control_event(self, _payload: object) -> None:
        self.control()
        self.push(self.now + self.sched.control_period_s, "control")

    def result(self, n: int, seed: int) -> Result:
        idle = sum(r[0] for r in self.records)
        train = sum(r[1] for r in self.records)
        predicted = [r[2] for r in self.records if r[2] is not None]
        total = sum(w for _, w in self.staleness) or 1.0
        ordered = sorted(self.staleness)
        acc, p95 = 0.0, 0
        for age, w in ordered:
            acc += w
            if acc >= 0.95 * total:
                p95 = age
                break
        hours = self.now / 3600.0
        # Feasible: some fleet keeps the learner busy (never at S = 0, where the bubble is still predicted).
        feasible = True
        try:
            mu_min(
                self.kappa,
                self.R / self.cfg.learner.usable_fraction,
                self.cfg.learner.t_train_s,
                (sum(self.t_bcasts) / len(self.t_bcasts)) if self.t_bcasts else 0.0,
                self.S,
            )
        except InfeasibleCapacity:
            feasible = False
        produced = self.consumed + self.dropped
        return Result(
            nodes=n,
            scenario=self.sc.name,
            seed=seed,
            feasible=feasible,
            bubble_simulated=round(idle / (idle + train), 4) if idle + train > 0 else 1.0,
            bubble_predicted=round(sum(predicted) / len(predicted), 4) if predicted else None,
            cost_per_step=round(sum(r[4] for r in self.records) / max(1, len(self.records)), 4),
            t_bcast_s=round(sum(self.t_bcasts) / len(self.t_bcasts), 2) if self.t_bcasts else math.nan,
            steps=self.step,
            sim_hours=round(hours, 2),
            active_mean=round(sum(r[3] for r in self.records) / max(1, len(self.records)), 1),
            ramp_s=None if self.ramp_s is None else round(self.ramp_s, 1),
            rollouts_per_step=round(self.R, 1),
            staleness_mean=round(sum(a * w for a, w in self.staleness) / total, 3),
            staleness_p95=p95,
            staleness_max=max((a for a, _ in self.staleness), default=0),
            stale_dropped_fraction=round(self.dropped / produced, 4) if produced else 0.0,
            requests_per_s={
                "join": round(self.requests["join"] / self.now, 3),
                "heartbeat": round(self.integrated_heartbeats / self.now, 1),
                "lease": round(self.integrated_leases / self.now, 2),
                "submission": round(self.integrated_leases / self.now, 2),
            },
            staleness=self.sc.staleness,
            capacity_rule=self.sc.capacity_rule,
            variant=VARIANTS[self.sc.name],
            staleness_final=self.S,
            staleness_moves=self.staleness_moves,
            drift_mean=round(sum(self.step_drifts) / len(self.step_drifts), 5) if self.step_drifts else 0.0,
            drift_over_bound=round(
                sum(d > self.cfg.run.drift_max * (1 + 1e-9) for d in self.step_drifts) / len(self.step_drifts), 4
            )
            if self.step_drifts
            else 0.0,  # at the bound is within
        )


def broadcast_arrivals(nodes: list[Node], broadcast: str, cfg: SimConfig = DEFAULT) -> list[tuple[Node, float]]:
    """Seconds from publish until each node holds the snapshot (the broadcast model in the docstring)."""
    uplink_bps, size = cfg.links.hub_uplink_mbps * BYTES_PER_MBIT, cfg.snapshot.bytes
    if broadcast == "star":
        share = uplink_bps / len(nodes)
        return [(n, size / min(n.link_bps, share)) for n in nodes]
    by_name = {n.name: n for n in nodes}
    chains = plan_chains([(n.name, n.link_bps) for n in nodes], uplink_bps)
    arrivals = []
    for chain in chains:
        slowest = uplink_bps / len(chains)
        setup_s, upstream = 0.0, None
        for pos, name in enumerate(chain):
            node = by_name[name]
            slowest = min(slowest, node.link_bps)
            # A hop between two NATed nodes waits for its hole punch, and so does everything after it.
            if link_kind(upstream, node.reach) == "holepunch":
                setup_s += cfg.fleet.holepunch_s
            upstream = node.reach
            arrivals.append(
                (node, setup_s + size / slowest + pos * (cfg.snapshot.chunk_bytes / slowest + cfg.links.hop_latency_s))
            )
    return arrivals


def default_steps(n: int) -> int:
    """Steps per run: at least 90, and at least NODE_STEPS_MEASURED / n, so that the measured half of every run
    spans about as many node sessions at every N. In a small fleet one node coming or going moves the cost
    of all-on by a tenth, so its saving needs weeks of simulated time to settle: at N = 10, 5 seeds of one
    fleet spread 5.3 points over 10,000 steps and 2.3 over 20,000."""
    return max(90, math.ceil(NODE_STEPS_MEASURED / n))


def churn_stream(seed: int, name: str) -> random.Random:
    """A node's own online and offline spells: its first draw says whether it is online at the start."""
    return random.Random(f"{seed}:{name}")


def demand(fleet: list[Node], staleness: int, share: float, cfg: SimConfig = DEFAULT) -> float:
    """R (rollouts the learner trains on per step) that makes mu_min `share` of the fleet's expected online
    throughput (ONLINE_AT_START of it).

    mu_min is the hub's own (hub.method.capacity.mu_min, linear in R) at the whole fleet's chain broadcast time, so
    every fleet asks for the same share of its throughput, whatever its slowest link; and R depends on the
    fleet only, not on a seed's dice, so the seeds of one fleet differ in churn and T_train alone.
    """
    t_bcast = max(seconds for _, seconds in broadcast_arrivals(fleet, "chain", cfg))
    per_rollout = mu_min(default_kappa(staleness), 1.0 / cfg.learner.usable_fraction, cfg.learner.t_train_s, t_bcast, staleness)
    return share * cfg.churn.online_at_start * sum(n.rate for n in fleet) / per_rollout


def build_fleet(n: int, seed: int, fleet_seed: int | None, cfg: SimConfig = DEFAULT) -> list[Node]:
    """The run's fleet: echo-hub plan's FLEET.toml when fleet.file is set (n unused), else n drawn nodes."""
    rng = random.Random((seed if fleet_seed is None else fleet_seed) * 1_000_003 + n)
    return fleet_from_file(cfg.fleet.file, rng, cfg) if cfg.fleet.file is not None else draw_fleet(n, rng, cfg)


def simulate(
    n: int,
    scenario: str,
    seed: int,
    steps: int,
    share: float = DEFAULT.learner.demand_share,
    fleet_seed: int | None = None,
    cfg: SimConfig = DEFAULT,
    staleness: int | str | None = None,
    capacity_rule: CapacityRule = "refined",
) -> Result:
    """One run. `seed` drives churn and T_train; the fleet is drawn from `fleet_seed` (None: from `seed` too,
    so seeds then differ in their fleets as well). `staleness`: S for every scenario but sync (None: STALENESS).
    `capacity_rule`: how the scheduler's capacity model charges the broadcast (hub.method.capacity.rule_staleness)."""
    fleet = build_fleet(n, seed, fleet_seed, cfg)
    base = replace(SCENARIOS[scenario], capacity_rule=capacity_rule)
    sc = base if staleness is None or base.name == "sync" else replace(base, staleness=staleness)
    # The same demand for every scenario of one fleet: the method's R at S = STALENESS, whatever S the scenario runs at.
    rollouts_per_step = cfg.learner.rollouts_per_step or demand(fleet, STALENESS, share, cfg)
    sim = Simulation(fleet, sc, steps, seed, rollouts_per_step, cfg)
    sim.run()
    return sim.result(len(fleet), seed)


def configured(args: argparse.Namespace) -> SimConfig:
    """--config's SimConfig (or the default), with --set's keys, then the other flags given on the command line, on
    top."""
    cfg = with_settings(load_sim_config(args.config) if args.config else DEFAULT, args.set)
    run = {k: v for k, v in (("seeds", args.seeds), ("steps", args.steps), ("fleet_seed", args.fleet_seed)) if v is not None}
    if args.scenarios:
        run["scenarios"] = tuple(args.scenarios.split(","))
    if args.capacity_rule:
        run["capacity_rule"] = tuple(args.capacity_rule.split(","))
    fleet = {}
    if args.nodes:
        fleet["nodes"] = tuple(int(x) for x in args.nodes.split(","))
    if args.fleet:
        fleet["file"] = args.fleet
    learner = {} if args.demand is None else {"demand_share": args.demand}
    try:
        return SimConfig.model_validate(
            {
                **cfg.model_dump(),
                "run": {**cfg.run.model_dump(), **run},
                "fleet": {**cfg.fleet.model_dump(), **fleet},
                "learner": {**cfg.learner.model_dump(), **learner},
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SimConfigError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def rows_to_run(cfg: SimConfig) -> list[tuple[int, int | str, str, CapacityRule]]:
    """(fleet size, S setting, scenario, capacity rule) of every row: sync (S = 0 whatever the setting) once per
    size and rule."""
    sizes = (0,) if cfg.fleet.file is not None else cfg.fleet.nodes
    rows = []
    for n in sizes:
        for rule in cfg.run.capacity_rule:
            for i, staleness in enumerate(cfg.run.staleness):
                rows += [(n, staleness, sc, rule) for sc in cfg.run.scenarios if sc != "sync" or i == 0]
    return rows


# The sim.toml key each flag sets: --help lists the flags beside the keys.
FLAG_FIELDS = {
    "fleet.nodes": ["--nodes"],
    "fleet.file": ["--fleet"],
    "run.scenarios": ["--scenarios"],
    "run.seeds": ["--seeds"],
    "run.fleet_seed": ["--fleet-seed"],
    "run.steps": ["--steps"],
    "learner.demand_share": ["--demand"],
    "run.capacity_rule": ["--capacity-rule"],
}


def build_parser() -> argparse.ArgumentParser:
    """The command line; its help ends with every sim.toml section and key, generated from SimConfig (as
    docs/configuration.md is from the hub's models), so it cannot drift from what --config accepts."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=reference_markdown(SimConfig, FLAG_FIELDS, "SIM.toml (--config): every section and key"),
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="SIM.toml",
        help="everything the simulator draws (every key: below; bench/presets/ has examples)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sim.toml key (dotted) and its TOML value, on top of --config; repeatable (e.g. --set run.seeds=1)",
    )
    parser.add_argument(
        "--fleet",
        type=Path,
        default=None,
        metavar="FLEET.toml",
        help="echo-hub plan's fleet file as the fleet (links and NAT still drawn)",
    )
    parser.add_argument("--nodes", default=None, help="fleet sizes, comma-separated (default 10,100,1000,10000)")
    parser.add_argument("--scenarios", default=None, help=f"scenarios, comma-separated (default {','.join(SCENARIOS)})")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per fleet size and scenario (default 1)")
    parser.add_argument(
        "--fleet-seed",
        type=int,
        default=None,
        help="draw one fleet per size from this seed, so seeds differ only in churn and T_train",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="learner steps per run, figures from the second half (default: default_steps(N))"
    )
    parser.add_argument(
        "--demand",
        type=float,
        default=None,
        help="mu_min as a share of the fleet's expected online throughput (default 0.3; above ~0.6 the fleet falls short)",
    )
    parser.add_argument(
        "--capacity-rule",
        default=None,
        help="capacity rules, comma-separated: paper (mu_min charges the whole T_bcast), refined (the hub's default: "
        "only past (S - kappa) T_train); each runs every row (default refined)",
    )
    parser.add_argument("--json", action="store_true", help="print every row as JSON instead of the tables")
    parser.add_argument("--plot", type=Path, default=None, help="write bubble and cost per step vs N to this PNG")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = configured(args)
        results = run_rows(cfg, args.json)
    except (SimConfigError, PlanError, InfeasibleCapacity) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    out = {
        "results": results,
        "ablation": ablation(results),
        "savings": savings(results),
        "staleness_comparison": staleness_comparison(results),
    }
    out["saving_spread"] = saving_spread(out["savings"])
    out["links_outside_fit"] = links_outside_fit(out["ablation"], cfg.links.fitted_nodes)
    if args.plot:
        plot(results, args.plot)
    warnings = [fit_warning(row) for row in out["links_outside_fit"]]
    if args.json:
        print(json.dumps(out, sort_keys=True, default=str))
        for line in warnings:
            print(line, file=sys.stderr)
    else:
        print("\n".join(ablation_markdown(out["ablation"], cfg.paper_figure) + spread_markdown(out["saving_spread"]) + warnings))
    return 0


def run_rows(cfg: SimConfig, quiet: bool) -> list[dict]:
    """Every row of the configured runs, as JSON-ready dicts."""
    results = []
    for n, staleness, scenario, rule in rows_to_run(cfg):
        for seed in range(cfg.run.seeds):
            started = time.perf_counter()
            size = n or len(load_fleet(cfg.fleet.file))
            r = simulate(
                n,
                scenario,
                seed,
                cfg.run.steps or default_steps(size),
                cfg.learner.demand_share,
                cfg.run.fleet_seed,
                cfg,
                staleness,
                rule,
            )
            if not quiet:
                print(
                    f"N={r.nodes:<6} {scenario:<10} S={staleness!s:<4} {rule:<7} seed {seed}: bubble {r.bubble_simulated:.3f} "
                    f"(predicted {r.bubble_predicted}) cost/step ${r.cost_per_step:.3f} T_bcast {r.t_bcast_s:.1f}s "
                    f"active {r.active_mean:.0f} ramp {r.ramp_s} [{time.perf_counter() - started:.1f}s]",
                    file=sys.stderr,
                    flush=True,
                )
            results.append(r.__dict__)
    return results


def ablation(results: list[dict]) -> list[dict]:
    """The paper's ablation table: per fleet size, S setting, capacity rule and variant, the mean over seeds of
    T_bcast, cost per step, active nodes and the share of rollouts dropped as stale, with the cost against the
    full system's (delta_vs_full = cost / cost(full) - 1) under the same rule."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["nodes"], str(r["staleness"]), r["capacity_rule"], r["variant"]), []).append(r)
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    out = []
    for (n, staleness, rule, variant), rows in sorted(groups.items()):
        full = groups.get((n, staleness, rule, "full"))
        cost = mean(rows, "cost_per_step")
        out.append(
            {
                "nodes": n,
                "staleness": rows[0]["staleness"],
                "capacity_rule": rule,
                "variant": variant,
                "seeds": len(rows),
                "t_bcast_s": round(mean(rows, "t_bcast_s"), 1),
                "cost_per_step": round(cost, 4),
                "delta_vs_full": round(cost / mean(full, "cost_per_step") - 1, 4) if full else None,
                "nodes_active": round(mean(rows, "active_mean"), 2),
                "stale_dropped_fraction": round(mean(rows, "stale_dropped_fraction"), 4),
                "bubble_simulated": round(mean(rows, "bubble_simulated"), 4),
            }
        )
    return out


def ablation_markdown(rows: list[dict], paper: tuple[PaperFigure, ...]) -> list[str]:
    """`ablation`'s rows as one Markdown table per fleet size and S setting (the README's): a row per variant of
    the paper's ablation, a column per capacity rule, and the paper's figures first where `paper` has them for that
    size. Sync, not a variant of the ablation, has a table only where it ran alone (spread_markdown sets it against
    cost-aware)."""
    tables = {(r["nodes"], str(r["staleness"])) for r in rows if r["variant"] != "sync"}
    tables |= {(r["nodes"], "0") for r in rows if all(n != r["nodes"] for n, _ in tables)}  # a size that ran sync only
    lines: list[str] = []
    for n, setting in sorted(tables):
        ours = [r for r in rows if (r["nodes"], str(r["staleness"])) == (n, setting)]
        lines += ablation_table(n, setting, ours, {VARIANTS[f.scenario]: f.cost_per_step for f in paper if f.nodes == n})
    return lines


def ablation_table(n: int, setting: str, rows: list[dict], paper: dict[str, float]) -> list[str]:
    """One table of ablation_markdown: fleet size `n`, S `setting`, its `rows`, the paper's $/step by variant."""
    rules = [rule for rule in RULE_LABELS if any(r["capacity_rule"] == rule for r in rows)]
    at = {(r["variant"], r["capacity_rule"]): r for r in rows}
    seeds = max(r["seeds"] for r in rows)
    lines = [
        f"N = {n}, S = {setting}, {seeds} seed(s): $/step (vs full), workers on",
        "",
        "| variant |" + (" paper |" if paper else "") + "".join(f" {RULE_LABELS[rule]} |" for rule in rules),
        "| --- |" + " --- |" * (len(rules) + bool(paper)),
    ]
    for variant, label in VARIANT_LABELS.items():
        if any((variant, rule) in at for rule in rules):
            cells = [label] + ([paper_cell(variant, paper)] if paper else [])
            cells += [ours_cell(variant, at.get((variant, rule))) for rule in rules]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def paper_cell(variant: str, paper: dict[str, float]) -> str:
    """The paper's column of a variant: its $/step, against the paper's full run where it gives one ("-": none)."""
    if variant not in paper:
        return "-"
    full = paper.get("full") if variant != "full" else None
    return table_cell(paper[variant], paper[variant] / full - 1 if full else None)


def ours_cell(variant: str, row: dict | None) -> str:
    """A capacity rule's column of a variant: ablation's row ("-": that rule did not run it)."""
    if row is None:
        return "-"
    return table_cell(row["cost_per_step"], None if variant == "full" else row["delta_vs_full"], row["nodes_active"])


def table_cell(cost: float, delta: float | None, active: float | None = None) -> str:
    """A cell of the ablation table: $/step, its change against the full run's (None: not shown), workers on. The
    $/step is the JSON's (4 decimals) rounded half up, as a reader rounds it: 7.7615 is 7.762, not float's 7.761."""
    shown = Decimal(str(cost)).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP)
    text = f"{shown}" + ("" if delta is None else f" ({100 * delta:+.1f}%)")
    return text if active is None else f"{text}, {active:g} on"


def spread_markdown(spread: list[dict]) -> list[str]:
    """saving_spread's rows as a Markdown table: cost-aware's saving against each baseline over the seeds."""
    if not spread:
        return []
    lines = [
        "cost-aware's saving over the seeds (1 - its $/step / the other's)",
        "",
        "| N | rule | vs | seeds | min | max | mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in spread:
        shown = " | ".join(f"{100 * r[key]:.1f}%" for key in ("min", "max", "mean"))
        lines.append(f"| {r['nodes']} | {r['capacity_rule']} | {r['vs']} | {r['seeds']} | {shown} |")
    return lines + [""]


def links_outside_fit(rows: list[dict], fitted: tuple[int, int] | None) -> list[dict]:
    """The fleet sizes of `rows` (ablation's) outside links.fitted_nodes, each with its largest T_bcast: the links
    reproduce the broadcast times they were fitted to at those sizes only, elsewhere T_bcast (and every cost that
    waits on it) is the broadcast model's extrapolation. None: links not fitted, nothing to flag."""
    if fitted is None:
        return []
    low, high = fitted
    return [
        {"nodes": n, "fitted_nodes": [low, high], "t_bcast_s": max(r["t_bcast_s"] for r in rows if r["nodes"] == n)}
        for n in sorted({r["nodes"] for r in rows})
        if not low <= n <= high
    ]


def fit_warning(row: dict) -> str:
    """The warning line of one links_outside_fit row."""
    low, high = row["fitted_nodes"]
    fitted = f"N = {low}" if low == high else f"N = {low} to {high}"
    return (
        f"warning: N = {row['nodes']} is outside the fleet the links were fitted to ({fitted}, links.fitted_nodes): "
        f"its T_bcast (up to {row['t_bcast_s']:,.0f} s) and the costs that wait on it are extrapolated"
    )


def savings(results: list[dict]) -> list[dict]:
    """Cost-aware against all-on, star and sync: 1 - cost(cost-aware) / cost(other), per N, capacity rule, S setting
    and seed (sync, at S = 0 whatever the setting, against every setting)."""
    out = []
    by = {(r["nodes"], r["capacity_rule"], r["scenario"], r["seed"], str(r["staleness"])): r for r in results}
    for (n, rule, scenario, seed, staleness), r in sorted(by.items()):
        if scenario != "cost-aware":
            continue
        row = {"nodes": n, "capacity_rule": rule, "seed": seed, "staleness": r["staleness"]}
        for other in ("all-on", "star", "sync"):
            key = (n, rule, other, seed, "0" if other == "sync" else staleness)
            if key in by:
                row[f"saving_vs_{other}"] = round(1 - r["cost_per_step"] / by[key]["cost_per_step"], 4)
        out.append(row)
    return out


@dataclass(frozen=True)
class FixedRun:
    """A fixed-S run as the staleness comparison reads it: reward_last None where no model runs (the simulator)."""

    cost_per_step: float
    drift_over_bound: float
    reward_last: float | None = None


def auto_against_fixed(auto_cost: float, auto_over: float, fixed: Mapping[int, FixedRun], reward_s0: float | None = None) -> dict:
    """auto's cost per step against the fixed S, by the decision on adaptive staleness: a fixed S is `eligible` when
    its share of steps past the drift bound is at most auto's plus DRIFT_SHARE_SLACK and, where rewards are known,
    its reward_last is within REWARD_GAP_MAX of S = 0's (`reward_s0`); a fixed S past that trains on what auto's guard
    refuses, which is not the same quality. `fixed_rows` lists every fixed S; best_fixed_eligible is the cheapest
    eligible one, and auto_within_eligible says whether auto's cost is at most AUTO_COST_SLACK times it; best_fixed
    is the cheapest whatever its drift. saving = 1 - cost(auto) / cost(S). bench/staleness.py --adaptive compares its
    real runs with it too."""

    def eligible(run: FixedRun) -> bool:
        if run.drift_over_bound > auto_over + DRIFT_SHARE_SLACK:
            return False
        return reward_s0 is None or run.reward_last is None or reward_s0 - run.reward_last <= REWARD_GAP_MAX

    rows = [
        {
            "staleness": s,
            "cost_per_step": run.cost_per_step,
            "drift_over_bound": run.drift_over_bound,
            "reward_last": run.reward_last,
            "eligible": eligible(run),
        }
        for s, run in sorted(fixed.items())
    ]
    out: dict = {"fixed_rows": rows}
    within = {s: run.cost_per_step for s, run in fixed.items() if eligible(run)}
    every = {s: run.cost_per_step for s, run in fixed.items()}
    for label, pick in (("best_fixed_eligible", within), ("best_fixed", every)):
        if pick:
            best = min(pick, key=pick.__getitem__)
            out[label] = best
            out[f"saving_vs_{label}"] = round(1 - auto_cost / pick[best], 4)
    if within:
        out["auto_within_eligible"] = auto_cost <= AUTO_COST_SLACK * within[out["best_fixed_eligible"]]
    return out


def staleness_comparison(results: list[dict]) -> list[dict]:
    """Per N, capacity rule, scenario and seed with an auto row: auto_against_fixed over that run's fixed-S rows."""
    out = []
    run_of = lambda r: (r["nodes"], r["capacity_rule"], r["scenario"], r["seed"])
    for n, rule, scenario, seed in sorted({run_of(r) for r in results if r["staleness"] == "auto"}):
        same = [r for r in results if run_of(r) == (n, rule, scenario, seed)]
        auto = next(r for r in same if r["staleness"] == "auto")
        fixed = {r["staleness"]: FixedRun(r["cost_per_step"], r["drift_over_bound"]) for r in same if r["staleness"] != "auto"}
        out.append(
            {
                "nodes": n,
                "capacity_rule": rule,
                "scenario": scenario,
                "seed": seed,
                "auto_cost_per_step": auto["cost_per_step"],
                "auto_drift_over_bound": auto["drift_over_bound"],
                **auto_against_fixed(auto["cost_per_step"], auto["drift_over_bound"], fixed),
            }
        )
    return out


def saving_spread(rows: list[dict]) -> list[dict]:
    """Per N, capacity rule and baseline: the saving's lowest, highest and mean over seeds, and the spread in
    points."""
    out = []
    for n, rule in sorted({(r["nodes"], r["capacity_rule"]) for r in rows}):
        for key in sorted({k for r in rows for k in r if k.startswith("saving_vs_")}):
            values = [r[key] for r in rows if (r["nodes"], r["capacity_rule"]) == (n, rule) and key in r]
            if values:
                out.append(
                    {
                        "nodes": n,
                        "capacity_rule": rule,
                        "vs": key.removeprefix("saving_vs_"),
                        "seeds": len(values),
                        "min": min(values),
                        "max": max(values),
                        "mean": round(sum(values) / len(values), 4),
                        "spread_points": round(100 * (max(values) - min(values)), 1),
                    }
                )
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    rules = sorted({r["capacity_rule"] for r in results})
    for scenario, rule in ((scenario, rule) for scenario in SCENARIOS for rule in rules):
        rows = sorted((r for r in results if (r["scenario"], r["capacity_rule"]) == (scenario, rule)), key=lambda r: r["nodes"])
        if not rows:
            continue
        if len(rules) > 1:
            scenario = f"{scenario} ({rule})"
        sizes = sorted({r["nodes"] for r in rows})
        mean = lambda key, n: sum(r[key] for r in rows if r["nodes"] == n) / sum(1 for r in rows if r["nodes"] == n)
        (line,) = axes[0].plot(sizes, [mean("bubble_simulated", n) for n in sizes], "o-", label=f"{scenario} simulated")
        predicted = [
            [r["bubble_predicted"] for r in rows if r["nodes"] == n and r["bubble_predicted"] is not None] for n in sizes
        ]
        axes[0].plot(
            sizes,
            [sum(p) / len(p) if p else math.nan for p in predicted],
            "x--",
            color=line.get_color(),
            label=f"{scenario} predicted",
        )
        axes[1].plot(sizes, [mean("cost_per_step", n) / n for n in sizes], "o-", label=scenario)
        axes[2].plot(sizes, [mean("t_bcast_s", n) for n in sizes], "o-", label=scenario)
    for ax, title in zip(axes, ("learner bubble", "cost per step per node ($)", "T_bcast (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("volunteers (N)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
