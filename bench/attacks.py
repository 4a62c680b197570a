"""Attacks on the real hub on loopback, measured and printed as JSON.

`reward`: a few identities flood the hub with groups its reward spends SPIN_S of CPU on, as sympy spent minutes on a
boxed \\exp tower (untrusted peers, round four, item 1), while an honest node keeps working and heartbeating.
The hub is the real service, state, store and checks in process (testbed/inproc.py), its task
testbed.poisoned_tasks:SpinningRewardTask; each node is a real libp2p host. Printed per check mode
(check process, hub thread): the honest node's submissions answered within HANDLER_TIMEOUT_S and accepted,
its submission and heartbeat round trips (p50, max) before and under the flood, the poisoned groups rejected
past their budget and counted against their senders, and whether the run stopped.

`web`, `churn` (item 7) and `strangers` (issue 65) run against a real `echo-hub start --http` process: an honest member heartbeats every
BEAT_S through a quiet spell, then under a web flood (WEB_ADDRESSES client addresses x WEB_CONNECTIONS keep-alive
connections, each asking /api/status as fast as it is answered), then under join/leave churn (CHURN_IDENTITIES
identities joining and leaving as fast as they are answered), then under STRANGER_IDENTITIES throwaway identities
that connect, are identified and hang up (py-libp2p's peerstore evicted the hub's own keys past 1,000 of them).
`strangers_node` sends them at a real `echo-node join` process's own address instead (a volunteer exited after 2,099
of them), twice: whether it stays up and connected to its hub, and its resident memory before and after each flood
(a second flood that adds nothing says the first one's growth was the allocator's high-water mark, not a leak).

`probes` (issue 65) runs a real `echo-hub start` with one local node training, and measures its learner's steps a
minute quiet, then while PROBE_IDENTITIES identities join, take the one-prompt probe lease each is given and never
answer it, asking again every PROBE_ASK_S (48 of them took the learner from 32 steps/min to 0), and, as a control,
while as many identities join and send as many requests (a second heartbeat in place of each lease request): on a
2-core machine the attackers' own CPU slows the learner, and the control measures that share. The hub allows
PROBE_IDENTITIES open leases and twice as many connections per address, so that all of them hold a probe from
loopback. Each attack runs in a process of its own, so the
member's round trips measure the hub, not this script. Printed per spell: the member's heartbeat round trips
(p50, p90, p99, max), the hub's CPU and resident memory (its processes together: the web server's is one of them), what the hub's log grew
by and its `chains:` lines, and the attack's own rate.

Usage: python bench/attacks.py [--attacks reward,web,churn] [--attackers 3] [--seconds 20] [--modes process,thread]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import trio
from transformers import AutoTokenizer

from hub.config import HubConfig, LearnerConfig, LeaseConfig
from hub.service.leasing import HANDLER_TIMEOUT_S
from hub.trust.submissions import REASON_OVER_BUDGET
from node.client import HubClient
from shared.crypto import Identity
from shared.default_model import ensure_default_model
from shared.layout import HUB_LOG_FILE, HUB_STORE_FILE
from shared.messages import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    LeaseReply,
    Reject,
    Submission,
    SubmitReply,
    SubmittedGroup,
)
from shared.net import running_host
from shared.rollout import Completion, SamplingParams
from testbed.inproc import LOOPBACK, PERMISSIVE_TRUST, InprocHub, inproc_hub
from testbed.poisoned_tasks import POISON

MODES = {"process": 1, "thread": 0}  # --check-procs of each mode
REWARD_BUDGET_S = 0.05  # CPU per completion: a poisoned group (SPIN_S of CPU) is far past it


class Node:
    """One node of the bench: a HubClient that makes completions with the hub's tokenizer."""

    def __init__(self, client: HubClient, hub: InprocHub, tokenizer) -> None:
        self.client, self.hub, self.tokenizer = client, hub, tokenizer

    def completion(self, text: str) -> Completion:
        ids = (*self.tokenizer.encode(text), self.tokenizer.eos_token_id)
        return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=self.hub.version, text=text)

    async def join(self) -> None:
        reply = await self.client.join(
            JoinRequest(
                price_per_hour=0.5,
                hardware="bench",
                link_bps=1e8,
                backend="hf",
                dtype="float32",
                model_config_hash=self.hub.config_hash,
                version_held=0,
            )
        )
        assert isinstance(reply, JoinReply), reply

    async def lease(self):
        with trio.fail_after(HANDLER_TIMEOUT_S):
            while True:
                reply = await self.client.lease(self.hub.version)
                if isinstance(reply, LeaseReply) and reply.lease is not None:
                    return reply.lease
                await trio.sleep(0.05)

    async def work(self, poisoned: bool) -> tuple[float, SubmitReply | None]:
        """Lease, answer (rightly, or with POISON in every group) and submit: (seconds to the reply, the reply)."""
        lease = await self.lease()
        groups = tuple(
            SubmittedGroup(
                prompt_id=p.prompt_id,
                completions=tuple(self.completion(t) for t in ((POISON, "x") if poisoned else (p.text[:-1][::-1], p.text[:-1]))),
            )
            for p in lease.prompts
        )
        start = time.monotonic()
        with trio.move_on_after(HANDLER_TIMEOUT_S + 5):
            reply = await self.client.submit(Submission(lease_id=lease.lease_id, node_id=self.client.peer_id, groups=groups))
            return time.monotonic() - start, reply if isinstance(reply, SubmitReply) else None
        return time.monotonic() - start, None

    async def beat(self) -> float:
        start = time.monotonic()
        await self.client.heartbeat(Heartbeat(version_held=self.hub.version))
        return time.monotonic() - start


def summary(seconds: list[float]) -> dict:
    return {
        "n": len(seconds),
        "p50_ms": round(1000 * statistics.median(seconds), 1) if seconds else None,
        "max_ms": round(1000 * max(seconds), 1) if seconds else None,
    }


async def honest_round(node: Node, until: float, out: dict) -> None:
    """Submissions and heartbeats of the honest node until `until` (time.monotonic)."""
    async with trio.open_nursery() as nursery:

        async def beats() -> None:
            while time.monotonic() < until:
                out["beats"].append(await node.beat())
                await trio.sleep(0.2)

        nursery.start_soon(beats)
        while time.monotonic() < until:
            took, reply = await node.work(poisoned=False)
            out["submits"].append(took)
            out["answered_in_time"] += reply is not None and took <= HANDLER_TIMEOUT_S
            out["accepted_all"] += reply is not None and reply.accepted > 0 and not reply.rejected


async def run_mode(procs: int, attackers: int, seconds: float, work: Path, model_dir: Path) -> dict:
    trust = PERMISSIVE_TRUST.model_copy(update={"check_procs": procs, "reward_budget_s": REWARD_BUDGET_S})
    # Room for every lease of the bench: no learner takes groups out of the buffer (as bench/p2p.py).
    config = HubConfig(
        learner=LearnerConfig(staleness=2, prompts_per_step=4096, group_size=2, buffer_max_groups=1_000_000),
        sampling=SamplingParams(max_new_tokens=32),
        lease=LeaseConfig(prompts_per_lease=2, max_inflight_steps=100.0),
        trust=trust,
        task="testbed.poisoned_tasks:SpinningRewardTask",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with inproc_hub(work, model_dir, config) as hub, AsyncExitStack() as stack:
        nodes = []
        for _ in range(attackers + 1):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            client = HubClient(host, identity, hub.addr, timeout_s=HANDLER_TIMEOUT_S + 5)
            await client.connect()
            nodes.append(Node(client, hub, tokenizer))
        honest, *flooders = nodes
        for node in nodes:
            await node.join()
        await honest.work(poisoned=False)  # the first check waits for the check process to start
        quiet = {"beats": [], "submits": [], "answered_in_time": 0, "accepted_all": 0}
        await honest_round(honest, time.monotonic() + seconds / 2, quiet)
        flood = {"beats": [], "submits": [], "answered_in_time": 0, "accepted_all": 0}
        charged = {"submissions": 0, "groups_rejected_over_budget": 0, "unanswered": 0}
        until = time.monotonic() + seconds

        async def attack(node: Node) -> None:
            while time.monotonic() < until:
                _, reply = await node.work(poisoned=True)
                if reply is None:
                    charged["unanswered"] += 1
                    continue
                charged["submissions"] += 1
                charged["groups_rejected_over_budget"] += sum(r == REASON_OVER_BUDGET for _, r in reply.rejected)

        async with trio.open_nursery() as nursery:
            for node in flooders:
                nursery.start_soon(attack, node)
            nursery.start_soon(honest_round, honest, until, flood)
        tallies = [hub.state.fleet.get(n.client.peer_id).tallies for n in flooders]
        return {
            "check_procs": procs,
            "attackers": attackers,
            "honest_quiet": {"submit": summary(quiet["submits"]), "heartbeat": summary(quiet["beats"])},
            "honest_under_flood": {
                "submit": summary(flood["submits"]),
                "heartbeat": summary(flood["beats"]),
                "answered_within_deadline": f"{flood['answered_in_time']}/{len(flood['submits'])}",
                "accepted": f"{flood['accepted_all']}/{len(flood['submits'])}",
            },
            "poisoned": charged,
            "attackers_rejected_in_tallies": sum(t.rejected for t in tallies),
            "attackers_accepted_in_tallies": sum(t.accepted for t in tallies),
            "run_stopped": hub.state.intake.reward_failure is not None,
        }


# -- web flood and join/leave churn against a real hub process (item 7) ----------------------------------------

BEAT_S = 0.2  # the honest member's heartbeat period (a round trip, then this long)
WEB_ADDRESSES = 16  # client addresses of the web flood, 127.0.0.2 on
WEB_CONNECTIONS = 8  # keep-alive connections per address
CHURN_IDENTITIES = 4
STRANGER_IDENTITIES = 5000
STRANGER_DIALS = 8  # identities connecting at once
PROBE_IDENTITIES = 64
PROBE_ASK_S = 5.0  # the leases are held whatever the pace: a slow one keeps their own CPU out of the figure
PROBE_HUB_TOML = """
[lease]
lease_timeout_s = 10
[trust]
max_open_leases_per_ip = 64
max_connections_per_ip = 128
"""
ATTACK_MARGIN_S = 1.0  # an attacker goes on this much longer than the member is measured under it
STARTED_LINE = b"attacking\n"  # what an attacker prints once it attacks
HUB_ARGS = ("--local-nodes", "0", "--steps", "0", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8")


def started() -> None:
    """An attacker tells the bench it attacks now (the first time it is called)."""
    if not getattr(started, "done", False):
        started.done = True  # type: ignore[attr-defined]
        sys.stdout.buffer.write(STARTED_LINE)
        sys.stdout.flush()


async def web_flood(url: str, seconds: float) -> dict:
    """WEB_ADDRESSES x WEB_CONNECTIONS keep-alive connections asking /api/status until `seconds` pass: answers by status."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    until = trio.current_time() + seconds
    answers: dict[str, int] = {}
    started()

    async def answer(stream: trio.SocketStream, buffered: bytes) -> tuple[int, bytes] | None:
        """(status, bytes past it) of one answer; None when the server closed the connection."""
        while b"\r\n\r\n" not in buffered:
            if not (chunk := await stream.receive_some(65536)):
                return None
            buffered += chunk
        head, _, rest = buffered.partition(b"\r\n\r\n")
        length = next(
            (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
        )
        while len(rest) < length:
            if not (chunk := await stream.receive_some(65536)):
                return None
            rest += chunk
        return int(head.split(b" ", 2)[1]), rest[length:]

    async def connection(address: str) -> None:
        while trio.current_time() < until:
            try:
                stream = await trio.open_tcp_stream(host, int(port), local_address=address)
            except OSError:
                answers["refused"] = answers.get("refused", 0) + 1
                await trio.sleep(0.05)
                continue
            buffered = b""
            async with stream:
                while trio.current_time() < until:
                    try:
                        await stream.send_all(b"GET /api/status HTTP/1.1\r\nHost: x\r\n\r\n")
                        got = await answer(stream, buffered)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        got = None
                    if got is None:
                        answers["closed"] = answers.get("closed", 0) + 1
                        break
                    code, buffered = got
                    answers[str(code)] = answers.get(str(code), 0) + 1

    with trio.move_on_at(until + 1.0):
        async with trio.open_nursery() as nursery:
            for a in range(WEB_ADDRESSES):
                for _ in range(WEB_CONNECTIONS):
                    nursery.start_soon(connection, f"127.0.0.{2 + a}")
    served = sum(n for code, n in answers.items() if code.isdigit())
    return {"answers": answers, "answers_per_s": round(served / seconds, 1)}


async def churn(hub_addr: str, config_hash: str, seconds: float) -> dict:
    """CHURN_IDENTITIES identities joining and leaving as fast as the hub answers, until `seconds` pass."""
    until = trio.current_time() + seconds
    pairs, refused = [0], [0]

    async def identity() -> None:
        me = Identity.generate()
        async with running_host(me, [LOOPBACK]) as (host, _):
            client = HubClient(host, me, hub_addr)
            await client.connect()
            if not pairs[0]:
                started()
            request = JoinRequest(
                price_per_hour=0.5, hardware="bench", link_bps=1e8, backend="hf", dtype="float32", model_config_hash=config_hash
            )
            while trio.current_time() < until:
                joined = await client.join(request)
                left = await client.leave(10.0)
                pairs[0] += 1
                refused[0] += isinstance(joined, Reject) + isinstance(left, Reject)

    async with trio.open_nursery() as nursery:
        for _ in range(CHURN_IDENTITIES):
            nursery.start_soon(identity)
    return {"pairs_per_s": round(pairs[0] / seconds, 1), "refused_requests": refused[0]}


async def strangers(hub_addr: str, seconds: float) -> dict:
    """STRANGER_IDENTITIES identities, STRANGER_DIALS at a time, each connecting and hanging up once the hub has
    identified it (or after a second); ends early once `seconds` pass."""
    from shared.net import connect

    until = trio.current_time() + seconds
    count, failed = [0], [0]
    started()

    async def dialler(share: int) -> None:
        for _ in range(share):
            if trio.current_time() >= until:
                return
            try:
                async with running_host(Identity.generate(), [LOOPBACK]) as (host, _):
                    with trio.move_on_after(1.0):
                        await connect(host, hub_addr)
                        await trio.sleep(0.05)  # the hub's identify runs on the new connection
                count[0] += 1
            except Exception:  # noqa: BLE001 - a refused dial is the attack's cost, counted
                failed[0] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(STRANGER_DIALS):
            nursery.start_soon(dialler, STRANGER_IDENTITIES // STRANGER_DIALS)
    return {"identities": count[0], "failed_dials": failed[0]}


async def probe_hoarders(hub_addr: str, config_hash: str, seconds: float, ask: bool = True) -> dict:
    """PROBE_IDENTITIES identities that join, claim the version the hub names, hold the probe they are leased and never
    answer it, asking for work every PROBE_ASK_S (`ask` False: a heartbeat in place of each lease request); until
    `seconds` pass."""
    until = trio.current_time() + seconds
    held, refused = [0], [0]
    started()

    async def identity() -> None:
        me = Identity.generate()
        async with running_host(me, [LOOPBACK]) as (host, _):
            client = HubClient(host, me, hub_addr)
            await client.connect()
            request = JoinRequest(
                price_per_hour=0.01, hardware="bench", link_bps=1e8, backend="hf", dtype="float32", model_config_hash=config_hash
            )
            joined = await client.join(request)
            if not isinstance(joined, JoinReply):
                refused[0] += 1
                return
            version = joined.latest_version
            while trio.current_time() < until:
                beat = await client.heartbeat(Heartbeat(version_held=version))
                version = beat.latest_version if isinstance(beat, HeartbeatReply) else version
                reply = await (client.lease(version) if ask else client.heartbeat(Heartbeat(version_held=version)))
                if isinstance(reply, LeaseReply) and reply.lease is not None:
                    held[0] += 1
                await trio.sleep(PROBE_ASK_S)

    async with trio.open_nursery() as nursery:
        for _ in range(PROBE_IDENTITIES):
            nursery.start_soon(identity)
    return {"identities": PROBE_IDENTITIES, "probes_taken": held[0], "joins_refused": refused[0]}


class Attacker:
    """A `--worker` process of this script: `start` returns once it says it attacks, `figures` once it ended."""

    def __init__(self, *worker_argv: str) -> None:
        self.argv = [sys.executable, __file__, "--worker", *worker_argv]
        self.out = b""
        self.process: trio.Process | None = None

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.process = process = await trio.lowlevel.open_process(self.argv, stdout=subprocess.PIPE, env=env)
        assert process.stdout is not None
        while STARTED_LINE not in self.out:
            if not (chunk := await process.stdout.receive_some()):
                raise RuntimeError(f"the {self.argv[3]} attacker ended before it started (exit {await process.wait()})")
            self.out += chunk

    async def figures(self) -> dict:
        assert self.process is not None and self.process.stdout is not None
        while chunk := await self.process.stdout.receive_some():
            self.out += chunk
        await self.process.wait()
        return json.loads(self.out.split(STARTED_LINE, 1)[1])


def worker(argv: list[str]) -> None:
    """`--worker web URL SECONDS`, `--worker churn HUB_ADDR CONFIG_HASH SECONDS` or `--worker strangers HUB_ADDR
    SECONDS`: one attack; STARTED_LINE once it attacks, then its figures as JSON."""
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    kind, *args = argv
    if kind == "web":
        print(json.dumps(trio.run(web_flood, args[0], float(args[1]))))
    elif kind == "strangers":
        print(json.dumps(trio.run(strangers, args[0], float(args[1]))))
    elif kind in ("probes", "beats"):
        print(json.dumps(trio.run(probe_hoarders, args[0], args[1], float(args[2]), kind == "probes")))
    else:
        print(json.dumps(trio.run(churn, args[0], args[1], float(args[2]))))


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children together, in MB."""
    import psutil

    hub = psutil.Process(pid)
    return round(sum(p.memory_info().rss for p in (hub, *hub.children(recursive=True)) if p.is_running()) / 1e6, 1)


def store_kb(data_dir: Path) -> float:
    """The hub's store on disk (its write-ahead log included), in kB."""
    files = (data_dir / HUB_STORE_FILE, data_dir / f"{HUB_STORE_FILE}-wal")
    return round(sum(f.stat().st_size for f in files if f.exists()) / 1000, 1)


def hub_cpu_s(pid: int) -> float:
    """CPU seconds the hub's processes (its web server's too) spent so far."""
    import psutil

    hub = psutil.Process(pid)
    total = 0.0
    for process in (hub, *hub.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def spell(member: HubClient, hub, attack: list[str] | None, seconds: float) -> dict:
    """The member's heartbeats for `seconds` (under `attack`, a worker's argv, when given), and what the hub spent."""
    log_file = hub.data_dir / HUB_LOG_FILE
    rss_at, store_at = tree_rss_mb(hub.process.pid), store_kb(hub.data_dir)
    log_at, cpu_at, started = log_file.stat().st_size, hub_cpu_s(hub.process.pid), time.monotonic()
    beats: list[float] = []
    attacked: dict = {}
    attacker = None
    if attack is not None:
        # It attacks a little longer than the member is measured, from the moment it says it started.
        attacker = Attacker(*attack, str(seconds + ATTACK_MARGIN_S))
        await attacker.start()
        log_at, cpu_at, started = log_file.stat().st_size, hub_cpu_s(hub.process.pid), time.monotonic()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sent = time.monotonic()
        beat = await member.heartbeat(Heartbeat(version_held=0))
        if not isinstance(beat, HeartbeatReply):
            raise RuntimeError(f"the member's heartbeat was answered {beat!r}")
        beats.append(time.monotonic() - sent)
        await trio.sleep(BEAT_S)
    elapsed = time.monotonic() - started
    with log_file.open("rb") as log:
        log.seek(log_at)
        grown = log.read()
    if attacker is not None:
        attacked = await attacker.figures()
    return {
        "heartbeat": {
            **summary(beats),
            "p90_ms": round(1000 * statistics.quantiles(beats, n=10)[-1], 1),
            "p99_ms": round(1000 * statistics.quantiles(beats, n=100)[-1], 1),
        },
        "hub_cores": round((hub_cpu_s(hub.process.pid) - cpu_at) / elapsed, 2),
        "hub_rss_mb": {"before": rss_at, "after": tree_rss_mb(hub.process.pid)},
        "store_kb": {"before": store_at, "after": store_kb(hub.data_dir)},
        "hub_log_kb_per_s": round(len(grown) / 1000 / elapsed, 1),
        "chains_lines": grown.count(b" chains: "),
        **attacked,
    }


async def flood_a_node(hub, node_dir: Path, seconds: float) -> dict:
    """STRANGER_IDENTITIES throwaway identities at a real node's listen address, twice: whether the node is still up and
    connected to the hub after them, and its RSS before and after each flood."""
    from shared.layout import NODE_LOG_FILE, NODE_STATUS_FILE
    from shared.messages import NodeView
    from testbed.harness import start_node, stop_all, wait_until

    node = start_node(hub.addr, node_dir)
    try:
        listening = re.compile(r"listening on (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")
        log_file = node_dir / NODE_LOG_FILE
        addr = wait_until(lambda: log_file.exists() and listening.search(log_file.read_text()), 120, "the node's address")
        status = node_dir / NODE_STATUS_FILE
        wait_until(lambda: status.exists() and NodeView.model_validate_json(status.read_text()).connected, 120, "the join")
        rss = [tree_rss_mb(node.process.pid)]
        floods = []
        for _ in range(2):
            attacker = Attacker("strangers", addr.group(1), str(seconds))
            await attacker.start()
            floods.append(await attacker.figures())
            await trio.sleep(3.0)  # a status write or two after the last identity
            rss.append(tree_rss_mb(node.process.pid))
        view = NodeView.model_validate_json(status.read_text())
        return {
            "node_up": node.process.poll() is None,
            "connected": view.connected,
            "status_age_s": round(time.time() - view.updated_at, 1),
            "node_rss_mb": {"before": rss[0], "after_first": rss[1], "after_second": rss[2]},
            "floods": floods,
        }
    finally:
        stop_all([node])


async def run_floods(work: Path, seconds: float, model_dir: Path, attacks: set[str]) -> dict:
    """The quiet spell, then the web flood and the churn among `attacks` (see the module docstring), against one real hub."""
    from shared.model_io import model_dir_config_hash
    from testbed.harness import start_hub, stop_all, wait_until

    hub = start_hub(work / "hub", *HUB_ARGS, "--http", "127.0.0.1:0")
    try:
        url = wait_until(lambda: re.search(r"^status page: (\S+)", hub.output(), re.M), 120, "the status page").group(1)
        config_hash = model_dir_config_hash(model_dir)
        me = Identity.generate()
        async with running_host(me, [LOOPBACK]) as (host, _):
            member = HubClient(host, me, hub.addr)
            await member.connect()
            joined = await member.join(
                JoinRequest(
                    price_per_hour=0.5,
                    hardware="bench",
                    link_bps=1e8,
                    backend="hf",
                    dtype="float32",
                    model_config_hash=config_hash,
                )
            )
            assert isinstance(joined, JoinReply), joined
            spells = {
                "quiet": None,
                "web": ["web", url],
                "churn": ["churn", hub.addr, config_hash],
                "strangers": ["strangers", hub.addr],
            }
            figures = {name: await spell(member, hub, attack, seconds) for name, attack in spells.items() if name in attacks}
            if "strangers_node" in attacks:
                figures["strangers_node"] = await flood_a_node(hub, work / "node", seconds)
            return figures
    finally:
        stop_all([hub])


async def steps_per_min(hub, seconds: float) -> float:
    """The learner's steps a minute over the next `seconds` (from the status the hub writes once a second)."""
    first = hub.status()
    await trio.sleep(seconds)
    last = hub.status()
    assert first is not None and last is not None
    return round(60.0 * (last.step - first.step) / (last.updated_at - first.updated_at), 1)


async def run_probes(work: Path, seconds: float, model_dir: Path) -> dict:
    """The learner's steps a minute quiet, then under PROBE_IDENTITIES probe hoarders, on one real hub (see the
    module docstring)."""
    from shared.model_io import model_dir_config_hash
    from testbed.harness import start_hub, stop_all, wait_until

    config = work / "hub.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(PROBE_HUB_TOML)
    hub = start_hub(work / "hub", "--config", str(config), "--local-nodes", "1", "--steps", "0", *HUB_ARGS[4:])
    try:
        wait_until(lambda: (s := hub.status()) is not None and s.step >= 3, 180, "the learner's first steps")
        quiet = await steps_per_min(hub, seconds)
        figures: dict = {"quiet": quiet}
        for kind in ("beats", "probes"):
            attacker = Attacker(kind, hub.addr, model_dir_config_hash(model_dir), str(seconds + 15))
            await attacker.start()
            await trio.sleep(5.0)  # they join (and take their probes)
            figures[f"under_{kind}"] = await steps_per_min(hub, seconds)
            figures[f"{kind}_attacker"] = await attacker.figures()
        figures["ratio_probes_to_quiet"] = round(figures["under_probes"] / quiet, 2) if quiet else None
        figures["ratio_probes_to_control"] = (
            round(figures["under_probes"] / figures["under_beats"], 2) if figures["under_beats"] else None
        )
        return figures
    finally:
        stop_all([hub])


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--attacks",
        default="reward,web,churn,strangers,strangers_node,probes",
        help="comma-separated: reward, web, churn, strangers, strangers_node, probes",
    )
    parser.add_argument("--attackers", type=int, default=3, help="reward: poisoning identities")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each attack (reward's quiet spell: half)")
    parser.add_argument("--modes", default="process,thread", help=f"reward: comma-separated: {', '.join(MODES)}")
    args = parser.parse_args()
    attacks = set(args.attacks.split(","))
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    model_dir = ensure_default_model(progress=False)
    results = []
    for mode in args.modes.split(",") if "reward" in attacks else ():
        with tempfile.TemporaryDirectory() as work:
            result = trio.run(run_mode, MODES[mode], args.attackers, args.seconds, Path(work), model_dir)
            results.append({"attack": "reward", "mode": mode, **result})
    if attacks & {"web", "churn", "strangers", "strangers_node"}:
        with tempfile.TemporaryDirectory() as work:
            results.append({"attack": "floods", **trio.run(run_floods, Path(work), args.seconds, model_dir, attacks | {"quiet"})})
    if "probes" in attacks:
        with tempfile.TemporaryDirectory() as work:
            results.append({"attack": "probes", **trio.run(run_probes, Path(work), args.seconds, model_dir)})
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
