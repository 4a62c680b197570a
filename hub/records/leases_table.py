"""The lease rows: what Leasing writes."""

from __future__ import annotations

import json
from collections.abc import Sequence

from hub.records.schema import LeaseRow, NewEvent
from hub.records.table import Table


class LeasesTable(Table):
    """The lease rows: what Leasing writes."""

    def add_lease(
        self, lease_id: str, node_id: str, prompt_ids: Sequence[str], min_version: int, issued_at: float, deadline: float
    ) -> None:
        with self._write():
            self.db.execute(
                "INSERT INTO leases (id, node_id, prompt_ids, min_version, issued_at, deadline, state)"
                " VALUES (?, ?, ?, ?, ?, ?, 'open')",
                (lease_id, node_id, json.dumps(list(prompt_ids)), min_version, issued_at, deadline),
            )

    def expire_leases(self, now: float, events: Sequence[NewEvent] = (), keep: Sequence[str] = ()) -> list[str]:
        """Mark open leases past their deadline expired, except those in `keep` (a submission for them is
        being checked); their ids."""
        kept = set(keep)
        with self._write():
            ids = [
                r[0]
                for r in self.db.execute("SELECT id FROM leases WHERE state = 'open' AND deadline < ?", (now,)).fetchall()
                if r[0] not in kept
            ]
            self.db.conn.executemany("UPDATE leases SET state = 'expired' WHERE id = ?", [(i,) for i in ids])
            self._events(events)
        return ids

    def lease(self, lease_id: str) -> LeaseRow | None:
        rows = self._rows("SELECT * FROM leases WHERE id = ?", (lease_id,))
        if not rows:
            return None
        row = rows[0]
        row["prompt_ids"] = tuple(json.loads(row["prompt_ids"]))
        return LeaseRow(**row)
