"""The hub's durable state in one SQLite file; the only module that touches SQLite.

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

import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import blake3
import sqlite_utils

from hub.records.buffer import REASON_STALE
from shared.messages import GROUP_VERDICTS, TALLY_FIELDS, EvalPoint, Tallies
from shared.rollout import Group

BUSY_TIMEOUT_MS = 10_000
EVENTS_DEFAULT_LIMIT = 200
# Retention of the events table: the newest this many rows (the books live in nodes, ledger and trajectories).
EVENTS_RETAINED = 100_000
# The leaderboard's hourly credit buckets are kept this long: its day is the last 24 of them; the whole run's
# figures are running tallies on the node rows.
CREDIT_HOUR_S = 3600
CREDIT_HOURS_KEPT = 48
# Retention of closed leases and of ledger rows nothing can void any more (then rolled up, one row per node).
CLOSED_RETAINED_S = 3600.0
# Steps whose row keeps its full metrics JSON (the status page reads the newest 300, a resume the newest one;
# metrics.jsonl keeps every step's): 90% of a step row's bytes, about 0.8 KB a step for good otherwise.
STEP_METRICS_KEPT = 1000
# Snapshot rows kept (one per version, nothing reads old ones: the shelf holds 3 and resumes from the newest).
SNAPSHOT_ROWS_KEPT = 100
# Price history rows kept per node (leases carry their own price: pay never needs older ones).
PRICES_KEPT_PER_NODE = 100
# The WAL file is cut back to this after a checkpoint; free pages past FREE_PAGES_SLACK go back to the disk
# (1 MiB of 4 KiB pages: more kept free makes the file swing by that much as payloads come and go).
WAL_LIMIT_BYTES = 64 * 1024 * 1024
FREE_PAGES_SLACK = 256

Verdict = Literal["accepted", "rejected", "late"]
VERDICTS: tuple[Verdict, ...] = GROUP_VERDICTS  # type: ignore[assignment]
LeaseState = Literal["open", "answered", "expired"]
# (kind, node id or None, detail): an event row written inside the transaction of the change it describes.
NewEvent = tuple[str, str | None, str]

# A step row's columns but its metrics JSON, in the order of StepRecord's fields (and created_at).
_STEP_COLUMNS = ("step, version, reward_mean, reward_std, staleness_mean, staleness_max, dropped_stale, t_train_s,"
                 " t_idle_s, bubble, tokens, clip_frac, created_at")

# Bumped whenever _SCHEMA changes; a database of another version is refused, never half-used.
SCHEMA_VERSION = 3


class SchemaMismatch(RuntimeError):
    """The database was written by an echo2 with another schema."""


class NodeBanned(Exception):
    """The node was banned before this write of its work could commit: nothing was written."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    version       INTEGER PRIMARY KEY,
    path          TEXT    NOT NULL,
    manifest_hash TEXT    NOT NULL,
    total_bytes   INTEGER NOT NULL,
    created_at    REAL    NOT NULL,
    published_at  REAL    NOT NULL,
    t_bcast_s     REAL
);
CREATE TABLE IF NOT EXISTS nodes (
    peer_id        TEXT PRIMARY KEY,
    price_per_hour REAL    NOT NULL,
    hardware       TEXT    NOT NULL,
    link_bps       REAL,
    backend        TEXT    NOT NULL,
    first_seen     REAL    NOT NULL,
    last_seen      REAL    NOT NULL,
    state          TEXT    NOT NULL,
    {tally_columns},
    audits_passed  INTEGER NOT NULL DEFAULT 0,
    vouched_at     REAL,
    rollouts_per_s REAL    NOT NULL DEFAULT 0,
    measured       INTEGER NOT NULL DEFAULT 0 CHECK (measured IN (0, 1)),
    online_s       REAL    NOT NULL DEFAULT 0,
    banned_reason  TEXT,
    name           TEXT,
    tokens         INTEGER NOT NULL DEFAULT 0,
    gpu_s          REAL    NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS nodes_accepted ON nodes(accepted);
CREATE TABLE IF NOT EXISTS credit_hours (
    hour          INTEGER NOT NULL,
    node_id       TEXT    NOT NULL,
    accepted      INTEGER NOT NULL DEFAULT 0,
    tokens        INTEGER NOT NULL DEFAULT 0,
    gpu_s         REAL    NOT NULL DEFAULT 0,
    audits_passed INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, node_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at REAL NOT NULL,
    alive_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    id          TEXT PRIMARY KEY,
    node_id     TEXT    NOT NULL REFERENCES nodes(peer_id),
    prompt_ids  TEXT    NOT NULL,
    min_version INTEGER NOT NULL,
    issued_at   REAL    NOT NULL,
    deadline    REAL    NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('open', 'answered', 'expired')),
    answered_at REAL
);
CREATE INDEX IF NOT EXISTS leases_open ON leases(state, deadline);
CREATE TABLE IF NOT EXISTS steps (
    step           INTEGER PRIMARY KEY,
    version        INTEGER NOT NULL,
    reward_mean    REAL    NOT NULL,
    reward_std     REAL    NOT NULL,
    staleness_mean REAL    NOT NULL,
    staleness_max  INTEGER NOT NULL,
    dropped_stale  INTEGER NOT NULL,
    t_train_s      REAL    NOT NULL,
    t_idle_s       REAL    NOT NULL,
    bubble         REAL    NOT NULL,
    tokens         INTEGER NOT NULL,
    clip_frac      REAL    NOT NULL,
    created_at     REAL    NOT NULL,
    metrics_json   TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS trajectories (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id          TEXT,
    node_id           TEXT    NOT NULL,
    prompt_id         TEXT    NOT NULL,
    version           INTEGER NOT NULL,
    group_hash        TEXT    NOT NULL,
    reward_mean       REAL    NOT NULL,
    verdict           TEXT    NOT NULL CHECK (verdict IN ('accepted', 'rejected', 'late')),
    reason            TEXT,
    received_at       REAL    NOT NULL,
    consumed_step     INTEGER REFERENCES steps(step),
    discard_reason    TEXT,
    signed_bytes_hash TEXT,
    held              INTEGER NOT NULL DEFAULT 0 CHECK (held IN (0, 1)),
    CHECK (consumed_step IS NULL OR discard_reason IS NULL)
);
CREATE INDEX IF NOT EXISTS trajectories_pending ON trajectories(verdict, consumed_step, discard_reason);
-- An accepted group's payload (token ids, log-probs, text), apart from its row: retention deletes it whole,
-- and the rows that stay (the books) stay packed.
CREATE TABLE IF NOT EXISTS payloads (
    id         INTEGER PRIMARY KEY REFERENCES trajectories(id),
    group_json TEXT NOT NULL
);
-- Groups ever received by verdict and ever dropped stale, kept by the writes themselves: a resume reads
-- four rows, not the whole history.
CREATE TABLE IF NOT EXISTS counts (
    name TEXT PRIMARY KEY,
    n    INTEGER NOT NULL
);
INSERT OR IGNORE INTO counts (name, n) VALUES ('accepted', 0), ('rejected', 0), ('late', 0), ('stale', 0);
CREATE TABLE IF NOT EXISTS ledger (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id    TEXT    NOT NULL REFERENCES nodes(peer_id),
    lease_id   TEXT,
    step       INTEGER REFERENCES steps(step),
    usd        REAL    NOT NULL,
    seconds    REAL    NOT NULL,
    created_at REAL    NOT NULL,
    voided     INTEGER NOT NULL DEFAULT 0 CHECK (voided IN (0, 1))
);
CREATE TABLE IF NOT EXISTS prices (
    node_id        TEXT NOT NULL REFERENCES nodes(peer_id),
    at             REAL NOT NULL,
    price_per_hour REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS prices_by_node ON prices(node_id, at);
CREATE TABLE IF NOT EXISTS events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      REAL NOT NULL,
    kind    TEXT NOT NULL,
    node_id TEXT,
    detail  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    step       INTEGER PRIMARY KEY REFERENCES steps(step),
    path       TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    created_at REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS evals (
    step       INTEGER PRIMARY KEY,
    reward     REAL    NOT NULL,
    pass_at_1  REAL    NOT NULL,
    pass_at_k  REAL    NOT NULL,
    k          INTEGER NOT NULL,
    prompts    INTEGER NOT NULL,
    seconds    REAL    NOT NULL,
    created_at REAL    NOT NULL
);
""".replace("{tally_columns}", ",\n    ".join(f"{name:<14} INTEGER NOT NULL DEFAULT 0" for name in TALLY_FIELDS))
# Statements with a `;` of their own inside, so not in _SCHEMA (split at `;`): `counts` kept exact, pending
# payloads kept.
_TRIGGERS = (
    "CREATE TRIGGER IF NOT EXISTS trajectories_counted AFTER INSERT ON trajectories BEGIN"
    " UPDATE counts SET n = n + 1 WHERE name = NEW.verdict; END",
    "CREATE TRIGGER IF NOT EXISTS trajectories_stale AFTER UPDATE OF discard_reason ON trajectories"
    f" WHEN NEW.discard_reason = '{REASON_STALE}' AND OLD.discard_reason IS NOT '{REASON_STALE}' BEGIN"
    " UPDATE counts SET n = n + 1 WHERE name = 'stale'; END",
    # A pending group (the buffer, an audit, what a crash must recover) keeps its payload, whoever deletes.
    "CREATE TRIGGER IF NOT EXISTS payloads_pending BEFORE DELETE ON payloads"
    " WHEN (SELECT consumed_step IS NULL AND discard_reason IS NULL FROM trajectories WHERE id = OLD.id) BEGIN"
    " SELECT RAISE(ABORT, 'the payload of a pending group'); END",
)


@dataclass(frozen=True)
class StepRecord:
    """One committed learner step; also the line written to metrics.jsonl."""

    step: int
    version: int
    reward_mean: float
    reward_std: float
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    t_train_s: float
    t_idle_s: float
    bubble: float
    tokens: int
    clip_frac: float
    extra: Mapping[str, float | None] = field(default_factory=dict)

    def as_json_dict(self) -> dict[str, float | int]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class SnapshotRow:
    version: int
    path: str
    manifest_hash: str
    total_bytes: int
    created_at: float
    published_at: float
    t_bcast_s: float | None


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    path: str
    version: int
    created_at: float


@dataclass(frozen=True)
class EventRow:
    id: int
    at: float
    kind: str
    node_id: str | None
    detail: str


@dataclass(frozen=True)
class TrajectoryRow:
    id: int
    lease_id: str | None
    node_id: str
    prompt_id: str
    version: int
    reward_mean: float
    verdict: Verdict
    reason: str | None
    received_at: float
    consumed_step: int | None
    discard_reason: str | None
    signed_bytes_hash: str | None


@dataclass(frozen=True)
class NodeRow:
    peer_id: str
    price_per_hour: float
    hardware: str
    link_bps: float | None
    backend: str
    first_seen: float
    last_seen: float
    state: str
    tallies: Tallies
    audits_passed: int
    vouched_at: float | None
    rollouts_per_s: float
    measured: bool
    online_s: float
    banned_reason: str | None
    name: str | None = None
    tokens: int = 0  # completion tokens of its accepted groups
    gpu_s: float = 0.0  # seconds of accepted work (hub.method.prices.billable_seconds), paid or not

    @classmethod
    def from_sql(cls, row: dict) -> NodeRow:
        tallies = Tallies(**{name: row.pop(name) for name in TALLY_FIELDS})
        return cls(**{**row, "measured": bool(row["measured"])}, tallies=tallies)


@dataclass(frozen=True)
class Credit:
    """A volunteer's accepted work: groups, their completion tokens, the seconds they took, audits passed."""

    accepted: int
    tokens: int
    gpu_s: float
    audits_passed: int


@dataclass(frozen=True)
class LeaderRow:
    """One volunteer on the leaderboard: its credit over the whole run and over the last day."""

    peer_id: str
    name: str | None
    run: Credit
    day: Credit


@dataclass(frozen=True)
class Retained:
    """What one `Store.retain` let go: payloads dropped, leases deleted, ledger rows merged into roll-ups."""

    payloads: int
    leases: int
    ledger_rows: int
    step_metrics: int = 0
    snapshot_rows: int = 0


@dataclass(frozen=True)
class LeaseRow:
    id: str
    node_id: str
    prompt_ids: tuple[str, ...]
    min_version: int
    issued_at: float
    deadline: float
    state: LeaseState
    answered_at: float | None


class Store:
    """The hub database at `path` (created if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000
        )
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
            if not fresh and found != SCHEMA_VERSION:
                raise SchemaMismatch(
                    f"{self.path} holds echo2 schema {found}, this echo2 uses {SCHEMA_VERSION}: "
                    "finish that run with the echo2 that started it, or start this one in a new --data-dir"
                )
            for statement in [*_SCHEMA.split(";"), *_TRIGGERS]:
                if statement.strip():
                    self.db.execute(statement)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()

    @contextmanager
    def _write(self) -> Iterator[None]:
        with self._lock:
            begin, undo, end = (
                ("SAVEPOINT w", ("ROLLBACK TO w", "RELEASE w"), "RELEASE w") if self._in_batch
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

    def _keep_payload(self, row_id: int, group_json: str | None) -> None:
        """An accepted group's payload beside its row (refused work keeps none), inside the caller's transaction."""
        if group_json is not None:
            self.db.execute("INSERT INTO payloads (id, group_json) VALUES (?, ?)", (row_id, group_json))

    def _events(self, events: Sequence[NewEvent]) -> None:
        """Insert events inside the caller's transaction."""
        now = time.time()
        for kind, node_id, detail in events:
            self.db.execute(
                "INSERT INTO events (at, kind, node_id, detail) VALUES (?, ?, ?, ?)", (now, kind, node_id, detail)
            )

    # -- snapshots ---------------------------------------------------------------------

    def add_snapshot(self, version: int, path: str, manifest_hash: str, total_bytes: int, created_at: float) -> None:
        """Record a published snapshot; versions must strictly increase."""
        with self._write():
            latest = self.db.execute("SELECT MAX(version) FROM snapshots").fetchone()[0]
            if latest is not None and version <= latest:
                raise ValueError(f"snapshot version {version} is not newer than the latest {latest}")
            self.db.execute(
                "INSERT INTO snapshots (version, path, manifest_hash, total_bytes, created_at, published_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (version, path, manifest_hash, total_bytes, created_at, time.time()),
            )

    def set_broadcast_time(self, version: int, t_bcast_s: float, event: NewEvent | None = None) -> None:
        with self._write():
            self.db.execute("UPDATE snapshots SET t_bcast_s = ? WHERE version = ?", (t_bcast_s, version))
            self._events([event] if event else [])

    def latest_version(self) -> int | None:
        return self._rows("SELECT MAX(version) AS v FROM snapshots")[0]["v"]

    def snapshots(self) -> list[SnapshotRow]:
        return [SnapshotRow(**r) for r in self._rows("SELECT * FROM snapshots ORDER BY version")]

    # -- nodes and leases --------------------------------------------------------------

    def upsert_node(
        self, peer_id: str, price_per_hour: float, hardware: str, link_bps: float | None, backend: str,
        state: str = "probing", event: NewEvent | None = None, name: str | None = None,
    ) -> bool:
        """Insert a node on first contact or refresh what it declares (its display name too: None shows its short
        peer id); tallies, audits and ban survive.

        False (and nothing written) for a banned node: a ban is checked in the same transaction, so a
        join racing a ban can never undo it."""
        now = time.time()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO nodes (peer_id, price_per_hour, hardware, link_bps, backend, first_seen, last_seen, state, name)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET price_per_hour = excluded.price_per_hour,"
                " hardware = excluded.hardware, link_bps = excluded.link_bps, backend = excluded.backend,"
                " last_seen = excluded.last_seen, state = excluded.state, name = excluded.name WHERE nodes.state != 'banned'",
                (peer_id, price_per_hour, hardware, link_bps, backend, now, now, state, name),
            )
            if cur.rowcount != 1:
                return False
            self._price_row(peer_id, price_per_hour, now)
            self._events([event] if event else [])
            return True

    def set_node_price(self, peer_id: str, price_per_hour: float, at: float, event: NewEvent | None = None) -> bool:
        """A joined node's re-declared price, kept in its price history; False (nothing written) when banned."""
        with self._write():
            cur = self.db.execute("UPDATE nodes SET price_per_hour = ? WHERE peer_id = ? AND state != 'banned'",
                                  (price_per_hour, peer_id))
            if cur.rowcount != 1:
                return False
            self._price_row(peer_id, price_per_hour, at)
            self._events([event] if event else [])
            return True

    def _price_row(self, peer_id: str, price_per_hour: float, at: float) -> None:
        """A price history row, unless the node's latest row already says this price (a rejoin at the same one);
        the node's rows past its newest PRICES_KEPT_PER_NODE go (a node re-declares or rejoins as often as it likes)."""
        self.db.execute(
            "INSERT INTO prices (node_id, at, price_per_hour) SELECT ?, ?, ? WHERE ? IS NOT"
            " (SELECT price_per_hour FROM prices WHERE node_id = ? ORDER BY at DESC, rowid DESC LIMIT 1)",
            (peer_id, at, price_per_hour, price_per_hour, peer_id),
        )
        self.db.execute(
            "DELETE FROM prices WHERE node_id = ? AND rowid NOT IN (SELECT rowid FROM prices WHERE node_id = ?"
            " ORDER BY at DESC, rowid DESC LIMIT ?)", (peer_id, peer_id, PRICES_KEPT_PER_NODE),
        )

    def price_history(self, limit_per_node: int) -> dict[str, list[tuple[float, float]]]:
        """(at, $/h) of each node's latest `limit_per_node` prices, oldest first."""
        rows = self._rows(
            "SELECT node_id, at, price_per_hour FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY node_id"
            " ORDER BY at DESC, rowid DESC) AS newest FROM prices) WHERE newest <= ? ORDER BY node_id, at, rowid",
            (limit_per_node,),
        )
        history: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            history.setdefault(row["node_id"], []).append((row["at"], row["price_per_hour"]))
        return history

    def count_refusal(self, peer_id: str) -> None:
        """One more request of this node refused at the protocol level (bad frame, expired lease...)."""
        with self._write():
            self.db.execute("UPDATE nodes SET refused = refused + 1 WHERE peer_id = ?", (peer_id,))

    def record_audit_pass(
        self, peer_id: str, vouched_at: float, release_ids: Sequence[int] = (), now: float | None = None
    ) -> bool:
        """One more audit of this node's work passed; its pay up to `vouched_at` (the audited submission's
        time) is vouched for, and its held rows `release_ids` may be trained on. Both survive a hub restart:
        probation, quota and what a later ban voids. False (nothing written) if the node is banned. The pass
        counts in the credit hour of `now` (the caller's clock, as submissions' do; default the wall clock)."""
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET audits_passed = audits_passed + 1, vouched_at = MAX(COALESCE(vouched_at, 0), ?)"
                " WHERE peer_id = ? AND state != 'banned'",
                (vouched_at, peer_id),
            )
            if cur.rowcount != 1:
                return False
            self.db.conn.executemany("UPDATE trajectories SET held = 0 WHERE id = ?", [(i,) for i in release_ids])
            self._credit(peer_id, time.time() if now is None else now, Credit(accepted=0, tokens=0, gpu_s=0.0,
                                                                              audits_passed=1))
            return True

    def _credit(self, node_id: str, now: float, credit: Credit) -> None:
        """Add `credit` to the node's hour bucket (and its tokens and seconds to its running tallies; its groups and
        audits have theirs); buckets older than CREDIT_HOURS_KEPT go, by the primary key's range."""
        if not (credit.accepted or credit.audits_passed):
            return
        hour = int(now // CREDIT_HOUR_S)
        self.db.execute("UPDATE nodes SET tokens = tokens + ?, gpu_s = gpu_s + ? WHERE peer_id = ?",
                        (credit.tokens, credit.gpu_s, node_id))
        self.db.execute(
            "INSERT INTO credit_hours (hour, node_id, accepted, tokens, gpu_s, audits_passed) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(hour, node_id) DO UPDATE SET accepted = accepted + excluded.accepted,"
            " tokens = tokens + excluded.tokens, gpu_s = gpu_s + excluded.gpu_s,"
            " audits_passed = audits_passed + excluded.audits_passed",
            (hour, node_id, credit.accepted, credit.tokens, credit.gpu_s, credit.audits_passed),
        )
        self.db.execute("DELETE FROM credit_hours WHERE hour < ?", (hour - CREDIT_HOURS_KEPT,))

    def leaders(self, now: float, limit: int) -> list[LeaderRow]:
        """The leaderboard: the `limit` volunteers with the most accepted groups over the whole run and the `limit`
        with the most over the last day (its 24 hour buckets), banned ones left out; indexed, never a scan of the work."""
        rows = self._rows(
            "WITH day AS (SELECT node_id, SUM(accepted) AS accepted, SUM(tokens) AS tokens, SUM(gpu_s) AS gpu_s,"
            "  SUM(audits_passed) AS audits_passed FROM credit_hours WHERE hour > ? GROUP BY node_id),"
            " top AS (SELECT node_id FROM (SELECT node_id FROM day WHERE node_id NOT IN"
            "   (SELECT peer_id FROM nodes WHERE state = 'banned') ORDER BY accepted DESC LIMIT ?)"
            "  UNION SELECT peer_id FROM (SELECT peer_id FROM nodes WHERE state != 'banned' ORDER BY accepted DESC LIMIT ?))"
            " SELECT n.peer_id, n.name, n.accepted, n.tokens, n.gpu_s, n.audits_passed, COALESCE(d.accepted, 0) AS d_accepted,"
            "  COALESCE(d.tokens, 0) AS d_tokens, COALESCE(d.gpu_s, 0) AS d_gpu_s, COALESCE(d.audits_passed, 0) AS d_audits"
            " FROM nodes n JOIN top t ON t.node_id = n.peer_id LEFT JOIN day d ON d.node_id = n.peer_id"
            " WHERE n.state != 'banned' AND (n.accepted > 0 OR n.audits_passed > 0) ORDER BY n.accepted DESC",
            (int(now // CREDIT_HOUR_S) - 24, limit, limit),
        )
        return [
            LeaderRow(r["peer_id"], r["name"], Credit(r["accepted"], r["tokens"], r["gpu_s"], r["audits_passed"]),
                      Credit(r["d_accepted"], r["d_tokens"], r["d_gpu_s"], r["d_audits"]))
            for r in rows
        ]

    def set_node_state(
        self, peer_id: str, state: str, banned_reason: str | None = None, event: NewEvent | None = None
    ) -> bool:
        """Move a node to `state`; False (and nothing written) when it is banned: a ban is for good."""
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET state = ?, banned_reason = COALESCE(?, banned_reason)"
                " WHERE peer_id = ? AND state != 'banned'",
                (state, banned_reason, peer_id),
            )
            if cur.rowcount != 1:
                if self.db.execute("SELECT 1 FROM nodes WHERE peer_id = ?", (peer_id,)).fetchone() is None:
                    raise KeyError(f"unknown node {peer_id}")
                return False
            self._events([event] if event else [])
            return True

    def node(self, peer_id: str) -> NodeRow | None:
        rows = self._rows("SELECT * FROM nodes WHERE peer_id = ?", (peer_id,))
        return NodeRow.from_sql(rows[0]) if rows else None

    def nodes(self) -> list[NodeRow]:
        return [NodeRow.from_sql(r) for r in self._rows("SELECT * FROM nodes ORDER BY first_seen")]

    def flush_liveness(
        self, rows: Sequence[tuple[str, float, float, float, bool]], session_id: int, alive_at: float
    ) -> None:
        """(peer, last_seen, online_s, rollouts_per_s, measured) per node that changed, and this session's clock."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE nodes SET last_seen = ?, online_s = ?, rollouts_per_s = ?, measured = ? WHERE peer_id = ?",
                [(last_seen, online_s, rate, int(measured), peer) for peer, last_seen, online_s, rate, measured in rows],
            )
            self.db.execute("UPDATE sessions SET alive_at = ? WHERE id = ?", (alive_at, session_id))

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
                for r in self.db.execute(
                    "SELECT id FROM leases WHERE state = 'open' AND deadline < ?", (now,)
                ).fetchall()
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

    # -- trajectories ------------------------------------------------------------------

    def record_trajectory(
        self,
        group: Group,
        lease_id: str | None,
        node_id: str,
        verdict: Verdict,
        reason: str | None = None,
        signed_bytes_hash: str | None = None,
    ) -> int:
        """Durably record a received group with the hub's verdict; returns its row id.

        Returning means committed: only then may the submission be acknowledged.
        """
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
        reward_mean = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
        group_json = group.model_dump_json()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO trajectories (lease_id, node_id, prompt_id, version, group_hash, reward_mean,"
                " verdict, reason, received_at, signed_bytes_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (lease_id, node_id, group.prompt_id, group.version,
                 blake3.blake3(group_json.encode()).hexdigest(), reward_mean, verdict, reason, time.time(), signed_bytes_hash),
            )
            self._keep_payload(int(cur.lastrowid), group_json if verdict == "accepted" else None)
            if node_id:
                # `verdict` was checked against VERDICTS above: it names a column.
                self.db.execute(f"UPDATE nodes SET {verdict} = {verdict} + 1 WHERE peer_id = ?", (node_id,))
            return int(cur.lastrowid)

    def record_submission(
        self,
        lease_id: str,
        node_id: str,
        verdicts: Sequence,
        usd: float,
        seconds: float,
        signed_bytes_hash: str,
        tokens: int = 0,
        now: float | None = None,
        rollouts_per_s: float | None = None,
        events: Sequence[NewEvent] = (),
        hold: bool = False,
    ) -> list[int]:
        """In one transaction: close the lease, record every group with its verdict, count them against
        the node, book the payment and the leaderboard's credit (`seconds` billed, `tokens` of the accepted
        completions), store the node's new measured throughput, and the events.

        `verdicts` are hub.trust.submissions.GroupVerdict. Returns the row ids in verdict order. `hold`: the
        accepted rows wait for an audit (`record_audit_pass` releases them). A banned node raises
        NodeBanned, and a lease that is not open for this node (a replay racing the first answer)
        ValueError; either changes nothing.
        """
        now = time.time() if now is None else now
        ids: list[int] = []
        with self._write():
            banned = self.db.execute("SELECT 1 FROM nodes WHERE peer_id = ? AND state = 'banned'", (node_id,)).fetchone()
            if banned is not None:
                raise NodeBanned(node_id)
            cur = self.db.execute(
                "UPDATE leases SET state = 'answered', answered_at = ? WHERE id = ? AND node_id = ? AND state = 'open'",
                (now, lease_id, node_id),
            )
            if cur.rowcount != 1:
                raise ValueError(f"lease {lease_id} is not open for {node_id}")
            for v in verdicts:
                if v.accepted:
                    group_json, version = v.group.model_dump_json(), v.group.version
                    group_hash = blake3.blake3(group_json.encode()).hexdigest()
                    reward_mean = sum(v.group.rewards) / len(v.group.rewards)
                else:
                    # Refused work: its hash, not its payload (a peer must not fill our disk with it).
                    group_json, group_hash = None, blake3.blake3(v.submitted.model_dump_json().encode()).hexdigest()
                    version = v.submitted.completions[0].version if v.submitted.completions else -1
                    reward_mean = 0.0
                cur = self.db.execute(
                    "INSERT INTO trajectories (lease_id, node_id, prompt_id, version, group_hash, reward_mean,"
                    " verdict, reason, received_at, signed_bytes_hash, held) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (lease_id, node_id, v.prompt_id[:200], version, group_hash, reward_mean,
                     v.verdict, (v.reason or None) and v.reason[:500], now, signed_bytes_hash, int(hold and v.accepted)),
                )
                ids.append(int(cur.lastrowid))
                self._keep_payload(ids[-1], group_json)
            counts = [sum(v.verdict == name for v in verdicts) for name in VERDICTS]
            sets = ", ".join(f"{name} = {name} + ?" for name in VERDICTS)
            self.db.execute(f"UPDATE nodes SET {sets} WHERE peer_id = ?", (*counts, node_id))
            self._credit(node_id, now, Credit(counts[VERDICTS.index("accepted")], tokens, seconds, 0))
            if rollouts_per_s is not None:
                self.db.execute(
                    "UPDATE nodes SET rollouts_per_s = ?, measured = 1 WHERE peer_id = ?", (rollouts_per_s, node_id)
                )
            if usd > 0:
                self.db.execute(
                    "INSERT INTO ledger (node_id, lease_id, step, usd, seconds, created_at) VALUES (?, ?, NULL, ?, ?, ?)",
                    (node_id, lease_id, usd, seconds, now),
                )
            self._events(events)
        return ids

    def recent_usable_groups(self, limit: int) -> tuple[int, int, int]:
        """(trained, settled, dropped as stale) among the newest `limit` accepted groups that were trained on
        or discarded. Both this and `recent_discards` walk back from the newest row and stop at `limit` (through the
        verdict index SQLite would sort every accepted group ever: a status build would cost the whole history)."""
        row = self._rows(
            "SELECT COALESCE(SUM(consumed_step IS NOT NULL), 0) AS trained, COUNT(*) AS settled,"
            " COALESCE(SUM(discard_reason = ?), 0) AS stale FROM ("
            " SELECT consumed_step, discard_reason FROM trajectories NOT INDEXED WHERE verdict = 'accepted'"
            " AND (consumed_step IS NOT NULL OR discard_reason IS NOT NULL) ORDER BY id DESC LIMIT ?)",
            (REASON_STALE, limit),
        )[0]
        return int(row["trained"]), int(row["settled"]), int(row["stale"])

    def trajectory_counts(self) -> dict[Verdict, int]:
        """Groups ever received, by verdict (every verdict present, zero if none)."""
        rows = self._rows("SELECT name, n FROM counts WHERE name != 'stale'")
        return {name: 0 for name in VERDICTS} | {r["name"]: int(r["n"]) for r in rows}

    def recent_discards(self, limit: int) -> dict[str, int]:
        """How the newest `limit` settled accepted groups were settled: reason -> count ("trained" for trained on)."""
        rows = self._rows(
            "SELECT COALESCE(discard_reason, 'trained') AS how, COUNT(*) AS n FROM ("
            " SELECT discard_reason FROM trajectories NOT INDEXED WHERE verdict = 'accepted'"
            " AND (consumed_step IS NOT NULL OR discard_reason IS NOT NULL) ORDER BY id DESC LIMIT ?) GROUP BY how",
            (limit,),
        )
        return {r["how"]: int(r["n"]) for r in rows}

    def recent_rejections(self, limit: int) -> dict[str, int]:
        """Why the newest `limit` rejected groups were rejected: reason -> count."""
        rows = self._rows(
            "SELECT COALESCE(reason, '?') AS why, COUNT(*) AS n FROM ("
            " SELECT reason FROM trajectories WHERE verdict = 'rejected' ORDER BY id DESC LIMIT ?) GROUP BY why",
            (limit,),
        )
        return {r["why"]: int(r["n"]) for r in rows}

    def dropped_stale_count(self) -> int:
        """Accepted groups ever dropped as too stale to train on."""
        return int(self._rows("SELECT n FROM counts WHERE name = 'stale'")[0]["n"])

    def recent_steps(self, limit: int) -> list[StepRecord]:
        """The newest `limit` learner steps, oldest first."""
        return self._step_records(
            "SELECT * FROM (SELECT * FROM steps ORDER BY step DESC LIMIT ?) ORDER BY step", (limit,)
        )

    def discard_trajectories(self, ids: Sequence[int], reason: str) -> None:
        """Mark accepted, untrained rows as never to be trained on (e.g. refused by the buffer)."""
        with self._write():
            self._discard(ids, reason)

    def discard_if_pending(self, ids: Sequence[int], reason: str) -> None:
        """Discard those of `ids` still pending (a ban may have discarded some already)."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                [(reason, i) for i in ids],
            )

    def discard_and_void(self, ids: Sequence[int], reason: str, node_id: str, lease_id: str) -> float:
        """Work that could not be audited: its pending rows discarded and its lease's pay voided, in one
        transaction. What the node is still paid."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                [(reason, i) for i in ids],
            )
            self.db.execute("UPDATE ledger SET voided = 1 WHERE node_id = ? AND lease_id = ?", (node_id, lease_id))
            return float(self.db.execute(
                "SELECT COALESCE(SUM(usd), 0) FROM ledger WHERE node_id = ? AND voided = 0", (node_id,)
            ).fetchone()[0])

    def discard_held(self, reason: str) -> int:
        """Discard every row still held for an audit (at start: their audits died with the last hub)."""
        with self._write():
            return self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE verdict = 'accepted' AND consumed_step IS NULL"
                " AND discard_reason IS NULL AND held = 1",
                (reason,),
            ).rowcount

    def _discard(self, ids: Sequence[int], reason: str) -> None:
        for row_id in ids:
            cur = self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                (reason, row_id),
            )
            if cur.rowcount != 1:
                raise ValueError(f"trajectory {row_id} is not an accepted, pending row")

    def unconsumed_groups(self) -> list[tuple[int, Group]]:
        """Accepted rows neither trained on nor discarded, oldest first: the buffer after a restart."""
        rows = self._rows(
            # A pending row always has its payload (retention takes only settled ones'): a missing one raises here.
            "SELECT t.id, p.group_json FROM trajectories t LEFT JOIN payloads p ON p.id = t.id WHERE verdict = 'accepted'"
            " AND consumed_step IS NULL AND discard_reason IS NULL AND held = 0 ORDER BY t.id"
        )
        return [(r["id"], Group.model_validate_json(r["group_json"])) for r in rows]

    def trajectories(self) -> list[TrajectoryRow]:
        cols = ", ".join(f for f in TrajectoryRow.__dataclass_fields__)
        return [TrajectoryRow(**r) for r in self._rows(f"SELECT {cols} FROM trajectories ORDER BY id")]

    # -- steps and ledger --------------------------------------------------------------

    def commit_step(self, record: StepRecord, consumed_ids: Sequence[int], dropped_stale_ids: Sequence[int] = ()) -> None:
        """In one transaction: the step row, its consumed and its stale-dropped trajectories."""
        now = time.time()
        with self._write():
            self.db.execute(
                f"INSERT INTO steps ({_STEP_COLUMNS}, metrics_json) VALUES ({', '.join('?' * 14)})",
                (record.step, record.version, record.reward_mean, record.reward_std, record.staleness_mean,
                 record.staleness_max, record.dropped_stale, record.t_train_s, record.t_idle_s, record.bubble,
                 record.tokens, record.clip_frac, now, json.dumps(dict(record.extra))),
            )
            for row_id in consumed_ids:
                cur = self.db.execute(
                    "UPDATE trajectories SET consumed_step = ? WHERE id = ? AND verdict = 'accepted'"
                    " AND consumed_step IS NULL AND discard_reason IS NULL",
                    (record.step, row_id),
                )
                if cur.rowcount != 1:
                    raise ValueError(f"trajectory {row_id} is not an accepted, pending row")
            self._discard(dropped_stale_ids, REASON_STALE)

    def steps(self) -> list[StepRecord]:
        return self._step_records("SELECT * FROM steps ORDER BY step")

    def _step_records(self, sql: str, params: Sequence = ()) -> list[StepRecord]:
        out = []
        for r in self._rows(sql, params):
            extra = json.loads(r.pop("metrics_json"))
            r.pop("created_at")
            out.append(StepRecord(**r, extra=extra))
        return out

    def latest_step(self) -> int | None:
        return self._rows("SELECT MAX(step) AS s FROM steps")[0]["s"]

    def latest_step_record(self) -> StepRecord | None:
        """The newest committed step, None before the first."""
        newest = self._step_records("SELECT * FROM steps ORDER BY step DESC LIMIT 1")
        return newest[0] if newest else None

    def ledger_total_usd(self, node_id: str | None = None) -> float:
        """Money booked and not voided, for one node or all."""
        if node_id is None:
            rows = self._rows("SELECT COALESCE(SUM(usd), 0) AS t FROM ledger WHERE voided = 0")
        else:
            rows = self._rows(
                "SELECT COALESCE(SUM(usd), 0) AS t FROM ledger WHERE voided = 0 AND node_id = ?", (node_id,)
            )
        return float(rows[0]["t"])

    def ledger_by_node_usd(self) -> dict[str, float]:
        """Money booked and not voided, per node."""
        rows = self._rows("SELECT node_id, SUM(usd) AS t FROM ledger WHERE voided = 0 GROUP BY node_id")
        return {r["node_id"]: float(r["t"]) for r in rows}

    # -- events and checkpoints --------------------------------------------------------

    def add_event(self, kind: str, node_id: str | None, detail: str) -> None:
        with self._write():
            self._events([(kind, node_id, detail)])

    def prune_events(self, keep: int) -> int:
        """Delete all but the newest `keep` events; how many went."""
        with self._write():
            return self.db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,)).rowcount

    # -- retention: what the books no longer need -----------------------------------------

    def retain(self, oldest_version: int, closed_before: float, vouch_needed: bool) -> Retained:
        """In one transaction: drop the payload of settled groups (trained on or discarded) made with a version
        older than `oldest_version` (off the snapshot shelf: no audit can score them again), delete leases
        closed before `closed_before`, and roll up the ledger rows booked before it that nothing can void any
        more into one row per node (and voided or not). `vouch_needed`: a failed audit voids a node's pay
        after its last passed one (audits are on); without audits only a ban voids, and it voids everything.
        Hashes, verdicts, rewards, versions, nodes and steps stay: the books add up the same."""
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
                "DELETE FROM snapshots WHERE version < (SELECT version FROM snapshots ORDER BY version DESC"
                " LIMIT 1 OFFSET ?)", (SNAPSHOT_ROWS_KEPT - 1,),
            ).rowcount
        return Retained(payloads, leases, ledger, metrics, snapshots)

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
            f"INSERT INTO steps ({_STEP_COLUMNS}, metrics_json) VALUES ({', '.join('?' * 13)}, '{{}}')", rows)
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
                (math.fsum(m[3] for m in members), math.fsum(m[4] for m in members), max(m[5] for m in members),
                 members[-1][0]),
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

    def events(self, limit: int = EVENTS_DEFAULT_LIMIT) -> list[EventRow]:
        """The newest `limit` events, newest first."""
        return [EventRow(**r) for r in self._rows("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))]

    def add_checkpoint(self, step: int, path: str, version: int) -> None:
        with self._write():
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints (step, path, version, created_at) VALUES (?, ?, ?, ?)",
                (step, path, version, time.time()),
            )

    def add_eval(self, row: EvalPoint) -> None:
        with self._write():
            self.db.execute(
                "INSERT OR REPLACE INTO evals (step, reward, pass_at_1, pass_at_k, k, prompts, seconds, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (row.step, row.reward, row.pass_at_1, row.pass_at_k, row.k, row.prompts, row.seconds, time.time()),
            )

    def evals(self, limit: int) -> list[EvalPoint]:
        """The newest `limit` evaluations, oldest first."""
        rows = self._rows("SELECT * FROM (SELECT * FROM evals ORDER BY step DESC LIMIT ?) ORDER BY step", (limit,))
        return [EvalPoint(**{k: v for k, v in r.items() if k != "created_at"}) for r in rows]

    def latest_checkpoint(self) -> CheckpointRow | None:
        rows = self._rows("SELECT * FROM checkpoints ORDER BY step DESC LIMIT 1")
        return CheckpointRow(**rows[0]) if rows else None

    # -- trust: penalties for a node caught cheating -----------------------------------

    def penalize_node(
        self, node_id: str, discard_ids: Sequence[int], since_ts: float, reason: str, event: NewEvent | None = None,
        discard_reason: str = "banned: audit failed",
    ) -> tuple[int, float]:
        """In one transaction: ban the node, discard its dropped pending rows, void its pay booked after
        `since_ts` (epoch seconds), and log the event.

        Returns (ledger rows voided, what the node is still paid); ValueError (and no change) if a row
        is not pending.
        """
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET state = 'banned', banned_reason = ? WHERE peer_id = ?", (reason, node_id)
            )
            if cur.rowcount != 1:
                raise KeyError(f"unknown node {node_id}")
            self._discard(discard_ids, discard_reason)
            # Its work still held for audit is discarded with it.
            self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE node_id = ? AND held = 1 AND consumed_step IS NULL"
                " AND discard_reason IS NULL",
                (discard_reason, node_id),
            )
            voided = self.db.execute(
                "UPDATE ledger SET voided = 1 WHERE node_id = ? AND created_at > ? AND voided = 0", (node_id, since_ts)
            ).rowcount
            paid = self.db.execute(
                "SELECT COALESCE(SUM(usd), 0) FROM ledger WHERE node_id = ? AND voided = 0", (node_id,)
            ).fetchone()[0]
            self._events([event] if event else [])
        return voided, float(paid)
