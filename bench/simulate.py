"""Fleet simulator: the method at 10 to 10,000 volunteers in simulated time, driven by the project's own code.

    python bench/simulate.py [--nodes 10,100,1000,10000] [--seeds 1] [--fleet-seed K] [--steps K] [--json] [--plot PNG]

Unchanged project code decides: `hub.method.capacity` (mu_min, predicted_bubble), the hub scheduler's own
policy `hub.control.policy.decide` (activate everything until T_train is known, then per control period one
set of nodes activated at once or released once it has been wanted for release RELEASE_HOLD_PERIODS periods
on end), `hub.method.chains.plan_chains` (who relays to whom), `hub.method.capacity.default_kappa` and the
lease and staleness rules as the hub applies them (a node holding a version older than the learner can use
gets no lease; a group of version x is used at step t only if (t - 1) - x <= S; the buffer is
consumed oldest first).

What is drawn (per seed; documented so the figures can be argued with):
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
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.config import LeaseConfig, SchedulerConfig  # noqa: E402
from hub.control.policy import CapacityView, FleetView, decide  # noqa: E402
from hub.method.capacity import (  # noqa: E402
    Arrival,
    InfeasibleCapacity,
    NodeOffer,
    default_kappa,
    mu_min,
    predicted_bubble,
)
from hub.method.chains import plan_chains  # noqa: E402
from hub.records.fleet import heartbeat_period  # noqa: E402
from shared.units import BYTES_PER_MBIT  # noqa: E402

GPU_MIX = (  # (share, rollouts/s, $/h)
    (0.35, 6.0, 0.10),
    (0.35, 20.0, 0.35),
    (0.20, 35.0, 1.10),
    (0.10, 60.0, 2.50),
)
JITTER_SIGMA = 0.25
LINK_MEDIAN_MBPS, LINK_SIGMA, LINK_MIN_MBPS, LINK_MAX_MBPS = 500.0, 0.5, 100.0, 2000.0
SESSION_MEAN_S, OFFLINE_MEAN_S, ONLINE_AT_START = 7200.0, 1800.0, 0.8
PROBE_S = 30.0
T_TRAIN_S, T_TRAIN_CV = 60.0, 0.10
STALENESS = 4
USABLE = 0.7
LEARNER_PRICE = 3.06
SNAPSHOT_BYTES = 1.2e9
CHUNK_BYTES = 1 << 20
HUB_UPLINK_BPS = 10e9 / 8
HOP_LATENCY_S = 0.05
DEMAND_SHARE = 0.3
ROLLOUTS_PER_LEASE = 4 * 16
NODE_STEPS_MEASURED = 200_000


@dataclass
class Node:
    name: str
    rate: float
    price: float
    link_bps: float
    online: bool = False
    state: str = "offline"  # offline | probing | standby | active
    held: int = -1  # version installed
    offer: NodeOffer = field(init=False)  # what the scheduler sees: rate and price are fixed per node here

    def __post_init__(self) -> None:
        self.offer = NodeOffer(self.name, self.price, self.rate)


@dataclass
class Scenario:
    name: str
    staleness: int
    broadcast: str
    scheduler: bool


SCENARIOS = {
    "cost-aware": Scenario("cost-aware", STALENESS, "chain", True),
    "all-on": Scenario("all-on", STALENESS, "chain", False),
    "star": Scenario("star", STALENESS, "star", True),
    "sync": Scenario("sync", 0, "chain", True),
}


def class_counts(n: int) -> list[int]:
    """How many volunteers of each GPU_MIX class a fleet of n has: the shares, rounded by largest remainder
    (ties to the earlier class), so every fleet of one size has the same mix."""
    exact = [share * n for share, _, _ in GPU_MIX]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def draw_fleet(n: int, rng: random.Random) -> list[Node]:
    classes = [i for i, count in enumerate(class_counts(n)) for _ in range(count)]
    rng.shuffle(classes)
    nodes = []
    for i, c in enumerate(classes):
        _, rate, price = GPU_MIX[c]
        link_mbps = min(LINK_MAX_MBPS, max(LINK_MIN_MBPS, LINK_MEDIAN_MBPS * math.exp(rng.gauss(0, LINK_SIGMA))))
        nodes.append(Node(f"n{i:05d}", rate * math.exp(rng.gauss(0, JITTER_SIGMA)),
                          price * math.exp(rng.gauss(0, JITTER_SIGMA)), link_mbps * BYTES_PER_MBIT))
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
    dropped_stale_frac: float
    requests_per_s: dict[str, float] = field(default_factory=dict)


class Simulation:
    def __init__(self, fleet: list[Node], scenario: Scenario, steps: int, seed: int, rollouts_per_step: float) -> None:
        self.nodes = {n.name: n for n in fleet}
        self.sc = scenario
        self.steps = steps
        # Common random numbers: every scenario of one seed sees the same T_train of step k and the same
        # online and offline spells of each node, so scenarios differ only in what the method decides.
        self.train_rng = random.Random(seed * 7919 + len(fleet))
        self.churn_rng = {n.name: churn_stream(seed, n.name) for n in fleet}
        self.kappa = default_kappa(scenario.staleness)
        self.R = rollouts_per_step
        self.inflight_cap = LeaseConfig().max_inflight_steps * rollouts_per_step
        # all-on is the hub's scheduler switched off: every measured node works.
        self.cfg = SchedulerConfig(enabled=scenario.scheduler)
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
        self.dropped = 0.0
        self.consumed = 0.0
        # (consumed, dropped) per recent step: the usable fraction the hub measures (trained / settled)
        # includes groups dropped as stale, so the model's R / usable counts that waste as the hub's does.
        self.recent_use: list[tuple[float, float]] = []
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

    def min_useful(self) -> int:
        next_take = self.step + 1 if self.training else self.step
        return max(0, next_take - self.sc.staleness)

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
        made = {v: rate * dt * USABLE for v, rate in self.rate_by_version.items() if v >= cutoff and rate > 1e-12}
        # The hub leases no more than max_inflight_steps steps of work ahead: nodes past it wait.
        room = max(0.0, self.inflight_cap - sum(self.buffer.values()))
        total = sum(made.values())
        scale = min(1.0, room / total) if total > 0 else 0.0
        for version, amount in made.items():
            self.buffer[version] = self.buffer.get(version, 0.0) + amount * scale
        self.spent += (self.active_price + LEARNER_PRICE) * dt / 3600.0
        period_s = heartbeat_period(self.online_count, self.cfg.heartbeat_period_s, self.cfg.heartbeats_per_s)
        self.integrated_heartbeats += self.online_count * dt / period_s
        self.integrated_leases += self.active_rate * dt / ROLLOUTS_PER_LEASE
        self.now = to

    def usable_rate(self) -> float:
        cutoff = self.min_useful()
        return sum(rate for v, rate in self.rate_by_version.items() if v >= cutoff) * USABLE

    def buffered(self) -> float:
        cutoff = self.step - self.sc.staleness  # usable by the next step (t = step + 1): (t-1) - x <= S
        return sum(amount for v, amount in self.buffer.items() if v >= cutoff)

    # -- learner --------------------------------------------------------------------------
    def start_step(self) -> None:
        t = self.step + 1
        cutoff = t - 1 - self.sc.staleness
        dropped = sum(self.buffer.pop(v) for v in [v for v in self.buffer if v < cutoff])
        self.dropped += dropped
        self.recent_use = (self.recent_use + [(self.R, dropped)])[-3 * self.kappa:]
        need = self.R
        for v in sorted(self.buffer):
            take = min(need, self.buffer[v])
            self.buffer[v] -= take
            need -= take
            if t > self.steps // 2:
                self.staleness.append(((t - 1) - v, take))
            if need <= 1e-9:
                break
        self.consumed += self.R
        idle = self.now - (self.idle_since or self.now)
        self.idle_since = None
        self.training = True
        t_train = max(1.0, self.train_rng.gauss(T_TRAIN_S, T_TRAIN_S * T_TRAIN_CV))
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
        if self.step % self.kappa == 0:
            self.publish(self.step)

    def active_count(self) -> int:
        return sum(1 for n in self.nodes.values() if n.state == "active")

    def usable(self) -> float:
        """The usable fraction as the hub measures it: trained over settled, stale drops included."""
        consumed = sum(c for c, _ in self.recent_use)
        dropped = sum(d for _, d in self.recent_use)
        return USABLE * consumed / (consumed + dropped) if consumed else USABLE

    def predicted(self) -> float | None:
        t_train = sum(self.t_train_recent) / len(self.t_train_recent)
        # The first step that needs the newest version needs R / USABLE of it: stale drops come from the
        # old version's overproduction, not from that step.
        arrival = None if self.t_arrive_last is None else Arrival(
            self.t_arrive_last, self.R / USABLE, self.active_count() * ROLLOUTS_PER_LEASE / 2, self.installs_last)
        return predicted_bubble(self.kappa, self.R / self.usable(), t_train, self.t_bcast_last or 0.0, self.active_rate,
                                self.sc.staleness, arrival)

    # -- broadcast ------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        online = [n for n in self.nodes.values() if n.online]
        self.publish_at[version] = self.now
        if not online:
            return
        arrivals = broadcast_arrivals(online, self.sc.broadcast)
        # A node finishes the lease it holds with the version it had (half a lease on average), asks for work
        # on the new one (when the hub times its arrival), and hands that work in a lease at a time (half a
        # lease behind a steady flow): in this fluid model, it switches one lease after the snapshot arrived.
        lease_s = {node.name: ROLLOUTS_PER_LEASE / node.rate for node, _ in arrivals}
        # What the hub measures: when each active node asks for work on the new version.
        installs = tuple((node.rate, seconds + lease_s[node.name] / 2) for node, seconds in arrivals
                         if node.state == "active")
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
        node.online = True
        self.online_count += 1
        self.requests["join"] += 1
        node.state = "probing"
        self.push(self.now + PROBE_S, "probed", node.name)
        self.push(self.now + self.churn_rng[node.name].expovariate(1 / SESSION_MEAN_S), "leave", node.name)
        newest = max(self.publish_at, default=None)
        if newest is not None:
            self.push(self.now + SNAPSHOT_BYTES / node.link_bps, "catch_up", (node.name, newest))

    def go_offline(self, node: Node) -> None:
        self.set_state(node, "offline")
        node.online = False
        node.held = -1
        self.online_count -= 1
        self.requests["leave"] += 1
        self.push(self.now + self.churn_rng[node.name].expovariate(1 / OFFLINE_MEAN_S), "join", node.name)

    def capacity(self) -> CapacityView:
        """The capacity model as the hub's scheduler computes it (hub.control.scheduler.Scheduler.capacity)."""
        if not self.t_train_recent:
            return CapacityView(self.active_rate, None, None, None, "learner has not stepped yet")
        t_train = sum(self.t_train_recent) / len(self.t_train_recent)
        try:
            needed = mu_min(self.kappa, self.R / self.usable(), t_train, self.t_bcast_last or 0.0, self.sc.staleness)
        except InfeasibleCapacity as exc:
            return CapacityView(self.active_rate, None, None, None, str(exc))
        return CapacityView(self.active_rate, needed, self.cfg.gamma * needed, None, "measured")

    def control(self) -> None:
        """One control period of the hub's policy (probes are moved to standby by their own event)."""
        capacity = self.capacity()
        if self.sc.scheduler and self.ramp_s is None and capacity.mu_target is not None \
                and self.active_rate >= capacity.mu_target:
            self.ramp_s = self.now
        measured = [n for n in self.nodes.values() if n.online and n.state in ("standby", "active")]
        fleet = FleetView(tuple(n.offer for n in measured if n.state == "active"),
                          tuple(n.offer for n in measured if n.state == "standby"))
        decision = decide(fleet, capacity, self.cfg, self.release_wanted, self.now)
        self.release_wanted = decision.release_wanted
        for move in decision.moves:
            self.set_state(self.nodes[move.node], move.state)

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.nodes.values():
            if self.churn_rng[node.name].random() < ONLINE_AT_START:
                self.come_online(node)
            else:
                self.push(self.churn_rng[node.name].expovariate(1 / OFFLINE_MEAN_S), "join", node.name)
        self.push(self.cfg.control_period_s, "control")
        self.publish(0)
        handlers = {
            "step_done": lambda p: self.step_done(p),
            "broadcast_done": self.broadcast_done,
            "switch": lambda p: self.install(self.nodes[p[0]], p[1]),
            "catch_up": lambda p: self.install(self.nodes[p[0]], p[1]) if self.nodes[p[0]].online else None,
            "probed": self._probed,
            "leave": lambda p: self.go_offline(self.nodes[p]) if self.nodes[p].online else None,
            "join": lambda p: self.come_online(self.nodes[p]) if not self.nodes[p].online else None,
            "control": self._control_event,
        }
        horizon = self.steps * T_TRAIN_S * 50  # a learner that never gets data stops the run
        while self.step < self.steps and self.now < horizon:
            next_at = self.events[0][0] if self.events else horizon
            if not self.training:
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
        self.push(self.now + self.cfg.control_period_s, "control")

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
            mu_min(self.kappa, self.R / USABLE, T_TRAIN_S, (sum(self.t_bcasts) / len(self.t_bcasts)) if self.t_bcasts else 0.0,
                   self.sc.staleness)
        except InfeasibleCapacity:
            feasible = False
        produced = self.consumed + self.dropped
        return Result(
            nodes=n, scenario=self.sc.name, seed=seed, feasible=feasible,
            bubble_simulated=round(idle / (idle + train), 4) if idle + train > 0 else 1.0,
            bubble_predicted=round(sum(predicted) / len(predicted), 4) if predicted else None,
            cost_per_step=round(sum(r[4] for r in self.records) / max(1, len(self.records)), 4),
            t_bcast_s=round(sum(self.t_bcasts) / len(self.t_bcasts), 2) if self.t_bcasts else math.nan,
            steps=self.step, sim_hours=round(hours, 2),
            active_mean=round(sum(r[3] for r in self.records) / max(1, len(self.records)), 1),
            ramp_s=None if self.ramp_s is None else round(self.ramp_s, 1),
            rollouts_per_step=round(self.R, 1),
            staleness_mean=round(sum(a * w for a, w in self.staleness) / total, 3),
            staleness_p95=p95, staleness_max=max((a for a, _ in self.staleness), default=0),
            dropped_stale_frac=round(self.dropped / produced, 4) if produced else 0.0,
            requests_per_s={
                "join": round(self.requests["join"] / self.now, 3),
                "heartbeat": round(self.integrated_heartbeats / self.now, 1),
                "lease": round(self.integrated_leases / self.now, 2),
                "submission": round(self.integrated_leases / self.now, 2),
            },
        )


def broadcast_arrivals(nodes: list[Node], broadcast: str) -> list[tuple[Node, float]]:
    """Seconds from publish until each node holds the snapshot (the broadcast model in the docstring)."""
    if broadcast == "star":
        share = HUB_UPLINK_BPS / len(nodes)
        return [(n, SNAPSHOT_BYTES / min(n.link_bps, share)) for n in nodes]
    by_name = {n.name: n for n in nodes}
    chains = plan_chains([(n.name, n.link_bps) for n in nodes], HUB_UPLINK_BPS)
    arrivals = []
    for chain in chains:
        slowest = HUB_UPLINK_BPS / len(chains)
        for pos, name in enumerate(chain):
            node = by_name[name]
            slowest = min(slowest, node.link_bps)
            arrivals.append((node, SNAPSHOT_BYTES / slowest + pos * (CHUNK_BYTES / slowest + HOP_LATENCY_S)))
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


def demand(fleet: list[Node], staleness: int, share: float) -> float:
    """R (rollouts the learner trains on per step) that makes mu_min `share` of the fleet's expected online
    throughput (ONLINE_AT_START of it).

    mu_min is the hub's own (hub.method.capacity.mu_min, linear in R) at the whole fleet's chain broadcast time, so
    every fleet asks for the same share of its throughput, whatever its slowest link; and R depends on the
    fleet only, not on a seed's dice, so the seeds of one fleet differ in churn and T_train alone.
    """
    t_bcast = max(seconds for _, seconds in broadcast_arrivals(fleet, "chain"))
    per_rollout = mu_min(default_kappa(staleness), 1.0 / USABLE, T_TRAIN_S, t_bcast, staleness)
    return share * ONLINE_AT_START * sum(n.rate for n in fleet) / per_rollout


def simulate(n: int, scenario: str, seed: int, steps: int, share: float = DEMAND_SHARE,
             fleet_seed: int | None = None) -> Result:
    """One run. `seed` drives churn and T_train; the fleet is drawn from `fleet_seed` (None: from `seed` too,
    so seeds then differ in their fleets as well)."""
    fleet = draw_fleet(n, random.Random((seed if fleet_seed is None else fleet_seed) * 1_000_003 + n))
    # The same demand for every scenario of one fleet: the method's R, whatever S the scenario runs at.
    sim = Simulation(fleet, SCENARIOS[scenario], steps, seed, demand(fleet, STALENESS, share))
    sim.run()
    return sim.result(n, seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="10,100,1000,10000", help="fleet sizes, comma-separated")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per fleet size and scenario")
    parser.add_argument("--fleet-seed", type=int, default=None,
                        help="draw one fleet per size from this seed, so seeds differ only in churn and T_train")
    parser.add_argument("--steps", type=int, default=None,
                        help="learner steps per run, figures from the second half (default: default_steps(N))")
    parser.add_argument("--demand", type=float, default=DEMAND_SHARE,
                        help="mu_min as a share of the fleet's expected online throughput (above ~0.6 the fleet falls short)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--plot", type=Path, default=None, help="write bubble and cost per step vs N to this PNG")
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    scenarios = args.scenarios.split(",")
    results = []
    for n in sizes:
        for scenario in scenarios:
            for seed in range(args.seeds):
                started = time.perf_counter()
                r = simulate(n, scenario, seed, args.steps or default_steps(n), args.demand, args.fleet_seed)
                if not args.json:
                    print(f"N={n:<6} {scenario:<10} seed {seed}: bubble {r.bubble_simulated:.3f} (predicted "
                          f"{r.bubble_predicted}) cost/step ${r.cost_per_step:.3f} T_bcast {r.t_bcast_s:.1f}s "
                          f"active {r.active_mean:.0f} ramp {r.ramp_s} [{time.perf_counter() - started:.1f}s]",
                          file=sys.stderr, flush=True)
                results.append(r.__dict__)
    out = {"results": results, "savings": savings(results)}
    out["saving_spread"] = saving_spread(out["savings"])
    if args.plot:
        plot(results, args.plot)
    print(json.dumps(out, sort_keys=True, default=str) if args.json else json.dumps(out["saving_spread"], indent=1))
    return 0


def savings(results: list[dict]) -> list[dict]:
    """Cost-aware against all-on, star and sync: 1 - cost(cost-aware) / cost(other), per N and seed."""
    out = []
    by = {(r["nodes"], r["scenario"], r["seed"]): r for r in results}
    for (n, scenario, seed), r in sorted(by.items()):
        if scenario != "cost-aware":
            continue
        row = {"nodes": n, "seed": seed}
        for other in ("all-on", "star", "sync"):
            if (n, other, seed) in by:
                row[f"saving_vs_{other}"] = round(1 - r["cost_per_step"] / by[(n, other, seed)]["cost_per_step"], 4)
        out.append(row)
    return out


def saving_spread(rows: list[dict]) -> list[dict]:
    """Per N and baseline: the saving's lowest, highest and mean over seeds, and the spread in points."""
    out = []
    for n in sorted({r["nodes"] for r in rows}):
        for key in sorted({k for r in rows for k in r if k.startswith("saving_vs_")}):
            values = [r[key] for r in rows if r["nodes"] == n and key in r]
            if values:
                out.append({"nodes": n, "vs": key.removeprefix("saving_vs_"), "seeds": len(values),
                            "min": min(values), "max": max(values), "mean": round(sum(values) / len(values), 4),
                            "spread_points": round(100 * (max(values) - min(values)), 1)})
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for scenario in SCENARIOS:
        rows = sorted((r for r in results if r["scenario"] == scenario), key=lambda r: r["nodes"])
        if not rows:
            continue
        sizes = sorted({r["nodes"] for r in rows})
        mean = lambda key, n: sum(r[key] for r in rows if r["nodes"] == n) / sum(1 for r in rows if r["nodes"] == n)
        line, = axes[0].plot(sizes, [mean("bubble_simulated", n) for n in sizes], "o-", label=f"{scenario} simulated")
        predicted = [[r["bubble_predicted"] for r in rows if r["nodes"] == n and r["bubble_predicted"] is not None] for n in sizes]
        axes[0].plot(sizes, [sum(p) / len(p) if p else math.nan for p in predicted], "x--", color=line.get_color(),
                     label=f"{scenario} predicted")
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
