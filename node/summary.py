"""What a stopped node did, printed when it stops: from its NodeView, the node's own or the one its data dir holds
(`echo-node join --dashboard` prints the one its node wrote on the way out)."""

from __future__ import annotations

from pathlib import Path

from shared.layout import NODE_STATUS_FILE
from shared.messages import TALLY_FIELDS, GroupReason, NodeView, reason_meaning
from shared.units import duration

# Less time in standby than this goes unmentioned: a measured probe passes through it on its way to work.
STANDBY_SAID_S = 1.0
LATE_TEXT = "your groups arrived after the hub moved on"
STANDBY_TEXT = "cheaper capacity covers the need at your price"


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
            *unpaid_lines(view),
        )
    )


def unpaid_lines(view: NodeView) -> list[str]:
    """What went unpaid and why, one line each: late groups (with the pace the hub needs), rejected groups by reason,
    time in standby."""
    lines = []
    late = view.tallies.late
    if late:
        need = view.needed_rollouts_per_s
        pace = f"this hub needs {need:.3g} rollouts/s per node" if need is not None else "this hub needs a faster node"
        lines.append(
            f"  unpaid     {late} late group{'' if late == 1 else 's'}: {LATE_TEXT}; {pace} "
            f"(this node's last lease ran at {view.rollouts_per_s:.3g})"
        )
    for why, n in sorted(view.reasons.items(), key=lambda item: -item[1]):
        if why != GroupReason.LATE and n:
            lines.append(f"  unpaid     {n} group{'' if n == 1 else 's'} rejected ({why}): {reason_meaning(why)}")
    if view.standby_s >= STANDBY_SAID_S:
        lines.append(f"  unpaid     {duration(view.standby_s)} in standby: {STANDBY_TEXT} (${view.price_per_hour:.2f}/h)")
    return lines


def stored_summary(data_dir: Path, since: float) -> str | None:
    """The summary of the node whose NodeView DATA_DIR holds; None when none was written `since` (time.time()):
    the node stopped before it ran, and an older view is another run's."""
    try:
        view = NodeView.model_validate_json((data_dir / NODE_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary_text(view) if view.updated_at >= since else None
