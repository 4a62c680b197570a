"""Store retention against a real SQLite file: the books are the same after it, after a crash in the middle of it,
and after a later ban; what is still needed keeps its payload; a resume reads no more for a longer history."""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub.config import HubConfig, LearnerConfig
from hub.records.store import Store
from hub.service.state import HubState
from shared.layout import HUB_STORE_FILE
from shared.tasks.reverse import ReverseTask
from testbed.inproc import LearnerAt
from testbed.large_store import build_large_store

CONFIG = HubConfig(learner=LearnerConfig(staleness=2, prompts_per_step=2, group_size=2))
STEPS, LEASES = 40, 400
OLDEST_ON_SHELF = STEPS - 3  # work of the newest versions (made at step - 1) is still on the shelf


def history(data_dir: Path, vouch_needed: bool = True) -> Path:
    """A store with a history none of which was retained."""
    return build_large_store(data_dir, STEPS, LEASES, nodes=4, vouch_needed=vouch_needed, retained=False).path


def copy(path: Path, to: Path) -> Path:
    to.mkdir(parents=True, exist_ok=True)
    source, target = sqlite3.connect(path), sqlite3.connect(to / HUB_STORE_FILE)
    source.backup(target)
    source.close()
    target.close()
    return to / HUB_STORE_FILE


def books(path: Path) -> dict:
    """Everything the hub shows of its history: nodes with tallies, audits, bans; pay; totals; steps; the buffer
    a resume refills; and the view a restarted HubState rebuilds (which writes a session: call it once per copy)."""
    store = Store(path)
    out = {
        "nodes": store.members.nodes(),
        "paid": {k: round(v, 9) for k, v in store.groups.ledger_by_node_usd().items()},
        "paid_total": round(store.groups.ledger_total_usd(), 9),
        "counts": (store.groups.trajectory_counts(), store.groups.dropped_stale_count()),
        "recent": (
            store.groups.recent_usable_groups(10_000),
            store.groups.recent_discards(10_000),
            store.groups.recent_rejections(10_000),
        ),
        "steps": store.training.steps(),
        "pending": store.groups.unconsumed_groups(),
        "rows": [
            (r.id, r.node_id, r.version, r.verdict, r.reward_mean, r.consumed_step, r.discard_reason)
            for r in store.groups.trajectories()
        ],
    }
    state = HubState(store, CONFIG, ReverseTask())
    out["view"] = (
        {p: (n.state, n.tallies, n.audits_passed, n.vouched_at) for p, n in state.fleet.nodes.items()},
        state.totals.groups,
        state.totals.dropped_stale,
        {k: round(v, 9) for k, v in state.totals.paid_usd.items()},
        state.buffer.row_ids(),
    )
    store.close()
    return out


def payload_ids(path: Path) -> set[int]:
    db = sqlite3.connect(path)
    try:
        return {r[0] for r in db.execute("SELECT id FROM payloads")}
    finally:
        db.close()


def retain(path: Path, vouch_needed: bool = True) -> tuple:
    """Retention now, with every lease of the history closed before now (it ended an hour ago): the same cut
    however long the test takes."""
    store = Store(path)
    try:
        kept = store.retain(OLDEST_ON_SHELF, time.time(), vouch_needed)
        return kept.payloads, kept.leases, kept.ledger_rows
    finally:
        store.close()


def test_books_are_the_same_after_retention_and_only_settled_payloads_off_the_shelf_go(tmp_path):
    path = history(tmp_path / "a")
    before = books(copy(path, tmp_path / "b"))
    held = payload_ids(path)
    payloads, leases, ledger_rows = retain(path)
    assert payloads > 0 and leases > 0 and ledger_rows > 0
    after = books(path)
    assert after == before
    # What stays: every pending group's payload, and settled ones of versions still on the shelf.
    store = Store(path)
    pending = {i for i, _ in store.groups.unconsumed_groups()}
    recent = {r.id for r in store.groups.trajectories() if r.verdict == "accepted" and r.version >= OLDEST_ON_SHELF}
    store.close()
    assert pending and recent and payload_ids(path) == (pending | recent) & held
    assert retain(path) == (0, 0, 0)  # nothing is retained twice
    store = Store(path)
    with pytest.raises(sqlite3.IntegrityError, match="payload of a pending group"):
        store.db.execute("DELETE FROM payloads WHERE id = ?", (min(pending),))
    store.close()


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.9])
def test_an_error_in_the_middle_of_retention_changes_nothing(tmp_path, fraction):
    path = history(tmp_path / "a")
    probe = copy(path, tmp_path / "probe")
    store = Store(probe)
    ticks = [0]
    store.db.conn.set_progress_handler(lambda: ticks.__setitem__(0, ticks[0] + 1), 100)
    store.retain(OLDEST_ON_SHELF, time.time(), True)
    store.close()
    before, held = books(copy(path, tmp_path / "b")), payload_ids(path)
    store = Store(path)
    left = [int(ticks[0] * fraction)]

    def interrupt() -> int:
        left[0] -= 1
        return int(left[0] <= 0)  # non-zero: SQLite aborts the statement running now

    store.db.conn.set_progress_handler(interrupt, 100)
    with pytest.raises(sqlite3.OperationalError, match="interrupt"):
        store.retain(OLDEST_ON_SHELF, time.time(), True)
    store.close()
    assert payload_ids(path) == held
    assert books(path) == before
    retain(path)  # the next retention does the whole of it
    assert books(path) == books(copy(path, tmp_path / "c"))


KILLED_IN_RETENTION = """
import os, signal, sys, time
from hub.records.store import Store
store = Store(sys.argv[1])
left = [int(sys.argv[2])]
def kill():
    left[0] -= 1
    if left[0] <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0
store.db.conn.set_progress_handler(kill, 100)
store.retain(int(sys.argv[3]), time.time(), True)
"""


@pytest.mark.parametrize("ticks", [40, 200, 350])  # of about 370 (hundreds of VM instructions) the whole takes
def test_a_hub_killed_in_the_middle_of_retention_loses_nothing(tmp_path, ticks):
    path = history(tmp_path / "a")
    before, held = books(copy(path, tmp_path / "b")), payload_ids(path)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_IN_RETENTION, str(path), str(ticks), str(OLDEST_ON_SHELF)],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert os.path.exists(f"{path}-wal")  # it died holding the store
    assert payload_ids(path) == held
    assert books(path) == before
    store = Store(path)
    assert store.integrity_check() == "ok"
    store.close()


@pytest.mark.parametrize("vouch_needed", [True, False])
def test_a_ban_after_retention_voids_what_it_would_have_voided(tmp_path, vouch_needed):
    path = history(tmp_path / "a", vouch_needed)
    twin = copy(path, tmp_path / "b")
    retain(path, vouch_needed)
    paid = []
    for p in (path, twin):
        store = Store(p)
        node = store.members.nodes()[0]
        # What HubState._penalize voids: pay after the last passed audit (with audits off: all of it).
        store.members.penalize_node(node.peer_id, [], (node.vouched_at or 0.0) if vouch_needed else 0.0, "test")
        paid.append({k: round(v, 9) for k, v in store.groups.ledger_by_node_usd().items()})
        store.close()
    assert paid[0] == paid[1]
    assert retain(path, vouch_needed)[2] > 0  # the banned node's rows are final: rolled up


def vm_steps_to_resume(data_dir: Path, steps: int, leases: int) -> int:
    """SQLite VM instructions (in hundreds) a HubState takes to rebuild its view from a store of that history."""
    # One lease every 10 s: the last hour's ledger rows, not yet final, are a few hundred either way.
    path = build_large_store(data_dir, steps, leases, nodes=8, lease_interval_s=10.0).path
    store = Store(path)
    ticks = [0]
    store.db.conn.set_progress_handler(lambda: ticks.__setitem__(0, ticks[0] + 1), 100)
    HubState(store, CONFIG, ReverseTask())
    store.close()
    return ticks[0]


def test_a_resume_reads_no_more_for_a_four_times_longer_history(tmp_path):
    short = vm_steps_to_resume(tmp_path / "short", 250, 2_500)
    long = vm_steps_to_resume(tmp_path / "long", 1_000, 10_000)
    assert short > 0 and long < 1.3 * short, (short, long)


def test_the_store_file_stops_growing_once_payloads_are_retained(tmp_path):
    """Each cycle writes 200 groups of 64 completions, trains on them and retains: freed pages are written again,
    so the file grows by the books alone, and the WAL is cut back by the checkpoint."""
    sizes = []
    for cycle in range(4):
        build_large_store(tmp_path, 20, 200, nodes=4, group_size=64)
        store = Store(tmp_path / HUB_STORE_FILE)
        store.journal.add_event("cycle", None, str(cycle))
        assert os.path.getsize(f"{tmp_path / HUB_STORE_FILE}-wal") > 0
        assert store.checkpoint()
        assert os.path.getsize(f"{tmp_path / HUB_STORE_FILE}-wal") == 0
        store.close()
        sizes.append(os.path.getsize(tmp_path / HUB_STORE_FILE))
    # What still grows is the books (rows of about 150 bytes per group, per lease for the last hour), not payloads.
    assert sizes[0] > 1_000_000 and (sizes[-1] - sizes[1]) / 2 < sizes[0] / 10, sizes


@pytest.mark.trio
async def test_the_hub_keeps_payloads_of_versions_still_on_its_shelf(tmp_path):
    path = history(tmp_path)
    shelf = [OLDEST_ON_SHELF - 1, OLDEST_ON_SHELF, OLDEST_ON_SHELF + 1]  # older than the window's oldest
    state = HubState(
        Store(path),
        CONFIG,
        ReverseTask(),
        learner=LearnerAt(CONFIG.learner.staleness, step=OLDEST_ON_SHELF + 1 + CONFIG.learner.staleness),
        shelved_versions=lambda: shelf,
    )
    kept = await state.retain(time.time())
    assert kept.payloads > 0 and kept.leases > 0
    rows = state.store.groups.trajectories()
    state.store.close()
    on_shelf = {r.id for r in rows if r.verdict == "accepted" and r.version >= shelf[0]}
    pending = {r.id for r in rows if r.verdict == "accepted" and r.consumed_step is None and r.discard_reason is None}
    assert on_shelf - pending and payload_ids(path) == on_shelf | pending


@pytest.mark.slow
def test_resume_bench_times_a_real_hub_restarted_on_a_built_history(tmp_path, capsys):
    from tests.test_bench_smoke import load_bench, printed_json

    resume = load_bench("resume")
    assert resume.main(["--steps", "30", "--leases", "300", "--work-dir", str(tmp_path), "--json"]) == 0
    first = printed_json(capsys)
    assert first["steps"] == 31 and first["leases"] == 300 and first["build_s"] > 0
    assert 0 < first["resume_s_large_store"] < first["build_s"] and first["store_bytes"] > 0
    assert resume.built(resume.base_dir(tmp_path, 30, 300), 30, 300, False, print) == (31, None)  # reused: no build_s


def test_old_steps_keep_their_columns_but_not_their_metrics_json_and_snapshot_rows_are_capped(tmp_path, monkeypatch):
    """A step row's metrics JSON is 90% of its bytes (metrics.jsonl holds every step's too): past the newest
    STEP_METRICS_KEPT steps only the columns stay. Snapshot rows past the newest SNAPSHOT_ROWS_KEPT go. The pages
    they held go back to the disk at the next checkpoint."""
    import hub.records.store as store_module
    from hub.records.schema import StepRecord

    monkeypatch.setattr(store_module, "STEP_METRICS_KEPT", 100)
    monkeypatch.setattr(store_module, "SNAPSHOT_ROWS_KEPT", 3)
    store = Store(tmp_path / HUB_STORE_FILE)
    extra = {f"a_metric_with_a_long_name_{i}": 0.1234567890123 * i for i in range(28)}  # as the learner logs them

    def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            store.training.commit_step(StepRecord(step, step, 0.5, 0.1, 1.0, 2, 0, 1.0, 0.0, 0.0, 100, 0.0, extra), [])
            store.shelf.add_snapshot(step, f"/snapshots/v{step}", "ab" * 32, 1000, float(step))

    def live_pages() -> int:
        return store.db.execute("PRAGMA page_count").fetchone()[0] - store.db.execute("PRAGMA freelist_count").fetchone()[0]

    steps(1, 1000)
    store.checkpoint()
    before = live_pages()
    kept = store.retain(0, 0.0, True)
    assert (kept.step_metrics, kept.snapshot_rows) == (900, 997)
    rows = store.training.steps()
    assert [s.step for s in rows] == list(range(1, 1001)) and [s.reward_mean for s in rows] == [0.5] * 1000
    assert all(s.extra == {} for s in rows[:900]) and all(s.extra == extra for s in rows[900:])
    assert [s.version for s in store.shelf.snapshots()] == [998, 999, 1000] and store.shelf.latest_version() == 1000
    store.checkpoint()
    assert live_pages() < 0.4 * before, (live_pages(), before)
    steps(1001, 1010)  # the next pass trims only the steps that crossed the line since
    kept = store.retain(0, 0.0, True)
    assert (kept.step_metrics, kept.snapshot_rows) == (10, 10)
    assert store.training.steps()[909].extra == {} and store.training.steps()[910].extra == extra
    store.close()


def test_trimming_old_step_metrics_leaves_the_books_as_they_were(tmp_path, monkeypatch):
    """Trajectories, ledger rows and evaluations refer to the steps whose rows retention writes again."""
    import hub.records.store as store_module

    path = history(tmp_path / "a")
    before = books(copy(path, tmp_path / "b"))
    monkeypatch.setattr(store_module, "STEP_METRICS_KEPT", 10)
    store = Store(path)
    assert store.retain(OLDEST_ON_SHELF, time.time(), True).step_metrics == STEPS - 10
    store.close()
    after = books(path)
    steps_before, steps_after = before.pop("steps"), after.pop("steps")
    assert [
        dataclasses.replace(s, extra={}, staleness_budget=None) if s.step <= STEPS - 10 else s for s in steps_before
    ] == steps_after
    assert {k: v for k, v in after.items() if k != "view"} == {k: v for k, v in before.items() if k != "view"}
    assert after["view"][0] == before["view"][0] and after["view"][1:4] == before["view"][1:4]


def test_retention_forgets_only_identities_that_left_nothing_to_remember(tmp_path):
    """Issue 65: a departed identity that did no work goes whole, its prices and expired leases with it, and is counted
    in a roll-up; one seen since the cut, one still holding a lease, a banned one, one with a refusal or a measurement
    stay."""
    store = Store(tmp_path / "hub.db")
    peers = ("idle", "recent", "leasing", "banned", "refused", "measured")
    now = time.time()
    for peer in peers:
        store.members.upsert_node(peer, 0.5, "t", 1e8, "hf", state="gone")
        store.members.set_node_price(peer, 0.6, at=now)
    store.leases.add_lease("expired", "idle", ["p1"], 0, now - 100, now - 50)
    store.leases.expire_leases(now)
    store.leases.add_lease("open", "leasing", ["p2"], 0, now, now + 60)
    store.members.set_node_state("banned", "banned", "a corrupt chunk")
    store.members.count_refusal("refused")
    session = store.start_session(now)
    store.members.flush_liveness([("idle", now, 30.0, 0.0, False), ("measured", now, 0.0, 1.0, True)], session, now)
    store.members.flush_liveness([("recent", now + 10, 0.0, 0.0, False)], session, now)
    cut = now + 5
    assert store.retain(0, 0.0, True, idle_before=cut).nodes == 1
    assert [n.peer_id for n in store.members.nodes()] == list(peers[1:])
    assert store.db.execute("SELECT COUNT(*) FROM prices WHERE node_id = 'idle'").fetchone()[0] == 0
    assert [r[0] for r in store.db.execute("SELECT id FROM leases")] == ["open"]
    assert store.members.seen_before(cut) == (len(peers) - 1, 0.6 * 30.0)  # four rows seen before the cut, and the roll-up
    assert store.members.remembered("idle", 8) is None  # a newcomer if it joins again
    assert store.members.upsert_node("idle", 0.5, "t", 1e8, "hf") and not store.members.upsert_node("banned", 0.5, "t", 1e8, "hf")
    assert store.integrity_check() == "ok"
    store.close()
