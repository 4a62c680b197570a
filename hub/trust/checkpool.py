"""Where a submission's per-group checks run: in a pool of worker processes, or in a thread of the hub's own.

The checks (`check_submission`: token ids decoded, lengths, EOS, vocabulary, the reward recomputed) need no
shared state and are most of a submission's CPU, so `CheckPool` spreads them over `--check-procs` processes,
each started (spawned: no torch state forked) with the rules built by a factory of its own. The trio process
keeps framing, admission, the lease book, copy detection and the commit. A worker's verdicts come back with
the submission's token and log-prob tuples as references into the hub's own copy (`dump_answer`), so the
hub process unpickles texts and rewards, not the completions it sent.

A worker that dies under a check is replaced and the check sent to another one; after CHECK_ATTEMPTS deaths
the submission is refused as busy (the node sends it again): never lost, never accepted unchecked.

The reward runs on text the node chose, so what it costs is the node's. A group whose reward spends more
than its CPU budget is rejected (shared/tasks/budget.py: interrupted in a worker's main thread, measured in
a thread); a submission whose checks run past `check_timeout_s` of wall clock has every group rejected (a
worker is killed and replaced; a thread cannot be killed, so its node gets no other check until it ends).
Each node checks one submission at a time (`NodeShares`): what one node's submissions cost delays that
node only, and the others take the remaining workers in turn. When the reward raises, or runs past its
budget, `RewardProbe` asks whether the reward itself is broken by running it on the operator's own probe
(the start check's made-up completions): broken, it is a RewardError that stops the run; sound, the work
is rejected and counted against its node (a few nodes' text never stops a run).
"""

from __future__ import annotations

import io
import logging
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection
from typing import Any, Protocol

import trio

from hub.records.leases import LeaseRecord
from hub.training.tasks import check_reward
from hub.trust.submissions import (
    REASON_OVER_BUDGET,
    REASON_REWARD_FAILED,
    GroupVerdict,
    SubmissionRules,
    VersionWindow,
    charged_verdicts,
    check_submission,
)
from shared.logs import PeerLogLimiter
from shared.messages import Submission
from shared.signals import children_ignore_ctrl_c
from shared.tasks.base import RewardError

log = logging.getLogger("echo2.hub.checks")

# A check sent to this many workers that all died is refused as busy: the submission, not chance, kills them.
CHECK_ATTEMPTS = 3
# A worker imports the task, its reward and the tokenizer before its first check.
WORKER_START_TIMEOUT_S = 300.0
# A probe the reward passed stands this long: nodes cannot make the hub probe on every submission.
PROBE_VALID_S = 60.0
_CONTEXT = multiprocessing.get_context("spawn")

RulesFactory = Callable[[], SubmissionRules]


class ChecksLost(Exception):
    """Every worker a submission's checks were sent to died: not the node's fault, nor known to be its doing."""


class PoolStopped(Exception):
    """The hub is stopping: the pool killed its workers under the checks still running (a clean stop, not a crash)."""


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


def probe_reward(rules: SubmissionRules) -> str | None:
    """The operator's own probe of the reward (the start check, hub/training/tasks.py): None when it passes,
    else its one line."""
    try:
        check_reward(rules.task, rules.group_size)
    except RewardError as exc:
        return str(exc)
    return None


def _hung(reward: str, timeout_s: float) -> str:
    """The one line for a reward that did not return on the operator's own probe."""
    return (
        f"reward {reward} did not return within {timeout_s:g}s on nodes' work nor on the start check's own "
        "completions; fix the reward function"
    )


class RewardProbe:
    """Whose fault a reward's failure or overrun on a node's work is (see the module docstring)."""

    def __init__(self, probe: Callable[[], Awaitable[str | None]]) -> None:
        self._probe = probe  # the probe's failure, None when it passed
        self._passed_at = -math.inf
        self._lock = trio.Lock()
        self._log = PeerLogLimiter()

    async def blame(self, node_id: str, what: str) -> None:
        """Return when the node's text is to blame for `what` (the reward passes the probe); raise RewardError,
        which stops the run, when the reward fails the probe too."""
        async with self._lock:  # one probe at a time: the others wait for its verdict
            if trio.current_time() - self._passed_at >= PROBE_VALID_S:
                problem = await self._probe()
                if problem is not None:
                    raise RewardError(problem)
                self._passed_at = trio.current_time()
        if self._log.allow(node_id, time.monotonic())[0]:
            log.warning("%s on the work of %s; the reward passes its probe: counted against the node", what, node_id)


class NodeShares:
    """Each node checks one submission at a time: its next waits for its last, never for another node's."""

    def __init__(self) -> None:
        self._turns: dict[str, trio.Lock] = {}

    @asynccontextmanager
    async def turn(self, node_id: str) -> AsyncIterator[None]:
        lock = self._turns.setdefault(node_id, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._turns.pop(node_id, None)


async def settled(verdicts: list[GroupVerdict], submission: Submission, probe: RewardProbe) -> list[GroupVerdict]:
    """Verdicts whose groups ran the reward past its budget stand once the probe says the reward is sound."""
    if any(v.reason == REASON_OVER_BUDGET for v in verdicts):
        await probe.blame(submission.node_id, "the reward ran past its CPU budget")
    return verdicts


async def reward_failed(exc: RewardError, submission: Submission, probe: RewardProbe) -> list[GroupVerdict]:
    """The reward raised on a submission: its groups rejected, once the probe says the reward is sound."""
    await probe.blame(submission.node_id, str(exc))
    return charged_verdicts(submission, REASON_REWARD_FAILED)


class _Taken:
    """A thread limiter's token taken before a check's clock started (waiting for a thread is no node's doing),
    handed to `trio.to_thread.run_sync`, which gives it back when the thread ends, abandoned or not."""

    def __init__(self, limiter: trio.CapacityLimiter, borrower: object) -> None:
        self.limiter, self.borrower = limiter, borrower

    async def acquire_on_behalf_of(self, _borrower: object) -> None:
        """Already taken."""

    def release_on_behalf_of(self, _borrower: object) -> None:
        self.limiter.release_on_behalf_of(self.borrower)


class ThreadChecks:
    """The checks in worker threads of the hub's own process (`--check-procs 0`): a thread cannot be killed, so
    a check past `timeout_s` is abandoned, its groups rejected, and its node's checks refused until it ends.
    Its own thread limiters: abandoned checks never hold the threads the store's writes need, nor the one the
    operator's probe runs in (nodes' overruns cannot make the probe time out)."""

    def __init__(self, rules: SubmissionRules, timeout_s: float, threads: int | None = None) -> None:
        self.rules = rules
        self.timeout_s = timeout_s
        self.limiter = trio.CapacityLimiter(threads or max(2, len(os.sched_getaffinity(0))))
        self._probe_limiter = trio.CapacityLimiter(1)
        self.shares = NodeShares()
        self.probe = RewardProbe(self._probe)
        self._lock = threading.Lock()
        self._overrunning: set[str] = set()  # nodes with an abandoned check still running

    async def run(self) -> None:
        """Nothing to start or supervise."""
        await trio.sleep_forever()

    def _checked(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> Any:
        """check_submission in the thread, its outcome as a value; the node is free once it returns."""
        try:
            return check_submission(submission, lease, self.rules, window)
        except RewardError as exc:
            return exc
        finally:
            with self._lock:
                self._overrunning.discard(submission.node_id)

    async def check(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> list[GroupVerdict]:
        node = submission.node_id
        async with self.shares.turn(node):
            with self._lock:
                if node in self._overrunning:
                    return charged_verdicts(submission, REASON_OVER_BUDGET)
                self._overrunning.add(node)  # until the thread returns (`_checked`), abandoned or not
            outcome: Any = None
            borrower = object()
            try:
                await self.limiter.acquire_on_behalf_of(borrower)
            except BaseException:
                with self._lock:
                    self._overrunning.discard(node)
                raise
            with trio.move_on_after(self.timeout_s):
                # trio takes any limiter (its stubs ask for a CapacityLimiter)
                outcome = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                    self._checked,
                    submission,
                    lease,
                    window,
                    abandon_on_cancel=True,
                    limiter=_Taken(self.limiter, borrower),  # type: ignore[arg-type]
                )
        if outcome is None:
            await self.probe.blame(node, f"the reward's checks ran past {self.timeout_s:g}s")
            return charged_verdicts(submission, REASON_OVER_BUDGET)
        if isinstance(outcome, RewardError):
            return await reward_failed(outcome, submission, self.probe)
        return await settled(outcome, submission, self.probe)

    async def _probe(self) -> str | None:
        with trio.move_on_after(self.timeout_s):
            return await trio.to_thread.run_sync(  # type: ignore[call-arg]
                probe_reward, self.rules, abandon_on_cancel=True, limiter=self._probe_limiter
            )
        return _hung(self.rules.task.reward_name, self.timeout_s)


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
    out = io.BytesIO()
    _RefPickler(out, _shared_parts(submission)).dump(answer)
    return out.getvalue()


class _RefPickler(pickle.Pickler):
    """Pickles the submission's own parts (by object identity) as references."""

    def __init__(self, out: io.BytesIO, parts: dict[int, tuple[str, int, int]]) -> None:
        super().__init__(out, pickle.HIGHEST_PROTOCOL)
        self.parts = parts

    def persistent_id(self, obj: Any) -> tuple[str, int, int] | None:
        return self.parts.get(id(obj))


class _RefUnpickler(pickle.Unpickler):
    """Resolves _RefPickler's references to the hub's copy of the submission."""

    def __init__(self, data: bytes, submission: Submission) -> None:
        super().__init__(io.BytesIO(data))
        self.submission = submission

    def persistent_load(self, ref: tuple[str, int, int]) -> Any:
        kind, g, c = ref
        group = self.submission.groups[g]
        return group if kind == "group" else getattr(group.completions[c], "token_ids" if kind == "tokens" else "logprobs")


def load_answer(data: bytes, submission: Submission) -> tuple[str, Any]:
    """A worker's answer with its references resolved to the hub's copy of the submission (equal values)."""
    return _RefUnpickler(data, submission).load()


def _serve(conn: Connection, factory: RulesFactory) -> None:
    """A worker process: build the rules, say so with the reward's name, then check submissions (or probe the
    reward: a job of None) until the hub's end of the pipe closes. A RewardError goes back as its message;
    anything else is the hub's bug."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the hub stops us (our pipe closes) on Ctrl-C; see children_ignore_ctrl_c
    try:
        rules = factory()
    except BaseException:  # noqa: BLE001 -- reported to the hub, which stops
        conn.send(("bug", traceback.format_exc()))
        return
    conn.send(("ready", rules.task.reward_name))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            conn.send_bytes(pickle.dumps(("probe", probe_reward(rules))))
            continue
        submission, lease, window = job
        try:
            conn.send_bytes(dump_answer(("ok", check_submission(submission, lease, rules, window)), submission))
        except RewardError as exc:
            conn.send_bytes(pickle.dumps(("reward", str(exc))))
        except Exception:  # noqa: BLE001 -- our own bug, raised again in the hub
            conn.send_bytes(pickle.dumps(("bug", traceback.format_exc())))


Job = tuple[Submission, LeaseRecord, VersionWindow] | None  # None: probe the reward


class _Worker:
    """One check process and the hub's end of its pipe. Its blocking methods run in worker threads."""

    def __init__(self, factory: RulesFactory) -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve, args=(child, factory), daemon=True, name="echo2-check")
        with children_ignore_ctrl_c():
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

    def call(self, job: Job, timeout_s: float) -> tuple[str, Any] | None:
        """Send one job and wait for its answer; None when it ran past `timeout_s`. EOFError or OSError: the
        worker died (blocking)."""
        self.conn.send(job)
        if not self.conn.poll(timeout_s):
            return None
        data = self.conn.recv_bytes()
        return pickle.loads(data) if job is None else load_answer(data, job[0])

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
        self.shares = NodeShares()
        self.probe = RewardProbe(self._probe)
        self._idle_send, self._idle = trio.open_memory_channel(procs)
        self._workers: set[_Worker] = set()
        self._nursery: trio.Nursery | None = None
        self._stopped = False  # `run` ended and killed the workers: a check they die under is no worker's failure

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
            self._stopped = True
            for worker in self._workers:
                worker.stop()

    async def _start_worker(self) -> None:
        """One more worker, idle once it has built its rules."""
        worker = _Worker(self.factory)
        self._workers.add(worker)
        # Abandoned when the hub stops meanwhile: `run` kills the process, which ends the thread's wait.
        self.reward_name = await trio.to_thread.run_sync(worker.ready, abandon_on_cancel=True)  # type: ignore[call-arg]
        self._idle_send.send_nowait(worker)

    async def _replace(self, worker: _Worker) -> None:
        """Kill a lost worker and start another in its place."""
        self._workers.discard(worker)
        await trio.to_thread.run_sync(worker.stop)
        if self._nursery is not None:
            self._nursery.start_soon(self._start_worker)

    async def check(self, submission: Submission, lease: LeaseRecord, window: VersionWindow) -> list[GroupVerdict]:
        """The verdicts of `check_submission`, computed by a worker: ChecksLost when CHECK_ATTEMPTS workers died
        under it, RewardError when the reward fails its probe too (see the module docstring)."""
        async with self.shares.turn(submission.node_id):
            for _ in range(CHECK_ATTEMPTS):
                answer = await self._call(await self._idle.receive(), (submission, lease, window))
                if answer is not None:
                    break
            else:
                raise ChecksLost(f"{CHECK_ATTEMPTS} check workers died checking a submission of lease {submission.lease_id}")
        kind, value = answer
        if kind == "timeout":
            await self.probe.blame(submission.node_id, f"the reward's checks ran past {self.timeout_s:g}s")
            return charged_verdicts(submission, REASON_OVER_BUDGET)
        if kind == "reward":
            return await reward_failed(RewardError(value), submission, self.probe)
        if kind == "bug":
            raise RuntimeError(f"a check worker failed on a submission of lease {submission.lease_id}:\n{value}")
        return await settled(value, submission, self.probe)

    async def _probe(self) -> str | None:
        """The operator's probe of the reward in a worker: None when it passed (a worker that dies under it is
        replaced and the probe sent again)."""
        while True:
            answer = await self._call(await self._idle.receive(), None)
            if answer is not None:
                kind, value = answer
                return _hung(self.reward_name, self.timeout_s) if kind == "timeout" else value

    async def _call(self, worker: _Worker, job: Job) -> tuple[str, Any] | None:
        """The worker's answer (("timeout", None) past the timeout), or None when it died under the job (it is
        replaced). A worker whose job is abandoned (the handler cancelled) or that hangs is replaced too: its
        state is unknown."""
        try:
            answer = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                worker.call, job, self.timeout_s, abandon_on_cancel=True
            )
        except (EOFError, OSError):
            if self._stopped:  # killed by `run` on the way out (the handlers' tasks outlive it): said by no line
                raise PoolStopped("the hub is stopping") from None
            log.warning("a check worker died (exit code %s): replaced, its check sent again", worker.process.exitcode)
            await self._replace(worker)
            return None
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self._replace(worker)
            raise
        if answer is None:
            await self._replace(worker)
            return ("timeout", None)
        self._idle_send.send_nowait(worker)
        return answer
