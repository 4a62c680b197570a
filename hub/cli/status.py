"""`echo-hub status`: print a hub's nodes, leases, versions, throughput and cost (live or from its data dir)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shared.checks import UserError, check_key_file, check_peer_addr
from shared.failures import plain_failure
from shared.layout import HUB_LOCK_FILE, HUB_STATUS_FILE
from shared.lock import live_holder
from shared.messages import (
    RECENT_REWARD_STEPS,
    STALE_FILE_S,
    TALLY_FIELDS,
    TALLY_SHORT,
    HubStatus,
    NodeStatus,
    reasons_text,
    short_id,
    tool_totals_text,
)
from shared.staleness import moves_text
from shared.units import duration

STATUS_TIMEOUT_S = 10.0


def fetch_status(hub_addr: str, key: Path | None = None) -> HubStatus:
    """One status request to a running hub over libp2p, as `key`'s identity (None: a throwaway one, which
    sees nodes' prices and costs redacted)."""
    import trio

    from shared.crypto import Identity
    from shared.messages import STATUS_PROTOCOL, StatusRequest
    from shared.net import connect, request, running_host

    async def fetch() -> HubStatus:
        identity = Identity.load(key) if key is not None else Identity.generate()
        async with running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, _):
            with trio.fail_after(STATUS_TIMEOUT_S):
                peer = await connect(host, hub_addr)
            return await request(host, peer, STATUS_PROTOCOL, StatusRequest(events=20), HubStatus, timeout_s=STATUS_TIMEOUT_S)

    return trio.run(fetch)


def run_state(status: HubStatus, data_dir: Path | None = None, now: float | None = None) -> str:
    """What the hub is doing: "running", "finished", "stopped", or, for a hub whose status file says running but
    which died without a word (SIGKILL, a power cut), "stopped (last seen <time>, <N> s ago)". `data_dir`: the
    status came from its file, so DATA_DIR/hub.lock's pid tells whether its writer still runs."""
    if not status.running:
        return "finished" if status.steps_target and status.step >= status.steps_target else "stopped"
    if data_dir is None:
        return "running"  # the hub itself answered
    age_s = (time.time() if now is None else now) - status.updated_at
    pid = live_holder(data_dir, HUB_LOCK_FILE)
    if pid is not None:
        return "running" if age_s <= STALE_FILE_S else f"running (pid {pid}; status not rewritten for {duration(age_s)})"
    if not (data_dir / HUB_LOCK_FILE).exists() and age_s <= STALE_FILE_S:
        return "running"  # no lock file to ask (a copied data dir): the status is fresh
    return f"stopped (last seen {_clock(status.updated_at)}, {duration(age_s)} ago)"


def _clock(at: float) -> str:
    """14:03:07 today, 2026-11-30 14:03 on an earlier day."""
    same_day = time.localtime(at)[:3] == time.localtime()[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", time.localtime(at))


def _node_cells(n: NodeStatus, redacted: bool) -> tuple[str | Text, ...]:
    """One row of the nodes table; a redacted status's prices and costs read "hidden", not 0."""
    chain = f"{n.chain}.{n.chain_position}" if n.chain is not None else "-"
    return (
        Text(n.label()),  # a name is the volunteer's text: printed as it is, never read as markup
        f"{n.state} (too slow)" if n.too_slow else n.state,
        "hidden" if redacted else f"{n.price_per_hour:.2f}",
        f"{n.rollouts_per_s:.2f}",
        str(n.version_held),
        *(str(getattr(n.tallies, name)) for name in TALLY_FIELDS),
        "hidden" if redacted else f"{n.cost_usd:.5f}",
        chain,
        n.net_text(),
    )


def _node_notes(status: HubStatus) -> list[str]:
    """The lines under the nodes table: each node's refusals by reason, the prices of nodes whose price moved, and the
    sampling test's evidence against a node where it is more than chance."""
    # A redacted status has no node's reasons: why a named node was refused is for operators.
    refused = [f"refused {short_id(n.peer_id)}: {reasons_text(n.reasons)}" for n in status.nodes if n.reasons]
    prices = [
        f"price {short_id(n.peer_id)}: $/h " + " -> ".join(f"{price:.2f} ({_clock(at)})" for at, price in n.price_history)
        for n in status.nodes
        if len(n.price_history) > 1  # only nodes whose price moved: a joined price alone says nothing new
    ]
    # Evidence under a tenth of the bar is what honest sampling shows by chance: only more is worth a line.
    bar = status.sampling_threshold_nats
    sampling = [
        f"sampling {short_id(n.peer_id)}: evidence it chose its tokens {n.sampling_nats:.1f} nats, condemned at {bar:.1f}"
        for n in status.nodes
        if bar is not None and n.sampling_nats >= 0.1 * bar
    ]
    return refused + prices + sampling


def _warning_rows(status: HubStatus) -> list[tuple[str, Text]]:
    """The newest warnings for the operator, newest first, each with its time and kind (and its text, but in a redacted
    status), and how many older ones the status holds."""
    rows: list[tuple[str, Text]] = []
    for warning in status.newest_warnings():
        text = Text(f"{_clock(warning.at)} {warning.kind}", style="bold yellow")  # the hub's text: never read as markup
        if warning.detail:
            text.append(f": {warning.detail}", style="yellow")
        rows.append(("warning", text))
    older = len(status.warnings) - len(rows)
    if older:
        rows.append(("", Text(f"{older} older warning{'' if older == 1 else 's'}: see --json, or hub.log")))
    return rows


def render(status: HubStatus, console: Console, state: str | None = None) -> None:
    """The status as tables; `state` (run_state's) in place of the status's own running flag."""
    head = Table.grid(padding=(0, 2))
    # Wrapped, never cut: a wide row (the reasons) must not clip another's value on an 80-column pipe; the values'
    # column keeps room for a one-line state.
    head.add_column(no_wrap=True)
    head.add_column(overflow="fold", min_width=40)
    head.add_column(overflow="fold")
    head.add_row("hub", status.hub_id)
    head.add_row("state", state or run_state(status))
    for label, text in _warning_rows(status):
        head.add_row(label, text, "")
    head.add_row("step", f"{status.step}/{status.steps_target or '∞'}", f"version v{status.version}")
    head.add_row(
        "rollout reward", status.recent_reward_text(), f"bubble {status.bubble:.2f}" if status.bubble is not None else ""
    )
    if (calls := status.recent_tool_calls()) is not None:
        head.add_row("tool calls", f"{calls:.2f} per rollout (last {RECENT_REWARD_STEPS} steps)", "")
    if status.tools is not None:
        head.add_row("tools", tool_totals_text(status.tools), "")
    if status.evals:
        e = status.evals[-1]
        passes = f"pass@1 {e.pass_at_1:.3f}, pass@{e.k} {e.pass_at_k:.3f}" if e.k > 1 else f"pass@1 {e.pass_at_1:.3f}"
        head.add_row("held-out", f"{e.reward:.3f} at step {e.step} ({e.prompts} prompts)", passes)
    head.add_row("staleness S / kappa", f"{status.staleness} / {status.kappa}", f"task {status.task}")
    head.add_row("S over time", moves_text(status.staleness_moves), "")
    t = status.totals
    head.add_row("trajectories", f"{t.accepted} accepted, {t.rejected} rejected, {t.late} late", f"{status.dropped_stale} stale")
    head.add_row("refused by reason", reasons_text(status.reasons), "since the hub started")
    head.add_row("open leases", str(status.open_leases), f"broadcast {status.broadcast_mode}")
    t_bcast = f"T_bcast {status.t_bcast_s:.1f} s" if status.t_bcast_s is not None else ""
    head.add_row("broadcast", status.broadcast_bytes_text(), t_bcast)
    mu = f"mu_pool {status.mu_pool:.2f}/s"
    if status.mu_min is not None:
        mu += f", mu_min {status.mu_min:.2f}/s, target {status.mu_target:.2f}/s"
    mu += f", {status.usable_fraction:.0%} of accepted groups trained on"
    head.add_row("throughput", mu, f"bubble {status.bubble:.2f}" if status.bubble is not None else "")
    if status.redacted:
        head.add_row("cost", "hidden: prices and costs are for operators; ask with --key DATA_DIR/hub.key", "")
    else:
        per_step = f"per step ${status.cost_per_step_usd:.5f}" if status.cost_per_step_usd else ""
        head.add_row("cost", f"${status.cost_usd:.4f}", per_step)
    console.print(head)
    # Short headers, as on the dashboard, one space between columns, and every figure whole: at 80 columns the
    # peer's name and id fold over lines instead of a figure being cut.
    nodes = Table(title="nodes", box=box.SIMPLE_HEAD, pad_edge=False, padding=0)
    nodes.add_column("peer", overflow="fold", min_width=8)
    for col in ("state", "$/h", "roll/s", "ver", *TALLY_SHORT.values(), "cost $", "chain", "net"):
        nodes.add_column(col, no_wrap=True)
    for n in status.nodes:
        nodes.add_row(*_node_cells(n, status.redacted))
    console.print(nodes)
    for line in _node_notes(status):
        console.print(line)
    for i, members in enumerate(status.chains):
        console.print(f"chain {i}: hub -> " + " -> ".join(short_id(p) for p in members))


def run_status(hub: str | None, data_dir: Path | None, as_json: bool, key: Path | None = None) -> int:
    """Print the status; exit 2 for a mistake (a mistyped address, a data dir with no hub), 1 for a hub that
    does not answer."""
    if hub is not None:
        check_peer_addr(hub)
        if key is not None:
            check_key_file(key)
        # py-libp2p logs each failed dial attempt at ERROR; the one line below says what happened.
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        try:
            status = fetch_status(hub, key)
        except Exception as exc:  # noqa: BLE001 - dial and protocol errors share no base class
            print(f"echo-hub status: no answer from {hub}: the hub {plain_failure(exc)}", file=sys.stderr)
            return 1
        state = run_state(status)
    else:
        data_dir = Path(data_dir or "echo2-data")
        written = _read_status_file(data_dir / HUB_STATUS_FILE)
        if written is None:
            return 1
        status = written
        state = run_state(status, data_dir)
        if status.running and state.startswith("stopped"):
            status = status.model_copy(update={"running": False})  # what its file says is no longer true
            if as_json:
                print(f"echo-hub status: the hub {state}", file=sys.stderr)
    try:
        if as_json:
            print(status.model_dump_json(indent=2))
        else:
            render(status, Console(), state)
        sys.stdout.flush()
    except BrokenPipeError:
        # `echo-hub status --json | head`: the reader has what it wanted.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _read_status_file(path: Path) -> HubStatus | None:
    """The HubStatus a data dir's hub last wrote; None (said on stderr) when the file holds something else, or when a
    hub is starting there and has written none for this start yet."""
    starting = _starting(path)
    if starting is not None:
        print(f"echo-hub status: {starting}", file=sys.stderr)
        return None
    if not path.exists():
        raise UserError(f"no {path}: give the --data-dir of a hub, or --hub ADDR")
    try:
        return HubStatus.model_validate_json(path.read_text())
    except ValueError:
        print(f"echo-hub status: {path} is not a hub status (written by another echo2?)", file=sys.stderr)
        return None


def _starting(path: Path) -> str | None:
    """What to say of a hub that holds the data dir but has not written its status since it started (it builds its
    model, loads its task, resumes: up to minutes); None when there is none, or it has. The lock file is written as
    the hub starts, so a status older than it is an earlier start's."""
    data_dir = path.parent
    pid = live_holder(data_dir, HUB_LOCK_FILE)
    if pid is None:
        return None
    try:
        if path.stat().st_mtime >= (data_dir / HUB_LOCK_FILE).stat().st_mtime:
            return None
    except FileNotFoundError:
        pass  # no status yet
    return (
        f"the hub in {data_dir} (pid {pid}) is starting: building its model and task; its status appears once it "
        "listens (a few seconds, minutes for a large model)"
    )
