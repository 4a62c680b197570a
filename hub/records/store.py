"""The hub's durable state in one SQLite file: the connection, the schema (hub/records/schema.py) and the transactions.

Tables: the queries live with the tables each owner writes, attributes of the Store on its connection and inside its
transactions (hub/records/table.py): `members` (Membership's nodes, prices, credit, bans), `leases` (Leasing's),
`groups` (Intake's submitted groups, payloads, rejections, discards and the ledger), `training` (steps, checkpoints,
evaluations), `shelf` (published snapshots), `journal` (events). A caller says `store.leases.lease(lease_id)`.

Threading: one connection, opened with check_same_thread=False and guarded by a
re-entrant lock, so any one thread at a time may use a Store. Every method blocks;
trio code calls them through trio.to_thread.run_sync.

Transactions: the connection runs in autocommit mode and every write method wraps
its statements in one explicit BEGIN IMMEDIATE ... COMMIT (`_write`), so a method is
all-or-nothing. `write_batch` runs many write methods in one transaction, each in a
savepoint of its own (still all-or-nothing on its own), with one COMMIT and one fsync for all:
the hub's group commit (hub/records/writer.py). sqlite-utils builds the schema and runs the queries;
its Table.insert is not used for writes because it commits on its own and would split a transaction.

Trajectory lifecycle: a row is written with its verdict (accepted, rejected, or late: refused
only because its version fell out of the staleness window). Only accepted rows keep the group
itself (in `payloads`, beside the row); a refused one keeps its blake3 hash, so refused work costs
the disk a row, not its payload. An
accepted row later gets exactly one of consumed_step (a committed learner step
trained on it) or discard_reason (stale, zero reward variance, buffer full...).
Accepted rows with neither are the replay buffer's contents after a restart, except those
`held` for the audit of a node on probation, which are released by a passed audit and are
discarded if the hub stops before their audit.

Retention (`retain`, run by HubState every RETAIN_PERIOD_S): a group's payload is kept while it is pending
(the buffer, an audit, crash recovery) and while its version is still on the snapshot shelf; then only its
hash, verdict, reward, version, node and step stay. Closed leases and ledger rows nothing can void any more
go after CLOSED_RETAINED_S (the ledger as one roll-up row per node); events keep the newest EVENTS_RETAINED.
A step row keeps its full metrics (`metrics_json`, which metrics.jsonl holds too) for the newest
STEP_METRICS_KEPT steps, then only its columns; the snapshots table keeps its newest SNAPSHOT_ROWS_KEPT rows.
A departed identity that left nothing to remember (IDLE_NODE_SQL: no work, no refusal, no pay, not banned) goes whole,
its prices and expired leases with it, once not seen for the cut HubState gives (IDLE_DEPARTED_KEPT_S); the
`forgotten_nodes` row counts such identities, so the hub still says how many left.
`counts` holds the totals by verdict, kept by triggers, so no reader counts the whole history.

Events: a write method that changes what the hub shows takes the event(s) describing it and
inserts them in its own transaction, so the log never disagrees with the state. Only the hub's state (its three
owners and the learner's records, hub/service/state.py) writes, through the one StoreWriter; dashboards and tests read.

Credit (the status page's leaderboard): a node's accepted groups, their tokens, the seconds of accepted work and
its passed audits are counted in the same transaction as the submission or audit, as running tallies on its row
and in an hourly bucket (`credit_hours`, the last CREDIT_HOURS_KEPT hours): nothing is summed from the work rows,
so retention may drop those.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils

from hub.records.groups_table import GroupsTable
from hub.records.journal_table import JournalTable
from hub.records.leases_table import LeasesTable
from hub.records.members_table import MembersTable
from hub.records.schema import (
    _MIGRATIONS,
    _SCHEMA,
    _STEP_COLUMNS,
    _TRIGGERS,
    BUSY_TIMEOUT_MS,
    FREE_PAGES_SLACK,
    SCHEMA_VERSION,
    SNAPSHOT_ROWS_KEPT,
    STEP_METRICS_KEPT,
    WAL_LIMIT_BYTES,
    Retained,
    SchemaMismatch,
    schema_opens,
)
from hub.records.shelf_table import ShelfTable
from hub.records.training_table import TrainingTable


class Store:
    """The hub database at `path` (created if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        self._lock = threading.RLock()
        self._in_batch = False
        self._metrics_trimmed_to = 0  # retain: steps up to this one have had their metrics JSON trimmed
        self.db = sqlite_utils.Database(conn)
        # Takes effect on a new file only: pages freed by retention go back to the disk (`checkpoint`).
        self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        with self._write():
            found = self.db.execute("PRAGMA user_version").fetchone()[0]
            fresh = not self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' LIMIT 1").fetchone()
            if not fresh and not schema_opens(found):
                raise SchemaMismatch(
                    f"{self.path} holds echo2 schema {found}, this echo2 uses {SCHEMA_VERSION}: "
                    "finish that run with the echo2 that started it, or start this one in a new --data-dir"
                )
            for version in range(found, SCHEMA_VERSION) if not fresh else ():
                for statement in _MIGRATIONS[version]:
                    self.db.execute(statement)
            for statement in [*_SCHEMA.split(";"), *_TRIGGERS]:
                if statement.strip():
                    self.db.execute(statement)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        # The tables each owner writes, all in this file and in this Store's transactions.
        self.members = MembersTable(self)
        self.leases = LeasesTable(self)
        self.groups = GroupsTable(self)
        self.training = TrainingTable(self)
        self.shelf = ShelfTable(self)
        self.journal = JournalTable(self)

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()

    @contextmanager
    def _write(self) -> Iterator[None]:
        with self._lock:
            begin, undo, end = (
                ("SAVEPOINT w", ("ROLLBACK TO w", "RELEASE w"), "RELEASE w")
                if self._in_batch
                else ("BEGIN IMMEDIATE", ("ROLLBACK",), "COMMIT")
            )
            self.db.execute(begin)
            try:
                yield
            except BaseException:
                # SQLite itself may have rolled the whole transaction back (disk full, I/O error): then
                # there is nothing to undo, and the caller must hear the error that did it.
                if self.db.conn.in_transaction:
                    for statement in undo:
                        self.db.execute(statement)
                raise
            self.db.execute(end)

    def write_batch(self, jobs: Sequence[Callable[[], object]]) -> list[tuple[bool, object]]:
        """Run write methods (`jobs`, each a call of one) in one transaction with one commit.

        Each job is all-or-nothing on its own: one that raises leaves nothing behind and the others go on.
        Returns (True, result) or (False, exception) per job, in order, once everything is committed. If
        the commit fails, or SQLite rolls the whole transaction back under a job (disk full, I/O error),
        it raises, and none of the jobs happened."""
        with self._lock:
            if self._in_batch:
                raise RuntimeError("write_batch is not re-entrant")
            self.db.execute("BEGIN IMMEDIATE")
            self._in_batch = True
            outcomes: list[tuple[bool, object]] = []
            try:
                for job in jobs:
                    # A job may call several write methods: its own savepoint makes it all-or-nothing.
                    self.db.execute("SAVEPOINT job")
                    try:
                        outcomes.append((True, job()))
                    except Exception as exc:
                        if not self.db.conn.in_transaction:
                            raise  # SQLite rolled the whole batch back: none of its jobs happened
                        self.db.execute("ROLLBACK TO job")
                        outcomes.append((False, exc))  # handed to that job's caller
                    self.db.execute("RELEASE job")
                self._in_batch = False
                self.db.execute("COMMIT")
            except BaseException:
                self._in_batch = False
                if self.db.conn.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        return outcomes

    def _rows(self, sql: str, params: Sequence | Mapping = ()) -> list[dict]:
        with self._lock:
            return list(self.db.query(sql, params))

    def pragma(self, name: str) -> str | int:
        """The value of a read-only PRAGMA (journal_mode, synchronous, foreign_keys, ...)."""
        with self._lock:
            return self.db.execute(f"PRAGMA {name}").fetchone()[0]

    def integrity_check(self) -> str:
        """'ok' when SQLite finds the file consistent, otherwise its first complaints."""
        with self._lock:
            rows = self.db.execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)

    def set_run(self, values: Mapping[str, str]) -> None:
        """What this data dir's run trains (model fingerprint, task...): what a resume is checked against."""
        with self._write():
            self.db.conn.executemany("INSERT OR REPLACE INTO run (key, value) VALUES (?, ?)", list(values.items()))

    def run_info(self) -> dict[str, str]:
        return {r["key"]: r["value"] for r in self._rows("SELECT key, value FROM run")}

    def start_session(self, now: float) -> int:
        """A hub process starts on this store; its learner time counts from `now`."""
        with self._write():
            cur = self.db.execute("INSERT INTO sessions (started_at, alive_at) VALUES (?, ?)", (now, now))
            return int(cur.lastrowid)

    def learner_seconds(self) -> float:
        """Learner time of every session so far (each up to its last flush)."""
        return float(self._rows("SELECT COALESCE(SUM(alive_at - started_at), 0) AS s FROM sessions")[0]["s"])

    def retain(self, oldest_version: int, closed_before: float, vouch_needed: bool, idle_before: float = -math.inf) -> Retained:
        """In one transaction: drop the payload of settled groups (trained on or discarded) made with a version
        older than `oldest_version` (off the snapshot shelf: no audit can score them again), delete leases
        closed before `closed_before`, and roll up the ledger rows booked before it that nothing can void any
        more into one row per node (and voided or not). `vouch_needed`: a failed audit voids a node's pay
        after its last passed one (audits are on); without audits only a ban voids, and it voids everything.
        Hashes, verdicts, rewards, versions, nodes and steps stay: the books add up the same. The identities last
        seen before `idle_before` that left nothing to remember go whole (`MembersTable.forget_idle`; default none)."""
        with self._write():
            payloads = self.db.execute(
                "DELETE FROM payloads WHERE id IN (SELECT t.id FROM payloads p JOIN trajectories t ON t.id = p.id"
                " WHERE t.version < ? AND (t.consumed_step IS NOT NULL OR t.discard_reason IS NOT NULL))",
                (oldest_version,),
            ).rowcount
            leases = self.db.execute(
                "DELETE FROM leases WHERE state IN ('answered', 'expired') AND deadline < ?", (closed_before,)
            ).rowcount
            ledger = self._roll_up_ledger(closed_before, vouch_needed)
            metrics = self._trim_step_metrics()
            snapshots = self.db.execute(
                "DELETE FROM snapshots WHERE version < (SELECT version FROM snapshots ORDER BY version DESC LIMIT 1 OFFSET ?)",
                (SNAPSHOT_ROWS_KEPT - 1,),
            ).rowcount
            nodes = self.members.forget_idle(idle_before)
        return Retained(payloads, leases, ledger, metrics, snapshots, nodes)

    def _trim_step_metrics(self) -> int:
        """Empty the metrics JSON of the steps that crossed the STEP_METRICS_KEPT line since the last pass (the step
        is the table's key). The rows are deleted and written again: a row shrunk in place keeps its page, while
        deleted runs of rows free theirs, and the short rows written back fill few."""
        newest = self.db.execute("SELECT MAX(step) FROM steps").fetchone()[0] or 0
        span = (self._metrics_trimmed_to, newest - STEP_METRICS_KEPT)
        self._metrics_trimmed_to = max(self._metrics_trimmed_to, span[1])
        where = "WHERE step > ? AND step <= ? AND metrics_json != '{}'"
        rows = self.db.execute(f"SELECT {_STEP_COLUMNS} FROM steps {where}", span).fetchall()
        # Trajectories, ledger rows and evaluations refer to these steps: checked at commit, once they are back.
        self.db.execute("PRAGMA defer_foreign_keys = ON")
        self.db.execute(f"DELETE FROM steps {where}", span)
        self.db.conn.executemany(
            f"INSERT INTO steps ({_STEP_COLUMNS}, metrics_json) VALUES ({', '.join('?' * 13)}, '{{}}')", rows
        )
        return len(rows)

    def _roll_up_ledger(self, before: float, vouch_needed: bool) -> int:
        """Merge each node's final ledger rows booked before `before` into its newest one; rows deleted."""
        rows = self.db.execute(
            "SELECT l.id, l.node_id, l.voided, l.usd, l.seconds, l.created_at FROM ledger l"
            " JOIN nodes n ON n.peer_id = l.node_id WHERE l.created_at < ?"
            " AND (n.state = 'banned' OR l.created_at <= COALESCE(n.vouched_at, ?)) ORDER BY l.id",
            (before, -1.0 if vouch_needed else float("inf")),
        ).fetchall()
        groups: dict[tuple[str, int], list[tuple]] = {}
        for row in rows:
            groups.setdefault((row[1], row[2]), []).append(row)
        gone: list[tuple[int]] = []
        for members in groups.values():
            if len(members) < 2:
                continue
            # A roll-up row is booked at its newest member's time: a later ban voids it whole or not at all,
            # as it would have its members.
            self.db.execute(
                "UPDATE ledger SET usd = ?, seconds = ?, created_at = ?, lease_id = NULL, step = NULL WHERE id = ?",
                (math.fsum(m[3] for m in members), math.fsum(m[4] for m in members), max(m[5] for m in members), members[-1][0]),
            )
            gone.extend((m[0],) for m in members[:-1])
        self.db.conn.executemany("DELETE FROM ledger WHERE id = ?", gone)
        return len(gone)

    def checkpoint(self) -> bool:
        """Copy the WAL into the file and cut it back, unless a reader holds it (then False: the next one
        does); free pages past FREE_PAGES_SLACK go back to the disk. Outside any transaction."""
        with self._lock:
            # The vacuum writes through the WAL, so it goes first and the checkpoint takes it along.
            free = int(self.pragma("freelist_count"))
            if free > FREE_PAGES_SLACK:
                self.db.execute(f"PRAGMA incremental_vacuum({free - FREE_PAGES_SLACK})").fetchall()
            # Not waiting on a reader: the writer's lock is held meanwhile, and every write would wait too.
            self.db.execute("PRAGMA busy_timeout=0")
            try:
                busy = self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                self.db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        return not busy
