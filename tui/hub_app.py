"""`echo-hub dashboard`: the hub's learner, fleet, chains, cost, events and warnings for its operator, refreshed
live."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

from shared.messages import RECENT_REWARD_STEPS, TALLY_FIELDS, TALLY_SHORT, HubStatus, NodeStatus, reasons_text, tool_totals_text
from shared.staleness import moves_text
from tui import DEFAULT_REFRESH_S
from tui.widgets import Banner, DashboardApp, clock, event_lines, money, number, short_id, styled_state, tally_cells


def display_state(node: NodeStatus) -> str:
    """The NodeState, except that a live node with a snapshot in flight shows as receiving."""
    if node.receiving_version is not None and node.state not in ("banned", "gone"):
        return "receiving"
    return node.state


def rho(node: NodeStatus) -> float | None:
    """Declared price per unit of measured throughput ($/h per rollout/s); None before any throughput."""
    return node.price_per_hour / node.rollouts_per_s if node.rollouts_per_s > 0 else None


def cost_per_rollout(status: HubStatus) -> float | None:
    return status.cost_usd / status.totals.accepted if status.totals.accepted > 0 else None


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    sort_key: Callable[[NodeStatus], Any]


def _tally(name: str, node: NodeStatus) -> int:
    return getattr(node.tallies, name)


def _none_last(value: float | None) -> tuple[bool, float]:
    return (value is None, 0.0 if value is None else value)


NODE_COLUMNS: tuple[Column, ...] = (
    Column("peer", "peer", lambda n: n.label()),
    Column("state", "state", display_state),
    Column("price", "$/h", lambda n: n.price_per_hour),
    Column("mu", "roll/s", lambda n: n.rollouts_per_s),
    Column("rho", "rho", lambda n: _none_last(rho(n))),
    Column("version", "ver", lambda n: n.version_held),
    *(Column(name, TALLY_SHORT[name], partial(_tally, name)) for name in TALLY_FIELDS),
    Column("cost", "cost", lambda n: n.cost_usd),
    Column("net", "net", lambda n: n.net_text()),
)


# Shown where the hub redacted a figure (asked without an operator key): "$/h 0.00" would read as a free node.
HIDDEN = "hidden"


def node_row(node: NodeStatus, redacted: bool = False) -> tuple[object, ...]:
    version = str(node.version_held)
    if node.receiving_version is not None:
        version += f"←{node.receiving_version}:{node.chunks_received}"
    return (
        Text(node.label(), style="bold"),
        styled_state(display_state(node)),
        Text(HIDDEN if redacted else money(node.price_per_hour), justify="right"),
        Text(number(node.rollouts_per_s), justify="right"),
        Text(number(rho(node), ".3g"), justify="right"),
        Text(version, justify="right"),
        *tally_cells(node.tallies),
        Text(HIDDEN if redacted else money(node.cost_usd, 3), justify="right"),
        Text(node.net_text(), style="yellow" if node.reachability == "nated" else ""),
    )


def chains_text(status: HubStatus) -> Text:
    """One line per forwarding chain: hub ▶ node vX ▶ node vY, with the snapshot in flight."""
    if not status.chains:
        return Text(f"no forwarding chains (broadcast mode: {status.broadcast_mode})", style="dim italic")
    by_id = {n.peer_id: n for n in status.nodes}
    out = Text()
    for index, chain in enumerate(status.chains):
        if index:
            out.append("\n")
        out.append(f"chain {index} ", style="bold")
        out.append("hub", style="bold blue")
        for peer in chain:
            out.append(" ▶ ", style="dim")
            node = by_id.get(peer)
            out.append(short_id(peer), style="bold")
            if node is None:
                out.append(" ?", style="red")
                continue
            held_style = "green" if node.version_held >= status.version else "yellow"
            out.append(f" v{node.version_held}", style=held_style)
            if node.receiving_version is not None:
                out.append(f" ↓v{node.receiving_version} {node.chunks_received}ch", style="cyan")
    return out


def learner_text(status: HubStatus) -> Text:
    out = Text()
    out.append(f"step {status.step}/{status.steps_target or '∞'}", style="bold")
    out.append(f"  v{status.version}  S={status.staleness}  κ={status.kappa}  leases {status.open_leases}\n")
    if len(status.staleness_moves) > 1:  # S moved (--staleness auto): when and why
        out.append(moves_text(status.staleness_moves, last=2) + "\n", style="cyan")
    out.append(f"T_train {number(status.t_train_s, '.1f', ' s')}  T_bcast {number(status.t_bcast_s, '.1f', ' s')}\n")
    out.append(status.broadcast_bytes_text() + "\n")
    over = status.bubble is not None and status.predicted_bubble is not None and status.bubble > status.predicted_bubble
    out.append(f"bubble {number(status.bubble, '.3f')}", style="yellow" if over else "green")
    out.append(f"  predicted {number(status.predicted_bubble, '.3f')}\n")
    below = status.mu_min is not None and status.mu_pool < status.mu_min
    out.append(f"mu_pool {number(status.mu_pool)}/s", style="red" if below else "green")
    out.append(f"  min {number(status.mu_min)}  target {number(status.mu_target)}  usable {status.usable_fraction:.0%}")
    return out


def cost_text(status: HubStatus) -> Text:
    out = Text()
    if status.redacted:  # the hub sends no totals then (HubStatus.redact): zeros would read as a free fleet
        out.append(f"total       {HIDDEN}\n", style="bold")
    else:
        out.append("total       ")
        out.append(money(status.cost_usd, 3) + "\n", style="bold")
        out.append(f"per step    {money(status.cost_per_step_usd, 4)}\n")
        out.append(f"per rollout {money(cost_per_rollout(status), 5)}\n")
        out.append(f"all nodes   {money(status.all_on_cost_usd, 3)}\n")
        if status.all_on_cost_usd > 0:
            out.append(f"saved       {1 - status.cost_usd / status.all_on_cost_usd:.0%}\n", style="green")
        else:
            out.append("saved       —\n")
    t = status.totals
    out.append(f"acc {t.accepted} rej {t.rejected} late {t.late} stale {status.dropped_stale}", style="dim")
    if status.redacted:
        out.append("\nnodes' prices and costs hidden: --key DATA_DIR/hub.key", style="yellow")
    return out


def warnings_text(status: HubStatus) -> Text:
    """The hub's newest warnings for its operator, newest first, one a line (their kinds only in a redacted status)."""
    lines = []
    for warning in status.newest_warnings():  # above everything but the banner
        line = Text(f"⚠ {clock(warning.at)} {warning.kind}", style="bold yellow")
        if warning.detail:
            line.append(f": {warning.detail}", style="yellow")
        lines.append(line)
    return Text("\n").join(lines)


class HubDashboard(DashboardApp):
    """Live view of one hub, from its STATUS_PROTOCOL (HubSource) or its DATA_DIR/status.json (DataDirSource)."""

    TITLE = "echo2 hub"
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS = [*DashboardApp.BINDINGS, Binding("s", "cycle_sort", "Sort"), Binding("S", "reverse_sort", "Reverse", show=False)]
    CSS = """
    .panel { border: round $primary; border-title-color: $accent; padding: 0 1; }
    #warnings { display: none; height: auto; max-height: 4; padding: 0 1; }
    #warnings.-shown { display: block; }
    #top { height: 8; }
    #learner { width: 2fr; }
    #cost { width: 1fr; min-width: 26; }
    .spark-row { height: 1; }
    .spark-row Label { width: 16; }
    .spark-row Sparkline { width: 1fr; }
    #chains { height: auto; max-height: 8; border: none; border-top: solid $primary; }
    #nodes-table { height: 1fr; min-height: 5; border: round $primary; border-title-color: $accent; }
    #nodes-table:focus { border: round $accent; }
    #bottom { height: 10; }
    #node-events-box, #events-box { width: 1fr; }
    .-short Header { display: none; }
    .-short #bottom { height: 5; }
    """

    def __init__(self, source, refresh_s: float = DEFAULT_REFRESH_S) -> None:
        super().__init__(source, refresh_s)
        self.status: HubStatus | None = None
        self.sort_column = 0
        self.sort_reverse = False
        self.selected_peer: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Banner(id="banner")
        yield Static(id="warnings")
        with Horizontal(id="top"):
            with Vertical(id="learner", classes="panel"):
                yield Static(id="learner-text")
                with Horizontal(classes="spark-row"):
                    yield Label("rollout —", id="reward-label")
                    yield Sparkline([], id="reward-spark")
                with Horizontal(classes="spark-row"):
                    yield Label("staleness —", id="staleness-label")
                    yield Sparkline([], id="staleness-spark")
                with Horizontal(classes="spark-row"):
                    yield Label("eval —", id="eval-label")
                    yield Sparkline([], id="eval-spark")
                with Horizontal(classes="spark-row", id="tools-row"):  # a tool-using run's only
                    yield Label("tools —", id="tools-label")
                    yield Sparkline([], id="tools-spark")
            yield Static(id="cost", classes="panel")
        yield Static(id="chains")
        yield DataTable(id="nodes-table", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="bottom"):
            with VerticalScroll(id="node-events-box", classes="panel"):
                yield Static(id="node-events")
            with VerticalScroll(id="events-box", classes="panel"):
                yield Static(id="events")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#nodes-table", DataTable)
        for column in NODE_COLUMNS:
            table.add_column(column.label, key=column.key)
        self.query_one("#learner").border_title = "learner"
        self.query_one("#cost").border_title = "cost"
        self.query_one("#chains").border_title = "chains"
        self.query_one("#node-events-box").border_title = "node events (select a node)"
        self.query_one("#events-box").border_title = "events"
        self._title_nodes()
        table.focus()
        super().on_mount()

    def show_data(self, result: HubStatus) -> None:
        self.status = result
        self.show_freshness(result.running, result.updated_at, "hub")
        self.sub_title = f"hub {short_id(result.hub_id)} · task {result.task}"
        warnings = self.query_one("#warnings", Static)
        warnings.update(warnings_text(result))
        warnings.set_class(bool(result.warnings), "-shown")
        self._show_learner(result)
        self.query_one("#cost", Static).update(cost_text(result))
        self.query_one("#chains", Static).update(chains_text(result))
        self._fill_nodes()
        self.query_one("#events", Static).update(event_lines(result.events))
        self._show_node_events()

    def _show_learner(self, status: HubStatus) -> None:
        self.query_one("#learner", Vertical).border_title = f"learner · {status.task} · hub {short_id(status.hub_id)}"
        self.query_one("#learner-text", Static).update(learner_text(status))
        rewards = [p.reward_mean for p in status.history]
        staleness = [p.staleness_mean for p in status.history]
        self.query_one("#reward-spark", Sparkline).data = rewards
        self.query_one("#staleness-spark", Sparkline).data = staleness
        recent = status.recent_reward()
        label = self.query_one("#reward-label", Label)
        label.update(f"rollout {number(recent[0] if recent else None, '.3f')}")
        label.tooltip = f"rollout reward, mean of the last {recent[1] if recent else RECENT_REWARD_STEPS} learner steps"
        last_staleness = staleness[-1] if staleness else None
        self.query_one("#staleness-label", Label).update(f"staleness {number(last_staleness, '.2f')}")
        self.query_one("#eval-spark", Sparkline).data = [e.reward for e in status.evals]
        last_eval = status.evals[-1] if status.evals else None
        self.query_one("#eval-label", Label).update(f"eval {last_eval.reward:.3f} @{last_eval.step}" if last_eval else "eval —")
        calls = [p.tool_calls for p in status.history if p.tool_calls is not None]
        self.query_one("#tools-row").display = bool(calls)
        self.query_one("#tools-spark", Sparkline).data = calls
        tools = self.query_one("#tools-label", Label)
        rate = status.tools.calls_per_s if status.tools is not None else None
        tools.update(f"tools {number(status.recent_tool_calls(), '.2f')}" + (f" {rate:.3g}/s" if rate is not None else ""))
        tools.tooltip = f"rounds of tool calls per rollout, mean of the last {RECENT_REWARD_STEPS} learner steps" + (
            "" if status.tools is None else f"; {tool_totals_text(status.tools)}"
        )

    def sorted_nodes(self) -> list[NodeStatus]:
        if self.status is None:
            return []
        column = NODE_COLUMNS[self.sort_column]
        return sorted(self.status.nodes, key=column.sort_key, reverse=self.sort_reverse)

    def _fill_nodes(self) -> None:
        table = self.query_one("#nodes-table", DataTable)
        keep = self.selected_peer
        table.clear()
        redacted = self.status is not None and self.status.redacted
        for node in self.sorted_nodes():
            table.add_row(*node_row(node, redacted), key=node.peer_id)
        if keep is not None and keep in table.rows:
            table.move_cursor(row=table.get_row_index(keep), animate=False)
        self._title_nodes()

    def _title_nodes(self) -> None:
        column = NODE_COLUMNS[self.sort_column]
        count = 0 if self.status is None else len(self.status.nodes)
        arrow = "▼" if self.sort_reverse else "▲"
        refused = "" if self.status is None or not self.status.reasons else f" · refused: {reasons_text(self.status.reasons)}"
        self.query_one("#nodes-table").border_title = f"nodes ({count}) · sort: {column.label} {arrow}  [s]{refused}"

    def _show_node_events(self) -> None:
        try:
            box = self.query_one("#node-events-box")
            text = self.query_one("#node-events", Static)
        except NoMatches:  # a highlight message that arrives while the app is closing its screen
            return
        if self.status is None or self.selected_peer is None:
            box.border_title = "node events (select a node)"
            text.update(event_lines((), empty="no node selected"))
            return
        box.border_title = f"events of {short_id(self.selected_peer)}"
        mine = [e for e in self.status.events if e.node_id == self.selected_peer]
        lines = event_lines(mine, with_node=False, empty="no recent events for this node")
        node = next((n for n in self.status.nodes if n.peer_id == self.selected_peer), None)
        if node is not None and node.reasons:  # an operator's view only (HubStatus.redact)
            lines = Text.assemble((f"refused: {reasons_text(node.reasons)}\n", "yellow"), lines)
        text.update(lines)

    def on_data_table_row_highlighted(self, message: DataTable.RowHighlighted) -> None:
        if message.row_key.value is None:
            return
        self.selected_peer = message.row_key.value
        self._show_node_events()

    def on_data_table_header_selected(self, message: DataTable.HeaderSelected) -> None:
        if message.column_index == self.sort_column:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_column, self.sort_reverse = message.column_index, False
        self._fill_nodes()

    def action_cycle_sort(self) -> None:
        self.sort_column = (self.sort_column + 1) % len(NODE_COLUMNS)
        self.sort_reverse = False
        self._fill_nodes()

    def action_reverse_sort(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self._fill_nodes()
