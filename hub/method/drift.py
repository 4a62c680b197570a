"""The off-policy drift `--staleness auto` decides on (hub/control/staleness.py), estimated from the learner's steps:
each step's mean |log-ratio| of its trained tokens and the mean age, in versions, of the groups it trained on.

Two readings per publish period:
- the period's drift, which the guard compares with its bound: the mean over the period's steps, or over the last
  MIN_DRIFT_STEPS steps when the period is shorter. Below S = 3 a period is one step (kappa = 1), and one step's drift
  ranges from ~0 (it trained on groups of the current version only) to twice the mean or more (the oldest ones):
  on the embedded default, 0.0 to 0.26 around a mean of 0.08. One such step had the guard undo a raise it had just
  made.
  No reading (None: S stays) until MIN_DRIFT_STEPS steps have been trained at the S in force, so a move is judged on
  steps taken under it, not on the steps of the S it left;
- the drift per version of age, which extrapolates the drift to a larger S: sum of drift over sum of mean age, over
  the last DRIFT_WINDOW_STEPS steps that trained on stale groups. A recent window, not the whole run: the drift one
  version brings falls as the policy settles (on the embedded default, 0.30 over the first 2 steps, 0.05 by step 30),
  and a run-long mean held auto at S = 1-2 for the first 15 steps. The ratio counts the drift that does not grow with
  age (engine mismatch) as age, so it errs on the side of a smaller S. None until MIN_STALE_STEPS such steps.

The drift at another S is extrapolated along the mean age a step trains at: the period's measured mean age (never
less than expected_age(S)), scaled by expected_age(S') / expected_age(S), where expected_age(S) = S - kappa / 2 with
kappa = default_kappa(S): a lease takes the newest published version, (kappa - 1) / 2 versions old on average as a
version is published every kappa steps; the capacity model lets generation take up to S - kappa steps (mu_min); and a
step trains half a version after the groups it takes, on average. Measured on the embedded default with 3 nodes
(`bench/staleness.py --adaptive`, 3 runs each): S = 1, 2, 4, 8 trained at mean ages 0.50-0.57, 1.37-1.54, 2.48-2.72,
4.38-4.47, against 0.5, 1.5, 2.5 and 4.5. One version of S adds one version of age from S = 1 but half a version above
S = 2, where kappa grows with S. The measured age anchors the scale when it is the larger: a fleet whose groups wait
longer in the buffer trains at older groups than the model says, at every S. A smaller one is not trusted: a few steps
after a raise most groups were still made under the old S, and the age they read is the old S's.
"""

from __future__ import annotations

import math
from collections import deque

from hub.method.capacity import default_kappa

# The stale steps the drift per version is taken over: recent, and still several publish periods at S <= 4.
DRIFT_WINDOW_STEPS = 16
# The fewest steps a drift reading averages, and the steps at a new S before its first reading.
MIN_DRIFT_STEPS = 4
# The drift per version is measured once the window holds this many steps that trained on stale groups.
MIN_STALE_STEPS = 2


def expected_age(staleness: int) -> float:
    """The mean age, in versions, of the groups a step trains on at staleness S >= 1 (see the module docstring)."""
    if staleness < 1:
        raise ValueError(f"expected_age needs S >= 1, got {staleness}")
    return staleness - default_kappa(staleness) / 2


class DriftMeter:
    """The learner's recent steps, read once per publish period (see the module docstring)."""

    def __init__(self) -> None:
        self._stale: deque[tuple[float, float]] = deque(maxlen=DRIFT_WINDOW_STEPS)  # (drift, mean age > 0)
        self._last: deque[tuple[float, float]] = deque(maxlen=MIN_DRIFT_STEPS)  # (drift, mean age) of the latest steps
        self._period = (0.0, 0.0, 0)  # sums of drift and of mean age, and steps, since the last reading
        self._at_this_s = 0  # steps trained since the S in force last changed

    def add(self, drift: float, age: float) -> None:
        """One learner step: its mean |log-ratio| and the mean age of the groups it trained on."""
        if age > 0:
            self._stale.append((drift, age))
        self._last.append((drift, age))
        drift_sum, age_sum, steps = self._period
        self._period = (drift_sum + drift, age_sum + age, steps + 1)
        self._at_this_s += 1

    def read(self) -> tuple[float | None, float | None, float | None]:
        """(drift, drift per version of age, mean age) for this publish period, the drift and the age over the same
        steps, each None when not measured yet; a new period begins."""
        (drift_sum, age_sum, steps), self._period = self._period, (0.0, 0.0, 0)
        per_version = self.drift_per_version()
        if self._at_this_s < MIN_DRIFT_STEPS:
            return None, per_version, None
        if steps < MIN_DRIFT_STEPS:
            drift_sum, age_sum, steps = (
                math.fsum(d for d, _ in self._last),
                math.fsum(a for _, a in self._last),
                len(self._last),
            )
        return drift_sum / steps, per_version, age_sum / steps

    def drift_per_version(self) -> float | None:
        """The recent stale steps' drift over their mean age (None: fewer than MIN_STALE_STEPS of them)."""
        if len(self._stale) < MIN_STALE_STEPS:
            return None
        return math.fsum(d for d, _ in self._stale) / math.fsum(a for _, a in self._stale)

    def moved(self) -> None:
        """The S in force changed: readings wait for MIN_DRIFT_STEPS steps under the new one."""
        self._at_this_s = 0
