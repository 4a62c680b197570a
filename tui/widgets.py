"""Pieces both dashboards share: value formatting, the status banner, and the refresh loop with its keys."""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime

from rich.text import Text
from textual.app import App
from textual.binding import Binding
from textual.widgets import HelpPanel, Static

from shared.messages import STALE_FILE_S, TALLY_FIELDS, EventRecord, Tallies, short_id
from tui import DEFAULT_REFRESH_S
from tui.sources import NoStatus, Throttled, Unreachable

MAX_REASON_CHARS = 300

EVENT_STYLES = {
    "join": "green",
    "leave": "yellow",
    "gone": "yellow",
    "ban": "bold red",
    "banned": "bold red",
    "activate": "cyan",
    "standby": "magenta",
    "snapshot": "blue",
    "publish": "blue",
}

STATE_STYLES = {
    "active": "bold green",
    "standby": "magenta",
    "receiving": "cyan",
    "probing": "yellow",
    "connecting": "yellow",
    "banned": "bold red",
    "gone": "dim",
}


def money(usd: float | None, digits: int = 2) -> str:
    if usd is None or not math.isfinite(usd):
        return "—"
    return f"${usd:,.{digits}f}"


def number(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:{fmt}}{unit}"


def clock(at: float) -> str:
    return datetime.fromtimestamp(at).strftime("%H:%M:%S")


def event_line(event: EventRecord, with_node: bool = True) -> Text:
    line = Text(clock(event.at) + " ", style="dim")
    line.append(f"{event.kind:<9}", style=EVENT_STYLES.get(event.kind, "bold"))
    if with_node and event.node_id is not None:
        line.append(f" {short_id(event.node_id)}", style="bold")
    if event.detail:
        line.append(f" {event.detail}")
    return line


def event_lines(events: tuple[EventRecord, ...] | list[EventRecord], with_node: bool = True, empty: str = "no events") -> Text:
    """Newest first, one per line."""
    if not events:
        return Text(empty, style="dim italic")
    return Text("\n").join(event_line(e, with_node) for e in sorted(events, key=lambda e: e.at, reverse=True))


# Tallies that are bad news when non-zero; any other tally is shown plain.
TALLY_STYLES = {"rejected": "red", "late": "yellow", "refused": "red"}


def tally_cells(tallies: Tallies) -> tuple[Text, ...]:
    """One right-aligned cell per tally, in TALLY_FIELDS order (a table's columns follow the same order)."""
    return tuple(
        Text(str(value := getattr(tallies, name)), justify="right", style=TALLY_STYLES.get(name, "") if value else "")
        for name in TALLY_FIELDS
    )


def styled_state(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


class Banner(Static):
    """One line above everything else: why the data is missing, old or final; hidden when all is well."""

    DEFAULT_CSS = """
    Banner { display: none; height: auto; padding: 0 1; text-style: bold; }
    Banner.-shown { display: block; }
    Banner.-error { background: $error; color: $text; }
    Banner.-warning { background: $warning; color: $text; }
    Banner.-info { background: $primary; color: $text; }
    """

    def show(self, level: str, message: str) -> None:
        self.set_classes(f"-shown -{level}")
        self.update(message)

    def hide(self) -> None:
        self.set_classes("")
        self.update("")

    @property
    def shown(self) -> bool:
        return self.has_class("-shown")


class DashboardApp(App):
    """Polls `self.source` every `refresh_s` in a worker and hands each result to `apply`.

    At most one fetch is in flight: a slow hub delays refreshes instead of piling them up.
    """

    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("r", "refresh_now", "Refresh"),
        Binding("question_mark", "toggle_help", "Help", key_display="?"),
    ]

    def __init__(self, source, refresh_s: float = DEFAULT_REFRESH_S) -> None:
        super().__init__()
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        self.source = source
        self.refresh_s = refresh_s
        self.loaded = asyncio.Event()
        self.last_result = None
        self.last_good_at: float | None = None
        self._fetching = False

    def on_mount(self) -> None:
        self.action_refresh_now()
        self.set_interval(self.refresh_s, self.action_refresh_now)

    def on_unmount(self) -> None:
        self.source.close()

    def action_refresh_now(self) -> None:
        if not self._fetching:
            self.run_worker(self.refresh_data(), group="fetch", exit_on_error=True)

    def action_toggle_help(self) -> None:
        if self.screen.query(HelpPanel):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    async def refresh_data(self) -> None:
        """Fetch once and show the result (tests await this directly)."""
        self._fetching = True
        try:
            result = await self.source.fetch()
        finally:
            self._fetching = False
        if not self.is_running:
            return  # the app began shutting down during the fetch: its widgets are being removed
        if isinstance(result, Throttled):
            # The hub is up and asked us to wait: what is on screen is still the latest we know.
            return
        self.last_result = result
        if not isinstance(result, (NoStatus, Unreachable)):
            self.last_good_at = time.time()
        if isinstance(result, (NoStatus, Unreachable)):
            self.show_problem(result)
        else:
            self.show_data(result)
        self.loaded.set()

    def show_data(self, result) -> None:
        """Put a fresh status on screen; each dashboard defines what it shows."""
        raise TypeError(f"{type(self).__name__} must define show_data")

    def show_problem(self, result: NoStatus | Unreachable) -> None:
        banner = self.query_one(Banner)
        reason = result.reason[:MAX_REASON_CHARS]
        if isinstance(result, Unreachable):
            since = "" if self.last_good_at is None else f"; showing data from {time.time() - self.last_good_at:.0f} s ago"
            banner.show("error", f"UNREACHABLE {self.source.describe()}: {reason} (retrying every {self.refresh_s:g} s{since})")
        else:
            banner.show("warning", reason)

    def show_freshness(self, running: bool, updated_at: float, what: str) -> None:
        """Hide the banner, or say that the writer finished or seems to have stopped writing."""
        banner = self.query_one(Banner)
        age_s = time.time() - updated_at
        if not running:
            banner.show("info", f"{what} finished at {clock(updated_at)} (final status)")
        elif age_s > STALE_FILE_S:
            banner.show("warning", f"{what} status last updated {age_s:.0f} s ago: the process may have stopped")
        else:
            banner.hide()
