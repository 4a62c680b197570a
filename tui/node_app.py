"""`echo-node join --dashboard`: a volunteer's own view (chain place, snapshot progress, work, earnings) from DATA_DIR/node_status.json."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Label, ProgressBar, Static

from shared.messages import TALLY_FIELDS, NodeView, reasons_text
from shared.units import duration
from tui import DEFAULT_REFRESH_S
from tui.widgets import Banner, DashboardApp, event_lines, money, number, short_id, styled_state, tally_cells


def identity_text(view: NodeView) -> Text:
    out = Text()
    out.append("peer    ")
    out.append(view.peer_id, style="bold")
    out.append(f"  ({view.name})\n" if view.name else "\n")
    transport, _, hub_id = view.hub_addr.partition("/p2p/")
    out.append(f"hub     {short_id(hub_id) if hub_id else '?'} at {transport}\n")
    out.append("state   ")
    out.append_text(styled_state(view.state))
    out.append("  connected" if view.connected else "  disconnected", style="green" if view.connected else "red")
    out.append(f"\nbackend {view.backend}   price {money(view.price_per_hour)}/h   holds v{view.version_held}")
    return out


def chain_text(view: NodeView) -> Text:
    if view.chain is None:
        return Text("not in a forwarding chain (standby nodes and star broadcast receive from the hub)", style="dim italic")
    out = Text(f"chain {view.chain}, position {view.chain_position}\n", style="bold")
    # Upstream None: the chain's head, fed by the hub itself.
    upstream = "hub" if view.upstream is None else short_id(view.upstream)
    out.append(upstream, style="bold blue" if view.upstream is None else "bold")
    out.append(" ▶ ", style="dim")
    out.append(f"[me {short_id(view.peer_id)}]", style="bold reverse")
    out.append(" ▶ ", style="dim")
    out.append("(end)" if view.downstream is None else short_id(view.downstream), style="bold" if view.downstream else "dim")
    return out


def work_text(view: NodeView) -> Text:
    t = view.tallies
    out = Text()
    out.append(f"throughput {number(view.tokens_per_s, '.0f')} tok/s  {number(view.rollouts_per_s)} rollouts/s\n")
    out.append(f"leases {view.leases_done}")
    for name, cell in zip(TALLY_FIELDS, tally_cells(t)):
        out.append(f"  {name} ")
        out.append(cell.plain, style=cell.style or ("green" if name == "accepted" else ""))
    if t.decided:
        out.append(f"  ({t.accepted / t.decided:.0%} accepted)")
    out.append("\nearnings ")
    out.append(money(view.earnings_usd, 4), style="bold green")
    out.append(f" for {view.paid_s:.0f} s paid at {money(view.price_per_hour)}/h; {duration(view.busy_s)} generating")
    if view.reasons:
        out.append(f"\nrefused by reason {reasons_text(view.reasons)}", style="yellow")
    for line in view.unpaid():
        out.append(f"\nunpaid: {line}", style="yellow")
    if view.last_refusals:
        out.append(f"\nlast refusal (the hub's words): {view.last_refusals[-1]}", style="dim")
    return out


def snapshot_label(view: NodeView) -> str:
    if view.receiving_version is None:
        return f"snapshot v{view.version_held} held; nothing in flight"
    return f"receiving v{view.receiving_version}: {view.chunks_received}/{view.chunks_total} chunks"


class NodeDashboard(DashboardApp):
    """Live view of one volunteer node from its DATA_DIR/node_status.json."""

    TITLE = "echo2 node"
    # Ctrl-C quits, as it stops the node everywhere else: under `echo-node join --dashboard` it stops the node too.
    BINDINGS = [*DashboardApp.BINDINGS, Binding("ctrl+c", "quit", "Quit", show=False, priority=True)]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    CSS = """
    .panel { border: round $primary; border-title-color: $accent; padding: 0 1; height: auto; }
    #middle { height: auto; }
    #chain, #snapshot { width: 1fr; height: 4; }
    #snapshot ProgressBar { width: 1fr; }
    #snapshot Bar { width: 1fr; }
    #events-box { height: 1fr; min-height: 4; border: round $primary; border-title-color: $accent; padding: 0 1; }
    .-short Header { display: none; }
    """

    def __init__(self, source, refresh_s: float = DEFAULT_REFRESH_S) -> None:
        super().__init__(source, refresh_s)
        self.view: NodeView | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Banner(id="banner")
        yield Static(id="identity", classes="panel")
        with Horizontal(id="middle"):
            yield Static(id="chain", classes="panel")
            with Vertical(id="snapshot", classes="panel"):
                yield Label("snapshot —", id="snapshot-label")
                yield ProgressBar(total=None, show_eta=False, id="snapshot-progress")
        yield Static(id="work", classes="panel")
        with VerticalScroll(id="events-box"):
            yield Static(id="events")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#identity").border_title = "node"
        self.query_one("#chain").border_title = "chain"
        self.query_one("#snapshot").border_title = "snapshot"
        self.query_one("#work").border_title = "work"
        self.query_one("#events-box").border_title = "recent events"
        super().on_mount()

    def show_data(self, result: NodeView) -> None:
        self.view = result
        self.show_freshness(True, result.updated_at, "node")
        self.sub_title = f"node {short_id(result.peer_id)} · {result.state}"
        self.query_one("#identity", Static).update(identity_text(result))
        self.query_one("#chain", Static).update(chain_text(result))
        self.query_one("#snapshot-label", Label).update(snapshot_label(result))
        bar = self.query_one("#snapshot-progress", ProgressBar)
        if result.receiving_version is not None and result.chunks_total > 0:
            bar.update(total=result.chunks_total, progress=result.chunks_received)
        else:
            # Nothing in flight: a full bar for the snapshot already held.
            bar.update(total=1, progress=1 if result.version_held >= 0 else 0)
        self.query_one("#work", Static).update(work_text(result))
        self.query_one("#events", Static).update(event_lines(result.events, with_node=False))
