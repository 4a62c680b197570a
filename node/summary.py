"""What a stopped node did, printed when it stops: from its NodeView, the node's own or the one its data dir holds
(`echo-node join --dashboard` prints the one its node wrote on the way out)."""

from __future__ import annotations

from pathlib import Path

from shared.layout import NODE_STATUS_FILE
from shared.messages import TALLY_FIELDS, NodeView
from shared.units import duration


def summary_text(view: NodeView) -> str:
    """A few labelled lines: snapshots installed, the hub's verdicts on the work, earnings, bytes relayed; then what
    went unpaid and why (late and rejected groups, time in standby)."""
    installed = view.versions_installed
    held = f"holds v{view.version_held}" if view.version_held >= 0 else "holds none"
    verdicts = ", ".join(f"{name} {getattr(view.tallies, name)}" for name in TALLY_FIELDS)
    return "\n".join(
        (
            f"  snapshots  {installed} version{'' if installed == 1 else 's'} installed, {held}",
            f"  work       {view.leases_done} leases: {verdicts} (as the hub replied)",
            f"  earnings   ${view.earnings_usd:.4f} at ${view.price_per_hour:.2f}/h over {duration(view.busy_s)} busy",
            f"  relayed    {view.relayed_bytes / 1e6:.1f} MB of snapshots to this node's successors",
            *(f"  unpaid     {line}" for line in view.unpaid()),
        )
    )


def stored_summary(data_dir: Path, since: float) -> str | None:
    """The summary of the node whose NodeView DATA_DIR holds; None when none was written `since` (time.time()):
    the node stopped before it ran, and an older view is another run's."""
    try:
        view = NodeView.model_validate_json((data_dir / NODE_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary_text(view) if view.updated_at >= since else None
