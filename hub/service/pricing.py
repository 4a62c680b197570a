"""What a node is paid for one answered lease: its price at lease time, for the seconds of the lease its
accepted work is worth, and never more than the per-lease cap.

Pure functions: HubState books what they return in the transaction that records the submission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hub.config import LeaseConfig
from hub.records.leases import LeaseRecord
from shared.rollout import Group


@dataclass(frozen=True)
class LeasePay:
    """The pay for one answered lease."""

    held_s: float  # how long the node held the lease, at most its timeout (also its throughput sample's time)
    billed_s: float  # of that, the seconds paid for (`billable_seconds`)
    usd: float
    tokens: int  # completion tokens of the accepted groups


def billable_seconds(hold_s: float, accepted: int, leased: int, accepted_tokens: int, tokens_per_s_floor: float) -> float:
    """Seconds of a lease the node is paid for: the time it held the lease, in the share of its prompts it
    answered acceptably, and never more than its accepted tokens take at the slowest rate paid in full.

    Holding a lease longer, or answering with a few tokens, earns nothing more than doing the work."""
    if leased < 1 or not 0 <= accepted <= leased:
        raise ValueError(f"accepted {accepted} of {leased} leased prompts")
    return min(max(0.0, hold_s) * accepted / leased, accepted_tokens / tokens_per_s_floor)


def price_lease(lease: LeaseRecord, accepted: Sequence[Group], answered_at: float, config: LeaseConfig) -> LeasePay:
    """The pay for a lease answered at `answered_at` with the `accepted` groups, at the price it was issued at."""
    held_s = min(answered_at - lease.issued_at, config.lease_timeout_s)
    tokens = sum(len(c.token_ids) for group in accepted for c in group.completions)
    billed_s = billable_seconds(held_s, len(accepted), len(lease.prompts), tokens, config.paid_tokens_per_s_floor)
    usd = min(lease.price_per_hour * billed_s / 3600.0, config.max_cost_per_lease_usd)
    return LeasePay(held_s, billed_s, usd, tokens)
