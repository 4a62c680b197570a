"""Where tool calls and environment steps run: worker processes that hold each rollout's environment and run
what a node's model turn asked for, each call within a wall clock, a CPU and a memory limit, with no network.

A tool is the operator's code, but its arguments come from a model turn a node sent, and a node chooses what
"the model" said. So a call may be made to loop, allocate, or reach out, and what it costs must be bounded
and charged to that one rollout:
- CPU: the call is interrupted past `cpu_s` of CPU (shared/tasks/budget.py's timer, as reward checks are);
- memory: the worker's address space is capped (RLIMIT_AS) at what it held after loading the tools plus
  `memory_bytes`, so an allocation past it fails in the call and the worker lives on;
- network: an audit hook refuses sockets and child processes in the worker; a call that tried is ended
  even if the tool caught the refusal;
- wall clock: a call still running after `wall_s` (blocked in C, asleep) has its worker killed and replaced.
  The environments that lived in that worker are lost, and their rollouts end too (RolloutEnd.ENVIRONMENT_LOST):
  a worker is the unit one hostile call can cost, for one bounded time.
A call the tool itself refuses (it raises) is an ordinary answer the model reads, `{"error": ...}` as in TRL.
Each owner (a node) has one call running at a time, so one node's calls wait behind each other, not everyone's.

This bounds what hostile arguments make the operator's code do; it is not a jail for hostile code (a tool
that means harm can use ctypes). Linux only: RLIMIT_AS is what bounds the memory.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import trio

from hub.agents.toolset import load_toolset
from shared.signals import children_ignore_ctrl_c
from shared.tasks.budget import OverBudget, cpu_budget
from shared.tools import TOOL_ARGUMENT_MAX_BYTES, TOOL_RESULT_MAX_CHARS, RolloutEnd

# A worker imports the operator's tools (and what they import) before its first call.
WORKER_START_TIMEOUT_S = 120.0
# Audit events that reach outside the worker: a socket, or a process that could open one.
_OUTSIDE_EVENTS = frozenset(
    {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system"}
    | {"os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"}
)
_CONTEXT = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may cost, and how many environments one worker holds."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_bytes: int = 512 * 1024 * 1024
    environments_per_worker: int = 256


@dataclass(frozen=True)
class ToolOutcome:
    """A call's answer (`text`: what the model reads, an error included) or the reason its rollout ends."""

    text: str | None = None
    end: RolloutEnd | None = None
    error: bool = False  # the tool raised: `text` holds {"error": ...} for the model


class SandboxFull(Exception):
    """Every worker holds its bound of environments: no rollout that needs one can start now."""


class SandboxBroken(Exception):
    """A worker could not load the tools: the operator's code fails before any node's call (stops the run)."""


def _refuse_outside(event: str, _args: tuple[Any, ...]) -> None:
    if event in _OUTSIDE_EVENTS:
        global _outside_tried
        _outside_tried = True
        raise PermissionError(f"tools get no network or processes ({event})")


_outside_tried = False


def _cap_memory(extra_bytes: int) -> None:
    """The address space capped at what the worker holds now plus `extra_bytes` (Linux: /proc and RLIMIT_AS)."""
    import resource

    with open("/proc/self/status") as status:
        held_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    cap = held_kib * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= TOOL_RESULT_MAX_CHARS else text[:TOOL_RESULT_MAX_CHARS] + " …[cut]"


def _run(func: Any, args: dict[str, Any], cpu_s: float) -> tuple[str, Any]:
    """("ok", value), ("error", text) or ("end", RolloutEnd): one call of the operator's code under the limits."""
    global _outside_tried
    _outside_tried = False
    try:
        with cpu_budget(cpu_s):
            value = func(**args)
    except OverBudget:
        return "end", RolloutEnd.TOOL_CPU
    except MemoryError:
        return "end", RolloutEnd.TOOL_MEMORY
    except Exception as exc:  # noqa: BLE001 -- the tool refused its arguments: an answer the model reads
        if _outside_tried:
            return "end", RolloutEnd.TOOL_NETWORK
        return "error", json.dumps({"error": f"{type(exc).__name__}: {_clip(exc)}"})
    if _outside_tried:
        return "end", RolloutEnd.TOOL_NETWORK
    return "ok", value


class _Serving:
    """A worker's side: the toolset, the environments it holds, one request at a time."""

    def __init__(self, tool_specs: Sequence[str], environment_spec: str | None, limits: SandboxLimits) -> None:
        self.toolset = load_toolset(tool_specs, environment_spec, schemas=False)
        self.limits = limits
        self.environments: dict[str, Any] = {}

    def serve(self, request: tuple[Any, ...]) -> tuple[str, Any]:
        kind, key, *rest = request
        if kind == "open":
            return self._open(key, rest[0])
        if kind == "close":
            self.environments.pop(key, None)
            return "ok", None
        environment = self.environments.get(key) if key is not None else None
        if key is not None and environment is None:
            return "end", RolloutEnd.ENVIRONMENT_LOST
        if kind == "reward":
            assert environment is not None, "a reward asked of a rollout without an environment"
            status, value = _run(environment.get_reward, {}, self.limits.cpu_s)
            return (status, float(value)) if status == "ok" else (status, value)
        name, arguments = rest
        func = self.toolset.functions.get(name)
        if func is None and environment is not None and name in self.toolset.environment_methods:
            func = getattr(environment, name)
        if func is None:
            return "error", json.dumps({"error": f"Tool {name} not found."})
        status, value = _run(func, arguments, self.limits.cpu_s)
        return (status, _clip(value)) if status == "ok" else (status, value)

    def _open(self, key: str, row: dict[str, Any]) -> tuple[str, Any]:
        if len(self.environments) >= self.limits.environments_per_worker:
            return "full", None
        factory = self.toolset.environment
        assert factory is not None, "open without an environment_factory"
        status, environment = _run(factory, {}, self.limits.cpu_s)
        if status != "ok":
            return status, environment
        status, observation = _run(environment.reset, row, self.limits.cpu_s)
        if status == "ok":
            self.environments[key] = environment
            return status, None if observation is None else _clip(observation)
        return status, observation


def _worker_main(conn: Connection, tool_specs: Sequence[str], environment_spec: str | None, limits: SandboxLimits) -> None:
    """A sandbox worker: load the tools, shut the way out, cap the memory, then serve requests until EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the hub stops its workers itself
    try:
        serving = _Serving(tool_specs, environment_spec, limits)
    except ValueError as exc:
        conn.send(("failed", str(exc)))
        return
    sys.addaudithook(_refuse_outside)
    _cap_memory(limits.memory_bytes)
    conn.send(("ready", (serving.toolset.names, serving.toolset.environment_reward)))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            reply = serving.serve(request)
        except MemoryError:  # past the cap outside a call (pickling a huge answer): the call's doing all the same
            reply = ("end", RolloutEnd.TOOL_MEMORY)
        conn.send(reply)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    lock: trio.Lock = field(default_factory=trio.Lock)
    environments: set[str] = field(default_factory=set)
    waiting: int = 0


class ToolSandbox:
    """The hub's side: `procs` workers, environments pinned to one each, calls bounded by `limits`."""

    def __init__(self, tool_specs: Sequence[str], environment_spec: str | None, limits: SandboxLimits, procs: int = 2) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxBroken("the tool sandbox needs Linux (its memory cap is RLIMIT_AS)")
        self.tool_specs = tuple(tool_specs)
        self.environment_spec = environment_spec
        self.limits = limits
        self.procs = procs
        self.workers: list[_Worker] = []
        self.pinned: dict[str, _Worker] = {}
        self.lost: set[str] = set()
        self.owners: dict[str, trio.Lock] = {}
        self.ends: dict[RolloutEnd, int] = {}
        self.restarts = 0
        self.names: tuple[str, ...] = ()  # the tools, as the workers loaded them
        self.environment_reward = False  # whether the environment has get_reward()

    async def start(self) -> None:
        self.workers = [await trio.to_thread.run_sync(self._spawn) for _ in range(self.procs)]

    def stop(self) -> None:
        for worker in self.workers:
            worker.process.kill()
            worker.process.join()
            worker.conn.close()
        self.workers = []

    def _spawn(self) -> _Worker:
        ours, theirs = _CONTEXT.Pipe()
        with children_ignore_ctrl_c():
            process = _CONTEXT.Process(
                target=_worker_main,
                args=(theirs, self.tool_specs, self.environment_spec, self.limits),
                name="echo2-tool-sandbox",
                daemon=True,
            )
            process.start()
        theirs.close()
        if not ours.poll(WORKER_START_TIMEOUT_S):
            process.kill()
            raise SandboxBroken(f"a tool worker did not load the tools within {WORKER_START_TIMEOUT_S:.0f} s")
        try:
            status, detail = ours.recv()
        except EOFError:
            raise SandboxBroken(f"a tool worker died loading the tools (exit code {process.exitcode})") from None
        if status != "ready":
            process.join()
            raise SandboxBroken(detail)
        self.names, self.environment_reward = detail
        return _Worker(process, ours)

    async def open_environment(self, key: str, row: dict[str, Any], owner: str) -> ToolOutcome:
        """A new environment for rollout `key`, reset with the dataset row: its observation (text, or None) or why
        the rollout ends. SandboxFull when every worker holds its bound."""
        roomy = [w for w in self.workers if len(w.environments) < self.limits.environments_per_worker]
        if not roomy:
            raise SandboxFull(f"{len(self.pinned)} environments open, {self.limits.environments_per_worker} a worker")
        worker = min(roomy, key=lambda w: (len(w.environments), w.waiting))
        worker.environments.add(key)
        self.pinned[key] = worker
        outcome = await self._ask(worker, ("open", key, row), owner)
        if outcome.end is not None or outcome.error:
            self._forget(key)
        return outcome

    async def call(self, key: str | None, name: str, arguments: dict[str, Any], owner: str) -> ToolOutcome:
        """Tool `name` with `arguments` (parsed from a model turn: hostile), in rollout `key`'s environment if
        it has one."""
        if len(json.dumps(arguments)) > TOOL_ARGUMENT_MAX_BYTES:
            return self._ended(RolloutEnd.ARGUMENTS_TOO_LARGE)
        if key is not None and key in self.lost:
            return self._ended(RolloutEnd.ENVIRONMENT_LOST)
        worker = self.pinned.get(key) if key is not None else None
        if worker is None:
            worker = self._least_busy()
        return await self._ask(worker, ("call", key if key in self.pinned else None, name, arguments), owner)

    async def reward(self, key: str, owner: str) -> ToolOutcome:
        """The environment's get_reward() (its text holds the float), or why the rollout ends."""
        if key in self.lost or key not in self.pinned:
            return self._ended(RolloutEnd.ENVIRONMENT_LOST)
        return await self._ask(self.pinned[key], ("reward", key), owner)

    async def close_environment(self, key: str, owner: str) -> None:
        """Rollout `key` is over (done, truncated or its lease ended): its environment goes."""
        worker = self.pinned.get(key)
        self._forget(key)
        self.lost.discard(key)
        if worker is not None and worker in self.workers:
            await self._ask(worker, ("close", key), owner)

    def _forget(self, key: str) -> None:
        worker = self.pinned.pop(key, None)
        if worker is not None:
            worker.environments.discard(key)

    def _ended(self, end: RolloutEnd) -> ToolOutcome:
        self.ends[end] = self.ends.get(end, 0) + 1
        return ToolOutcome(end=end)

    async def _ask(self, worker: _Worker, request: tuple[Any, ...], owner: str) -> ToolOutcome:
        owner_lock = self.owners.setdefault(owner, trio.Lock())
        try:
            async with owner_lock:
                while True:
                    worker.waiting += 1
                    try:
                        async with worker.lock:
                            if worker in self.workers:
                                return await self._exchange(worker, request)
                    finally:
                        worker.waiting -= 1
                    # Killed while this request waited: the environments it held are gone with it.
                    kind, key = request[0], request[1]
                    if kind == "close":
                        return ToolOutcome()
                    if key is not None:
                        return self._ended(RolloutEnd.ENVIRONMENT_LOST)
                    worker = self._least_busy()
        finally:
            if not owner_lock.locked() and owner_lock.statistics().tasks_waiting == 0:
                self.owners.pop(owner, None)

    def _least_busy(self) -> _Worker:
        if not self.workers:
            raise SandboxBroken("no tool worker is left: each one killed could not be started again")
        return min(self.workers, key=lambda w: w.waiting)

    async def _exchange(self, worker: _Worker, request: tuple[Any, ...]) -> ToolOutcome:
        # Shielded (bounded by wall_s): a request cancelled after its send would leave its answer in the pipe, and
        # every later request of this worker would read the one before it.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(worker.conn.send, request)
            answered = await trio.to_thread.run_sync(worker.conn.poll, self.limits.wall_s)
            try:
                reply = await trio.to_thread.run_sync(worker.conn.recv) if answered else None
            except (EOFError, OSError):  # it died under the call (a native crash, an exit, the OOM killer)
                await self._replace(worker)
                return self._ended(RolloutEnd.TOOL_CRASHED)
            if reply is None:
                await self._replace(worker)
                return self._ended(RolloutEnd.TOOL_WALL_TIME)
        status, value = reply
        if status == "end":
            return self._ended(RolloutEnd(value))
        if status == "full":
            raise SandboxFull("a worker holds its bound of environments")
        if status == "error":
            return ToolOutcome(text=value, error=True)
        return ToolOutcome(text=None if value is None else str(value))

    async def _replace(self, worker: _Worker) -> None:
        """Kill `worker` (a call ran past its wall clock, or it died) and start another; its environments are lost.
        A worker that cannot be started again leaves the pool one short (SandboxBroken once none is left)."""
        worker.process.kill()
        await trio.to_thread.run_sync(worker.process.join)
        worker.conn.close()
        for key in worker.environments:
            self.pinned.pop(key, None)
            self.lost.add(key)
        worker.environments.clear()
        self.restarts += 1
        self.workers.remove(worker)
        self.workers.append(await trio.to_thread.run_sync(self._spawn))


@asynccontextmanager
async def open_sandbox(
    tool_specs: Sequence[str], environment_spec: str | None, limits: SandboxLimits, procs: int = 2
) -> AsyncIterator[ToolSandbox]:
    """A started sandbox, its workers killed on the way out."""
    sandbox = ToolSandbox(tool_specs, environment_spec, limits, procs)
    await sandbox.start()
    try:
        yield sandbox
    finally:
        sandbox.stop()
