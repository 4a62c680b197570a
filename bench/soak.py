"""Soak: a real hub and real nodes for M minutes at long completions, with hub SIGKILLs and node churn; what grows
per learner step (store, data dir, hub RSS, open fds, logs) and whether an acknowledged group is ever lost.

Usage: python bench/soak.py [--minutes M] [--min-steps N] [--json] [--kills 3] [--nodes 3] [--work-dir DIR] [--skip-resume]

The model is a random-init one whose special tokens' logits are pinned at 0 while the others spread with a std of 4
nats, so EOS is all but never sampled and completions run to --max-new-tokens (320): ~300 tokens on average. The
task scores the share of a completion's characters found in its prompt (testbed.tasks:OverlapTask), so groups
carry advantages and the learner trains for real.

The hub runs as `echo-hub start` does from a shell (its own interpreter, under the allocator it picks: shared/memory.py),
not forked from the test server. It is SIGKILLed `--kills` times, evenly over the run's first half, and restarted on
the same data dir and port, so that its last life spans the second half; over the whole run a node at a time is
stopped (SIGINT) and started again on its data dir. Growth per step is the slope of a least-squares line over the samples of the run's
second half:
- store_bytes_per_step: the store's pages in use (dbstat) less the payloads table's. Payloads are kept for a
  window of versions and go (retain), the WAL is cut back at each checkpoint and FREE_PAGES_SLACK free pages are
  kept: bounded parts whose swings (several MB as groups come and go) a slope over minutes cannot see through;
- store_file_bytes_per_step: hub.sqlite with its WAL, those swings included;
- data_dir_bytes_per_step: every file under the hub's data dir.
The hub's RSS slope is fitted over its last life, the first 30% of it left out (warm-up: the model loads,
allocators fill): a life of a few minutes swings by tens of MB, so the short lives before the kills measure noise.
Each sample's RSS is the hub's resting one: the least of the readings taken every RSS_POLL_S since the previous
sample. A single reading lands inside a learner step or between two at random, and a step holds its activations
(~130 MB here) while it runs: two runs of the same code fitted 18 and 34 MB per 1k steps over single readings, as
more of them happened to land mid-step late in the life, while the resting RSS rose by about 10. What is kept
between steps is what would grow without bound; hub_rss_peak_mb is the largest reading of the last life.

acknowledged_lost: groups a node was told were accepted (its SubmitReply, summed from node_status.json at each
node's SIGINT stop) beyond what the hub's books credit it with at the end. payload_bytes_per_step: groups received
x their mean payload JSON bytes (sampled from the store's payloads while they are kept) / steps. log_bytes_max:
the largest log or captured-output file in any data dir; node_dir_bytes_max: the largest node data dir at the end. resume_s_large_store: bench/resume.py's figure (null when
that benchmark is not there, or with --skip-resume).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from shared.layout import HUB_STORE_FILE, NODE_STATUS_FILE
from shared.messages import NodeView
from testbed import forked
from testbed.harness import HubProc, free_port, query, start_hub

MAX_NEW_TOKENS = 320
LOGIT_STD_NATS = 4.0  # the non-special tokens' logit spread: EOS at 0 is then ~e^-10 as likely as the top token
SAMPLE_S = 3.0
RSS_POLL_S = 0.1  # readings of the hub's RSS between two samples: their least is the resting RSS, their most the peak
WARMUP_SHARE = 0.3  # of the hub's last life, left out of the RSS slope
KILLS_WITHIN = 0.5  # share of the run the hub kills happen in: the rest is its last life
HUB_TOML = """
[learner]
checkpoint_every = 10
[scheduler]
heartbeat_period_s = 1.0
heartbeat_timeout_s = 6.0
"""


def build_model(out: Path) -> Path:
    """A random-init qwen2 (hidden 64, 2 layers, untied head) that never stops early, with room for long completions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.tasks.reverse import ReverseTask
    from testbed.models import random_model_dir

    random_model_dir(out, hidden=64, layers=2, tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompts = [p.text for p in ReverseTask().sample(random.Random(0), 8)]
    with torch.no_grad():
        std = float(model(**tokenizer(prompts, return_tensors="pt", padding=True)).logits.std())
        model.lm_head.weight.mul_(LOGIT_STD_NATS / std)
        model.lm_head.weight[tokenizer.all_special_ids] = 0.0
    model.config.max_position_embeddings = 1024
    model.save_pretrained(out)
    return out


@dataclass
class SoakNode:
    """One volunteer, stopped and started again on its data dir; `acked` sums what its finished lives were told."""

    index: int
    data_dir: Path
    out_dir: Path
    process: forked.Forked | None = None
    acked: int = 0

    def start(self, hub_addr: str, model: Path) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / NODE_STATUS_FILE).unlink(missing_ok=True)  # a life that writes none is counted as 0
        argv = [
            "join",
            "--hub",
            hub_addr,
            "--price",
            "0.35",
            "--backend",
            "hf",
            "--device",
            "cpu",
            "--data-dir",
            str(self.data_dir),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--model",
            str(model),
        ]
        # The output beside the data dir: the data dir holds only what the node writes itself.
        out = self.out_dir / f"node-{self.index}-{time.time_ns()}.out"
        self.process = forked.spawn("node.cli", argv, str(out), {**os.environ, "PYTHONUNBUFFERED": "1"})

    def stop(self) -> None:
        """SIGINT (the node writes its status once more), then add what this life was told was accepted."""
        process = self.process
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:
            view = NodeView.model_validate_json((self.data_dir / NODE_STATUS_FILE).read_text())
        except (OSError, ValueError):
            return
        self.acked += view.tallies.accepted


@dataclass
class Sample:
    t: float
    life: int
    step: int
    store_bytes: int
    store_file_bytes: int
    data_bytes: int
    rss_mb: float | None  # resting: the least reading since the previous sample
    fds: int | None
    rss_peak_mb: float | None = None  # the most


@dataclass
class Soak:
    work: Path
    minutes: float
    kills: int
    say: Callable[[str], None]
    samples: list[Sample] = field(default_factory=list)
    payload_means: list[float] = field(default_factory=list)
    life: int = 0
    killed: int = 0

    @property
    def hub_dir(self) -> Path:
        return self.work / "hub"

    def sample(self, hub: HubProc, started: float, rss_readings: list[float]) -> Sample:
        steps = query(self.hub_dir, "SELECT COALESCE(MAX(step), 0) FROM steps")[0][0]
        count, total = query(self.hub_dir, "SELECT COUNT(*), COALESCE(SUM(LENGTH(group_json)), 0) FROM payloads")[0]
        if count:
            self.payload_means.append(total / count)
        kept = query(
            self.hub_dir,
            "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name != 'payloads' AND name NOT IN"
            " (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'payloads')",
        )[0][0]
        rss, fds = process_figures(hub.process.pid)
        readings = [*rss_readings, *([] if rss is None else [rss])]
        sample = Sample(
            time.monotonic() - started,
            self.life,
            steps,
            kept,
            store_bytes(self.hub_dir),
            tree_bytes(self.hub_dir),
            min(readings, default=None),
            fds,
            max(readings, default=None),
        )
        self.samples.append(sample)
        return sample


def _sizes(paths) -> int:
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_size
        except OSError:  # deleted since it was listed (a rotated snapshot, a checkpoint, the WAL)
            pass
    return total


def store_bytes(hub_dir: Path) -> int:
    return _sizes(hub_dir.glob(f"{HUB_STORE_FILE}*"))


def tree_bytes(root: Path) -> int:
    """Bytes of the files under `root`, walked while the hub writes and deletes in it (a directory that vanishes
    mid-walk is skipped: os.walk ignores errors unless told otherwise)."""
    return _sizes(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)


def process_figures(pid: int) -> tuple[float | None, int | None]:
    """(RSS in MB, open fds) of a live process; (None, None) once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None, None
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kb / 1024, fds


def rss_readings(pid: int, seconds: float) -> list[float]:
    """The process's RSS in MB every RSS_POLL_S for `seconds` (none once it is gone)."""
    readings, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        rss, _ = process_figures(pid)
        if rss is not None:
            readings.append(rss)
        time.sleep(RSS_POLL_S)
    return readings


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x; None without two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def settled_rss(samples: list[Sample]) -> list[tuple[float, float]]:
    """(step, RSS MB) of the hub's last life, its first WARMUP_SHARE left out (the model loads, allocators fill)."""
    last = max((s.life for s in samples), default=0)
    points = [(s.step, s.rss_mb) for s in samples if s.life == last and s.rss_mb is not None]
    return points[int(len(points) * WARMUP_SHARE) :]


def growth_figures(samples: list[Sample], duration_s: float) -> dict:
    """Bytes per step over the second half, the hub's RSS slope over its last life, its fds first and last."""
    second_half = [s for s in samples if s.t >= duration_s / 2]
    rss = slope(settled_rss(samples))
    with_fds = [s for s in samples if s.fds is not None and s.step > 0]
    return {
        "store_bytes_per_step": slope([(s.step, s.store_bytes) for s in second_half]),
        "store_file_bytes_per_step": slope([(s.step, s.store_file_bytes) for s in second_half]),
        "data_dir_bytes_per_step": slope([(s.step, s.data_bytes) for s in second_half]),
        "hub_rss_slope_mb_per_1k_steps": None if rss is None else rss * 1000,
        "hub_rss_peak_mb": max((s.rss_peak_mb for s in samples if s.life == samples[-1].life and s.rss_peak_mb), default=None),
        "hub_fds_first": with_fds[0].fds if with_fds else None,
        "hub_fds_last": with_fds[-1].fds if with_fds else None,
    }


def log_bytes_max(roots: list[Path]) -> int:
    sizes = [
        p.stat().st_size
        for root in roots
        for pattern in ("*.log*", "node.out*", "node.err*")
        for p in root.rglob(pattern)
        if p.is_file()
    ]
    return max(sizes, default=0)


def resume_figure(skip: bool) -> tuple[float | None, str | None]:
    """bench/resume.py's resume_s_large_store, or None and why not."""
    script = REPO_ROOT / "bench" / "resume.py"
    if skip:
        return None, "--skip-resume"
    if not script.exists():
        return None, "bench/resume.py is not there yet"
    done = subprocess.run([sys.executable, str(script), "--json"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["resume_s_large_store"], None


def plan(duration_s: float, kills: int, churns: int) -> list[tuple[float, str]]:
    """When each hub kill and node restart happens: kill k at k/(kills+1) of the run's first KILLS_WITHIN,
    restart j at (2j+1)/(2 churns+2) of the run."""
    events = [(KILLS_WITHIN * duration_s * (k + 1) / (kills + 1), "kill") for k in range(kills)]
    events += [(duration_s * (2 * j + 1) / (2 * churns + 2), "churn") for j in range(churns)]
    return sorted(events)


def run(args: argparse.Namespace, say) -> dict:
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="echo2-soak-"))
    say(f"work dir {work}; building the long-completion model")
    model = build_model(work / "model")
    (work / "hub.toml").parent.mkdir(parents=True, exist_ok=True)
    (work / "hub.toml").write_text(HUB_TOML)
    hub_args = (
        "--local-nodes",
        "0",
        "--steps",
        "0",
        "--model",
        str(model),
        "--task",
        "testbed.tasks:OverlapTask",
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--staleness",
        "2",
        "--config",
        str(work / "hub.toml"),
        # What grows is measured, not learning: at the default lr the random model's policy collapses within
        # ~200 steps into equal completions with equal rewards, and the learner stops stepping.
        "--lr",
        "1e-6",
    )
    soak = Soak(work, args.minutes, args.kills, say)
    port = free_port()
    hub = start_hub(soak.hub_dir, *hub_args, port=port, command_line=True)
    nodes = [SoakNode(i, work / f"node-{i}", work) for i in range(args.nodes)]
    for node in nodes:
        node.start(hub.addr, model)
    duration_s = args.minutes * 60
    events = plan(duration_s, args.kills, max(2, round(args.minutes)))
    rng = random.Random(0)
    readings: list[float] = []
    started = time.monotonic()
    try:
        # Past M minutes, on until the learner made --min-steps: a short run on a busy machine still has steps to
        # measure growth over (the kills and churn stay within the M minutes).
        while (now := time.monotonic() - started) < duration_s or (soak.samples and soak.samples[-1].step < args.min_steps):
            while events and events[0][0] <= now:
                _, kind = events.pop(0)
                if kind == "kill":
                    hub = kill_and_restart(soak, hub, hub_args, port)
                    readings = []  # the killed process's
                else:
                    node = rng.choice(nodes)
                    node.stop()
                    node.start(hub.addr, model)
                    say(f"node {node.index} stopped and started again")
            s = soak.sample(hub, started, readings)
            say(
                f"{s.t:5.0f}s step {s.step}, store {s.store_bytes / 1e6:.2f} MB, data dir {s.data_bytes / 1e6:.1f} MB, "
                f"hub rss {s.rss_mb or 0:.0f} MB resting, {s.rss_peak_mb or 0:.0f} peak, fds {s.fds}"
            )
            readings = rss_readings(hub.process.pid, SAMPLE_S)
    finally:
        ran_s = time.monotonic() - started
        code = hub.stop(timeout_s=60)
        for node in nodes:
            node.stop()
    return figures(soak, nodes, ran_s, code, args.skip_resume)


def kill_and_restart(soak: Soak, hub: HubProc, hub_args: tuple[str, ...], port: int) -> HubProc:
    hub.process.send_signal(signal.SIGKILL)
    hub.process.wait(timeout=30)
    soak.killed += 1
    soak.life += 1
    restarted_at = time.monotonic()
    hub = start_hub(soak.hub_dir, *hub_args, port=port, command_line=True)
    soak.say(f"hub SIGKILLed ({soak.killed}/{soak.kills}); serving again after {time.monotonic() - restarted_at:.1f}s")
    return hub


def figures(soak: Soak, nodes: list[SoakNode], duration_s: float, hub_exit: int, skip_resume: bool) -> dict:
    hub_dir = soak.hub_dir
    steps = query(hub_dir, "SELECT COALESCE(MAX(step), 0) FROM steps")[0][0]
    tokens = query(hub_dir, "SELECT COALESCE(SUM(tokens), 0), COUNT(*) FROM steps")[0]
    received = query(hub_dir, "SELECT COUNT(*) FROM trajectories")[0][0]
    credited = dict(query(hub_dir, "SELECT peer_id, accepted FROM nodes"))
    peers = [NodeView.model_validate_json((n.data_dir / NODE_STATUS_FILE).read_text()).peer_id for n in nodes]
    lost = sum(max(0, n.acked - credited.get(peer, 0)) for n, peer in zip(nodes, peers))
    group_bytes = sum(soak.payload_means) / len(soak.payload_means) if soak.payload_means else None
    completions = tokens[1] * 4 * 4  # prompts per step x group size
    resume_s, resume_note = resume_figure(skip_resume)
    result = {
        "minutes": soak.minutes,
        "steps": steps,
        "completion_tokens_mean": tokens[0] / completions if completions else None,
        "payload_bytes_per_step": received * group_bytes / steps if steps and group_bytes else None,
        **growth_figures(soak.samples, duration_s),
        "kills": soak.killed,
        "acknowledged_lost": lost,
        "acknowledged": sum(n.acked for n in nodes),
        "resume_s_large_store": resume_s,
        "log_bytes_max": log_bytes_max([hub_dir, *(n.data_dir for n in nodes)]),
        "node_dir_bytes_max": max(tree_bytes(n.data_dir) for n in nodes),
        "hub_exit": hub_exit,
    }
    if resume_note:
        result["resume_note"] = resume_note
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the fleet runs (default 20)")
    parser.add_argument(
        "--min-steps", type=int, default=0, help="past --minutes, run on until the learner made this many steps (default 0)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress stays on stderr)")
    parser.add_argument("--kills", type=int, default=3, help="hub SIGKILLs, spread over the run (default 3)")
    parser.add_argument("--nodes", type=int, default=3, help="volunteer nodes (default 3)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the data dirs here (default: a temp dir)")
    parser.add_argument("--skip-resume", action="store_true", help="leave out bench/resume.py's large-store resume")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def say(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} soak: {message}", file=sys.stderr, flush=True)

    result = run(args, say)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32} {value}")


if __name__ == "__main__":
    main()
