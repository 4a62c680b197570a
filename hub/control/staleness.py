"""Adaptive staleness (`--staleness auto`), as pure functions: each publish period the hub picks the S in
[1, staleness_max] (kappa = default_kappa(S)) that the capacity model says is cheapest per learner step,
under a guard on the off-policy drift of the tokens the learner trains on.

The drift is the mean |log pi_behaviour - log pi_current| over the step's trained tokens (GRPO's log-ratio,
hub/method/grpo.py), averaged over the steps since the previous decision, or the last MIN_DRIFT_STEPS steps when
fewer, and not read until MIN_DRIFT_STEPS steps were trained at a new S (hub/method/drift.py). Of the three
measures the learner could use, it is the one that:
- is measured on every step at no cost (the loss computes the log-ratio anyway) and counts what the importance
  ratio must correct, engine mismatch included;
- grows about linearly with a rollout's age, so the drift at a larger S can be extrapolated: the recent drift per
  version of age (hub/method/drift.py; conservative, as part of the drift does not grow with age) times the mean age
  that S adds (the measured age scaled by expected_age), or drift / age, one version of S at most, before the drift
  per version is measured;
- reads on the clip's scale: PPO clips at |log-ratio| ~ 0.2 (eps 0.2 / 0.28), so a mean well below that leaves
  most tokens with a gradient.
The default bound, drift_max = 0.2, is the clip's own range (eps_low): the mean token stays inside the trust region
the loss enforces. Measured on the embedded default (`bench/staleness.py --steps 120 --staleness 0 2 4 8`): S = 4
trained at a mean drift of 0.107 and ended within 0.02 of S = 0's reward; S = 8, at 0.165, ended 0.05 below it
(held-out accuracy 0.46 against 0.57). The lowering threshold, 0.8 x 0.2 = 0.16, lies between the two. The former
default, 0.1, held auto at S = 1-3 on that model, where S = 4 lost no reward and cost 2.9x less.
The clipped fraction stays at 0 until the drift is already large and depends on the advantages' signs; the k3
KL is second order in the log-ratio (about half its mean square), so it is noisier at the small drifts where the
decision is taken.

The rule, one move per publish period:
- drift >= LOWER_AT * drift_max: S - 1 (DRIFT), whatever the cost, at once; a lowering is one version at a time, so
  each is measured before the next;
- else the cheapest S up to a ceiling, the smallest S within COST_TOLERANCE of the cheapest (fresher rollouts
  for the same money); the ceiling is the largest S' whose extrapolated drift, drift + the drift per version x
  age x (expected_age(S') / expected_age(S) - 1), stays below LOWER_AT * drift_max (so a raise never triggers the
  next period's lowering), and S + 1 while the drift per version is not measured (drift / age can be near 0 then,
  and the ceiling staleness_max). A raise may span several versions: one version per period took 15-20 steps to
  climb from S = 1 to the S = 4 the embedded default's fleet wanted (kappa = S - 1, so a period grows with S), and
  those steps cost what S = 1 costs. The extrapolation is conservative (above), so a jump lands under the bound as
  a single step would;
- a raise says why: the fleet falls short of mu_min at the S in force (POOL_SHORT) or the broadcast's stall
  costs (BROADCAST); a lowering says it is as cheap (CHEAPER_LOWER).

Three margins keep S from flapping when T_bcast is close to the (S - kappa) * T_train that hides it, where the stall
switches on and off with ordinary T_train noise and each S's cost crosses COST_TOLERANCE both ways:
- the costs plan the broadcast gamma times slower than measured (staleness_costs), the headroom mu_target = gamma *
  mu_min gives the throughput: the stall is convex in T_train (max(0, T_bcast - (S - kappa) * T_train)), so a
  period's mean T_train understates the stall its faster steps bring, and a plan at the mean sits on the edge;
- hysteresis: a raise needs the S it goes to cheaper by more than COST_TOLERANCE; a lowering for cost needs S - 1 no
  dearer than S (the band between the two is COST_TOLERANCE), and so for HOLD_PERIODS publish periods on end, as a
  node's release waits RELEASE_HOLD_PERIODS control periods (hub/control/policy.py). Each S's cost
  steps with the marginal node the pool buys, and that node moves with the measured R and T_train from period to
  period: S - 1 can be as cheap as S in one period and more than COST_TOLERANCE dearer in the next, so a lowering
  taken on one period's costs is undone by the next raise. The drift guard ignores these margins: it acts on
  quality, not money, and at once;
- after the drift guard lowered S, no raise for HOLD_PERIODS periods: the drift it measures at the lower S is
  smaller, and the extrapolation to a larger S would allow straight back the S the guard has just left.

bench/simulate.py calls `choose_staleness` with `staleness_costs` for its `auto` rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hub.method.capacity import (
    CapacityRule,
    InfeasibleCapacity,
    NodeOffer,
    activate,
    cost_per_step,
    default_kappa,
    mu_min,
    rule_staleness,
)
from hub.method.drift import expected_age
from shared.staleness import StalenessReason

# Lower S once the drift reaches this share of its bound: the margin covers the S_old steps in which groups
# leased under the old S are still trained on (hub/training/loop.py, the window's grace), and the MIN_DRIFT_STEPS
# steps at a new S before its drift is read (hub/method/drift.py).
LOWER_AT = 0.8
# A larger S must be this much cheaper per step to be chosen: stale rollouts cost quality the model cannot price.
COST_TOLERANCE = 0.02
# A lowering for cost waits until S - 1 has been as cheap as S for this many publish periods on end; a raise waits
# this many periods after the drift guard lowered S.
HOLD_PERIODS = 5


@dataclass(frozen=True)
class StalenessCost:
    """The capacity model's cost per step at one S, and whether the fleet falls short of its target there."""

    cost_per_step: float
    pool_short: bool


@dataclass(frozen=True)
class StalenessChoice:
    """The S to put in force (the current one when it stays) and why it moved (None: it stays)."""

    staleness: int
    reason: StalenessReason | None
    detail: str
    # S - 1 costs no more than S this period: what StalenessHold.after counts.
    lower_as_cheap: bool = False


@dataclass(frozen=True)
class StalenessHold:
    """What the hysteresis counts over publish periods (see the module docstring): the periods on end, at this S and
    before this one, in which S - 1 cost no more than S; the periods since the drift guard last lowered S, this one
    not counted (None: it has not)."""

    as_cheap_periods: int = 0
    periods_since_drift: int | None = None

    def after(self, choice: StalenessChoice) -> StalenessHold:
        """The counts for the next period, given this period's choice."""
        since = self.periods_since_drift
        since = 0 if choice.reason is StalenessReason.DRIFT else None if since is None else since + 1
        return StalenessHold(self.as_cheap_periods + 1 if choice.lower_as_cheap else 0, since)


def staleness_costs(
    offers: Sequence[NodeOffer],
    staleness_max: int,
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    gamma: float,
    learner_price_per_hour: float,
    rule: CapacityRule = "refined",
) -> dict[int, StalenessCost]:
    """Cost per step for each S in [1, staleness_max] (kappa = default_kappa(S)): the cheapest nodes of `offers` that
    reach gamma * mu_min(S) are bought, or all of them when they fall short or no fleet suffices. The broadcast is
    planned gamma * t_bcast_s long, headroom for its stall as for the throughput (see the module docstring); mu_min
    and the step's time follow the capacity `rule`."""
    costs = {}
    t_bcast_s = gamma * t_bcast_s
    for s in range(1, staleness_max + 1):
        kappa, modelled = default_kappa(s), rule_staleness(rule, s)
        try:
            bought = activate(offers, gamma * mu_min(kappa, rollouts_per_step, t_train_s, t_bcast_s, modelled))
            pool, short = bought.active, bought.shortfall > 0
        except InfeasibleCapacity:
            pool, short = tuple(offers), True
        mu_pool = math.fsum(n.rollouts_per_s for n in pool)
        cost = cost_per_step(
            kappa,
            rollouts_per_step,
            t_train_s,
            t_bcast_s,
            mu_pool,
            learner_price_per_hour,
            (n.price_per_hour for n in pool),
            modelled,
        )
        costs[s] = StalenessCost(cost, short)
    return costs


def cheapest_staleness(costs: Mapping[int, StalenessCost], ceiling: int) -> int:
    """The smallest S <= ceiling whose cost is within COST_TOLERANCE of the cheapest such S."""
    candidates = sorted(s for s in costs if s <= ceiling)
    best = min(costs[s].cost_per_step for s in candidates)
    return next(s for s in candidates if costs[s].cost_per_step <= best * (1 + COST_TOLERANCE))


def raise_ceiling(
    current: int,
    staleness_max: int,
    drift: float | None,
    drift_max: float,
    drift_per_version: float | None = None,
    periods_since_drift: int | None = None,
    age: float | None = None,
) -> int:
    """The largest S a raise may reach: the largest S' whose extrapolated drift, drift + the drift per version of age x
    the age S' adds, stays below the lowering threshold; the age S' adds is the mean age (`age`, measured, when above
    expected_age(current); else that) x (expected_age(S') / expected_age(current) - 1). Current + 1 at most while
    drift_per_version is unmeasured, drift / age standing in for it. The current S when not even current + 1 passes,
    when the drift is unmeasured, or less than HOLD_PERIODS periods after the drift guard last lowered S
    (periods_since_drift; None: never)."""
    if drift is None or (periods_since_drift is not None and periods_since_drift < HOLD_PERIODS):
        return current
    model = expected_age(current)
    scale = max(1.0, (age or 0.0) / model)
    if drift_per_version is None:
        rise, staleness_max = drift / (model * scale), min(staleness_max, current + 1)
    else:
        rise = drift_per_version
    ceiling = current
    while ceiling < staleness_max and drift + (expected_age(ceiling + 1) - model) * scale * rise < LOWER_AT * drift_max:
        ceiling += 1
    return ceiling


def lower_as_cheap(current: int, costs: Mapping[int, StalenessCost]) -> bool:
    """Whether S - 1 costs no more per step than the S in force."""
    return current > 1 and costs[current - 1].cost_per_step <= costs[current].cost_per_step


def choose_staleness(
    current: int,
    staleness_max: int,
    drift: float | None,
    drift_max: float,
    costs: Mapping[int, StalenessCost],
    drift_per_version: float | None = None,
    hold: StalenessHold = StalenessHold(),
    age: float | None = None,
) -> StalenessChoice:
    """This publish period's S: one version below `current`, or up to raise_ceiling above it (see the module
    docstring for the rule).

    `drift`: mean |log-ratio| of the trained tokens over the period (None: not read yet, the first MIN_DRIFT_STEPS
    steps at the S in force); `costs`: the capacity model's cost for each S in [1, staleness_max]
    (staleness_costs), missing when not measured yet; `drift_per_version`: the recent drift per version of age
    (None: not measured yet); `hold`: the hysteresis's counts, `hold.after(choice)` from the previous period's (a
    fresh one at the start); `age`: the mean age of the groups trained on over the drift's steps (None:
    expected_age(current) stands in). hub/method/drift.py reads the three.
    """
    if drift is not None and drift >= LOWER_AT * drift_max and current > 1:
        return StalenessChoice(current - 1, StalenessReason.DRIFT, f"drift {drift:.3g} >= {LOWER_AT:g} x {drift_max:g}")
    if not costs:
        return StalenessChoice(current, None, "capacity not measured yet")
    ceiling = raise_ceiling(current, staleness_max, drift, drift_max, drift_per_version, hold.periods_since_drift, age)
    best = cheapest_staleness(costs, ceiling)
    here = costs[current].cost_per_step
    as_cheap = lower_as_cheap(current, costs)
    if best > current:
        there = costs[best].cost_per_step
        reason = StalenessReason.POOL_SHORT if costs[current].pool_short else StalenessReason.BROADCAST
        return StalenessChoice(best, reason, f"${here:.4g}/step at S={current}, ${there:.4g} at S={best}")
    if best < current and as_cheap and hold.as_cheap_periods + 1 >= HOLD_PERIODS:
        there = costs[current - 1].cost_per_step
        return StalenessChoice(
            current - 1, StalenessReason.CHEAPER_LOWER, f"${there:.4g}/step at S={current - 1}, ${here:.4g} at S={current}"
        )
    return StalenessChoice(current, None, f"${here:.4g}/step at S={current}", as_cheap)
