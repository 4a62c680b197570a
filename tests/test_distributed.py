"""The learner sharded across processes (hub/training/distributed.py): rows split by tokens, two gloo ranks that train
like one process, checkpoints that move between world sizes, and a real `echo-hub start --learner-procs 2`
whose nodes install its snapshots, that stops with one line when rank 1 is killed and resumes."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hub.config import HubConfig, LearnerConfig
from hub.training.checkpoint import latest_checkpoint, save_checkpoint
from hub.training.distributed import Collective, init_ranks, partition_rows, rank_store
from hub.training.learner import Learner
from hub.training.ranks import RankEnv
from shared.layout import NODE_STATUS_FILE
from shared.messages import NodeView
from shared.model_identity import load_model_identity
from testbed import forked
from testbed.harness import query, wait_until
from tests.test_learner import synthetic_groups

SAMPLING = HubConfig().sampling
CFG = LearnerConfig(prompts_per_step=4, group_size=4, lr=1e-5, dtype="float32", micro_batch_tokens=64)
TOLERANCE = 1e-5


def test_rows_go_to_the_least_loaded_rank_longest_first():
    # tokens 9, 1, 5, 5, 2: 9 -> r0; 5 (row 2) -> r1; 5 (row 3) -> r1 (5 < 9); 2 -> r0? no: r1 has 10, r0 9 -> r0;
    # 1 -> r1 (10 vs 11).
    assert partition_rows([9, 1, 5, 5, 2], 2) == [[0, 4], [1, 2, 3]]
    assert partition_rows([3, 3, 3], 1) == [[0, 1, 2]]
    assert partition_rows([4], 3) == [[0], [], []]
    assert partition_rows([], 2) == [[], []]
    with pytest.raises(ValueError):
        partition_rows([1], 0)
    assert Collective().sum([1.5, 2.0]) == [1.5, 2.0] and Collective().max(3.0) == 3.0


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def listening_sockets() -> list[str]:
    """The addresses this process listens on (TCP)."""
    import psutil

    return [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def two_rank_run(rank: int, store: str, model_dir: str, work: str) -> None:
    """Rank `rank` of 2: resume the one-process checkpoint, take step 2, save a sharded checkpoint; rank 0 also
    records what its process listens on once the group is up."""
    torch.set_num_threads(1)
    collective = init_ranks(RankEnv(rank, 2, rank, store_file=store), "cpu")
    if rank == 0:
        (Path(work) / "listening.txt").write_text("\n".join(listening_sockets()))
    checkpoint = latest_checkpoint(Path(work) / "single")
    learner = Learner(load_model_identity(Path(model_dir)), CFG, SAMPLING, checkpoint, collective, "cpu")
    learner.train_step(synthetic_groups(seed=2), 2)
    state = learner.state_dict()
    learner.save_sharded(Path(work) / "sharded" / "step-00000002" / "dcp")
    if rank == 0:
        torch.save(state, Path(work) / "two-rank-weights.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def test_two_ranks_train_like_one_process_and_checkpoints_move_between_world_sizes(default_model_dir, tmp_path):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    single = Learner(load_model_identity(default_model_dir), CFG, SAMPLING)
    single.train_step(synthetic_groups(seed=1), 1)
    save_checkpoint(tmp_path / "single", 1, 1, single.model, single.tokenizer, single.optimizer)
    single.train_step(synthetic_groups(seed=2), 2)
    expected = weights(single)

    # One-process checkpoint resumed on two ranks, which then take the same step 2.
    store = rank_store(tmp_path)
    assert store.stat().st_mode & 0o777 == 0o600
    mp.spawn(two_rank_run, args=(str(store), str(default_model_dir), str(tmp_path)), nprocs=2)
    # Untrusted peers, round three, item 9: torch's TCPStore listened on every interface (its keys, the ranks'
    # gloo addresses, listed, written and deleted from another interface). The ranks meet in a 0600 file now,
    # and what they listen on is loopback only.
    listening = (tmp_path / "listening.txt").read_text().split()
    assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening
    gathered = torch.load(tmp_path / "two-rank-weights.pt")
    assert "lm_head.weight" not in gathered  # tied to the embedding: one name, as a snapshot carries it
    assert max_diff(gathered, expected) <= TOLERANCE

    # Their sharded checkpoint resumed by one process: the same weights, the optimizer state of two steps.
    (tmp_path / "sharded" / "step-00000002" / "state.json").write_text('{"step": 2, "version": 2}')
    info = latest_checkpoint(tmp_path / "sharded")
    assert info.sharded
    resumed = Learner(load_model_identity(default_model_dir), CFG, SAMPLING, info)
    assert max_diff(gathered, weights(resumed)) == 0.0
    steps = {int(s["step"]) for s in resumed.optimizer.state_dict()["state"].values()}
    assert steps == {2}


def gpu_rank(rank: int, world: int, store: str, model_dir: str, work: str) -> None:
    """One NCCL rank: the learner sharded in bf16 (FSDP2 MixedPrecisionPolicy) takes one step."""
    device = f"cuda:{rank}"
    collective = init_ranks(RankEnv(rank, world, rank, store_file=store), device)
    cfg = CFG.model_copy(update={"dtype": "bfloat16", "device": "cuda"})
    learner = Learner(load_model_identity(Path(model_dir)), cfg, SAMPLING, collective=collective, device=device)
    # Alone (world 1), state_dict() gives the live tensors, which the step changes in place: copy them.
    before = {name: tensor.detach().to("cpu", copy=True) for name, tensor in learner.state_dict().items()}
    stats = learner.train_step(synthetic_groups(seed=1), 1)
    after = learner.state_dict()
    masters = {p.dtype for p in learner.model.parameters()}
    if rank == 0:
        torch.save({"before": before, "after": after, "masters": masters, "loss": stats.loss}, Path(work) / "gpu.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_ranks_train_in_bf16_with_fp32_masters(default_model_dir, tmp_path):
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    mp.spawn(gpu_rank, args=(world, str(rank_store(tmp_path)), str(default_model_dir), str(tmp_path)), nprocs=world)
    result = torch.load(tmp_path / "gpu.pt")
    assert result["masters"] == {torch.float32}
    assert all(t.dtype == torch.float32 for t in result["after"].values())
    assert torch.isfinite(torch.tensor(result["loss"]))
    assert max_diff(result["after"], result["before"]) > 0


# -- a real hub with two learner processes ------------------------------------------------------------


def start_hub(data_dir: Path, *args: str) -> forked.Forked:
    out = data_dir.parent / f"{data_dir.name}-{time.time_ns()}.out"
    argv = [
        "start",
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--no-progress",
        "--learner-procs",
        "2",
        *args,
    ]
    return forked.spawn("hub.cli.main", argv, str(out), {**os.environ, "PYTHONUNBUFFERED": "1"})


def steps_done(data_dir: Path) -> int:
    try:
        return query(data_dir, "SELECT MAX(step) FROM steps")[0][0] or 0
    except sqlite3.OperationalError:  # the hub has not created its store yet
        return 0


def rank_pid(data_dir: Path) -> int:
    """The spawned learner rank 1 of the hub on `data_dir` (RANK=1 in its environment)."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(data_dir).encode() in cmdline and b"\0RANK=1\0" in b"\0" + environ:
            return pid
    raise LookupError("no learner rank 1")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--lora-rank", "8"), ("--lora-rank 8 with 2 learner processes", "drop --learner-procs")),
        (("--optimizer", "adamw8bit"), ("--optimizer adamw8bit with 2 learner processes", "drop --learner-procs")),
    ],
)
def test_what_a_sharded_learner_cannot_do_is_refused_in_one_line(tmp_path, flags, words):
    data = tmp_path / "hub"
    result = subprocess.run(
        [sys.executable, "-m", "hub.cli", "start", "--data-dir", str(data), "--learner-procs", "2", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and all(w in line for w in words), line
    assert not data.exists()


@pytest.mark.slow
def test_a_hub_with_two_learner_processes_trains_stops_when_a_rank_dies_and_resumes(tmp_path):
    data = tmp_path / "hub"
    # One local node and a checkpoint every 4 steps: what the test needs, at half the CPU of the defaults.
    config = tmp_path / "hub.toml"
    config.write_text("[learner]\ncheckpoint_every = 4\n")
    hub = start_hub(data, "--steps", "200", "--local-nodes", "1", "--config", str(config))
    try:

        def installed() -> bool:
            """The node holds a version the sharded learner published after v0 (node.log says installs once a
            minute: its status file says the version it holds)."""
            held = []
            for path in (data / "nodes").glob(f"*/{NODE_STATUS_FILE}"):
                with contextlib.suppress(OSError, ValueError):
                    held.append(NodeView.model_validate_json(path.read_text()).version_held)
            return any(v >= 3 for v in held)

        wait_until(lambda: steps_done(data) >= 6, 180, "6 steps of the sharded learner", poll_s=0.5)
        wait_until(installed, 60, "the node to install v3 or v6 of the sharded learner", poll_s=0.5)
        wait_until(lambda: (data / "checkpoints" / "step-00000004" / "dcp").is_dir(), 60, "the step-4 checkpoint")
        os.kill(rank_pid(data), signal.SIGKILL)
        assert hub.wait(timeout=60) == 1
    finally:
        if hub.poll() is None:
            hub.kill()
            hub.wait()
    out = next(tmp_path.glob("hub-*.out")).read_text()
    last = out.strip().splitlines()[-1]
    assert "learner rank 1 was killed by signal 9" in last and "resume from checkpoint step" in last, out[-3000:]
    assert "Traceback" not in out
    step = query(data, "SELECT MAX(step) FROM steps")[0][0]
    waiting = {
        r[0]
        for r in query(
            data, "SELECT id FROM trajectories WHERE verdict = 'accepted' AND consumed_step IS NULL AND discard_reason IS NULL"
        )
    }

    hub = start_hub(data, "--steps", str(step + 3), "--local-nodes", "1", "--config", str(config))
    try:
        assert hub.wait(timeout=180) == 0
    finally:
        if hub.poll() is None:
            hub.kill()
    resumed = sorted(tmp_path.glob("hub-*.out"))[-1].read_text() if len(list(tmp_path.glob("hub-*.out"))) > 1 else ""
    assert f"resuming the run in {data} at step {step}" in resumed, resumed[-3000:]
    assert query(data, "SELECT MAX(step) FROM steps")[0][0] == step + 3
    # Every group acknowledged before the kill was trained on after it, or is still waiting, or aged out.
    rows = {r[0]: r[1:] for r in query(data, "SELECT id, consumed_step, discard_reason FROM trajectories")}
    assert all(rows[i][0] is None or rows[i][0] > step for i in waiting if rows[i][1] is None)
