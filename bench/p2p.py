"""What the hub's P2P plane sustains on this machine: joins/s, submissions/s, and `echo-node join` -> first accepted work.

How it is measured:
- joins/s and submissions/s: the real HubService (real libp2p host, Noise + Yamux, real SQLite
  store with synchronous=FULL, real lease book, submission checks and replay buffer) runs in a
  child process of its own, so it has one core to itself while the light clients run in this
  process. `--clients` clients, each with its own libp2p host and fresh identity, are created
  first; joins/s is clients / wall time of all of them dialling (Noise handshake) and joining
  concurrently. Then every client answers leases with minimal valid work (1 prompt per lease, 2
  completions of a few tokens, correctly signed) for `--seconds`, each submission asking for the
  next lease as a node does; submissions/s counts submissions the hub accepted (verified,
  re-scored, committed, acknowledged) per wall second. Requests go on the clients' sessions (one
  long-lived stream each, SESSION_PROTOCOL). Then the same again with a lease request before every
  submission (`two_round_trips`, the protocol before 2.1.0), and with a stream per request
  (`stream_per_request`, a client built here that opens a stream each), and with one check process (`one_check_process`:
  for this light reward the hub's default checks in its own thread), side by side.
- hub_cpu_ms_per_submission and hub_cpu_utilization: the hub process's CPU (every thread) over the submit
  phase, per accepted submission and per wall second: a utilization below 1 says the clients, not the hub,
  were the limit. check_procs_cpu_ms_per_submission: its check processes' CPU beside it. hub_cpu_ms_per_heartbeat likewise over the heartbeat phase. fleet_supported_16_cores: the
  nodes a 16-core hub serves at bench/ingest.py's workload (one submission every 4 s, heartbeats at the
  adaptive period) from those two costs, the hub's one trio process doing all of this one's work.
- join -> first accepted: a real `echo-hub start --local-nodes 0 --steps 0` on loopback and one
  real `echo-node join` process (CPU, tiny default model); the time from spawning the node to
  the hub's commit of its first accepted group (the hub's store timestamps), split at the join.

    python bench/p2p.py [--json] [--clients 16] [--seconds 10] [--no-node]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script: the tests' in-process helpers live beside it

from node.client import HubClient
from shared.crypto import Identity
from shared.messages import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Lease,
    LeaseReply,
    Reject,
    Submission,
    SubmitReply,
    SubmittedGroup,
)
from shared.net import request, running_host
from shared.rollout import Completion, SamplingParams
from shared.wire import Message
from testbed.harness import query

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
GROUP_SIZE = 2
STALENESS = 4
REQUEST_TIMEOUT_S = 30.0
SERVE_READY = "SERVING "
ADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)\s*$", re.M)
NODE_TIMEOUT_S = 180.0
HEARTBEAT_SECONDS = 5.0
# The fleet one hub process serves: each node submits every SUBMIT_INTERVAL_S and heartbeats at the default period.
SUBMIT_INTERVAL_S = 20.0
# bench/ingest.py's workload: an RTX 5090-class node hands in one (8k-token) completion every 4 s.
WORKLOAD_SUBMIT_INTERVAL_S = 4.0


# -- the hub side (child process) -------------------------------------------------------------


def serve(data_dir: Path, check_procs: int | None) -> None:
    """Run the real HubService and HubState on loopback (testbed/inproc.py: the factory `echo-hub start` uses,
    with a version counter for the learner) with `check_procs` (None: the hub's default); print the address."""
    from hub.config import HubConfig, LearnerConfig, LeaseConfig
    from shared.default_model import ensure_default_model
    from testbed.inproc import PERMISSIVE_TRUST, inproc_hub

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    model_dir = ensure_default_model(progress=False)
    config = HubConfig(
        learner=LearnerConfig(staleness=STALENESS, prompts_per_step=4096, group_size=GROUP_SIZE, buffer_max_groups=1_000_000),
        sampling=SamplingParams(max_new_tokens=8),
        lease=LeaseConfig(prompts_per_lease=1, lease_timeout_s=60.0, max_inflight_steps=100.0),
        trust=PERMISSIVE_TRUST.model_copy(update={"check_procs": check_procs}),
    )

    async def main() -> None:
        async with inproc_hub(data_dir, model_dir, config) as hub:
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                print(SERVE_READY + hub.addr + " " + hub.config_hash, flush=True)
                async for _ in signals:
                    break

    trio.run(main)


# -- the client side ---------------------------------------------------------------------------


class LightClient(HubClient):
    def __init__(self, host, identity: Identity, hub_addr: str, tokenizer, sessions: bool) -> None:
        super().__init__(host, identity, hub_addr, timeout_s=REQUEST_TIMEOUT_S)
        self.sessions = sessions  # False: a stream per request, for comparison with sessions
        self.tokenizer = tokenizer
        self.submit_latencies: list[float] = []
        self.accepted_submissions = 0
        self.accepted_groups = 0
        self.refused: Counter[str] = Counter()
        self.heartbeats = 0

    def answer(self, lease: Lease) -> Submission:
        groups = []
        for p in lease.prompts:
            word = p.text[:-1]
            completions = []
            for text in (word[::-1], word):
                ids = (*self.tokenizer.encode(text), self.tokenizer.eos_token_id)
                completions.append(
                    Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=0, text=text)
                )
            groups.append(SubmittedGroup(prompt_id=p.prompt_id, completions=tuple(completions)))
        return Submission(lease_id=lease.lease_id, node_id=self.peer_id, groups=tuple(groups))

    async def ask(
        self,
        protocol: str,
        msg: Message,
        reply_type: type[Message],
        timeout_s: float | None = None,
        sign_with: Identity | None = None,
    ):
        if self.sessions:
            return await super().ask(protocol, msg, reply_type, timeout_s, sign_with)
        return await request(
            self.host,
            self.hub_peer_id,
            protocol,
            msg,
            reply_type,
            Reject,
            timeout_s=timeout_s or self.timeout_s,
            sign_with=sign_with,
        )

    async def work_until(self, deadline: float, one_round_trip: bool) -> None:
        """Lease -> submit until `deadline`; with `one_round_trip` each submission asks for the next lease
        (the node's own way), otherwise every lease is a request of its own."""
        pending: LeaseReply | None = None
        while time.monotonic() < deadline:
            reply, pending = pending or await self.lease(0), None
            if not isinstance(reply, LeaseReply) or reply.lease is None:
                self.refused["lease: " + reply.reason[:60]] += 1
                await trio.sleep(0.05)
                continue
            started = time.monotonic()
            submission = self.answer(reply.lease)
            if one_round_trip:
                submission = submission.model_copy(update={"next_lease_for": 0})
            result = await self.submit(submission)
            if isinstance(result, SubmitReply):
                pending = result.next_lease
            if isinstance(result, SubmitReply) and result.accepted:
                self.submit_latencies.append(time.monotonic() - started)
                self.accepted_submissions += 1
                self.accepted_groups += result.accepted
            else:
                self.refused["submit: " + (result.reason[:60] if isinstance(result, Reject) else "nothing accepted")] += 1

    async def beat_until(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            reply = await self.heartbeat(Heartbeat(version_held=0))
            if isinstance(reply, HeartbeatReply):
                self.heartbeats += 1
            else:
                self.refused["heartbeat: " + reply.reason[:60]] += 1


def cpu_s(pid: int) -> float:
    """CPU seconds a process spent so far, all its threads."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def children_cpu_s(pid: int) -> float:
    """CPU seconds the live children of a process spent so far (the hub's check processes)."""
    import psutil

    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        times = child.cpu_times()
        total += times.user + times.system
    return total


async def drive(
    hub_addr: str,
    config_hash: str,
    n_clients: int,
    seconds: float,
    tokenizer,
    progress,
    one_round_trip: bool,
    sessions: bool,
    hub_pid: int,
) -> dict:
    async with AsyncExitStack() as stack:
        hosts = []
        for _ in range(n_clients):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            hosts.append((host, identity))
        join_latencies: list[float] = []
        clients: list[LightClient] = []

        async def join(host, identity) -> None:
            started = time.monotonic()
            client = LightClient(host, identity, hub_addr, tokenizer, sessions)
            await client.connect()
            reply = await client.join(
                JoinRequest(
                    price_per_hour=0.1,
                    hardware="bench",
                    link_bps=1e8,
                    backend="hf",
                    dtype="float32",
                    model_config_hash=config_hash,
                    version_held=0,
                )
            )
            if not isinstance(reply, JoinReply):
                raise RuntimeError(f"join refused: {reply}")
            join_latencies.append(time.monotonic() - started)
            clients.append(client)
            progress("join", len(clients))

        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for host, identity in hosts:
                nursery.start_soon(join, host, identity)
        join_wall = time.monotonic() - started

        started, hub_cpu, checks_cpu = time.monotonic(), cpu_s(hub_pid), children_cpu_s(hub_pid)
        deadline = started + seconds
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(client.work_until, deadline, one_round_trip)

            async def tick() -> None:
                while time.monotonic() < deadline:
                    progress("submit", sum(c.accepted_submissions for c in clients))
                    await trio.sleep(0.5)

            nursery.start_soon(tick)
        work_wall, work_cpu = time.monotonic() - started, cpu_s(hub_pid) - hub_cpu
        checks_cpu = children_cpu_s(hub_pid) - checks_cpu
        # Then heartbeats alone, as fast as the hub answers them: what liveness costs the hub per node.
        started, hub_cpu = time.monotonic(), cpu_s(hub_pid)
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(client.beat_until, started + min(seconds, HEARTBEAT_SECONDS))
        beat_wall, beat_cpu = time.monotonic() - started, cpu_s(hub_pid) - hub_cpu
        beats = sum(c.heartbeats for c in clients)
        latencies = [t for c in clients for t in c.submit_latencies]
        submissions = sum(c.accepted_submissions for c in clients)
        return {
            "clients": n_clients,
            "joins_per_s": round(n_clients / join_wall, 1),
            "join_latency_median_s": round(statistics.median(join_latencies), 4),
            "submissions_per_s": round(submissions / work_wall, 1),
            "groups_per_s": round(sum(c.accepted_groups for c in clients) / work_wall, 1),
            "submit_latency_median_s": round(statistics.median(latencies), 4) if latencies else None,
            "submit_latency_p95_s": round(sorted(latencies)[int(0.95 * (len(latencies) - 1))], 4) if latencies else None,
            "accepted_submissions": submissions,
            "refused_or_no_work": dict(sum((c.refused for c in clients), Counter()).most_common()),
            "seconds": round(work_wall, 2),
            "heartbeats_per_s": round(beats / beat_wall, 1),
            # The hub process's CPU (libp2p, checks, commit: every thread) over the submit phase: below 1 core
            # utilization, the clients were the limit, not the hub.
            "hub_cpu_ms_per_submission": round(work_cpu * 1000 / max(1, submissions), 4),
            "hub_cpu_utilization": round(work_cpu / work_wall, 3),
            # Beside it, not in it: the hub's check processes (--check-procs), which have cores of their own.
            "check_procs_cpu_ms_per_submission": round(checks_cpu * 1000 / max(1, submissions), 4),
            "hub_cpu_ms_per_heartbeat": round(beat_cpu * 1000 / max(1, beats), 4),
        }


def cpu_figures(run: dict) -> dict:
    """A side-by-side run's rates and hub CPU, and the fleet a 16-core hub serves at that cost."""
    out = {
        k: run[k]
        for k in (
            "submissions_per_s",
            "heartbeats_per_s",
            "hub_cpu_ms_per_submission",
            "check_procs_cpu_ms_per_submission",
            "hub_cpu_ms_per_heartbeat",
            "hub_cpu_utilization",
            "refused_or_no_work",
        )
    }
    out["fleet_supported_16_cores"] = fleet_supported_16_cores(run["hub_cpu_ms_per_submission"], run["hub_cpu_ms_per_heartbeat"])
    return out


def fleet_supported(submissions_per_s: float, heartbeats_per_s: float) -> dict:
    """How many nodes keep this hub process busy when each submits every SUBMIT_INTERVAL_S and heartbeats as
    the hub tells it: each request costs the hub 1/rate of its time, measured with no other load. With the
    default config the whole fleet beats at most scheduler.heartbeats_per_s times a second; at a fixed
    2 s period (how the hub did it before) every node adds a heartbeat every 2 s."""
    from hub.config import SchedulerConfig

    config = SchedulerConfig()
    per_submission, per_beat = 1 / submissions_per_s, 1 / heartbeats_per_s
    fixed = int(1 / (per_submission / SUBMIT_INTERVAL_S + per_beat / config.heartbeat_period_s))
    budget = config.heartbeats_per_s
    if fixed <= budget * config.heartbeat_period_s:  # a fleet this small beats at the configured period anyway
        adaptive = fixed
    else:
        adaptive = int(max(0.0, 1 - budget * per_beat) * SUBMIT_INTERVAL_S * submissions_per_s)
    return {
        "submit_interval_s": SUBMIT_INTERVAL_S,
        "nodes": adaptive,
        "heartbeats_per_s_budget": budget,
        "nodes_at_a_fixed_2s_heartbeat": fixed,
        "nodes_without_heartbeats": int(SUBMIT_INTERVAL_S * submissions_per_s),
    }


def fleet_supported_16_cores(submission_ms: float, heartbeat_ms: float) -> int:
    """Nodes a 16-core hub serves at bench/ingest.py's workload (one submission per node every
    WORKLOAD_SUBMIT_INTERVAL_S, the fleet beating scheduler.heartbeats_per_s times a second in all), from this
    hub process's measured CPU: libp2p, framing and the commit stay in its one trio process, so it has one core
    (the checks of these few-token completions are a small part of it)."""
    from hub.config import SchedulerConfig

    left = 1.0 - SchedulerConfig().heartbeats_per_s * heartbeat_ms / 1000
    return int(left / (submission_ms / 1000 / WORKLOAD_SUBMIT_INTERVAL_S))


def service_bench(
    n_clients: int, seconds: float, progress, one_round_trip: bool, sessions: bool = True, check_procs: int | None = None
) -> dict:
    from transformers import AutoTokenizer

    from shared.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
    with tempfile.TemporaryDirectory(prefix="echo2-bench-p2p-") as tmp:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp, *([] if check_procs is None else ["--check-procs", str(check_procs)])],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            line = child.stdout.readline()
            if not line.startswith(SERVE_READY):
                raise RuntimeError(f"hub service did not start: {line!r}")
            hub_addr, config_hash = line[len(SERVE_READY) :].split()
            return trio.run(
                drive, hub_addr, config_hash, n_clients, seconds, tokenizer, progress, one_round_trip, sessions, child.pid
            )
        finally:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def first_work_bench(progress) -> dict:
    """Spawn a real hub and one real node; time node spawn -> join -> first accepted group."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="echo2-bench-join-") as tmp:
        data = Path(tmp) / "hub"
        data.mkdir()
        hub_out = open(data / "hub.out", "wb")
        hub = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hub.cli",
                "start",
                "--data-dir",
                str(data),
                "--listen",
                LOOPBACK,
                "--local-nodes",
                "0",
                "--steps",
                "0",
                "--prompts-per-step",
                "4",
                "--group-size",
                "4",
                "--no-progress",
            ],
            stdout=hub_out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        node = None
        try:
            deadline = time.monotonic() + NODE_TIMEOUT_S
            while not (match := ADDR_RE.search((data / "hub.out").read_text(errors="replace"))):
                if hub.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("hub did not start: " + (data / "hub.out").read_text(errors="replace")[-2000:])
                time.sleep(0.1)
            progress("node", 0)
            spawned = time.time()
            node = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "node.cli",
                    "join",
                    "--hub",
                    match.group(1),
                    "--backend",
                    "hf",
                    "--device",
                    "cpu",
                    "--data-dir",
                    str(Path(tmp) / "node"),
                    "--listen",
                    LOOPBACK,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            while True:
                joined = query(data, "SELECT MIN(at) FROM events WHERE kind = 'join'")[0][0]
                first = query(data, "SELECT MIN(received_at) FROM trajectories WHERE verdict = 'accepted'")[0][0]
                if first is not None:
                    break
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the node delivered no accepted work")
                time.sleep(0.1)
            return {
                "join_to_first_accepted_s": round(first - spawned, 2),
                "node_spawn_to_joined_s": round(joined - spawned, 2),
                "joined_to_first_accepted_s": round(first - joined, 2),
            }
        finally:
            for proc in (node, hub):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            hub_out.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    parser.add_argument("--clients", type=int, default=16, help="light clients joining and submitting concurrently")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the clients submit")
    parser.add_argument("--no-node", action="store_true", help="skip the real `echo-node join` measurement")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--check-procs", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.check_procs)
        return

    from rich.progress import Progress

    with Progress(disable=args.json, transient=True) as bar:
        task = bar.add_task("p2p bench", total=None)

        def progress(phase: str, n: int) -> None:
            bar.update(task, description=f"{phase}: {n}")

        result = service_bench(args.clients, args.seconds, progress, one_round_trip=True)
        # Side by side, the same hub with every lease asked for on its own (how nodes did it before 2.1.0).
        two = service_bench(args.clients, args.seconds, progress, one_round_trip=False)
        result["two_round_trips"] = {k: two[k] for k in ("submissions_per_s", "submit_latency_median_s", "refused_or_no_work")}
        # And with a stream per request (what sessions save), and with one check process (what the
        # hub's default spares this light reward), side by side.
        per = service_bench(args.clients, args.seconds, progress, one_round_trip=True, sessions=False)
        result["stream_per_request"] = cpu_figures(per)
        pool = service_bench(args.clients, args.seconds, progress, one_round_trip=True, check_procs=1)
        result["one_check_process"] = cpu_figures(pool)
        result["fleet_supported"] = fleet_supported(result["submissions_per_s"], result["heartbeats_per_s"])
        result["fleet_supported_16_cores"] = fleet_supported_16_cores(
            result["hub_cpu_ms_per_submission"], result["hub_cpu_ms_per_heartbeat"]
        )
        if not args.no_node:
            result.update(first_work_bench(progress))
    result["cpus"] = os.cpu_count()
    result["method"] = (
        "HubService in its own process; light libp2p clients in another; joins/s = clients / wall time of "
        "concurrent dial+join; submissions/s = accepted lease answers (1 prompt x 2 completions, signed, "
        "re-scored, committed with synchronous=FULL) per wall second, each client looping submit (asking for "
        "the next lease in it), on sessions; two_round_trips: the same with a lease request before every "
        "submission; stream_per_request: the same with a stream per request instead of sessions; "
        "join->first accepted = real echo-node process spawn to the hub's commit of its first accepted group"
    )
    if args.json:
        print(json.dumps(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="P2P plane")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for key, value in result.items():
            if key != "method":
                table.add_row(key, str(value))
        Console().print(table)
        print(result["method"])


if __name__ == "__main__":
    main()
