"""Moving prices (docs/DESIGN.md §9): what a node's re-declared price does to the scheduler and when it may move.

A node pays at the price in force when its lease was issued (hub/service/pricing.py); the scheduler ranks it by
its *ranking* price, which follows the declared one only once that moved more than a band away, so a price
flapping by a cent neither reorders the pool nor churns it.
"""

from __future__ import annotations

import math


def ranking_price(ranked: float, declared: float, band: float) -> float:
    """The price the scheduler ranks a node by after it declared `declared`: the new price when it moved more
    than `band` (a share of the ranked price) away from `ranked`, else `ranked` unchanged."""
    if band < 0:
        raise ValueError(f"band must be >= 0, got {band}")
    return declared if abs(declared - ranked) > band * ranked else ranked


def price_change_refusal(price: float, ceiling: float, last_change_at: float | None, now: float,
                         min_interval_s: float) -> str | None:
    """Why a joined node may not re-declare `price` now (None: it may): the same bounds as at join, and one
    change per `min_interval_s` after the last one (`last_change_at`; None: none since it joined)."""
    if not math.isfinite(price) or price < 0:
        return f"price must be a finite number >= 0, got {price!r}"
    if price > ceiling:
        return f"price ${price:g}/h is above this hub's ceiling ${ceiling:g}/h"
    if last_change_at is not None and now - last_change_at < min_interval_s:
        return f"one price change per {min_interval_s:g}s: next in {min_interval_s - (now - last_change_at):.0f}s"
    return None
