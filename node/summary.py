"""What a stopped node did, printed when it stops: why (the hub's run is over, or a signal) and a summary, from its
NodeView, the node's own or the one its data dir holds (`echo-node join --dashboard` prints the one its node wrote
on the way out)."""

from __future__ import annotations

from pathlib import Path

from shared.layout import NODE_STATUS_FILE
from shared.messages import RELAY_UNPAID_TEXT, TALLY_FIELDS, NodeView, RunOver
from shared.units import duration

# What the hub pays for (hub.method.prices.billable_seconds), against the node's own generating time beside it.
PAID_TIME_TEXT = "the hub's measure: each lease from issue to answer, in the share of its groups accepted"
UNANSWERED_TEXT = "the hub never replied (lost on the way, or cut off by the stop): maybe paid, not counted above"


def summary_text(view: NodeView) -> str:
    """A few labelled lines: snapshots installed, the hub's verdicts on the work, earnings with the seconds the hub paid
    for beside this node's own generating time, bytes relayed; then what went unpaid and why (late and rejected groups,
    time in standby) and answers the hub never replied to."""
    installed = view.versions_installed
    held = f"holds v{view.version_held}" if view.version_held >= 0 else "holds none"
    verdicts = ", ".join(f"{name} {getattr(view.tallies, name)}" for name in TALLY_FIELDS)
    unanswered = view.unanswered
    return "\n".join(
        (
            f"  snapshots  {installed} version{'' if installed == 1 else 's'} installed, {held}",
            f"  work       {view.leases_done} leases: {verdicts} (as the hub replied)",
            f"  earnings   ${view.earnings_usd:.4f} for {view.paid_s:.1f} s paid at ${view.price_per_hour:.2f}/h ({PAID_TIME_TEXT})",
            f"  busy       {duration(view.busy_s)} generating (this node's own clock)",
            f"  relayed    {view.relayed_bytes / 1e6:.1f} MB of snapshots to this node's successors ({RELAY_UNPAID_TEXT})",
            *(f"  unpaid     {line}" for line in view.unpaid()),
            *([f"  no reply   {unanswered} answer{'' if unanswered == 1 else 's'}: {UNANSWERED_TEXT}"] if unanswered else []),
        )
    )


def run_over_text(over: RunOver) -> str:
    """What a node the end of the hub's run stopped says (then its summary)."""
    return f"{over.text()}: stopped (join with --wait-next-run to wait for the next run instead)"


def stored_view(data_dir: Path, since: float) -> NodeView | None:
    """The NodeView DATA_DIR holds; None when none was written `since` (time.time()): the node stopped before it ran,
    and an older view is another run's."""
    try:
        view = NodeView.model_validate_json((data_dir / NODE_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return view if view.updated_at >= since else None
