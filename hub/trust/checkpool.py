"""Where a submission's per-group checks run: in a pool of worker processes, or in a thread of the hub's own.

The checks (`check_submission`: token ids decoded, lengths, EOS, vocabulary, the reward recomputed) need no
shared state and are most of a submission's CPU, so `CheckPool` spreads them over `--check-procs` processes,
each started (spawned: no torch state forked) with the rules built by a factory of its own. The trio process
keeps framing, admission, the lease book, copy detection and the commit. A worker's verdicts come back with
the submission's token and log-prob tuples as references into the hub's own copy (`dump_answer`), so the
hub process unpickles texts and rewards, not the completions it sent.

A worker that dies under a check is replaced and the check sent to another one; after CHECK_ATTEMPTS deaths
the submission is refused as busy (the node sends it again): never lost, never accepted unchecked. A check
that runs past the timeout can only be the operator's reward hanging (nothing else in it waits): its worker
is killed and replaced and the failure is a RewardError, which stops the run as a raising reward does.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import trio

from hub.records.leases import LeaseRecord
from hub.trust.submissions import GroupVerdict, SubmissionRules, VersionWindow, check_submission
from shared.messages import Submission
from shared.tasks.base import RewardError

log = logging.getLogger("echo2.hub.checks")

# A check sent to this many workers that all died is refused as busy: the submission, not chance, kills them.
CHECK_ATTEMPTS = 3
# A worker imports the task, its reward and the tokenizer before its first check.
WORKER_START_TIMEOUT_S = 300.0
_CONTEXT = multiprocessing.get_context("spawn")

RulesFactory = Callable[[], SubmissionRules]


class ChecksLost(Exception):
    """Every worker a submission's checks were sent to died: not the node's fault, nor known to be its doing."""


def resolved_check_procs(configured: int | None, light_reward: bool) -> int:
    """Check worker processes for `--check-procs` (0: checks in a thread of the hub's own process). None: the
    cores this process may use, less one for the trio process, at least 1; 0 for a task whose reward is lighter
    than the trip to a process (`Task.light_reward`): there the pool costs the hub's process more CPU per
    submission than the checks it takes away (bench/p2p.py: 1.96 against 1.18 ms on the reverse task)."""
    if configured is not None:
        return configured
    if light_reward:
        return 0
    return max(1, len(os.sched_getaffinity(0)) - 1)


class SubmissionChecks(Protocol):
    """Runs `check_submission` for the hub (HubState runs `run` in its nursery)."""

    async def run(self) -> None: ...

    async def check(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> list[GroupVerdict]: ...


class ThreadChecks:
    """The checks in a worker thread of the hub's own process (`--check-procs 0`): one core at most."""

    def __init__(self, rules: SubmissionRules) -> None:
        self.rules = rules

    async def run(self) -> None:
        """Nothing to start or supervise."""
        await trio.sleep_forever()

    async def check(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> list[GroupVerdict]:
        return await trio.to_thread.run_sync(check_submission, submission, lease, self.rules, window)


def _shared_parts(submission: Submission) -> dict[int, tuple[str, int, int]]:
    """The submission's groups and token and log-prob tuples by object id, as references into it: verdicts carry
    them (a checked completion is a shallow copy with its text), and the hub holds the same submission."""
    parts: dict[int, tuple[str, int, int]] = {}
    for g, group in enumerate(submission.groups):
        parts[id(group)] = ("group", g, 0)
        for c, completion in enumerate(group.completions):
            parts[id(completion.token_ids)] = ("tokens", g, c)
            parts[id(completion.logprobs)] = ("logprobs", g, c)
    return parts


def dump_answer(answer: tuple[str, Any], submission: Submission) -> bytes:
    """The worker's answer pickled with the submission's own parts sent as references (most of its bytes)."""
    parts = _shared_parts(submission)
    out = io.BytesIO()
    pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: parts.get(id(obj))
    pickler.dump(answer)
    return out.getvalue()


def load_answer(data: bytes, submission: Submission) -> tuple[str, Any]:
    """A worker's answer with its references resolved to the hub's copy of the submission (equal values)."""

    def resolve(ref: tuple[str, int, int]) -> Any:
        kind, g, c = ref
        group = submission.groups[g]
        return group if kind == "group" else getattr(group.completions[c], "token_ids" if kind == "tokens" else "logprobs")

    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = resolve
    return unpickler.load()


def _serve(conn: Connection, factory: RulesFactory) -> None:
    """A worker process: build the rules, say so with the reward's name, then check submissions until the hub's
    end of the pipe closes. A RewardError goes back as its message; anything else is the hub's bug."""
    try:
        rules = factory()
    except BaseException:  # noqa: BLE001 -- reported to the hub, which stops
        conn.send(("bug", traceback.format_exc()))
        return
    conn.send(("ready", rules.task.reward_name))
    while True:
        try:
            submission, lease, window = conn.recv()
        except EOFError:
            return
        try:
            conn.send_bytes(dump_answer(("ok", check_submission(submission, lease, rules, window)), submission))
        except RewardError as exc:
            conn.send_bytes(pickle.dumps(("reward", str(exc))))
        except Exception:  # noqa: BLE001 -- our own bug, raised again in the hub
            conn.send_bytes(pickle.dumps(("bug", traceback.format_exc())))


class _Worker:
    """One check process and the hub's end of its pipe. Its blocking methods run in worker threads."""

    def __init__(self, factory: RulesFactory) -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve, args=(child, factory), daemon=True, name="echo2-check")
        self.process.start()
        child.close()

    def ready(self) -> str:
        """The reward's name, once the worker built its rules (blocking)."""
        if not self.conn.poll(WORKER_START_TIMEOUT_S):
            raise RuntimeError(f"a check worker did not start within {WORKER_START_TIMEOUT_S:.0f}s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"a check worker exited before it started (exit code {self.process.exitcode})") from None
        if kind != "ready":
            raise RuntimeError(f"a check worker failed to start:\n{value}")
        return value

    def call(self, job: tuple[Submission, LeaseRecord, VersionWindow], timeout_s: float) -> tuple[str, Any] | None:
        """Send one check and wait for its answer; None when it ran past `timeout_s`. EOFError or OSError: the
        worker died (blocking)."""
        self.conn.send(job)
        if not self.conn.poll(timeout_s):
            return None
        return load_answer(self.conn.recv_bytes(), job[0])

    def stop(self) -> None:
        """Kill the process and reap it (blocking)."""
        self.process.kill()
        self.process.join()
        self.conn.close()


class CheckPool:
    """`procs` check worker processes, each checking one submission at a time; see the module docstring."""

    def __init__(self, factory: RulesFactory, procs: int, timeout_s: float) -> None:
        if procs < 1:
            raise ValueError(f"a check pool needs at least one process, not {procs}")
        self.factory = factory
        self.procs = procs
        self.timeout_s = timeout_s
        self.reward_name = ""
        self._idle_send, self._idle = trio.open_memory_channel(procs)
        self._workers: set[_Worker] = set()
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        """Start the workers, replace the ones lost while it runs, and kill them all when it ends."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for _ in range(self.procs):
                    nursery.start_soon(self._start_worker)
                await trio.sleep_forever()
        finally:
            # A check cancelled as the hub stops replaces its worker (shielded): start none in a closed nursery.
            self._nursery = None
            for worker in self._workers:
                worker.stop()

    async def _start_worker(self) -> None:
        """One more worker, idle once it has built its rules."""
        worker = _Worker(self.factory)
        self._workers.add(worker)
        # Abandoned when the hub stops meanwhile: `run` kills the process, which ends the thread's wait.
        self.reward_name = await trio.to_thread.run_sync(worker.ready, abandon_on_cancel=True)
        self._idle_send.send_nowait(worker)

    async def _replace(self, worker: _Worker) -> None:
        """Kill a lost worker and start another in its place."""
        self._workers.discard(worker)
        await trio.to_thread.run_sync(worker.stop)
        if self._nursery is not None:
            self._nursery.start_soon(self._start_worker)

    async def check(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> list[GroupVerdict]:
        """The verdicts of `check_submission`, computed by a worker: ChecksLost when CHECK_ATTEMPTS workers died
        under it, RewardError when the reward failed or hung."""
        for _ in range(CHECK_ATTEMPTS):
            worker = await self._idle.receive()
            answer = await self._call(worker, (submission, lease, window))
            if answer is not None:
                return self._verdicts(answer, submission)
        raise ChecksLost(f"{CHECK_ATTEMPTS} check workers died checking a submission of lease {submission.lease_id}")

    async def _call(self, worker: _Worker, job: tuple[Submission, LeaseRecord, VersionWindow]) -> tuple[str, Any] | None:
        """The worker's answer, or None when it died under the check (it is replaced). A worker whose check is
        abandoned (the handler cancelled) or that hangs is replaced too: its state is unknown."""
        try:
            answer = await trio.to_thread.run_sync(worker.call, job, self.timeout_s, abandon_on_cancel=True)
        except (EOFError, OSError):
            log.warning("a check worker died (exit code %s): replaced, its check sent again", worker.process.exitcode)
            await self._replace(worker)
            return None
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self._replace(worker)
            raise
        if answer is None:
            await self._replace(worker)
            return ("reward", f"reward {self.reward_name} did not return within {self.timeout_s:g}s (lease "
                              f"{job[1].lease_id}); fix the reward function")
        self._idle_send.send_nowait(worker)
        return answer

    @staticmethod
    def _verdicts(answer: tuple[str, Any], submission: Submission) -> list[GroupVerdict]:
        kind, value = answer
        if kind == "reward":
            raise RewardError(value)
        if kind == "bug":
            raise RuntimeError(f"a check worker failed on a submission of lease {submission.lease_id}:\n{value}")
        return value
