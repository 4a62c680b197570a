"""Group commit: the hub's store writes from many concurrent handlers, committed together.

Every write of the hub's state (its three owners' and the learner's records) goes through one StoreWriter. A write that arrives while no batch is being
committed leads one: it takes every write queued so far (up to MAX_BATCH_WRITES) to one worker
thread, where `Store.write_batch` runs them in one transaction, each in a savepoint of its own,
and commits once. Writes that arrive meanwhile queue; when a batch is committed the oldest of them
is woken to lead the next. So under load the hub pays one thread hop, one lock and one fsync per
batch rather than per request, and with one request in flight it pays exactly what a direct write
did.

A queued write is committed (or fails) before its caller hears of it, even if the caller is
cancelled meanwhile: like `trio.to_thread.run_sync`, cancellation never interrupts a commit that a
peer's acknowledgement, or the hub's view of its state, depends on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from hub.records.store import Store

# Bounds the time one batch holds the store (and its leader waits): writes are sub-millisecond each.
MAX_BATCH_WRITES = 256

T = TypeVar("T")


@dataclass(eq=False)
class _Write:
    call: Callable[[], object]
    # Set when the write is committed (outcome known) or when it is elected to lead the next batch.
    wake: trio.Event = field(default_factory=trio.Event)
    outcome: tuple[bool, Any] | None = None


class StoreWriter:
    """Batches writes to `store`; see the module docstring."""

    def __init__(self, store: Store, max_batch: int = MAX_BATCH_WRITES) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.store = store
        self.max_batch = max_batch
        self._queue: list[_Write] = []
        self._committing = False
        self.batches = 0  # committed batches and the writes in them: writes / batches is the batching gained
        self.writes = 0

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (one Store write method) in the next committed batch; its result or exception."""
        job = _Write(functools.partial(fn, *args))
        self._queue.append(job)
        with trio.CancelScope(shield=True):
            if self._committing:
                await job.wake.wait()
            else:
                self._committing = True
            if job.outcome is None:
                await self._lead()
        assert job.outcome is not None, "a led batch settles every job in it"
        ok, value = job.outcome
        if not ok:
            raise value
        return value

    def write_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`write` from a worker thread trio started (the learner's): the thread waits for the batch's commit. Where
        trio is not running the hub (a record written before it starts or after it ended), `fn` runs at once,
        all-or-nothing as every Store write method is."""
        try:
            trio.from_thread.check_cancelled()
        except RuntimeError:  # not a thread trio started
            return fn(*args)
        except trio.Cancelled:
            pass  # the write is shielded: a record the learner made is kept
        return trio.from_thread.run(self.write, fn, *args)

    async def _lead(self) -> None:
        batch = self._queue[: self.max_batch]
        del self._queue[: self.max_batch]
        try:
            outcomes = await trio.to_thread.run_sync(self.store.write_batch, [w.call for w in batch])
        except BaseException as exc:  # noqa: BLE001 -- the commit failed: none of the batch happened, all hear why
            outcomes = [(False, exc)] * len(batch)
        self.batches += 1
        self.writes += len(batch)
        for w, outcome in zip(batch, outcomes, strict=True):
            w.outcome = outcome
            w.wake.set()
        if self._queue:
            self._queue[0].wake.set()
        else:
            self._committing = False
