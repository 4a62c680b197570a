"""The hub database's schema, its constants and the rows its tables return (hub/records/store.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal, NamedTuple

from hub.records.buffer import REASON_STALE
from shared.messages import GROUP_VERDICTS, TALLY_FIELDS, Tallies

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
# Snapshot rows kept (one per version, nothing reads old ones: a restart shelves the newest S + 1 again).
SNAPSHOT_ROWS_KEPT = 100
# Price history rows kept per node (leases carry their own price: pay never needs older ones).
PRICES_KEPT_PER_NODE = 100
# A node row that left nothing to remember (hub.records.fleet.forgettable, as the store sees it): gone, not banned,
# never measured, no group or refusal counted, no audit passed (nothing paid: retention also finds no ledger row).
IDLE_NODE_SQL = " AND ".join(
    ("state = 'gone'", "measured = 0", "audits_passed = 0", "vouched_at IS NULL", *(f"{name} = 0" for name in TALLY_FIELDS))
)
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
_STEP_COLUMNS = (
    "step, version, reward_mean, reward_std, staleness_mean, staleness_max, dropped_stale, t_train_s,"
    " t_idle_s, bubble, tokens, clip_frac, created_at"
)

# Bumped whenever _SCHEMA changes; a database of an older version is brought up to it by _MIGRATIONS, one of a newer
# one is refused, never half-used.
SCHEMA_VERSION = 8
# version -> the statements that take a database of that version to the next one, in one transaction with the rest.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # The time of a node's last price change, so the one-per-interval rule holds across a hub restart (issue 54 item 5):
    # its newest price row when it has more than one (the first is the price it joined at).
    3: (
        "ALTER TABLE nodes ADD COLUMN price_changed_at REAL",
        "UPDATE nodes SET price_changed_at = (SELECT MAX(at) FROM prices WHERE node_id = peer_id)"
        " WHERE (SELECT COUNT(*) FROM prices WHERE node_id = peer_id) > 1",
    ),
    # Idle departed identities compacted (issue 65): the table, its row and the indexes are created as on a new file.
    4: (),
    # A lease's terms, so that a restarted hub takes the answer to a lease it granted before (issue 67 item 1); a lease
    # written before has no price (NULL) and is not taken after a restart.
    5: (
        "ALTER TABLE leases ADD COLUMN price_per_hour REAL",
        "ALTER TABLE leases ADD COLUMN probe INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN held_version INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN address TEXT",
    ),
    # An answered lease keeps its answer's hash and the reply it got, so that the same answer sent again (its reply lost
    # to a crash between the commit and the reply) gets that reply, not a refusal (issue 67 item 1).
    6: ("ALTER TABLE leases ADD COLUMN answer_hash TEXT", "ALTER TABLE leases ADD COLUMN reply_json TEXT"),
    # A node's groups by the step that trained them: what a ban reports of its work already learned from (issue 66).
    7: ("CREATE INDEX IF NOT EXISTS trajectories_by_node ON trajectories(node_id, consumed_step)",),
}


def schema_opens(found: int) -> bool:
    """Whether a database of schema `found` opens here: this echo2's, or an older one _MIGRATIONS bring up to it."""
    return found <= SCHEMA_VERSION and all(version in _MIGRATIONS for version in range(found, SCHEMA_VERSION))


class SchemaMismatch(RuntimeError):
    """The database was written by an echo2 with another schema."""


@dataclass(frozen=True)
class TrainedWork:
    """A node's groups the learner already trained on, and the steps that did."""

    groups: int
    first_step: int | None
    last_step: int | None

    def describe(self) -> str:
        if not self.groups:
            return "none of its groups was trained on"
        steps = f"step {self.first_step}" if self.first_step == self.last_step else f"steps {self.first_step}-{self.last_step}"
        return f"{self.groups} of its groups were trained on ({steps})"


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
    gpu_s          REAL    NOT NULL DEFAULT 0,
    price_changed_at REAL
);
CREATE INDEX IF NOT EXISTS nodes_accepted ON nodes(accepted);
-- The identities retention may delete (IDLE_NODE_SQL), by when they were last seen: a pass that finds none reads none.
CREATE INDEX IF NOT EXISTS nodes_idle ON nodes(last_seen) WHERE {idle_node};
-- The identities retention deleted, rolled up: the status counts them among the nodes that left, and the all-on cost
-- keeps their $/h x online seconds.
CREATE TABLE IF NOT EXISTS forgotten_nodes (
    id    INTEGER PRIMARY KEY CHECK (id = 0),
    nodes INTEGER NOT NULL,
    usd_s REAL    NOT NULL
);
INSERT OR IGNORE INTO forgotten_nodes (id, nodes, usd_s) VALUES (0, 0, 0.0);
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
    answered_at REAL,
    -- The terms hub.records.leases.LeaseRecord holds: a restarted hub takes answers to its open leases on them.
    price_per_hour REAL,
    probe          INTEGER NOT NULL DEFAULT 0,
    held_version   INTEGER NOT NULL DEFAULT 0,
    address        TEXT,
    -- Once answered: the hash of the signed answer and the reply it got (what the same answer sent again gets).
    answer_hash    TEXT,
    reply_json     TEXT
);
CREATE INDEX IF NOT EXISTS leases_open ON leases(state, deadline);
-- A node's leases: what retention checks before it deletes an identity (and the foreign key check of that delete).
CREATE INDEX IF NOT EXISTS leases_by_node ON leases(node_id);
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
CREATE INDEX IF NOT EXISTS trajectories_by_node ON trajectories(node_id, consumed_step);
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
-- A node's ledger rows: what retention checks before it deletes an identity (and the foreign key check of that delete).
CREATE INDEX IF NOT EXISTS ledger_by_node ON ledger(node_id);
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
""".replace("{tally_columns}", ",\n    ".join(f"{name:<14} INTEGER NOT NULL DEFAULT 0" for name in TALLY_FIELDS)).replace(
    "{idle_node}", IDLE_NODE_SQL
)
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


class SettledGroups(NamedTuple):
    """How the newest settled accepted groups were settled (GroupsTable.recent_usable_groups)."""

    trained: int
    settled: int
    stale: int
    zero_variance: int


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
    # The S this step trained under: a resumed --staleness auto run goes on at it (None: not recorded).
    staleness_budget: int | None = None

    def as_json_dict(self) -> dict[str, float | int]:
        out = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
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
    price_changed_at: float | None = None  # its last price change (a re-price, or a re-join at another price)

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
    """What one `Store.retain` let go: payloads dropped, leases deleted, ledger rows merged into roll-ups, identities
    forgotten."""

    payloads: int
    leases: int
    ledger_rows: int
    step_metrics: int = 0
    snapshot_rows: int = 0
    nodes: int = 0


@dataclass(frozen=True)
class LeaseTerms:
    """What a lease row keeps of hub.records.leases.LeaseRecord beyond its prompts and window: what it is paid at, and
    what its answer is held to."""

    price_per_hour: float
    probe: bool
    held_version: int
    address: str | None


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
    price_per_hour: float | None = None  # None: written before schema 6, never taken after a restart
    probe: int = 0
    held_version: int = 0
    address: str | None = None
    answer_hash: str | None = None  # once answered (schema 7): the hash of the signed answer's bytes
    reply_json: str | None = None  # and the SubmitReply it got, without a next lease
