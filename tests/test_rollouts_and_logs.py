"""What a long run leaves on disk besides its store: --save-rollouts' Parquet shards (read back with datasets and
pandas, capped), size-rotated logs and captured output, and a node's data dir that holds a bounded set of files."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from hub.training.rollout_export import RolloutExport, rollout_columns, shard_name, shards_to_delete
from shared.logs import PeerLogLimiter, RotatingFile, capture_output, rotate_files
from shared.rollout import Completion, Group
from testbed.harness import start_hub

ROOT = Path(__file__).resolve().parent.parent


def completion(tokens: tuple[int, ...], version: int, text: str) -> Completion:
    return Completion(token_ids=tokens, logprobs=tuple(-1.0 for _ in tokens), finish_reason="stop", version=version, text=text)


def group(pid: str, version: int, rewards: tuple[float, ...], node: str = "node-a") -> Group:
    return Group(
        prompt_id=pid,
        prompt_text=f"reverse {pid}",
        version=version,
        rewards=rewards,
        node_id=node,
        completions=tuple(completion((i + 1, 2), version, f"c{i}") for i in range(len(rewards))),
    )


def test_rollout_columns_carry_the_learners_advantages_and_the_steps_staleness() -> None:
    # Rewards (0, 1): mean 0.5, sample std sqrt(0.5); the learner divides by std + 1e-4.
    step_groups = [group("p1", 4, (0.0, 1.0)), group("p2", 3, (1.0, 1.0), node="node-b")]
    columns = rollout_columns(step_groups, step=6, staleness=(1, 2), advantage_scale="group")
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert columns["advantage"] == pytest.approx([-a, a, 0.0, 0.0])
    assert columns["reward"] == [0.0, 1.0, 1.0, 1.0]
    assert columns["step"] == [6] * 4
    assert columns["staleness"] == [1, 1, 2, 2]
    assert columns["version"] == [4, 4, 3, 3]
    assert columns["node"] == ["node-a", "node-a", "node-b", "node-b"]
    assert columns["prompt"] == ["reverse p1", "reverse p1", "reverse p2", "reverse p2"]
    assert columns["completion"] == ["c0", "c1", "c0", "c1"]
    assert columns["token_ids"] == [[1, 2], [2, 2], [1, 2], [2, 2]]
    assert rollout_columns(step_groups, 6, (1, 2), "none")["advantage"] == pytest.approx([-0.5, 0.5, 0.0, 0.0])


def test_oldest_shards_go_first_and_the_newest_always_stays() -> None:
    sizes = [("a", 10), ("b", 20), ("c", 30)]
    assert shards_to_delete(sizes, 60) == []
    assert shards_to_delete(sizes, 50) == ["a"]
    assert shards_to_delete(sizes, 30) == ["a", "b"]
    assert shards_to_delete(sizes, 5) == ["a", "b"]
    assert shards_to_delete([], 5) == []


def test_saved_shards_load_with_datasets_and_pandas_and_stay_under_the_cap(tmp_path: Path) -> None:
    import datasets
    import pandas

    out = tmp_path / "rollouts"
    export = RolloutExport(out, max_bytes=10**9, advantage_scale="group")
    for step in (1, 2, 3):
        export.save([group(f"p{step}", step - 1, (0.0, 1.0)), group(f"q{step}", step - 1, (1.0, 0.0))], step, (0, 0))
    frame = pandas.read_parquet(out)
    assert sorted(frame["step"]) == [1] * 4 + [2] * 4 + [3] * 4
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert loaded.num_rows == 12
    assert sorted(set(loaded["prompt_id"])) == ["p1", "p2", "p3", "q1", "q2", "q3"]
    assert loaded.features["token_ids"].feature.dtype == "int32"
    one = (out / shard_name(3)).stat().st_size
    RolloutExport(out, max_bytes=int(2.5 * one), advantage_scale="group").save([group("p4", 3, (0.0, 1.0))], 4, (0,))
    assert sorted(p.name for p in out.iterdir()) == [shard_name(3), shard_name(4)]


def test_a_shard_cut_short_by_a_crash_is_never_read_and_is_removed(tmp_path: Path) -> None:
    out = tmp_path / "rollouts"
    out.mkdir()
    (out / f".{shard_name(7)}.tmp").write_bytes(b"PAR1 half a shard")
    RolloutExport(out, max_bytes=10**9, advantage_scale="group")
    assert list(out.iterdir()) == []


def test_rotating_file_keeps_backups_and_each_file_under_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "node.out"
    sink = RotatingFile(path, max_mb=1000 / 2**20, backups=2)
    for i in range(100):
        sink.write(f"line {i:03d} of output that would grow\n".encode())
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.out", "node.out.1", "node.out.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    assert path.read_text().splitlines()[-1] == "line 099 of output that would grow"
    rotate_files(path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.out.1", "node.out.2"]


def test_a_peers_lines_are_held_back_within_the_window_and_counted_on_its_clock() -> None:
    now = [100.0]
    limiter = PeerLogLimiter(window_s=10.0, clock=lambda: now[0])
    assert limiter.tail("peer") == ""  # the first is logged
    assert limiter.tail("peer") is None and limiter.tail("peer") is None  # then held back
    assert limiter.tail("other") == ""  # each key on its own
    now[0] += 9.999
    assert limiter.tail("peer") is None
    now[0] += 0.001
    assert limiter.tail("peer") == " (3 more since the last such line)"


def test_held_back_lines_are_counted_in_the_things_they_report() -> None:
    """The hub's refusal lines: one per node and reason a minute, what was held back counted in groups."""
    now = [0.0]
    limiter = PeerLogLimiter(window_s=60.0, clock=lambda: now[0])
    assert limiter.tail("node/tokens", count=2) == ""
    now[0] = 30.0
    assert limiter.tail("node/tokens", count=3) is None and limiter.tail("node/tokens", count=4) is None
    assert limiter.tail("node/late", count=5) == ""  # another reason of the same node has its own minute
    now[0] = 60.0
    assert limiter.tail("node/tokens", count=1) == " (7 more since the last such line)"
    assert limiter.tail("node/tokens") is None  # and the next minute starts from that line


def test_captured_output_is_rotated(tmp_path: Path) -> None:
    """A forked child's stdout and stderr through capture_output: prints and a line on stderr land, rotated."""
    import multiprocessing

    path = tmp_path / "node.out"
    child = multiprocessing.get_context("fork").Process(target=_print_lines, args=(path,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["node.out", "node.out.1"]
    text = "".join((tmp_path / name).read_text() for name in reversed(files))
    assert text.count("printed") == 300 and text.endswith("a line on stderr\n")
    assert all(p.stat().st_size <= 4000 for p in tmp_path.iterdir())


def _print_lines(path: Path) -> None:
    capture_output(path, max_mb=4000 / 2**20, backups=1)
    for i in range(300):
        print(f"printed line {i:04d}")
    print("a line on stderr", file=sys.stderr)


LOG_CAP_BYTES = 20_000
# What a node's data dir may hold (README: the retention rule of each), a local node's output included.
NODE_FILES = {"node.key", "node.lock", "node_status.json", "node.log", "node.log.1", "node.out", "node.out.1", "snapshots"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_run_saves_its_rollouts_and_keeps_logs_and_node_dirs_bounded(tmp_path: Path) -> None:
    import datasets

    data, out = tmp_path / "data", tmp_path / "rollouts"
    hub = start_hub(
        data,
        "--local-nodes",
        "1",
        "--steps",
        "4",
        "--staleness",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--save-rollouts",
        str(out),
        "--log-max-mb",
        str(LOG_CAP_BYTES / 2**20),
        "--log-backups",
        "1",
        "--log-level",
        "debug",
    )
    assert hub.process.wait(timeout=280) == 0, hub.output()[-3000:]
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert sorted(set(loaded["step"])) == [1, 2, 3, 4]
    assert loaded.num_rows == 4 * 4 * 4
    (node_dir,) = (data / "nodes").iterdir()
    assert set(loaded["node"]) == {_peer_id(node_dir)}
    # Step t trains the policy of version t - 1: a group of version v is t - 1 - v versions old.
    assert loaded["staleness"] == [t - 1 - v for t, v in zip(loaded["step"], loaded["version"])]
    # kappa 1: a snapshot every step; the node holds the one it installed (and one in flight), no more.
    assert {p.name for p in node_dir.iterdir()} <= NODE_FILES
    assert len(list((node_dir / "snapshots").iterdir())) <= 2
    logs = [*data.glob("hub.log*"), *node_dir.glob("node.log*")]
    assert (data / "hub.log.1").exists(), "a debug log of a short run passes 20 kB: it rotated"
    assert len(list(data.glob("hub.log*"))) == 2
    assert all(p.stat().st_size <= LOG_CAP_BYTES for p in logs), [(p.name, p.stat().st_size) for p in logs]


def _peer_id(node_dir: Path) -> str:
    from shared.crypto import Identity

    return Identity.load_or_create(node_dir / "node.key").peer_id


def test_a_start_prints_none_of_torchaos_wheel_warnings() -> None:
    """torchao's wheel warns that its CUDA kernels and triton do not load, and torch that torchao registers its enums
    as pytree constants, whenever transformers imports it: importing our entry points first keeps those lines out of
    every start (the kernels' and triton's only on a machine with no CUDA); torchao's other warnings, and torch's
    about another package's enum, stay."""
    import torch

    code = (
        "import logging\n"
        "logging.basicConfig()  # as hub.log's handler: torchao.kernel.intmm's NullHandler hides its line otherwise\n"
        "import node.cli, hub.cli.main, transformers, torchao, torchao.kernel.intmm, enum\n"
        "logging.getLogger('torchao').warning('kept')\n"
        "class Theirs(enum.Enum):\n    A = 1\n"
        "logging.getLogger('torch.utils._pytree').warning('%s is an Enum subclass and is now supported', Theirs)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "Failed to load" not in done.stderr and "Detected no triton" not in done.stderr, done.stderr[-2000:]
    assert "kept" in done.stderr
    enum_warnings = [line for line in done.stderr.splitlines() if "is an Enum subclass" in line]
    assert len(enum_warnings) == 1 and "Theirs" in enum_warnings[0], done.stderr[-2000:]
