"""What the hub measured of its learner and of its broadcasts: the figures the scheduler plans by, Leasing holds
leases to and the status board shows, kept in one object so each is computed once and read by all.

`Measurements` is fed by the step commit (HubState.commit_step reads the recent steps and settled groups inside the
commit's transaction: `read_from`) and at start; by the learner's own window (`LearnerWindow`: its step, whether a
step is under way, the S in force and the S the window uses, kappa); and by the broadcaster when a broadcast reached
every receiver (`broadcast_done`). Readers never write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hub.method.capacity import default_kappa, fresh_usable_fraction, saturation, usable_fraction
from hub.records.schema import StepRecord
from hub.records.store import Store

# T_train is the mean of this many newest steps.
T_TRAIN_STEPS = 10
# Settled accepted groups the usable fraction is measured over: recent enough to follow the reward.
USABLE_WINDOW_GROUPS = 512


def next_take(step: int, training: bool) -> int:
    """The step of the learner's next take (`ReplayBuffer.take`'s `step`): `step` + 1 while a step is under way."""
    return step + 1 if training else step


def takes_served(held: int, first_take: int, staleness: int, grace: tuple[int, int]) -> int:
    """How many takes from `first_take` on still use version `held`: the take at step c uses versions >= c -
    grace_staleness(S, grace, c), so the last one is at held + S, or later while a lowered S's grace lasts."""
    old, until = grace
    last = max(held + staleness, min(until, held + max(staleness, old)))
    return max(0, last - first_take + 1)


def oldest_useful_version(step: int, training: bool, window_staleness: int) -> int:
    """The oldest version whose fresh rollouts the learner's next take can still use: that take uses groups up to
    `window_staleness` versions older than its step."""
    return max(0, next_take(step, training) - window_staleness)


def grace_staleness(staleness: int, grace: tuple[int, int], step: int) -> int:
    """The S the buffer and the leases' window use at `step`: the S in force, or a larger one it replaced while its
    grace lasts (`grace` = (S before a lowering, the last step that still uses it))."""
    old, until = grace
    return max(staleness, old) if step <= until else staleness


def grace_after_lowering(grace: tuple[int, int], window: int, version: int, staleness: int) -> tuple[int, int]:
    """The grace once S (`staleness`, the one being lowered) is lowered at `version`, the window then `window`: a group
    made with a version up to this one was usable under the old S until at most `version` + S, so the old window
    holds until then and no group made or leased before the change is dropped for it."""
    return window, max(grace[1], version + staleness)


def resumed_staleness(newest: StepRecord | None, staleness_max: int) -> int | None:
    """--staleness auto: the S a resumed run goes on at, the one its newest committed step trained under, within
    [1, staleness_max] (None: no step yet, the start's S)."""
    if newest is None:
        return None
    return min(max(1, newest.staleness_budget or 1), staleness_max)


@dataclass
class LearnerWindow:
    """The learner's side of the version window, as the learner (hub/training/loop.py) last set it."""

    step: int = 0
    training: bool = False
    staleness: int = 1  # the S in force
    window_staleness: int = 1  # the S the window uses: the S in force, or a larger one it replaced, for its grace
    grace: tuple[int, int] = (1, 0)  # (S before a lowering, the last step that still uses it): grace_staleness
    kappa: int = 1

    def min_useful_version(self) -> int:
        return oldest_useful_version(self.step, self.training, self.window_staleness)

    def takes_served(self, held: int) -> int:
        return takes_served(held, next_take(self.step, self.training), self.staleness, self.grace)

    @classmethod
    def at_start(cls, store: Store, staleness: int, kappa: int, staleness_max: int | None) -> LearnerWindow:
        """The window a learner over `store` starts with, before it is built (the scheduler is built first): its
        newest committed step, and under --staleness auto (`staleness_max` set) the S that step trained under."""
        resumed = resumed_staleness(store.training.latest_step_record(), staleness_max) if staleness_max is not None else None
        if resumed is not None:
            staleness, kappa = resumed, default_kappa(resumed)
        return cls(
            step=store.training.latest_step() or 0,
            staleness=staleness,
            window_staleness=staleness,
            grace=(staleness, 0),
            kappa=kappa,
        )


@dataclass(frozen=True)
class StepReading:
    """The figures a step commit reads back from the store."""

    t_train_recent_s: float | None
    usable_fraction: float
    fresh_usable_fraction: float
    saturated: str | None = None  # why the fresh fraction is too low for more nodes to help (capacity.saturation)


def read_step_figures(store: Store) -> StepReading:
    """T_train over the newest steps and the usable fractions over the newest settled groups (blocking)."""
    recent = [s.t_train_s for s in store.training.recent_steps(T_TRAIN_STEPS)]
    groups = store.groups.recent_usable_groups(USABLE_WINDOW_GROUPS)
    fresh = fresh_usable_fraction(groups.trained, groups.settled, groups.stale)
    zero_share = groups.zero_variance / groups.settled if groups.settled else 0.0
    return StepReading(
        sum(recent) / len(recent) if recent else None,
        usable_fraction(groups.trained, groups.settled),
        fresh,
        saturation(fresh, zero_share),
    )


@dataclass
class Measurements:
    """The measured figures; see the module docstring."""

    learner: LearnerWindow = field(default_factory=LearnerWindow)
    t_train_recent_s: float | None = None  # None: no step yet
    # Share of accepted groups that end up trained on (hub.method.capacity.usable_fraction), and the same with stale
    # drops counted as usable (fresh_usable_fraction): what the fleet is sized by, and what one step's rollouts
    # shrink by (hub.method.capacity.Arrival). `saturated`: why that share is too low for more nodes to help.
    usable_fraction: float = 1.0
    fresh_usable_fraction: float = 1.0
    saturated: str | None = None
    # Of the newest broadcast on every receiver: T_bcast, the active pool's throughput-weighted mean time to install
    # it, and (rollouts/s, seconds from publish to install) of each active node. None / empty: none yet.
    t_bcast_s: float | None = None
    t_arrive_s: float | None = None
    installs: tuple[tuple[float, float], ...] = ()

    def step_committed(self, reading: StepReading) -> None:
        self.t_train_recent_s = reading.t_train_recent_s
        self.usable_fraction = reading.usable_fraction
        self.fresh_usable_fraction = reading.fresh_usable_fraction
        self.saturated = reading.saturated

    def broadcast_done(self, seconds: float, arrive_s: float | None, installs: tuple[tuple[float, float], ...]) -> None:
        self.t_bcast_s, self.t_arrive_s, self.installs = seconds, arrive_s, installs
