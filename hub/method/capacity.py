"""Capacity model and cost-aware activation (docs/DESIGN.md §5-6), as pure functions.

How much rollout throughput keeps the learner busy (mu_min), the learner idle time and bubble
a pool of given throughput leaves, which nodes to buy (cheapest throughput first), and the
closed-loop decision the hub's scheduler takes every control period.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.messages import NEEDED_ROLLOUTS_PER_S_MAX

SECONDS_PER_HOUR = 3600.0
DEFAULT_RELEASE_MARGIN = 0.2
# Below this the measurement is more likely broken than the run: never plan for more than 20x R.
MIN_USABLE_FRACTION = 0.05
# Below this fresh usable fraction the learner starves for want of signal, not rollouts (hub.method.capacity.
# saturation): the scheduler then activates no node for it.
SATURATED_USABLE_FRACTION = 0.2
# "paper": the ECHO-2 paper's mu_min = kappa R / (kappa T_train - T_bcast); "refined": the hub's, which charges
# the broadcast only past (S - kappa) T_train (broadcast_stall_s).
CapacityRule = Literal["paper", "refined"]
CAPACITY_RULES: tuple[CapacityRule, ...] = ("paper", "refined")


class InfeasibleCapacity(ValueError):
    """No fleet, however large, hides the broadcast inside one publish period."""


def _check_period(kappa: int, rollouts_per_step: float, t_train_s: float, t_bcast_s: float) -> None:
    if kappa < 1:
        raise ValueError(f"kappa must be >= 1, got {kappa}")
    if rollouts_per_step <= 0:
        raise ValueError(f"rollouts_per_step must be > 0, got {rollouts_per_step}")
    if t_train_s <= 0:
        raise ValueError(f"t_train_s must be > 0, got {t_train_s}")
    if t_bcast_s < 0:
        raise ValueError(f"t_bcast_s must be >= 0, got {t_bcast_s}")


def turned_rollouts_per_s(rollouts_per_s: float, batch_rollouts: float, turns: int, turn_wait_s: float) -> float:
    """A node's rollouts per second in a tool-using run. Its `batch_rollouts` (a lease's prompts x n) are generated
    in step, turn by turn, and each of the batch's `turns` rounds is sent to the hub and waits `turn_wait_s` for the
    answers (the round trip and the environment's time) while the engine idles: B / (B / mu + turns * wait), mu the
    node's rate at generating the same tokens without waiting. However fast the node, the waits bound it at
    B / (turns * wait). A single-turn run (turns 1, no wait) keeps mu."""
    if rollouts_per_s <= 0:
        raise ValueError(f"rollouts_per_s must be > 0, got {rollouts_per_s}")
    if batch_rollouts < 1:
        raise ValueError(f"batch_rollouts must be >= 1, got {batch_rollouts}")
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if turn_wait_s < 0:
        raise ValueError(f"turn_wait_s must be >= 0, got {turn_wait_s}")
    if turn_wait_s == 0:
        return rollouts_per_s  # exactly: B / (B / mu) rounds
    return batch_rollouts / (batch_rollouts / rollouts_per_s + turns * turn_wait_s)


def usable_fraction(trained_groups: int, settled_groups: int) -> float:
    """Share of accepted groups the learner trains on (the rest it skips: zero reward variance,
    stale, dropped); 1.0 before any group settled.

    The learner consumes R rollouts per step of *trained* groups, so the fleet must produce
    R / usable_fraction accepted rollouts per step: that is the R the capacity model plans with.
    """
    if not 0 <= trained_groups <= settled_groups:
        raise ValueError(f"need 0 <= trained <= settled, got {trained_groups}, {settled_groups}")
    if settled_groups == 0:
        return 1.0
    return max(MIN_USABLE_FRACTION, trained_groups / settled_groups)


def fresh_usable_fraction(trained_groups: int, settled_groups: int, stale_groups: int) -> float:
    """Share of accepted groups the fleet must make per trained one, counting only the losses more nodes do not
    make worse: (trained + stale) / settled, floored as usable_fraction is; 1.0 before any group settled.

    A group dropped as stale had passed every other check: it was lost to overproduction or a slow broadcast,
    which a larger fleet makes worse, not better. Sizing the fleet by the plain usable fraction feeds on its
    own drops: more nodes make more stale groups, the fraction falls, the target rises. Counting a stale group
    as usable leaves the losses that happen to a group whatever the fleet (zero reward variance, banned or
    unaudited work), measured over every settled group, so overproduction does not bias them either.
    """
    if not 0 <= stale_groups <= settled_groups - trained_groups:
        raise ValueError(f"need 0 <= stale <= settled - trained, got {stale_groups}, {settled_groups}, {trained_groups}")
    return usable_fraction(trained_groups + stale_groups, settled_groups)


def saturation(fresh_usable: float, zero_variance_share: float) -> str | None:
    """Why a fresh usable fraction below SATURATED_USABLE_FRACTION is not the fleet's to fix, in one line; None
    above it. `zero_variance_share`: of the newest settled groups, the share with equal rewards."""
    if fresh_usable >= SATURATED_USABLE_FRACTION:
        return None
    if zero_variance_share >= 0.5:
        why = (
            f"the reward gives every completion the same score in {zero_variance_share:.0%} of recent groups "
            "(a saturated reward or a collapsed policy)"
        )
    else:
        why = "most recent groups were discarded (banned or unaudited work)"
    return (
        f"only {fresh_usable:.0%} of accepted groups can be trained on: {why}; more nodes would not help, "
        "so the hub activates none for it"
    )


def rule_staleness(rule: CapacityRule, staleness: int | None) -> int | None:
    """The S the capacity model is given under `rule`: the hub's refined rule takes S (the broadcast stalls only
    past (S - kappa) T_train); the paper's formula ignores it (the whole T_bcast stalls), except at S = 0, where
    no fleet keeps the learner busy under either."""
    return staleness if rule == "refined" or staleness == 0 else None


def broadcast_stall_s(kappa: int, t_train_s: float, t_bcast_s: float, staleness: int | None = None) -> float:
    """Seconds per publish period in which the fleet holds no version it may still generate with.

    The upstream formula (staleness None) counts the whole T_bcast. Under the hub's lease rule (docs/DESIGN.md
    §5.2) a node keeps generating with version x through the learner's step x + S, which ends S - kappa steps
    after version x + kappa is published; only a broadcast slower than that stalls it:
    max(0, T_bcast - (S - kappa) * T_train). At S = 0 (kappa = 1) that is T_bcast + T_train: a
    node generates only while the learner waits.
    """
    if staleness is None:
        return t_bcast_s
    return max(0.0, t_bcast_s - (staleness - kappa) * t_train_s)


def mu_min(kappa: int, rollouts_per_step: float, t_train_s: float, t_bcast_s: float, staleness: int | None = None) -> float:
    """Pool throughput (rollouts/s) that just keeps the learner busy: kappa*R / (kappa*T_train - stall), the
    stall as broadcast_stall_s gives it (docs/DESIGN.md §5.3; stall = T_bcast when staleness is None). At S = 0
    no pool does: the learner waits for every broadcast and every rollout."""
    _check_period(kappa, rollouts_per_step, t_train_s, t_bcast_s)
    if staleness == 0:
        raise InfeasibleCapacity(
            "with S = 0 the learner waits for each snapshot to arrive and each step's rollouts to be made: "
            "no fleet keeps it busy; allow staleness (S >= 1) to overlap generation with training"
        )
    stall_s = broadcast_stall_s(kappa, t_train_s, t_bcast_s, staleness)
    window_s = kappa * t_train_s - stall_s
    if window_s <= 0:
        stall = (
            f"T_bcast = {t_bcast_s:g} s"
            if staleness is None
            else (f"the broadcast's stall T_bcast - (S - kappa) * T_train = {stall_s:g} s")
        )
        raise InfeasibleCapacity(
            f"kappa * T_train = {kappa} * {t_train_s:g} s = {kappa * t_train_s:g} s does not exceed {stall}: "
            f"no fleet can keep the learner busy; raise the staleness budget S and kappa (publish less often) or "
            f"shrink the snapshot (faster broadcast)"
        )
    return kappa * rollouts_per_step / window_s


@dataclass(frozen=True)
class Arrival:
    """How a version reaches the pool, for the first step that needs it (see first_step_idle_s).

    t_arrive_s: the pool's throughput-weighted mean time from publish to install (<= T_bcast, which is
    the last node's); fresh_rollouts_per_step: the accepted rollouts one step needs, R over the usable
    fraction *without* stale drops (those come from the old version's overproduction, not from this step);
    lease_rollouts: half a lease's rollouts for every active node. A node that installs V first finishes
    the lease it holds with the version it had, and only then asks for work on V, which is when the hub
    times its arrival (hub.distribution.broadcast, heartbeats aside); from then on it hands V's rollouts in a lease at a
    time, on average half a lease later than a steady flow would: the pool makes R_fresh + lease_rollouts
    before the step has R_fresh of V. When a lease takes as long as a learner step (the tiny default),
    that lag is a large part of the first step's idle.

    installs: (rollouts/s, seconds from publish to install) of each active node that installed V, for the
    pool's stall (pool_stall_s); empty: not known, and every node is charged the last one's (T_bcast).
    """

    t_arrive_s: float
    fresh_rollouts_per_step: float
    lease_rollouts: float = 0.0
    installs: tuple[tuple[float, float], ...] = ()


def pool_stall_s(kappa: int, t_train_s: float, staleness: int, installs: Sequence[tuple[float, float]]) -> float:
    """The pool's stall per publish period: each node's broadcast_stall_s at its own install time, weighted
    by its throughput (`installs`: (rollouts/s, seconds from publish to install) per node).

    What a period loses is each node's throughput times the time it holds no usable version; charging
    every node the last one's T_bcast, as the fleet-wide formula does, overstates it whenever the
    installs spread out along a chain.
    """
    if not installs:
        raise ValueError("no installs to weigh")
    if any(not (w >= 0.0 and math.isfinite(w)) or not (t >= 0.0 and math.isfinite(t)) for w, t in installs):
        raise ValueError(f"installs need finite weights and times >= 0, got {list(installs)[:5]}")
    total = math.fsum(w for w, _ in installs)
    if total <= 0.0:
        raise ValueError("installs carry no throughput")
    return math.fsum(w * broadcast_stall_s(kappa, t_train_s, t, staleness) for w, t in installs) / total


def first_step_idle_s(kappa: int, t_train_s: float, mu_pool: float, staleness: int, arrival: Arrival) -> float:
    """Idle before the first step that can use nothing older than the newest version.

    Version V is published at the end of step V; step V - kappa + S + 2 is the first to find V - kappa
    too stale, and it starts (S - kappa + 1) * T_train after the publish. All it trains on is made with
    V, which the pool starts on on average t_arrive_s after the publish, and whose output of V lags by half
    a lease per node (Arrival.lease_rollouts), so it waits
    max(0, (R_fresh + lease_rollouts) / mu_pool - ((S - kappa + 1) * T_train - t_arrive)). Against the
    per-period balance (with a stall) this binds when the pool makes a step's rollouts well within a step,
    slack the balance counts but that step cannot use, as nothing made before V arrived serves it. Never
    at kappa = 1. Optimistic where earlier steps also eat V's rollouts.
    """
    validate_kappa(kappa, staleness)
    if mu_pool <= 0:
        return math.inf
    window_s = (staleness - kappa + 1) * t_train_s - arrival.t_arrive_s
    return max(0.0, (arrival.fresh_rollouts_per_step + arrival.lease_rollouts) / mu_pool - window_s)


def predicted_idle_s(
    kappa: int,
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    mu_pool: float,
    staleness: int | None = None,
    arrival: Arrival | None = None,
) -> float:
    """Learner idle seconds per publish period: max(0, kappa*R/mu_pool + stall - kappa*T_train), the stall
    as broadcast_stall_s gives it (at S = 0: R/mu_pool + T_bcast, as nothing is made while it trains), or
    as pool_stall_s gives it when `arrival` has the nodes' installs (and S is given); with `arrival` known
    (and S given), at least first_step_idle_s.

    An empty pool (mu_pool <= 0) never delivers, so the idle time is infinite.
    """
    _check_period(kappa, rollouts_per_step, t_train_s, t_bcast_s)
    if mu_pool <= 0:
        return math.inf
    if arrival is not None and arrival.installs and staleness is not None:
        stall_s = pool_stall_s(kappa, t_train_s, staleness, arrival.installs)
    else:
        stall_s = broadcast_stall_s(kappa, t_train_s, t_bcast_s, staleness)
    idle_s = max(0.0, kappa * rollouts_per_step / mu_pool + stall_s - kappa * t_train_s)
    if arrival is not None and staleness is not None:
        idle_s = max(idle_s, first_step_idle_s(kappa, t_train_s, mu_pool, staleness, arrival))
    return idle_s


def predicted_bubble(
    kappa: int,
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    mu_pool: float,
    staleness: int | None = None,
    arrival: Arrival | None = None,
) -> float:
    """Learner bubble ratio T_idle / (T_idle + kappa*T_train); 1.0 for an empty pool."""
    idle_s = predicted_idle_s(kappa, rollouts_per_step, t_train_s, t_bcast_s, mu_pool, staleness, arrival)
    if math.isinf(idle_s):
        return 1.0
    return idle_s / (idle_s + kappa * t_train_s)


def predicted_step_s(
    kappa: int, rollouts_per_step: float, t_train_s: float, t_bcast_s: float, mu_pool: float, staleness: int | None = None
) -> float:
    """Wall seconds per learner step, idle included: (kappa*T_train + T_idle) / kappa."""
    idle_s = predicted_idle_s(kappa, rollouts_per_step, t_train_s, t_bcast_s, mu_pool, staleness)
    return (kappa * t_train_s + idle_s) / kappa


def cost_per_step(
    kappa: int,
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    mu_pool: float,
    learner_price_per_hour: float,
    active_prices_per_hour: Iterable[float],
    staleness: int | None = None,
) -> float:
    """Dollars per learner step: (learner + active node prices) $/h * predicted step seconds / 3600."""
    per_hour = learner_price_per_hour + math.fsum(active_prices_per_hour)
    step_s = predicted_step_s(kappa, rollouts_per_step, t_train_s, t_bcast_s, mu_pool, staleness)
    return per_hour * step_s / SECONDS_PER_HOUR


@dataclass(frozen=True)
class NodeOffer:
    """A node as the scheduler sees it: declared price and measured throughput."""

    name: str
    price_per_hour: float
    rollouts_per_s: float

    def __post_init__(self) -> None:
        if not self.price_per_hour >= 0:
            raise ValueError(f"node {self.name!r}: price_per_hour must be >= 0, got {self.price_per_hour}")
        if not self.rollouts_per_s >= 0:
            raise ValueError(f"node {self.name!r}: rollouts_per_s must be >= 0, got {self.rollouts_per_s}")

    @property
    def rho(self) -> float:
        """Dollars per hour per rollout/s; infinite for a node that delivers nothing.

        A zero-throughput node (not yet measured, or measured at nothing) buys no capacity at
        any price, free ones included, so it sorts after every node that does; it is activated
        only when the whole fleet falls short, which is also how it gets measured at all.
        """
        if self.rollouts_per_s == 0:
            return math.inf
        return self.price_per_hour / self.rollouts_per_s


def _cheapest_first_key(node: NodeOffer) -> tuple[float, str]:
    return (node.rho, node.name)


def _check_unique(nodes: Iterable[NodeOffer]) -> None:
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise ValueError(f"duplicate node name {node.name!r}")
        seen.add(node.name)


@dataclass(frozen=True)
class Activation:
    """Result of `activate`: the nodes to run (activation order), the rest, and the gap left."""

    active: tuple[NodeOffer, ...]
    standby: tuple[NodeOffer, ...]
    mu_active: float
    shortfall: float


def activate(nodes: Sequence[NodeOffer], mu_target: float) -> Activation:
    """Shortest cheapest-rho prefix (ties by name) whose throughput reaches mu_target.

    If the whole fleet falls short, every node is active and shortfall = mu_target - sum.
    """
    _check_unique(nodes)
    ordered = sorted(nodes, key=_cheapest_first_key)
    total = 0.0
    for count, node in enumerate(ordered):
        if total >= mu_target:
            return Activation(tuple(ordered[:count]), tuple(ordered[count:]), total, 0.0)
        total += node.rollouts_per_s
    return Activation(tuple(ordered), (), total, max(0.0, mu_target - total))


def default_kappa(staleness: int) -> int:
    """Publish period for a staleness budget S: max(1, S - 1)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return max(1, staleness - 1)


def validate_kappa(kappa: int, staleness: int) -> None:
    """Raise unless 1 <= kappa <= S - 1 (S >= 2), or kappa == 1 (S in {0, 1})."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    upper = max(1, staleness - 1)
    if not 1 <= kappa <= upper:
        raise ValueError(f"kappa must satisfy 1 <= kappa <= {upper} for staleness S={staleness}, got {kappa}")


@dataclass(frozen=True)
class Decision:
    """One closed-loop control step: activate or release a set of nodes, or hold (no nodes)."""

    action: Literal["activate", "release", "hold"]
    nodes: tuple[str, ...]
    reason: str


def control_decision(
    active: Sequence[NodeOffer], standby: Sequence[NodeOffer], mu_target: float, release_margin: float = DEFAULT_RELEASE_MARGIN
) -> Decision:
    """The scheduler's move this control period, from measured throughputs.

    Below target: activate the cheapest standby nodes whose throughput covers the shortfall.
    Otherwise release the most expensive active nodes (highest rho first, ties by the last name,
    mirroring activation order) as long as the pool keeps >= mu_target * (1 + release_margin)
    without them. The margin is the hysteresis band: measurement noise smaller than it cannot
    make the loop release a node and buy it back the next period. If the priciest node cannot be
    released yet but standby nodes cheaper per unit of throughput could take its place (the pool
    without it plus those nodes clears the same band), activate the cheapest of them that do: a
    later period then releases it. Without that step a cheap node that joins after the target is
    met would wait on standby forever.

    A move is a set, not one node, so a fleet of thousands reaches its target in a few control
    periods rather than one period per node.
    """
    if release_margin < 0:
        raise ValueError(f"release_margin must be >= 0, got {release_margin}")
    _check_unique([*active, *standby])
    mu_pool = math.fsum(node.rollouts_per_s for node in active)
    if mu_pool < mu_target:
        return _top_up(standby, mu_pool, mu_target)
    hold = Decision("hold", (), f"pool {mu_pool:.4g}/s meets target {mu_target:.4g}/s")
    if not active:
        return hold
    release_floor = mu_target * (1.0 + release_margin)
    without = mu_pool - max(active, key=_cheapest_first_key).rollouts_per_s
    if without >= release_floor:  # checked before sorting: most periods hold, and fleets run to thousands
        return _release(active, without, release_floor) or hold
    return _replacement(active, standby, without, release_floor) or hold


def _top_up(standby: Sequence[NodeOffer], mu_pool: float, mu_target: float) -> Decision:
    """Below target: the cheapest standby nodes whose throughput covers the shortfall (hold with none)."""
    below = f"pool {mu_pool:.4g}/s below target {mu_target:.4g}/s"
    if not standby:
        return Decision("hold", (), f"{below}, no standby node")
    return Decision("activate", _names(activate(standby, mu_target - mu_pool).active), below)


def _release(active: Sequence[NodeOffer], without: float, release_floor: float) -> Decision | None:
    """The priciest active nodes the pool can do without while it keeps release_floor (`without`: the pool
    less the priciest); None when the exact sum leaves none to release."""
    ordered = sorted(active, key=_cheapest_first_key, reverse=True)
    count = 1
    while count < len(ordered) and without - ordered[count].rollouts_per_s >= release_floor:
        without -= ordered[count].rollouts_per_s
        count += 1
    # The running difference drifts by ulps over a long batch: what stays must clear the band exactly,
    # or with no margin the pool would sit a hair under target and buy a node back next period.
    while count and (without := math.fsum(n.rollouts_per_s for n in ordered[count:])) < release_floor:
        count -= 1
    if not count:
        return None
    released = ordered[:count]
    return Decision(
        "release",
        _names(released),
        f"pool without {_count(released)} {without:.4g}/s >= target with margin {release_floor:.4g}/s",
    )


def _replacement(
    active: Sequence[NodeOffer], standby: Sequence[NodeOffer], without: float, release_floor: float
) -> Decision | None:
    """Standby nodes cheaper per unit than the priciest active node that, with the pool less that node
    (`without`), clear release_floor: the cheapest of them that do; None when none can."""
    priciest = max(active, key=_cheapest_first_key)
    cheaper = [n for n in standby if _cheapest_first_key(n) < _cheapest_first_key(priciest)]
    if not cheaper or without + math.fsum(n.rollouts_per_s for n in cheaper) < release_floor:
        return None
    # The cheapest pool that clears the band (it leaves the priciest node out, as the check above says):
    # activate all of its standby nodes at once; later periods release what it leaves out.
    best = activate([*active, *cheaper], release_floor).active
    cheaper_names = {n.name for n in cheaper}
    picks = [n for n in best if n.name in cheaper_names]
    return Decision(
        "activate",
        _names(picks),
        f"rho {picks[0].rho:.4g} below {priciest.name}'s {priciest.rho:.4g}: cheaper nodes can "
        f"replace it (target with margin {release_floor:.4g}/s)",
    )


def held_release(
    wanted_since: Mapping[str, float], batch: Sequence[str], now: float, hold_s: float
) -> tuple[list[str], dict[str, float]]:
    """The nodes of a release batch that the loop has wanted to release for at least hold_s (in batch order),
    and since when each node of the batch has been wanted without a break (the next period's `wanted_since`).

    Nodes not in this period's batch drop out, new ones start now. One noisy period can thus release only
    what every period of the hold agreed on (batches are priciest-first prefixes: the smallest of them),
    not its own whole batch.
    """
    since = {name: wanted_since.get(name, now) for name in batch}
    return [name for name in batch if now - since[name] >= hold_s], since


def _names(nodes: Iterable[NodeOffer]) -> tuple[str, ...]:
    return tuple(node.name for node in nodes)


def _count(nodes: Sequence[NodeOffer]) -> str:
    return "it" if len(nodes) == 1 else f"these {len(nodes)}"


def ewma(previous: float | None, sample: float, alpha: float) -> float:
    """Exponential moving average; alpha is the new sample's weight, previous None starts at sample."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if previous is None:
        return sample
    return alpha * sample + (1.0 - alpha) * previous


def in_time_rollouts_per_s(rollouts: int, held_s: float, versions_moved: int, versions_allowed: int) -> float | None:
    """The pace at which a lease answered late would have come back in time: while the node held it (`held_s`), the
    oldest version the hub accepts moved `versions_moved` versions; the work could take `versions_allowed` of them
    (from the lease's minimum to one past the version it was made with). At the hub's pace that is
    rollouts / (held_s * allowed / moved) rollouts/s: what "this hub needs N rollouts/s per node" tells the node.
    None when nothing moved or no time passed (nothing to say). At most NEEDED_ROLLOUTS_PER_S_MAX: the node's timing
    sets held_s, and a lease answered in a blink must not make a reply that cannot be sent."""
    if rollouts < 0 or versions_allowed < 1:
        raise ValueError(f"need rollouts >= 0 and versions_allowed >= 1, got {rollouts}, {versions_allowed}")
    if held_s <= 0 or versions_moved <= 0:
        return None
    return min(NEEDED_ROLLOUTS_PER_S_MAX, rollouts * versions_moved / (held_s * versions_allowed))
