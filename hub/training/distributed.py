"""The learner across processes: PyTorch FSDP2 (`fully_shard`) over torch.distributed, one learner rank each.

Rank 0 is the hub process: libp2p, the store, the scheduler, the broadcaster and learner rank 0.
Ranks 1..N-1 run only the learner: `echo-hub start` again with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, spawned by `--learner-procs N` on one machine or launched by torchrun across
machines. Rank 0 drives: everything that needs every rank (a step, gathering the full weights for
a snapshot or an evaluation, a checkpoint, the end) is a Command it broadcasts; the other ranks
loop on them (`follow`). A step's rows are split across ranks by token count (`partition_rows`);
each rank computes its rows, FSDP2 reduce-scatters the gradients, and each rank steps its shard
of the optimizer state. Backend: NCCL on CUDA, gloo on CPU.

Rendezvous: the ranks of `--learner-procs` (one machine) meet in a FileStore, a file of mode 0600 in the
data dir, and their gloo (or NCCL) sockets listen on loopback only: torch's TCPStore would listen on
every interface of the machine (whatever MASTER_ADDR says), where anyone who reaches the port could
read and overwrite the ranks' addresses. Under torchrun across machines the store is torchrun's: the
README says what to firewall.

Failure: a rank that dies makes the next collective on rank 0 fail (or the hub's watch sees its
process gone); the hub then stops with one line naming the rank, and a restart resumes from the
last checkpoint. The store lives on rank 0 only, so acknowledged groups are never lost.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hub.training.ranks import RANK_STORE_ENV, RankEnv
from shared.memory import release_free_memory

log = logging.getLogger("echo2.hub.distributed")

# A collective waits this long for the other ranks. The followers wait in one for rank 0's next command
# while the hub waits for rollouts, which may take hours; a rank that dies closes its sockets, which
# the others see at once, so the timeout only bounds a rank that hangs.
COLLECTIVE_TIMEOUT_S = 86400.0
JOIN_TIMEOUT_S = 300.0
RANK_POLL_S = 0.5
BROKEN_GROUP_WAIT_S = 3.0
RANK_STORE_FILE = "learner-ranks.store"
LOOPBACK_IFNAME = "lo"


class LearnerRankLost(RuntimeError):
    """A learner rank died or stopped answering: the run cannot go on."""


def partition_rows(tokens: Sequence[int], world: int) -> list[list[int]]:
    """Row indices per rank, balanced by token count: longest rows first, each to the least loaded rank
    (lowest rank on ties); each rank's rows in their original order. The same on every rank."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        parts[rank].append(index)
        loads[rank] += tokens[index]
    return [sorted(part) for part in parts]


@dataclass(frozen=True)
class Collective:
    """This process's place among the learner ranks, and the reductions a step needs (identity when alone)."""

    rank: int = 0
    world: int = 1

    def sum(self, values: Sequence[float]) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
        dist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64, device=_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())


SOLO = Collective()


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def device_for(configured: str, env: RankEnv) -> str:
    """The torch device of one rank: its own GPU (LOCAL_RANK) when the learner runs on CUDA."""
    return f"cuda:{env.local_rank}" if configured.startswith("cuda") else configured


def init_ranks(env: RankEnv, device: str) -> Collective:
    """Join the learner's process group (blocks until every rank has)."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if env.store_file is not None:  # ranks on this machine: a private file, sockets on loopback only
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, LOOPBACK_IFNAME)
        dist.init_process_group(
            backend, store=dist.FileStore(env.store_file, env.world), rank=env.rank, world_size=env.world, timeout=timeout
        )
        return Collective(env.rank, env.world)
    # env:// so that under torchrun the ranks use its agent's store (TORCHELASTIC_USE_AGENT_STORE) rather
    # than rank 0 binding the same port again.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world, timeout=timeout)
    return Collective(env.rank, env.world)


def rank_store(data_dir: Path) -> Path:
    """A fresh rendezvous file for --learner-procs in `data_dir`, readable and writable by this user only (each
    start replaces the last one's)."""
    path = Path(data_dir) / RANK_STORE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def join_ranks(env: RankEnv, device: str, watch: RankWatch | None) -> Collective:
    """init_ranks for rank 0, watching the ranks it spawned meanwhile: one that dies before joining (a bad
    flag, an import error) ends the wait with LearnerRankLost naming it and its log."""
    if watch is None:
        return init_ranks(env, device)
    result: dict[str, object] = {}

    def join() -> None:
        try:
            result["collective"] = init_ranks(env, device)
        except Exception as exc:  # noqa: BLE001 - reported below, on the calling thread
            result["error"] = exc

    thread = threading.Thread(target=join, name="join-learner-ranks", daemon=True)
    thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while thread.is_alive():
        thread.join(RANK_POLL_S)
        gone = watch.dead()
        if gone is None and time.monotonic() > deadline:
            gone = f"the learner ranks did not join within {JOIN_TIMEOUT_S:.0f}s (their logs: {watch.logs[0].parent})"
        if gone is not None:
            watch.kill()
            raise LearnerRankLost(gone)
    if "error" in result:
        watch.kill()
        raise LearnerRankLost(f"joining the learner ranks failed: {result['error']}")
    collective = result["collective"]
    assert isinstance(collective, Collective)
    return collective


def shard(model: torch.nn.Module, bf16: bool) -> None:
    """FSDP2 over every rank: each decoder layer its own unit (all-gathered just before it runs), then the
    rest. bf16: parameters and compute in bf16, gradients reduced and master weights kept in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in no_split:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def full_state_dict(model: torch.nn.Module, keep: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU, gathered a tensor at a time (a collective: every rank calls
    it). Other ranks get an empty dict. `keep`: the names to return (the rest are still gathered, as every
    rank must take part in each all-gather, and dropped)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    wanted = None if keep is None else set(keep)
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0 and (wanted is None or name in wanted):
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


# -- rank 0 drives, the others follow ---------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One operation every rank runs together."""

    kind: str  # "init", "step", "state", "checkpoint", "final", "stop"
    step: int = 0
    groups: tuple[Any, ...] = ()
    path: str = ""
    checkpoint: Any = None  # "init": the CheckpointInfo every rank resumes from (rank 0 chose it)
    lr: float | None = None  # "step": the learning rate of the step (the schedule's)


def broadcast(command: Command | None) -> Command:
    """Rank 0 sends `command`; the others receive it (they pass None)."""
    import torch.distributed as dist

    box: list[Command | None] = [command]
    dist.broadcast_object_list(box, src=0, device=_device() if dist.get_backend() == "nccl" else None)
    received = box[0]
    if received is None:
        raise LearnerRankLost("rank 0 broadcast no command")
    return received


def _die_with_parent() -> None:
    """In a spawned rank, before exec: SIGKILL when the hub process exits (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class RankWatch:
    """The learner processes this hub spawned (--learner-procs): started, watched, stopped."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def spawn(self, world: int, store_file: Path, data_dir: Path, argv: Sequence[str]) -> None:
        """Ranks 1..world-1 on this machine: `echo-hub start` with the same flags, its rank in the environment."""
        data_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                RANK_STORE_ENV: str(store_file),
            }
            path = data_dir / f"learner-rank-{rank}.log"
            with open(path, "wb") as out:  # retention: each start's log replaces the last one's
                # Their own session: a Ctrl-C reaches the hub alone, which then stops them in order. Killed
                # with the hub if it dies, so no rank outlives it waiting in a collective.
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "hub.cli", *argv],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
            self.logs.append(path)

    def dead(self, wait_s: float = 0.0) -> str | None:
        """A line naming the first spawned rank that has exited, if any; `wait_s`: how long to give one to be
        seen gone (a collective fails on its closed sockets a moment before its exit can be reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                    return f"learner rank {rank} {how} (its log: {self.logs[rank - 1]})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.stop()

    def stop(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class RankGroup:
    """Rank 0's handle on the learner: the Learner's own interface, each call run on every rank.

    Calls are serialised (the learner's step, a snapshot's gather and an evaluation's copy may come
    from different threads); a failed collective becomes LearnerRankLost naming the rank that went.
    """

    def __init__(self, learner, watch: RankWatch | None) -> None:
        self.learner = learner
        self.watch = watch
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.learner, name)

    def _run(self, command: Command):
        with self._lock:
            try:
                broadcast(command)
                return run_command(self.learner, command)
            except RuntimeError as exc:
                gone = self.watch.dead(wait_s=BROKEN_GROUP_WAIT_S) if self.watch is not None else None
                if gone is None and not _broken_group(exc):
                    raise  # ours (out of memory, a bug): not a lost rank
                raise LearnerRankLost(gone or f"a learner rank stopped answering ({exc})") from exc

    def train_step(self, groups, step: int, lr: float | None = None):
        return self._run(Command("step", step=step, groups=tuple(groups), lr=lr))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._run(Command("state"))

    def save_sharded(self, path: Path) -> None:
        self._run(Command("checkpoint", path=str(path)))

    def save_final(self, out_dir: Path) -> None:
        self._run(Command("final", path=str(out_dir)))

    def stop(self) -> None:
        """The other ranks leave their loop; a rank already gone (after the last step) is only logged."""
        with self._lock:
            try:
                broadcast(Command("stop"))
            except RuntimeError as exc:
                log.warning("could not tell every learner rank to stop: %s", exc)


def _broken_group(exc: BaseException) -> bool:
    """Whether a failed collective means the process group broke (a peer died or hung up)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("connection", "gloo", "nccl", "timed out", "socket"))


def run_command(learner, command: Command):
    if command.kind == "step":
        return learner.train_step(command.groups, command.step, command.lr)
    if command.kind == "state":
        return learner.state_dict()
    if command.kind == "checkpoint":
        return learner.save_sharded(Path(command.path))
    if command.kind == "final":
        return learner.save_final(Path(command.path))
    raise ValueError(f"unknown learner command {command.kind!r}")


def follow(learner) -> None:
    """Ranks 1..N-1: run rank 0's commands until it says stop (or the group breaks, which raises)."""
    while True:
        command = broadcast(None)
        if command.kind == "stop":
            return
        run_command(learner, command)
        if command.kind == "step":
            release_free_memory()
