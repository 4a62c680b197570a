"""The lease rows: what Leasing writes."""

from __future__ import annotations

import json
from collections.abc import Sequence

from hub.records.schema import LeaseRow, LeaseTerms, NewEvent
from hub.records.table import Table


class LeasesTable(Table):
    """The lease rows: what Leasing writes."""

    def add_lease(
        self,
        lease_id: str,
        node_id: str,
        prompt_ids: Sequence[str],
        min_version: int,
        issued_at: float,
        deadline: float,
        terms: LeaseTerms | None = None,
    ) -> None:
        """An open lease; with its `terms` a restarted hub still takes its answer until its deadline (`reopen`)."""
        price, probe, held, address = (
            (terms.price_per_hour, terms.probe, terms.held_version, terms.address) if terms else (None, False, 0, None)
        )
        with self._write():
            self.db.execute(
                "INSERT INTO leases (id, node_id, prompt_ids, min_version, issued_at, deadline, state, price_per_hour, probe,"
                " held_version, address) VALUES (?, ?, ?, ?, ?, ?, 'open', ?, ?, ?, ?)",
                (
                    lease_id,
                    node_id,
                    json.dumps(list(prompt_ids)),
                    min_version,
                    issued_at,
                    deadline,
                    price,
                    int(probe),
                    held,
                    address,
                ),
            )

    def reopen(self, now: float) -> list[LeaseRow]:
        """On a hub's start: the open leases an earlier run of it granted that are still good at `now` (unexpired, with
        their terms); every other open one is marked expired (none can be answered now)."""
        with self._write():
            self.db.execute(
                "UPDATE leases SET state = 'expired' WHERE state = 'open' AND (deadline < ? OR price_per_hour IS NULL)", (now,)
            )
            rows = self._rows("SELECT * FROM leases WHERE state = 'open' ORDER BY issued_at")
        return [LeaseRow(**{**row, "prompt_ids": tuple(json.loads(row["prompt_ids"]))}) for row in rows]

    def answered_since(self, now: float) -> list[LeaseRow]:
        """On a hub's start: the leases an earlier run of it saw answered whose deadline is not past at `now` and whose
        reply it kept: their answers may come again, their replies lost."""
        rows = self._rows(
            "SELECT * FROM leases WHERE state = 'answered' AND deadline >= ? AND reply_json IS NOT NULL ORDER BY issued_at",
            (now,),
        )
        return [LeaseRow(**{**row, "prompt_ids": tuple(json.loads(row["prompt_ids"]))}) for row in rows]

    def reply_to(self, lease_id: str, node_id: str, answer_hash: str) -> str | None:
        """The reply the answer hashed `answer_hash` got when it answered `node_id`'s lease `lease_id` (None: no such
        answer, or another one answered it)."""
        rows = self._rows(
            "SELECT reply_json FROM leases WHERE id = ? AND node_id = ? AND state = 'answered' AND answer_hash = ?",
            (lease_id, node_id, answer_hash),
        )
        return rows[0]["reply_json"] if rows else None

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
