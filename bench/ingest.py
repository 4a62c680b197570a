"""What the hub's submission path costs per completion, by stage, and how it scales with `--check-procs`.

How it is measured (no libp2p clients compete for the CPU): a real HubState (real SQLite store, lease book,
copy detector, the tiny default model's tokenizer and the task's reward) is built as `echo-hub start` builds it
(testbed/inproc.py -> hub.cli.build), with `trust.check_procs` set to each value of `--procs` (0: the checks in a
thread of the hub's own process, the path before check workers). Nodes join and are leased; every lease is
answered by a pre-built, correctly signed submission frame. Each frame then goes through the functions the
submit handler calls (hub/service/handlers.py `_on_submit`): `read_frame` (from memory), `decode_signed`,
`HubState.accept_submission` (claim, checks in the pool, copies, commit), with enough submissions in flight to
keep every worker busy. completions_per_s = completions accepted or refused by the checks / wall time.

cpu_ms_per_completion by stage, measured one stage at a time on the same frames (CPU time of the thread):
  protocol   read_frame over an in-memory stream (framing only: libp2p's Noise and Yamux are bench/p2p.py's)
  signature  Ed25519 verification of the signed bytes
  parse      the submission's JSON parsed into the frozen messages (decode_signed's other half)
  decode     check_submission less the reward: token ids decoded by the tokenizer, lengths, EOS, vocabulary
  reward     the task's reward recomputed on the decoded texts (math: math-verify)
  copies     reject_copies against a fresh copy detector
  ipc        a check's job pickled to a worker and its verdicts back, which refer to the hub's own copy of the
             submission's token and log-prob tuples rather than carry them (both ends; 0 for procs 0)
  commit     the rest of the hub process's CPU per completion in the timed run (claim, admission, pricing, the
             store's transaction in its writer thread, the buffer), from its measured total
Stages run by the hub process: protocol, signature, parse, copies, commit, and its half of ipc; by the
workers: decode, reward and theirs. fleet_supported_16_cores: nodes a 16-core hub serves at one completion
per node every WORKLOAD_COMPLETION_INTERVAL_S, with heartbeats at the hub's adaptive period (past
heartbeats_per_s / period nodes, the fleet beats heartbeats_per_s times a second in all): the hub process
has one core, the checks the other 15, and the fleet is the smaller of what each serves (procs 0: all of it on
one core). hub_cpu_utilization and worker_cpu_utilization_per_proc say what cores the run got: every worker
always has a check waiting, so a worker below 1 was starved by the machine, and scaling shows the machine.

    python bench/ingest.py [--task reverse|math] [--procs 0,1,2] [--submissions 96] [--completion-tokens 512] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script: the test bed lives beside it

from hub.config import HubConfig, LearnerConfig, LeaseConfig
from hub.records.snapshots import SnapshotShelf
from hub.service.state import HubState
from hub.trust.checkpool import CheckPool, dump_answer, load_answer
from hub.trust.copies import CopyDetector
from hub.trust.submissions import check_submission, reject_copies
from shared.crypto import SIGNATURE_BYTES, Identity, verify_from_peer
from shared.default_model import ensure_default_model
from shared.messages import Heartbeat, JoinRequest, Submission, SubmittedGroup
from shared.model_io import build_snapshot
from shared.rollout import Completion, SamplingParams
from shared.tasks.base import checked_rewards
from shared.wire import HEADER_BYTES, decode_message, decode_signed, encode_message, encode_signed, read_frame
from testbed.inproc import PERMISSIVE_TRUST, LearnerAt, open_core

WORKLOAD_COMPLETION_INTERVAL_S = 4.0  # an RTX 5090-class node's one 8k-token completion (the paper's workload)
FLEET_CORES = 16
HUB_PROCESS_CORES = 1  # the trio process: framing, admission, leases, copies, commit
CALIBRATION_SUBMISSIONS = 16
# Untimed submissions per check process first: a worker's first reward imports and warms what it uses (sympy).
WARMUP_SUBMISSIONS_PER_PROC = 2
MATH_PROBLEMS = 200
# Reasoning a math completion spends tokens on before its final answer, with numbers so no two are alike.
MATH_STEP = "Step {i}: from the previous line, {a} + {b} = {c}, and multiplying by {d} gives {e}. "


@dataclass(frozen=True)
class Frame:
    peer: str
    frame: bytes
    completions: int


class BytesStream:
    """A stream over bytes already received: what read_frame reads from once libp2p delivered them."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    async def read(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk


def write_math_task(directory: Path, rng: random.Random) -> str:
    """A math:FILE.jsonl task of arithmetic word problems with integer, fraction and root answers."""
    rows = []
    for i in range(MATH_PROBLEMS):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = i % 3
        if kind == 0:
            rows.append({"prompt": f"What is {a} times {b}? Put the final answer in \\boxed{{}}.", "answer": str(a * b)})
        elif kind == 1:
            g = math.gcd(a, b)
            rows.append(
                {
                    "prompt": f"Simplify {a}/{b}. Put the final answer in \\boxed{{}}.",
                    "answer": f"\\frac{{{a // g}}}{{{b // g}}}" if b // g != 1 else str(a // g),
                }
            )
        else:
            rows.append(
                {
                    "prompt": f"Simplify the square root of {4 * a}. Put the final answer in \\boxed{{}}.",
                    "answer": f"2\\sqrt{{{a}}}",
                }
            )
    path = directory / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"math:{path}"


def math_text(answer: str, right: bool, tokens: int, tokenizer, rng: random.Random) -> str:
    """A worked answer of about `tokens` tokens ending in a boxed final answer, right or off by a little."""
    final = answer if right else (answer + "+1" if rng.random() < 0.5 else str(rng.randint(2, 9999)))
    tail = f"Therefore the answer is \\boxed{{{final}}}."
    steps, used, i = [], len(tokenizer.encode(tail)), 0
    while used < tokens:
        a, b, d = rng.randint(1, 999), rng.randint(1, 999), rng.randint(2, 9)
        step = MATH_STEP.format(i=i, a=a, b=b, c=a + b, d=d, e=(a + b) * d)
        used += len(tokenizer.encode(step))
        steps.append(step)
        i += 1
    return "".join(steps) + tail


def reverse_text(answer: str, right: bool, rng: random.Random) -> str:
    return answer if right else "".join(rng.sample(answer, len(answer)))


def completion(text: str, tokenizer, max_tokens: int, rng: random.Random) -> Completion:
    ids = tokenizer.encode(text)[: max_tokens - 1] + [tokenizer.eos_token_id]
    return Completion(
        token_ids=tuple(ids),
        logprobs=tuple(-rng.uniform(0.01, 3.0) for _ in ids),
        finish_reason="stop",
        version=0,
        text=tokenizer.decode(ids, skip_special_tokens=True),
    )


def build_frames(
    state: HubState, leases: list[tuple[Identity, object]], make_text: Callable, tokenizer, max_tokens: int, rng: random.Random
) -> list[Frame]:
    """One signed submission frame per lease: every prompt answered, about 60% right."""
    frames = []
    for identity, lease in leases:
        groups = tuple(
            SubmittedGroup(
                prompt_id=p.id,
                completions=tuple(
                    completion(make_text(p, rng.random() < 0.6, rng), tokenizer, max_tokens, rng) for _ in range(state.group_size)
                ),
            )
            for p in lease.prompts
        )
        submission = Submission(lease_id=lease.lease_id, node_id=identity.peer_id, groups=groups)
        frames.append(Frame(identity.peer_id, encode_signed(submission, identity), len(groups) * state.group_size))
    return frames


async def lease_all(state: HubState, n_leases: int) -> list[tuple[Identity, object]]:
    """Nodes joined, active, holding n_leases leases between them."""
    per_node = PERMISSIVE_TRUST.max_open_leases_per_peer // 2
    leases = []
    while len(leases) < n_leases:
        identity = Identity.generate()
        request = JoinRequest(
            price_per_hour=0.5,
            hardware="bench",
            link_bps=1e9,
            backend="hf",
            dtype="float32",
            model_config_hash=state.model_config_hash,
            version_held=0,
        )
        record = await state.membership.join(identity.peer_id, request, "10.0.0.1")
        await state.set_state(record, "active", "bench")
        for _ in range(min(per_node, n_leases - len(leases))):
            grant = await state.leasing.grant(identity.peer_id, 0)
            assert grant.lease is not None, grant.reason
            leases.append((identity, grant.lease))
    return leases


async def submit(state: HubState, frame: Frame) -> int:
    """What HubService._on_submit does with a frame, less libp2p: the completions the checks judged."""
    tag, body = await read_frame(BytesStream(frame.frame), {Submission.TYPE: state.intake.frame_cap(frame.peer)})
    submission = decode_signed(tag, body, frame.peer, Submission)
    outcome = await state.intake.accept(frame.peer, submission, hashlib.blake2b(body, digest_size=16).hexdigest())
    return (outcome.accepted + len(outcome.rejected) + len(outcome.late)) * state.group_size


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def timed_run(state: HubState, frames: list[Frame], in_flight: int) -> dict:
    """Every frame through the submit path, `in_flight` at a time: wall time, hub and worker CPU."""
    pool = state.intake.checks
    pids = [w.process.pid for w in pool._workers] if isinstance(pool, CheckPool) else []
    queue = iter(frames)
    judged = 0

    async def feeder() -> None:
        nonlocal judged
        for frame in queue:
            n = await submit(state, frame)
            judged += n

    cpu0, workers0, t0 = time.process_time(), _cpu_of(pids), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(feeder)
    wall = time.perf_counter() - t0
    return {
        "completions": judged,
        "wall_s": wall,
        "hub_cpu_s": time.process_time() - cpu0,
        "worker_cpu_s": _cpu_of(pids) - workers0,
    }


def _thread_ms(fn: Callable, *args) -> tuple[float, object]:
    t0 = time.thread_time()
    out = fn(*args)
    return (time.thread_time() - t0) * 1000, out


async def calibrate(state: HubState, frames: list[Frame], config: HubConfig) -> dict[str, float]:
    """CPU ms per completion of each stage, one at a time on the same frames (before they are submitted)."""
    rules, window = state.intake.rules, state.leasing.window()
    copies = CopyDetector(config.trust.copy_cache_groups, config.learner.group_size, config.trust.copy_false_alarm, 0.01)
    for frame in frames[:2]:  # warm: the reward's first call imports and caches what it uses
        submission = decode_signed(
            *await read_frame(BytesStream(frame.frame), {Submission.TYPE: len(frame.frame)}), frame.peer, Submission
        )
        check_submission(submission, state.leasing.book.open[submission.lease_id], rules, window)
    ms = dict.fromkeys(("protocol", "signature", "parse", "decode", "reward", "copies", "ipc_hub", "ipc_worker"), 0.0)
    completions = 0
    for frame in frames:
        t0 = time.thread_time()
        tag, body = await read_frame(BytesStream(frame.frame), {Submission.TYPE: len(frame.frame)})
        ms["protocol"] += (time.thread_time() - t0) * 1000
        signature, json_body = body[:SIGNATURE_BYTES], body[SIGNATURE_BYTES:]
        spent, ok = _thread_ms(verify_from_peer, frame.peer, bytes((tag,)) + json_body, signature)
        assert ok
        ms["signature"] += spent
        spent, submission = _thread_ms(decode_message, Submission, json_body)
        ms["parse"] += spent
        lease = state.leasing.book.open[submission.lease_id]
        spent, verdicts = _thread_ms(check_submission, submission, lease, rules, window)
        prompts = {p.id: p for p in lease.prompts}
        reward_ms = sum(
            _thread_ms(checked_rewards, rules.task, prompts[v.prompt_id], [c.text for c in v.group.completions])[0]
            for v in verdicts
            if v.accepted
        )
        ms["decode"] += spent - reward_ms
        ms["reward"] += reward_ms
        t0 = time.thread_time()
        await reject_copies(verdicts, copies, frame.peer, submission.lease_id)
        ms["copies"] += (time.thread_time() - t0) * 1000
        job_ms, job = _thread_ms(pickle.dumps, (submission, lease, window))
        in_worker, lease_copy, _ = pickle.loads(job)  # a worker's answer refers into its own copy of the job
        answer_ms, answer = _thread_ms(dump_answer, ("ok", check_submission(in_worker, lease_copy, rules, window)), in_worker)
        ms["ipc_hub"] += job_ms + _thread_ms(load_answer, answer, submission)[0]
        ms["ipc_worker"] += answer_ms + _thread_ms(pickle.loads, job)[0]
        completions += frame.completions
    return {stage: total / completions for stage, total in ms.items()}


def heartbeat_ms(state: HubState, peer: str, repeats: int = 2000) -> float:
    """CPU ms of one heartbeat on the hub, less libp2p: parse and HubState.heartbeat."""
    body = encode_message(Heartbeat(version_held=0))[HEADER_BYTES:]
    t0 = time.thread_time()
    for _ in range(repeats):
        state.membership.heartbeat(peer, decode_message(Heartbeat, body), state.leasing.newest_version())
    return (time.thread_time() - t0) * 1000 / repeats


def fleet_supported(hub_ms: float, worker_ms: float, beat_ms: float, heartbeats_per_s: float) -> dict:
    """Nodes a FLEET_CORES hub serves at the documented workload, from per-completion CPU costs."""
    per_node = 1.0 / WORKLOAD_COMPLETION_INTERVAL_S  # completions/s
    hub_left = HUB_PROCESS_CORES - heartbeats_per_s * beat_ms / 1000
    by_hub = hub_left / (per_node * hub_ms / 1000)
    # No check workers (procs 0): the checks are in hub_ms, and the other cores idle.
    by_workers = (FLEET_CORES - HUB_PROCESS_CORES) / (per_node * worker_ms / 1000) if worker_ms else math.inf
    return {
        "fleet_supported_16_cores": int(min(by_hub, by_workers)),
        "limited_by": "hub process" if by_hub < by_workers else "check workers",
        "nodes_by_hub_process": int(by_hub),
        "nodes_by_check_workers": int(by_workers) if worker_ms else None,
    }


async def run_procs(procs: int, args, model_dir: Path, task: str, tokenizer, make_text: Callable) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = HubConfig(
            task=task,
            data_dir=Path(tmp),
            learner=LearnerConfig(prompts_per_step=1024, buffer_max_groups=100_000, staleness=2),
            lease=LeaseConfig(prompts_per_lease=4, lease_timeout_s=3600.0, max_inflight_steps=100.0),
            sampling=SamplingParams(max_new_tokens=args.completion_tokens),
            trust=PERMISSIVE_TRUST.model_copy(update={"check_procs": procs}),
        )
        shelf = SnapshotShelf(keep=3, directory=Path(tmp) / "snapshots")
        shelf.add(build_snapshot({"w": torch.zeros(4)}, 0, Identity.generate(), "0" * 64, shelf.directory))
        state = open_core(Path(tmp), model_dir, config, shelf, LearnerAt(config.learner.staleness)).state
        rng = random.Random(procs)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(state.run)
                warmup = WARMUP_SUBMISSIONS_PER_PROC * max(1, procs)
                leases = await lease_all(state, args.submissions + CALIBRATION_SUBMISSIONS + warmup)
                frames = build_frames(state, leases, make_text, tokenizer, args.completion_tokens, rng)
                stages = await calibrate(state, frames[:CALIBRATION_SUBMISSIONS], config)
                beat = heartbeat_ms(state, frames[0].peer)
                if isinstance(state.intake.checks, CheckPool):
                    while state.intake.checks._idle.statistics().current_buffer_used < procs:
                        await trio.sleep(0.05)
                await timed_run(state, frames[CALIBRATION_SUBMISSIONS:][:warmup], warmup)
                run = await timed_run(state, frames[CALIBRATION_SUBMISSIONS + warmup :], max(4, 4 * procs))
                nursery.cancel_scope.cancel()
        finally:
            state.store.close()
    return summarize(procs, stages, beat, run, config.scheduler.heartbeats_per_s)


def summarize(procs: int, stages: dict[str, float], beat: float, run: dict, heartbeats_per_s: float) -> dict:
    """The stage table with commit taken from the hub process's measured CPU, and the fleet it implies."""
    n = run["completions"]
    hub_measured = run["hub_cpu_s"] * 1000 / n
    in_hub = ["protocol", "signature", "parse", "copies"] + (["decode", "reward"] if procs == 0 else ["ipc_hub"])
    commit = max(0.0, hub_measured - sum(stages[s] for s in in_hub))
    table = {s: round(stages[s], 4) for s in ("protocol", "signature", "parse", "decode", "reward", "copies")}
    table["ipc"] = 0.0 if procs == 0 else round(stages["ipc_hub"] + stages["ipc_worker"], 4)
    table["commit"] = round(commit, 4)
    hub_ms = sum(stages[s] for s in in_hub) + commit
    worker_ms = stages["decode"] + stages["reward"] + stages["ipc_worker"] if procs else 0.0
    return {
        "procs": procs,
        "completions": n,
        "wall_s": round(run["wall_s"], 3),
        "completions_per_s": round(n / run["wall_s"], 1),
        "cpu_ms_per_completion": table,
        "hub_process_cpu_ms_per_completion": round(hub_measured, 4),
        "worker_cpu_ms_per_completion_measured": round(run["worker_cpu_s"] * 1000 / n, 4) if procs else None,
        # Cores the run got: workers always had checks waiting, so below 1 per worker the machine was the limit.
        "hub_cpu_utilization": round(run["hub_cpu_s"] / run["wall_s"], 3),
        "worker_cpu_utilization_per_proc": round(run["worker_cpu_s"] / run["wall_s"] / procs, 3) if procs else None,
        "heartbeat_cpu_ms": round(beat, 4),
        **fleet_supported(hub_ms, worker_ms, beat, heartbeats_per_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("reverse", "math"), default="math")
    parser.add_argument("--procs", default="1,2", help="comma-separated --check-procs values (0: checks in a thread)")
    parser.add_argument("--submissions", type=int, default=96, help="timed submissions per procs value (4 prompts each)")
    parser.add_argument("--completion-tokens", type=int, default=512, help="tokens of a math completion (reverse: its word)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(0)
        if args.task == "math":
            task = write_math_task(Path(tmp), rng)

            def make_text(p, right, rng):
                return math_text(p.answer, right, args.completion_tokens, tokenizer, rng)
        else:
            task = "reverse"

            def make_text(p, right, rng):
                return reverse_text(p.answer, right, rng)

        results = []
        for procs in [int(p) for p in args.procs.split(",")]:
            results.append(trio.run(run_procs, procs, args, model_dir, task, tokenizer, make_text))
            if not args.json:
                print(json.dumps(results[-1]), file=sys.stderr)
    base = next((r for r in results if r["procs"] == 1), None)
    for r in results:
        r["scaling"] = round(r["completions_per_s"] / base["completions_per_s"], 3) if base and r["procs"] else None
    out = {
        "bench": "ingest",
        "task": args.task,
        "completion_tokens": args.completion_tokens,
        "workload": {"completion_interval_s": WORKLOAD_COMPLETION_INTERVAL_S, "fleet_cores": FLEET_CORES},
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "runs": results,
        "median_scaling": statistics.median([r["scaling"] for r in results if r["scaling"]] or [0]),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
