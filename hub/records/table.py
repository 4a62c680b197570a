"""What every table of the hub database shares: the Store's connection, its transactions and the helpers that
write inside them (hub/records/store.py owns the file, the schema and the one transaction per commit)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import sqlite_utils

from hub.records.schema import CREDIT_HOUR_S, CREDIT_HOURS_KEPT, Credit, NewEvent


class Core(Protocol):
    """The Store as its tables see it: the connection and the transaction."""

    db: sqlite_utils.Database

    def _write(self) -> AbstractContextManager[None]: ...

    def _rows(self, sql: str, params: Sequence | Mapping = ()) -> list[dict]: ...


class Table:
    """One table (or a few that change together) of the hub database; its writes run in the Store's transaction."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self.db = core.db

    def _write(self) -> AbstractContextManager[None]:
        return self._core._write()

    def _rows(self, sql: str, params: Sequence | Mapping = ()) -> list[dict]:
        return self._core._rows(sql, params)

    def _keep_payload(self, row_id: int, group_json: str | None) -> None:
        """An accepted group's payload beside its row (refused work keeps none), inside the caller's transaction."""
        if group_json is not None:
            self.db.execute("INSERT INTO payloads (id, group_json) VALUES (?, ?)", (row_id, group_json))

    def _events(self, events: Sequence[NewEvent]) -> None:
        """Insert events inside the caller's transaction."""
        now = time.time()
        for kind, node_id, detail in events:
            self.db.execute("INSERT INTO events (at, kind, node_id, detail) VALUES (?, ?, ?, ?)", (now, kind, node_id, detail))

    def _credit(self, node_id: str, now: float, credit: Credit) -> None:
        """Add `credit` to the node's hour bucket (and its tokens and seconds to its running tallies; its groups and
        audits have theirs); buckets older than CREDIT_HOURS_KEPT go, by the primary key's range."""
        if not (credit.accepted or credit.audits_passed):
            return
        hour = int(now // CREDIT_HOUR_S)
        self.db.execute(
            "UPDATE nodes SET tokens = tokens + ?, gpu_s = gpu_s + ? WHERE peer_id = ?", (credit.tokens, credit.gpu_s, node_id)
        )
        self.db.execute(
            "INSERT INTO credit_hours (hour, node_id, accepted, tokens, gpu_s, audits_passed) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(hour, node_id) DO UPDATE SET accepted = accepted + excluded.accepted,"
            " tokens = tokens + excluded.tokens, gpu_s = gpu_s + excluded.gpu_s,"
            " audits_passed = audits_passed + excluded.audits_passed",
            (hour, node_id, credit.accepted, credit.tokens, credit.gpu_s, credit.audits_passed),
        )
        self.db.execute("DELETE FROM credit_hours WHERE hour < ?", (hour - CREDIT_HOURS_KEPT,))

    def _discard(self, ids: Sequence[int], reason: str) -> None:
        for row_id in ids:
            cur = self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                (reason, row_id),
            )
            if cur.rowcount != 1:
                raise ValueError(f"trajectory {row_id} is not an accepted, pending row")
