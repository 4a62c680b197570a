"""Group commit over a real SQLite store: concurrent writes share commits, each stays all-or-nothing on its
own, every caller hears its own outcome only after the commit, and a cancelled caller's write still lands."""

from __future__ import annotations

import sqlite3

import pytest
import trio

from hub.records.store import Store
from hub.records.writer import StoreWriter


@pytest.fixture
def store(tmp_path) -> Store:
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("n", 0.1, "test", 1e8, "hf")
    yield store
    store.close()


def lease_ids(store: Store) -> set[str]:
    return {row["id"] for row in store._rows("SELECT id FROM leases")}


@pytest.mark.trio
async def test_concurrent_writes_share_commits_and_each_hears_its_own_outcome(store):
    writer = StoreWriter(store)
    results: dict[str, object] = {}

    async def add(i: int) -> None:
        lease_id = f"lease-{i}"
        try:
            await writer.write(store.leases.add_lease, lease_id, "n" if i % 10 else "ghost", ["p"], 0, 0.0, 1.0)
            results[lease_id] = "ok"
        except sqlite3.IntegrityError as exc:  # an unknown node: the foreign key refuses this write alone
            results[lease_id] = exc

    async with trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(add, i)
    failed = {k for k, v in results.items() if v != "ok"}
    assert failed == {f"lease-{i}" for i in range(0, 200, 10)}
    assert lease_ids(store) == {f"lease-{i}" for i in range(200) if i % 10}
    assert writer.writes == 200 and writer.batches < 50  # the batching itself: far fewer commits than writes
    # Alone, a write is its own batch: nothing waits for company.
    before = writer.batches
    await writer.write(store.leases.add_lease, "alone", "n", ["p"], 0, 0.0, 1.0)
    assert writer.batches == before + 1 and "alone" in lease_ids(store)


@pytest.mark.trio
async def test_a_failing_write_leaves_nothing_behind_inside_a_shared_batch(store):
    writer = StoreWriter(store)

    def half_then_fail() -> None:
        with store._write():
            store.db.execute("INSERT INTO events (at, kind, node_id, detail) VALUES (0, 'half', NULL, '')")
            raise RuntimeError("boom")

    async def expect_boom() -> None:
        with pytest.raises(RuntimeError, match="boom"):
            await writer.write(half_then_fail)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(writer.write, store.journal.add_event, "kept", None, str(i))
        nursery.start_soon(expect_boom)
        for i in range(5, 10):
            nursery.start_soon(writer.write, store.journal.add_event, "kept", None, str(i))
    kinds = [e.kind for e in store.journal.events(100)]
    assert kinds.count("kept") == 10 and "half" not in kinds


@pytest.mark.trio
async def test_a_cancelled_caller_still_gets_its_write_committed(store):
    writer = StoreWriter(store)
    with trio.move_on_after(0):
        await writer.write(store.leases.add_lease, "cancelled", "n", ["p"], 0, 0.0, 1.0)
    assert "cancelled" in lease_ids(store)


@pytest.mark.trio
async def test_a_store_failure_reaches_the_caller_as_itself(store):
    writer = StoreWriter(store)
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        await writer.write(store.journal.add_event, "x", None, "")


@pytest.mark.trio
async def test_when_sqlite_rolls_the_whole_batch_back_no_write_of_it_is_reported_done(store):
    """Disk full or an I/O error makes SQLite roll back the whole transaction: every write of that batch
    fails (none happened), not only the one that hit it, and the writer goes on with the next batch."""
    writer = StoreWriter(store)

    def disk_full() -> None:
        with store._write():
            store.db.execute("ROLLBACK")  # what SQLite does on SQLITE_FULL / SQLITE_IOERR
            raise sqlite3.OperationalError("database or disk is full")

    outcomes: dict[str, object] = {}

    async def write(name: str, fn, *args) -> None:
        try:
            outcomes[name] = await writer.write(fn, *args)
        except sqlite3.OperationalError as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write, "first", store.journal.add_event, "first", None, "")  # leads a batch of its own
        await trio.sleep(0)
        nursery.start_soon(write, "full", disk_full)  # these two queue into the next batch
        nursery.start_soon(write, "after", store.journal.add_event, "after", None, "")
    assert outcomes["first"] is None
    assert isinstance(outcomes["full"], sqlite3.OperationalError) and outcomes["after"] is outcomes["full"]
    assert [e.kind for e in store.journal.events(10)] == ["first"]
    await writer.write(store.journal.add_event, "later", None, "")
    assert {e.kind for e in store.journal.events(10)} == {"first", "later"}


@pytest.mark.trio
async def test_a_job_of_several_writes_is_all_or_nothing_in_a_batch(store):
    writer = StoreWriter(store)

    def two_then_fail() -> None:
        store.journal.add_event("one", None, "")
        store.journal.add_event("two", None, "")
        raise RuntimeError("the third part failed")

    with pytest.raises(RuntimeError):
        await writer.write(two_then_fail)
    assert store.journal.events(10) == []


@pytest.mark.trio
async def test_a_worker_threads_write_waits_for_the_batch_and_one_outside_trio_runs_at_once(store):
    """The learner's records (a snapshot row, a checkpoint row, an event) come from its worker threads: there they
    go through the writer's batch and the thread waits for the commit; before trio starts or after it ended, at once."""
    writer = StoreWriter(store)
    writer.write_blocking(store.journal.add_event, "before", None, "no trio yet")
    assert writer.writes == 0 and [e.kind for e in store.journal.events(10)] == ["before"]
    await trio.to_thread.run_sync(writer.write_blocking, store.journal.add_event, "thread", None, "from a worker thread")
    assert writer.writes == 1 and {e.kind for e in store.journal.events(10)} == {"before", "thread"}
