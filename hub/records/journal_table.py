"""The event log."""

from __future__ import annotations

from hub.records.schema import EVENTS_DEFAULT_LIMIT, EventRow
from hub.records.table import Table


class JournalTable(Table):
    """The event log."""

    def add_event(self, kind: str, node_id: str | None, detail: str) -> None:
        with self._write():
            self._events([(kind, node_id, detail)])

    def prune_events(self, keep: int) -> int:
        """Delete all but the newest `keep` events; how many went."""
        with self._write():
            return self.db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,)).rowcount

    def events(self, limit: int = EVENTS_DEFAULT_LIMIT) -> list[EventRow]:
        """The newest `limit` events, newest first."""
        return [EventRow(**r) for r in self._rows("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))]
