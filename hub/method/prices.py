"""Prices (docs/DESIGN.md §9), every rule of them in one place: what one answered lease pays, what a node's
re-declared price does to the scheduler, and when it may move.

A lease is paid at the node's price when it was issued, for the seconds of the lease its accepted work is worth,
and never more than the per-lease cap (`price_lease`, `billable_seconds`); the intake books what they return in the
transaction that records the submission. The scheduler ranks a node by its *ranking* price, which follows the
declared one only once that moved more than a band away, so a price flapping by a cent neither reorders the pool
nor churns it. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.rollout import Group

SECONDS_PER_HOUR = 3600.0


class PayTerms(Protocol):
    """What pay is bounded by (hub.config.LeaseConfig)."""

    @property
    def lease_timeout_s(self) -> float: ...
    @property
    def paid_tokens_per_s_floor(self) -> float: ...
    @property
    def max_cost_per_lease_usd(self) -> float: ...


@dataclass(frozen=True)
class LeasePay:
    """The pay for one answered lease."""

    held_s: float  # how long the node held the lease, at most its timeout (also its throughput sample's time)
    billed_s: float  # of that, the seconds paid for (`billable_seconds`)
    usd: float
    tokens: int  # completion tokens the node sampled in the accepted groups (a tool's answers are the hub's)

    @property
    def booked_s(self) -> float:
        """The seconds the ledger books for this pay (what the node is told it was paid for): `billed_s`, or none
        when the lease pays nothing (the ledger then has no row for it)."""
        return self.billed_s if self.usd > 0 else 0.0


def billable_seconds(hold_s: float, accepted: int, leased: int, accepted_tokens: int, tokens_per_s_floor: float) -> float:
    """Seconds of a lease the node is paid for: the time it held the lease, in the share of its prompts it
    answered acceptably, and never more than its accepted tokens take at the slowest rate paid in full.

    Holding a lease longer, or answering with a few tokens, earns nothing more than doing the work."""
    if leased < 1 or not 0 <= accepted <= leased:
        raise ValueError(f"accepted {accepted} of {leased} leased prompts")
    return min(max(0.0, hold_s) * accepted / leased, accepted_tokens / tokens_per_s_floor)


def price_lease(
    issued_at: float, price_per_hour: float, leased: int, accepted: Sequence[Group], answered_at: float, terms: PayTerms
) -> LeasePay:
    """The pay for a lease of `leased` prompts issued at `issued_at` at `price_per_hour`, answered at `answered_at`
    with the `accepted` groups."""
    held_s = min(answered_at - issued_at, terms.lease_timeout_s)
    tokens = sum(c.sampled_tokens() for group in accepted for c in group.completions)
    billed_s = billable_seconds(held_s, len(accepted), leased, tokens, terms.paid_tokens_per_s_floor)
    usd = min(price_per_hour * billed_s / SECONDS_PER_HOUR, terms.max_cost_per_lease_usd)
    return LeasePay(held_s, billed_s, usd, tokens)


def ranking_price(ranked: float, declared: float, band: float) -> float:
    """The price the scheduler ranks a node by after it declared `declared`: the new price when it moved more
    than `band` (a share of the ranked price) away from `ranked`, else `ranked` unchanged."""
    if band < 0:
        raise ValueError(f"band must be >= 0, got {band}")
    return declared if abs(declared - ranked) > band * ranked else ranked


def price_change_refusal(
    price: float, ceiling: float, last_change_at: float | None, now: float, min_interval_s: float
) -> str | None:
    """Why a joined node may not re-declare `price` now (None: it may): the same bounds as at join, and one
    change per `min_interval_s` after the last one (`last_change_at`, kept across re-joins; None: none yet)."""
    if not math.isfinite(price) or price < 0:
        return f"price must be a finite number >= 0, got {price!r}"
    if price > ceiling:
        return f"price ${price:g}/h is above this hub's ceiling ${ceiling:g}/h"
    if last_change_at is not None and now - last_change_at < min_interval_s:
        return f"one price change per {min_interval_s:g}s: next in {min_interval_s - (now - last_change_at):.0f}s"
    return None
