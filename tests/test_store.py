"""The hub store against a real SQLite file: schema, durability pragmas, atomic steps, restart."""

from __future__ import annotations

import sqlite3
import time

import pytest

from hub.records.schema import SCHEMA_VERSION, SchemaMismatch, StepRecord, TrainedWork
from hub.records.store import Store
from hub.trust.submissions import GroupVerdict
from shared.messages import GroupReason, SubmittedGroup, Tallies
from shared.rollout import Completion, Group


def make_group(prompt_id: str, version: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    completions = tuple(
        Completion(token_ids=(5, 6, 2), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop", version=version, text="ab")
        for _ in rewards
    )
    return Group(prompt_id=prompt_id, prompt_text="ba>", version=version, completions=completions, rewards=rewards)


def make_record(step: int) -> StepRecord:
    return StepRecord(
        step=step,
        version=step,
        reward_mean=0.5,
        reward_std=0.5,
        staleness_mean=1.0,
        staleness_max=2,
        dropped_stale=0,
        t_train_s=0.1,
        t_idle_s=0.05,
        bubble=1 / 3,
        tokens=42,
        clip_frac=0.0,
        extra={"kl": 0.01},
    )


def test_schema_and_pragmas(tmp_path):
    store = Store(tmp_path / "hub.db")
    tables = set(store.db.table_names())
    assert {"snapshots", "nodes", "leases", "trajectories", "steps", "ledger", "events", "checkpoints", "sessions"} <= tables
    assert store.pragma("journal_mode") == "wal"
    assert store.pragma("synchronous") == 2  # FULL
    assert store.pragma("foreign_keys") == 1
    assert store.pragma("busy_timeout") > 0
    assert store.integrity_check() == "ok"
    assert store.pragma("user_version") == SCHEMA_VERSION


def test_database_of_another_schema_is_refused_untouched(tmp_path):
    Store(tmp_path / "hub.db").close()
    Store(tmp_path / "hub.db").close()  # same schema: reopens
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("CREATE TABLE nodes (peer_id TEXT PRIMARY KEY, accepted INTEGER)")  # an earlier layout, no version
    old.commit()
    old.close()
    with pytest.raises(SchemaMismatch, match="schema 0, this echo2 uses"):
        Store(tmp_path / "old.db")
    check = sqlite3.connect(tmp_path / "old.db")
    assert [r[0] for r in check.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["nodes"]
    assert check.execute("PRAGMA user_version").fetchone()[0] == 0


def test_a_database_of_schema_3_is_migrated_and_keeps_its_rows(tmp_path):
    """Schema 4 keeps a node's last price change on its row (issue 54 item 5): a hub.sqlite of schema 3 opens, gains
    the column (a node's newest price row when it changed its price, NULL when it did not), and keeps everything else."""
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("peerA", 0.35, "cpu", 1e8, "hf")
    store.members.upsert_node("peerB", 0.35, "cpu", 1e8, "hf")
    changed_at = time.time() + 10.0
    store.members.set_node_price("peerB", 0.4, at=changed_at)  # a change schema 3 kept only in its price history
    store.leases.add_lease("L0", "peerA", ["p1"], 0, time.time(), time.time() + 600)
    store.leases.add_lease("L1", "peerA", ["p2"], 0, time.time(), time.time() + 600)
    store.close()
    old = sqlite3.connect(tmp_path / "hub.db")  # schema 3: the same tables without the column
    old.execute("UPDATE leases SET state = 'answered', answered_at = ? WHERE id = 'L1'", (time.time(),))
    old.execute("ALTER TABLE nodes DROP COLUMN price_changed_at")
    # schema 6's lease terms, and schema 7's answer kept with its reply
    for column in ("price_per_hour", "probe", "held_version", "address", "answer_hash", "reply_json"):
        old.execute(f"ALTER TABLE leases DROP COLUMN {column}")
    old.execute("DROP INDEX trajectories_by_node")  # schema 8's
    old.execute("PRAGMA user_version = 3")
    old.commit()
    old.close()
    store = Store(tmp_path / "hub.db")
    assert store.pragma("user_version") == SCHEMA_VERSION == 8
    assert store.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'trajectories_by_node'").fetchone()
    assert store.members.seen_before(0.0) == (0, 0.0)  # schema 5: the roll-up of forgotten identities, empty
    assert [(n.peer_id, n.price_per_hour, n.price_changed_at) for n in store.members.nodes()] == [
        ("peerA", 0.35, None),
        ("peerB", 0.4, changed_at),
    ]
    assert store.members.set_node_price("peerA", 0.5, at=123.0)
    assert store.members.node("peerA").price_changed_at == 123.0
    # Schema 6: a lease granted before it has no terms (no price), so a restart cannot take its answer: it expires.
    assert store.leases.reopen(time.time()) == [] and store.leases.lease("L0").state == "expired"
    # Schema 7: a lease answered before it kept no reply, so its answer sent again cannot be given one.
    assert store.leases.lease("L1").reply_json is None and store.leases.answered_since(time.time()) == []
    assert store.integrity_check() == "ok"


def test_a_start_resumes_a_run_of_an_older_schema_and_refuses_a_newer_one(tmp_path):
    """`echo-hub start` reads the run of a data dir whose store this echo2 migrates (schema 5: a run started before
    leases kept their terms), and refuses, in one line, one written by a newer echo2."""
    from hub.cli.preflight import read_run
    from hub.config import HubConfig
    from shared.checks import UserError
    from shared.layout import HUB_STORE_FILE

    store = Store(tmp_path / HUB_STORE_FILE)
    store.set_run({"task": "reverse"})
    store.close()
    old = sqlite3.connect(tmp_path / HUB_STORE_FILE)
    for column in ("price_per_hour", "probe", "held_version", "address", "answer_hash", "reply_json"):
        old.execute(f"ALTER TABLE leases DROP COLUMN {column}")
    old.execute("PRAGMA user_version = 5")
    old.commit()
    old.close()
    run = read_run(HubConfig(data_dir=tmp_path))
    assert run is not None and run.meta == {"task": "reverse"} and run.step == 0
    migrated = Store(tmp_path / HUB_STORE_FILE)  # as the hub opens it
    assert migrated.pragma("user_version") == SCHEMA_VERSION
    migrated.close()
    newer = sqlite3.connect(tmp_path / HUB_STORE_FILE)
    newer.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    newer.commit()
    newer.close()
    with pytest.raises(UserError, match=f"holds echo2 schema {SCHEMA_VERSION + 1}, this echo2 uses {SCHEMA_VERSION}"):
        read_run(HubConfig(data_dir=tmp_path))


def test_commit_step_is_atomic(tmp_path):
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("peerA", 0.35, "rtx5090", 1e8, "hf")
    store.leases.add_lease("L1", "peerA", ["p1", "p2"], 0, time.time(), time.time() + 60)
    ids = [store.groups.record_trajectory(make_group(f"p{i}", 0), "L1", "peerA", "accepted") for i in range(3)]
    store.training.commit_step(make_record(1), ids[:2], dropped_stale_ids=[ids[2]])
    rows = {r.id: r for r in store.groups.trajectories()}
    assert rows[ids[0]].consumed_step == 1 and rows[ids[1]].consumed_step == 1
    assert rows[ids[2]].discard_reason == "stale" and store.groups.dropped_stale_count() == 1
    assert store.members.node("peerA").tallies.accepted == 3

    # A second step that names an already-consumed id must leave nothing behind.
    fresh = store.groups.record_trajectory(make_group("p9", 1), None, "", "accepted")
    with pytest.raises(ValueError, match="not an accepted, pending row"):
        store.training.commit_step(make_record(2), [fresh, ids[0]])
    assert [s.step for s in store.training.steps()] == [1]
    assert [gid for gid, _ in store.groups.unconsumed_groups()] == [fresh]
    # Duplicate step numbers are refused by the primary key, also atomically.
    with pytest.raises(sqlite3.IntegrityError):
        store.training.commit_step(make_record(1), [fresh])
    assert [gid for gid, _ in store.groups.unconsumed_groups()] == [fresh]


def test_unconsumed_groups_survive_reopen(tmp_path):
    path = tmp_path / "hub.db"
    store = Store(path)
    a = store.groups.record_trajectory(make_group("a", 0), None, "", "accepted")
    store.groups.record_trajectory(make_group("r", 0), None, "", "rejected", reason="bad reward claim")
    b = store.groups.record_trajectory(make_group("b", 1, (1.0, 0.0)), None, "", "accepted")
    c = store.groups.record_trajectory(make_group("c", 1), None, "", "accepted")
    store.training.commit_step(make_record(1), [a])
    store.groups.discard_trajectories([c], "zero reward variance")
    store.close()

    again = Store(path)
    pending = again.groups.unconsumed_groups()
    assert [gid for gid, _ in pending] == [b]
    assert pending[0][1] == make_group("b", 1, (1.0, 0.0))
    assert again.integrity_check() == "ok"


def test_a_tool_using_group_round_trips_and_a_row_written_before_tools_still_loads(tmp_path):
    """Groups are stored as JSON: a multi-turn one comes back token-exact with its environment segments; a row an
    older hub wrote (its completions name no env_spans) loads as a single-turn group."""
    path = tmp_path / "hub.db"
    store = Store(path)
    turns = Completion(
        token_ids=(5, 2, 9, 9, 2, 7, 6, 2),
        logprobs=(-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4, -0.5),
        finish_reason="stop",
        version=1,
        text="a b",
        env_spans=((2, 3),),
    )
    tool_group = Group(prompt_id="t", prompt_text="ba>", version=1, completions=(turns, turns), rewards=(0.0, 1.0))
    old = make_group("old", 1)
    old_json = old.model_dump_json()
    assert '"env_spans":[]' in old_json
    tool_id = store.groups.record_trajectory(tool_group, None, "", "accepted")
    old_id = store.groups.record_trajectory(old, None, "", "accepted")
    store.close()
    older = sqlite3.connect(path)  # the row as a hub before tools wrote it
    with older:
        older.execute("UPDATE payloads SET group_json = ? WHERE id = ?", (old_json.replace(',"env_spans":[]', ""), old_id))
    older.close()

    again = Store(path)
    loaded = dict(again.groups.unconsumed_groups())
    assert "env_spans" not in again.db.execute("SELECT group_json FROM payloads WHERE id = ?", (old_id,)).fetchone()[0]
    assert loaded[old_id] == old and loaded[old_id].completions[0].env_spans == ()
    assert loaded[tool_id] == tool_group
    assert loaded[tool_id].completions[0].env_segments() == [(9, 9, 2)]


def test_snapshots_checkpoints_events_leases(tmp_path):
    store = Store(tmp_path / "hub.db")
    assert store.shelf.latest_version() is None
    store.shelf.add_snapshot(0, "snapshots/v0", "h0", 100, time.time())
    store.shelf.add_snapshot(3, "snapshots/v3", "h3", 100, time.time())
    with pytest.raises(ValueError, match="not newer"):
        store.shelf.add_snapshot(3, "snapshots/v3b", "h3b", 100, time.time())
    store.shelf.set_broadcast_time(3, 1.5)
    assert store.shelf.latest_version() == 3
    assert store.shelf.snapshots()[-1].t_bcast_s == 1.5

    assert store.training.latest_checkpoint() is None
    store.training.commit_step(make_record(1), [])
    store.training.commit_step(make_record(2), [])
    store.training.add_checkpoint(1, "ckpt/1", 1)
    store.training.add_checkpoint(2, "ckpt/2", 2)
    assert store.training.latest_checkpoint().step == 2
    with pytest.raises(sqlite3.IntegrityError):  # a checkpoint must name a committed step
        store.training.add_checkpoint(7, "ckpt/7", 7)

    store.journal.add_event("join", "peerA", "hello")
    store.journal.add_event("ban", "peerA", "bad chunk")
    assert [e.kind for e in store.journal.events(limit=1)] == ["ban"]

    store.members.upsert_node("peerA", 0.35, "cpu", None, "hf")
    store.leases.add_lease("L1", "peerA", ["p1"], 0, time.time(), time.time() - 1)
    store.leases.add_lease("L2", "peerA", ["p2"], 0, time.time(), time.time() + 60)
    assert store.leases.expire_leases(time.time(), events=[("lease_expired", "peerA", "L1")]) == ["L1"]
    assert store.leases.lease("L1").state == "expired" and store.leases.lease("L2").prompt_ids == ("p2",)
    assert store.journal.events(limit=1)[0].kind == "lease_expired"
    with pytest.raises(sqlite3.IntegrityError):  # leases only for known nodes
        store.leases.add_lease("L3", "stranger", ["p"], 0, time.time(), time.time())
    assert store.training.steps()[0].extra == {"kl": 0.01}


def test_submission_verdicts_are_tallied_per_node_and_overall(tmp_path):
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("peerA", 0.35, "rtx5090", 1e8, "hf")
    store.leases.add_lease("L1", "peerA", ["p1", "p2", "p3"], 0, time.time(), time.time() + 60)
    good = make_group("p1", 3)
    submitted = SubmittedGroup(prompt_id="p1", completions=good.completions)
    verdicts = [
        GroupVerdict("p1", True, "", submitted, group=good),
        GroupVerdict("p2", False, "stale version 1 (oldest accepted 2)", submitted, late=True),
        GroupVerdict("p3", False, "tokens after EOS", submitted, code=GroupReason.TOKENS),
    ]
    ids = store.groups.record_submission(
        "L1",
        "peerA",
        verdicts,
        usd=0.01,
        seconds=2.0,
        signed_bytes_hash="h",
        rollouts_per_s=3.5,
        events=[("probed", "peerA", "3.5 rollouts/s")],
    )
    assert [store.groups.trajectories()[i].verdict for i in range(3)] == ["accepted", "late", "rejected"]
    assert len(ids) == 3
    node = store.members.node("peerA")
    assert node.tallies == Tallies(accepted=1, rejected=1, late=1)
    assert (node.rollouts_per_s, node.measured) == (3.5, True)
    assert store.journal.events(limit=1)[0].detail == "3.5 rollouts/s"  # in the same transaction
    assert store.groups.ledger_total_usd("peerA") == pytest.approx(0.01)
    # A replay racing the first answer finds the lease answered: nothing changes.
    with pytest.raises(ValueError, match="not open"):
        store.groups.record_submission("L1", "peerA", verdicts, usd=0.01, seconds=2.0, signed_bytes_hash="h")
    assert store.members.node("peerA").tallies == Tallies(accepted=1, rejected=1, late=1)
    store.groups.record_trajectory(make_group("p4", 1), None, "peerA", "late", reason="stale version 1")
    assert store.groups.trajectory_counts() == {"accepted": 1, "rejected": 1, "late": 2}
    assert store.members.node("peerA").tallies.late == 2
    with pytest.raises(ValueError, match="verdict must be one of"):
        store.groups.record_trajectory(make_group("p5", 1), None, "peerA", "maybe")


def test_recent_usable_groups_counts_settled_accepted_rows(tmp_path):
    store = Store(tmp_path / "hub.db")
    ids = [store.groups.record_trajectory(make_group(f"p{i}", 0), None, "", "accepted") for i in range(6)]
    store.groups.record_trajectory(make_group("late", 0), None, "", "late")  # never accepted: not counted
    assert store.groups.recent_usable_groups(100) == (0, 0, 0, 0)  # all pending: nothing settled
    store.training.commit_step(make_record(1), ids[:2], dropped_stale_ids=[ids[2]])
    store.groups.discard_trajectories([ids[3]], "zero reward variance")
    assert store.groups.recent_usable_groups(100) == (2, 4, 1, 1)  # ids[4:] still pending; ids[2] went stale, ids[3] equal
    assert store.groups.recent_usable_groups(2) == (0, 2, 1, 1)  # the newest two settled were both skipped


def test_liveness_sessions_audits_and_penalties_survive_reopen(tmp_path):
    path = tmp_path / "hub.db"
    store = Store(path)
    first = store.start_session(1000.0)
    store.members.upsert_node("peerA", 0.35, "cpu", 1e8, "hf", "active", event=("join", "peerA", "price $0.35/h"))
    store.members.flush_liveness([("peerA", 1010.0, 9.5, 2.25, True)], first, 1030.0)
    store.members.record_audit_pass("peerA", 1005.0)
    store.members.record_audit_pass("peerA", 1003.0)  # an older submission's audit passing later vouches for no less
    store.leases.add_lease("L1", "peerA", ["p1"], 0, 1000.0, 2000.0)
    store.leases.add_lease("L2", "peerA", ["p2"], 0, 1000.0, 2000.0)
    g1, g2 = make_group("p1", 0), make_group("p2", 0)
    v = lambda g: GroupVerdict(g.prompt_id, True, "", SubmittedGroup(prompt_id=g.prompt_id, completions=g.completions), g)
    (row1,) = store.groups.record_submission("L1", "peerA", [v(g1)], usd=0.01, seconds=1.0, signed_bytes_hash="h", now=1004.0)
    (row2,) = store.groups.record_submission("L2", "peerA", [v(g2)], usd=0.02, seconds=1.0, signed_bytes_hash="h", now=1006.0)
    store.close()

    store = Store(path)
    assert store.learner_seconds() == pytest.approx(30.0)
    second = store.start_session(5000.0)
    store.members.flush_liveness([], second, 5004.0)
    assert store.learner_seconds() == pytest.approx(34.0)
    node = store.members.node("peerA")
    assert (node.last_seen, node.online_s, node.rollouts_per_s, node.measured) == (1010.0, 9.5, 2.25, True)
    assert (node.audits_passed, node.vouched_at) == (2, 1005.0)
    # Caught later: banned, its pending row discarded, pay after its last vouched-for submission voided.
    voided, paid = store.members.penalize_node(
        "peerA", [row2], node.vouched_at, "audit failed", event=("audit_fail", "peerA", "x")
    )
    assert (voided, paid) == (1, pytest.approx(0.01))
    node = store.members.node("peerA")
    assert (node.state, node.banned_reason) == ("banned", "audit failed")
    assert {r.id: r.discard_reason for r in store.groups.trajectories()} == {row1: None, row2: "banned: audit failed"}
    with pytest.raises(ValueError, match="not an accepted, pending row"):  # all or nothing
        store.members.penalize_node("peerA", [row2], 0.0, "again")
    assert store.groups.ledger_total_usd("peerA") == pytest.approx(0.01)
    assert [e.kind for e in store.journal.events()] == ["audit_fail", "join"]


def test_refused_work_is_kept_as_a_hash_not_a_payload(tmp_path):
    def grown_by(refused_tokens: int) -> int:
        """Bytes the store's files (WAL included) grow by for one submission: one accepted group, one refused."""
        directory = tmp_path / str(refused_tokens)
        store = Store(directory / "hub.db")
        store.members.upsert_node("peerA", 0.35, "cpu", 1e8, "hf")
        store.leases.add_lease("L1", "peerA", ["p1", "p2"], 0, time.time(), time.time() + 60)
        good = make_group("p1", 3)
        refused = SubmittedGroup(
            prompt_id="p2",
            completions=tuple(
                Completion(
                    token_ids=(5,) * refused_tokens, logprobs=(-0.1,) * refused_tokens, finish_reason="length", version=3, text=""
                )
                for _ in range(8)
            ),
        )
        verdicts = [
            GroupVerdict("p1", True, "", SubmittedGroup(prompt_id="p1", completions=good.completions), group=good),
            GroupVerdict("p2", False, "completion too long", refused, code=GroupReason.TOKENS),
        ]
        before = sum(p.stat().st_size for p in directory.iterdir())
        store.groups.record_submission("L1", "peerA", verdicts, usd=0.0, seconds=1.0, signed_bytes_hash="h")
        rows = store.db.execute(
            "SELECT verdict, id NOT IN (SELECT id FROM payloads), length(group_hash) FROM trajectories ORDER BY id"
        ).fetchall()
        assert rows == [("accepted", 0, 64), ("rejected", 1, 64)]
        store.close()
        return sum(p.stat().st_size for p in directory.iterdir()) - before

    # 8 x 4000 refused tokens (about 220 kB of JSON) cost the disk what 8 x 1 tokens do.
    assert abs(grown_by(4000) - grown_by(1)) < 8 * 1024


def test_a_nodes_trained_work_is_counted_with_its_steps(tmp_path):
    """What a ban reports of the node's work the learner already learned from (issue 66): groups and steps."""
    store = Store(tmp_path / "hub.db")
    ids = {}
    for node, prompts in (("A", ("p1", "p2", "p3")), ("B", ("p4",))):
        for prompt in prompts:
            ids[prompt] = store.groups.record_trajectory(make_group(prompt, 0), None, node, "accepted")
    assert store.groups.trained_of("A").describe() == "none of its groups was trained on"
    store.training.commit_step(make_record(3), [ids["p1"], ids["p4"]])
    assert store.groups.trained_of("A").describe() == "1 of its groups were trained on (step 3)"
    store.training.commit_step(make_record(5), [ids["p2"]])
    assert store.groups.trained_of("A") == TrainedWork(2, 3, 5)
    assert store.groups.trained_of("A").describe() == "2 of its groups were trained on (steps 3-5)"
    assert store.groups.trained_of("B") == TrainedWork(1, 3, 3)
