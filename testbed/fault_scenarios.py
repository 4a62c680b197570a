"""Fault scenarios against the real system, shared by tests/test_faults.py (one test per cheat class)
and bench/faults.py (which measures and prints them): misbehaving nodes, hub crashes, node churn.

Every scenario runs against a real hub process (`echo-hub start`, loopback) with real libp2p peers:
in-process nodes built from the node's own HubClient, HubLink and Worker (honest, or cheating through
the worker's rewrite hook and raw frames, with the real tiny model) and, for churn, real `echo-node join`
processes. A scenario that fails is a row of its own naming its error (run_row); the others still run.

- cheats: bad signature, replay, fake reward, oversized and garbage frames, stream flood, fake
  log-probs, wrong model, copied completions. Each counts attempts, how many the hub detected
  (refused, or caught later: banned/flagged), accepted groups still standing, money paid and not
  voided, and rejections of an honest control node running alongside.
- crash: SIGKILL of the hub at random moments (mid learner step, mid submission), restart, and
  check that no acknowledged group is lost, none counted or paid twice, snapshot versions and
  steps stay monotone, and SQLite's integrity check passes.
- churn: a share of real nodes SIGKILLed right after a snapshot is published (mid broadcast) and
  while they hold leases; the run must still complete and the survivors finish the snapshot
  whose broadcast lost a node.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from hub.service.status import STATUS_PERIOD_S
from node.client import BUSY_RETRY_S, HubClient
from node.hub_link import HubLink, NodeRefused, describe_failure
from node.worker import Rewrite, Worker
from shared.crypto import Identity
from shared.layout import HUB_STATUS_FILE, SNAPSHOTS_DIR
from shared.messages import (
    SUBMIT_PROTOCOL,
    Heartbeat,
    HubStatus,
    JoinReply,
    JoinRequest,
    Lease,
    Reject,
    Submission,
    SubmitReply,
    SubmittedGroup,
)
from shared.net import running_host
from shared.wire import StreamEOF
from testbed.harness import HubProc, free_port, node_peer_id, query, start_hub, start_node, wait_until

log = logging.getLogger("echo2.tests.faults")

REQUEST_TIMEOUT_S = 20.0
LEASE_WAIT_S = 60.0
LINK_JOIN_S = 60.0  # a client's first join through its hub link (which retries until the hub answers)
LINK_BACKOFF_MAX_S = 2.0  # its rejoins: the crash scenario's hub comes back within seconds
BROADCAST_FINISH_S = 60.0
STEPS_AFTER_CHURN = 5
FLOOD_STREAMS = 300
# How long silent strangers hold their connections: past the hub's idle sweep (trust.idle_connection_s, 15 s).
SILENT_STRANGER_HOLD_S = 18.0
HUB_ARGS = (
    "--local-nodes",
    "0",
    "--steps",
    "0",
    "--prompts-per-step",
    "64",
    "--group-size",
    "4",
    "--max-new-tokens",
    "8",
    "--log-level",
    "info",
)


class Refused(Exception):
    """The hub answered with a Reject."""


@dataclass
class ScenarioResult:
    name: str
    attempts: int = 0
    detected: int = 0
    accepted: int = 0
    paid: float = 0.0
    false_rejections: int = 0
    # The node's cost on the hub's status (what the dashboard shows) agrees with its ledger.
    shown_cost_matches_ledger: bool = True
    error: str | None = None  # the scenario failed before its end: why (its figures are then all zero)


# -- reading the hub's store (read-only, while the hub runs) -------------------------------


class HubDB:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        return query(self.data_dir, sql, params)

    def paid(self, node_id: str) -> float:
        return float(self.query("SELECT COALESCE(SUM(usd), 0) FROM ledger WHERE node_id = ? AND voided = 0", (node_id,))[0][0])

    def groups_of(self, lease_id: str) -> int:
        """Groups recorded against a lease, whatever their verdict."""
        return self.query("SELECT COUNT(*) FROM trajectories WHERE lease_id = ?", (lease_id,))[0][0]

    def shown_cost(self, node_id: str) -> float | None:
        """The node's cost in the hub's status.json, or None before the node appears there."""
        path = self.data_dir / HUB_STATUS_FILE
        if not path.exists():
            return None
        status = HubStatus.model_validate_json(path.read_text())
        return next((n.cost_usd for n in status.nodes if n.peer_id == node_id), None)

    def events(self, kind: str, node_id: str | None = None) -> int:
        if node_id is None:
            return self.query("SELECT COUNT(*) FROM events WHERE kind = ?", (kind,))[0][0]
        return self.query("SELECT COUNT(*) FROM events WHERE kind = ? AND node_id = ?", (kind, node_id))[0][0]

    def banned(self, node_id: str) -> bool:
        rows = self.query("SELECT state FROM nodes WHERE peer_id = ?", (node_id,))
        return bool(rows) and rows[0][0] == "banned"

    def standing_in(self, lease_ids: list[str]) -> int:
        """Accepted groups of these leases the hub did not take back: trained on, or waiting to be."""
        if not lease_ids:
            return 0
        marks = ",".join("?" * len(lease_ids))
        return self.query(
            f"SELECT COUNT(*) FROM trajectories WHERE lease_id IN ({marks}) AND verdict = 'accepted' AND discard_reason IS NULL",
            tuple(lease_ids),
        )[0][0]


# -- an in-process node built from node/'s own parts ------------------------------------------


class Client(HubClient):
    """A node made of node/'s HubClient, HubLink (join, heartbeats, rejoins) and Worker (lease, generate, sign,
    submit), on the engine it is given. It asks for each lease itself and installs the newest snapshot in
    `snapshots_dir` before asking (the scenarios test the hub's books, not the transfer). A scenario makes it
    misbehave through the worker's `rewrite` hook or raw frames (`send`)."""

    def __init__(
        self,
        host,
        identity,
        hub_addr: str,
        engine,
        config_hash: str,
        engine_lock: trio.Lock | None = None,
        snapshots_dir: Path | None = None,
    ) -> None:
        super().__init__(host, identity, hub_addr, timeout_s=REQUEST_TIMEOUT_S)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config_hash = config_hash
        self.snapshots_dir = snapshots_dir
        self.engine_lock = engine_lock or trio.Lock()  # one per engine: clients sharing an engine take turns
        self.refused: str | None = None  # the hub's reason once it refused this node for good (banned)
        self.joined = trio.Event()
        self.link = HubLink(
            self,
            self.join_request,
            lambda: Heartbeat(version_held=self.version),
            lambda reply: None,
            LINK_BACKOFF_MAX_S,
            on_join=self._on_join,
        )
        # can_work False: no lease rides on a submission (the scenario asks for each; an extra one would stay open
        # against the node's quota).
        self.worker = Worker(
            self,
            engine,
            self.engine_lock,
            can_work=lambda: False,
            version_held=lambda: self.version,
            max_rollouts_per_s=None,
            on_unknown=self.link.beat_now.set,
        )

    @property
    def version(self) -> int:
        return self.engine.version

    def join_request(self, price_per_hour: float = 0.35) -> JoinRequest:
        return JoinRequest(
            price_per_hour=price_per_hour,
            hardware="bench",
            link_bps=1e8,
            backend="hf",
            dtype="float32",
            model_config_hash=self.config_hash,
            version_held=self.version,
        )

    async def _on_join(self, reply: JoinReply) -> None:
        self.joined.set()

    async def join_once(self) -> None:
        """One join, no retry (a throwaway identity, or a fresh node checking it can get in): Refused when refused."""
        await self.connect()
        reply = await self.join(self.join_request())
        if isinstance(reply, Reject):
            raise Refused(f"join refused: {reply.reason}")

    async def run_link(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The hub link, started once joined; a refusal for good (a ban: a cheat's expected end) ends it quietly."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._link)
            with trio.fail_after(LINK_JOIN_S):
                while not self.joined.is_set() and self.refused is None:
                    with trio.move_on_after(0.1):
                        await self.joined.wait()
            if self.refused is not None:
                raise Refused(self.refused)
            task_status.started()

    async def _link(self) -> None:
        try:
            await self.link.run()
        except NodeRefused as exc:
            self.refused = exc.args[0]

    async def take_lease(self, wait_s: float = LEASE_WAIT_S) -> Lease:
        """The next lease the worker gets; Refused once this node is refused for good, TimeoutError (with the hub's
        last reason) when none comes within `wait_s`."""
        why = "not asked"
        with trio.move_on_after(wait_s):
            while self.refused is None:
                await self.install_newest()
                lease = await self.worker.next_lease()
                if not isinstance(lease, str):
                    return lease
                why = lease
        if self.refused is not None:
            raise Refused(self.refused)
        raise TimeoutError(f"no lease in {wait_s:g}s ({why})")

    async def install_newest(self) -> None:
        """Install the newest snapshot in the hub's data dir, if newer than the engine's."""
        from shared.snapshot import SnapshotError, read_snapshot_files

        if self.snapshots_dir is None:
            return
        versions = [int(p.stem[1:]) for p in self.snapshots_dir.glob("v*.manifest")]
        newest = max(versions, default=self.version)
        if newest <= self.version:
            return
        async with self.engine_lock:
            try:
                snapshot = await trio.to_thread.run_sync(read_snapshot_files, self.snapshots_dir, newest, self.hub_peer_id)
                await trio.to_thread.run_sync(self.engine.install, snapshot.path, newest)
            except (OSError, SnapshotError):
                return  # still being written, or already deleted for a newer one: next time

    async def groups(self, lease: Lease, engine=None, claim_version: int | None = None) -> tuple[SubmittedGroup, ...]:
        """Groups for `lease` made outside the worker (by `engine`, claiming `claim_version`): what a scenario sends
        as raw bytes, or a cheat submits in place of its own engine's."""
        engine = engine or self.engine
        async with self.engine_lock:
            made = await trio.to_thread.run_sync(
                engine.generate, [p.text for p in lease.prompts], lease.group_size, lease.sampling
            )
        out = []
        for prompt, completions in zip(lease.prompts, made):
            if claim_version is not None:
                completions = [c.model_copy(update={"version": claim_version}) for c in completions]
            out.append(SubmittedGroup(prompt_id=prompt.prompt_id, completions=tuple(completions)))
        return tuple(out)

    def decode(self, completion) -> str:
        """The completion's text as the hub decodes it (the hub never believes the node's own text)."""
        return self.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)

    def submission(self, lease: Lease, groups) -> Submission:
        return Submission(lease_id=lease.lease_id, node_id=self.peer_id, groups=tuple(groups))

    async def submit_answer(self, lease: Lease, groups) -> SubmitReply | Reject:
        """`groups` submitted for `lease` as the worker submits (HubClient.submit, sent again while the hub is busy)."""
        return await self.submit(self.submission(lease, groups), deadline=time.monotonic() + lease.deadline_s)

    async def send(self, protocol: str, frame: bytes, reply_types: tuple, close_write: bool = True):
        """Write raw bytes on a new stream; the hub's reply, or the name of how the stream ended."""
        try:
            return await self.send_frame(protocol, frame, *reply_types, close_write=close_write)
        except StreamEOF:
            return "reset"
        except trio.TooSlowError:
            return "timeout"
        except Exception as exc:  # noqa: BLE001 - any way the hub refuses us counts as refused
            return f"error:{type(exc).__name__}"

    async def send_while_busy(self, protocol: str, frame: bytes, reply_types: tuple, lease: Lease):
        """Raw bytes no node sends (a tampered submission), sent again while the hub is busy, as HubClient.submit does
        with what it signs, until the lease's deadline."""
        deadline = time.monotonic() + lease.deadline_s
        while True:
            reply = await self.send(protocol, frame, reply_types)
            if not (isinstance(reply, Reject) and reply.busy and time.monotonic() + BUSY_RETRY_S < deadline):
                return reply
            await trio.sleep(BUSY_RETRY_S)

    async def honest_round(self) -> int:
        """One lease answered by the worker; how many of its groups the hub rejected (a control measurement)."""
        lease = await self.take_lease()
        reply = await self.worker.work(lease)
        # Strict: the control answers at the newest version, so even a late group counts here.
        return len(reply.rejected) + len(reply.late) if isinstance(reply, SubmitReply) else len(lease.prompts)


@asynccontextmanager
async def linked_clients(hub: HubProc, members: list[tuple[Identity, object, Path]]) -> AsyncIterator[list[Client]]:
    """One Client per (identity, engine, model dir) joined to `hub` with its link running, for the block."""
    from shared.model_io import model_dir_config_hash

    locks: dict[int, trio.Lock] = {}
    async with AsyncExitStack() as stack:
        clients = []
        for identity, engine, model_dir in members:
            host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
            clients.append(
                Client(
                    host,
                    identity,
                    hub.addr,
                    engine,
                    model_dir_config_hash(model_dir),
                    locks.setdefault(id(engine), trio.Lock()),
                    hub.data_dir / SNAPSHOTS_DIR,
                )
            )
        async with trio.open_nursery() as nursery:  # inside the hosts: their links end before they do
            for client in clients:
                await nursery.start(client.run_link)
            try:
                yield clients
            finally:
                nursery.cancel_scope.cancel()


def accepted_of(reply) -> int:
    return reply.accepted if isinstance(reply, SubmitReply) else 0


def refused(reply) -> bool:
    """The hub answered with a Reject: a stream it reset or left hanging is not a refusal it explained."""
    return isinstance(reply, Reject)


# -- scenarios -------------------------------------------------------------------------------


async def scenario_bad_signature(x: Client, control: Client, db: HubDB, attempts: int) -> ScenarioResult:
    r = ScenarioResult("bad_signature")
    for _ in range(attempts):
        lease = await x.take_lease()
        groups = await x.groups(lease)
        frame = bytearray(x.signed(x.submission(lease, groups)))
        frame[5 + 7] ^= 0x40  # a bit of the signature, just after the 5-byte frame header
        paid_before = db.paid(x.peer_id)
        reply = await x.send_while_busy(SUBMIT_PROTOCOL, bytes(frame), (SubmitReply,), lease)
        r.attempts += 1
        r.detected += refused(reply)
        r.accepted += accepted_of(reply)
        r.paid += db.paid(x.peer_id) - paid_before
        # Then the genuine answer, as a real node would send: the lease must not stay open
        # (open leases count against the node's quota).
        await x.submit_answer(lease, groups)
        r.false_rejections += await control.honest_round()
    return r


async def scenario_replay(x: Client, control: Client, db: HubDB, attempts: int) -> ScenarioResult:
    r = ScenarioResult("replay")
    for _ in range(attempts):
        lease = await x.take_lease()
        answer = x.submission(lease, await x.groups(lease))
        first = await x.submit(answer, deadline=time.monotonic() + lease.deadline_s)
        if accepted_of(first) == 0:
            raise RuntimeError(f"honest first answer refused: {first!r}")
        paid_once, groups_once = db.paid(x.peer_id), db.groups_of(lease.lease_id)
        # The same signed bytes again (Ed25519 signatures are deterministic): for all the hub knows the node's own
        # answer sent again, its reply lost. Caught when it is refused, or given the first reply and nothing more.
        reply = await x.submit(answer, deadline=time.monotonic() + lease.deadline_s)
        more = db.groups_of(lease.lease_id) - groups_once
        r.attempts += 1
        r.detected += refused(reply) or (reply == first and more == 0)
        r.accepted += more
        r.paid += db.paid(x.peer_id) - paid_once
        r.false_rejections += await control.honest_round()
    return r


async def scenario_fake_reward(x: Client, control: Client, db: HubDB, attempts: int) -> ScenarioResult:
    """Claim the opposite of the true reward for every completion: each group is a lie the hub must refuse
    unpaid (it scores the completions itself)."""
    from shared.tasks.reverse import ReverseTask

    task = ReverseTask()
    r = ScenarioResult("fake_reward")
    paid_before = db.paid(x.peer_id)
    mismatches_before = db.events("reward_claim_mismatch", x.peer_id)

    async def lie(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
        return tuple(
            g.model_copy(
                update={
                    "claimed_rewards": tuple(
                        1.0 - t for t in task.rewards(task.get(g.prompt_id), [x.decode(c) for c in g.completions])
                    )
                }
            )
            for g in groups
        )

    for _ in range(attempts):
        reply = await x.worker.work(await x.take_lease(), rewrite=lie)
        r.attempts += 1
        r.accepted += accepted_of(reply)
        r.false_rejections += await control.honest_round()
    # One reward_claim_mismatch event per submission whose claims differ from the hub's scores.
    r.detected = db.events("reward_claim_mismatch", x.peer_id) - mismatches_before
    r.paid = db.paid(x.peer_id) - paid_before
    return r


def _frame_protocols() -> dict:
    """protocol -> (the request type the hub reads there, the replies it may send)."""
    from shared.messages import (
        HEARTBEAT_PROTOCOL,
        JOIN_PROTOCOL,
        LEASE_PROTOCOL,
        STATUS_PROTOCOL,
        SUBMIT_PROTOCOL,
        Heartbeat,
        HeartbeatReply,
        JoinReply,
        JoinRequest,
        LeaseReply,
        LeaseRequest,
        StatusRequest,
        Submission,
    )

    return {
        JOIN_PROTOCOL: (JoinRequest, (JoinReply,)),
        HEARTBEAT_PROTOCOL: (Heartbeat, (HeartbeatReply,)),
        LEASE_PROTOCOL: (LeaseRequest, (LeaseReply,)),
        SUBMIT_PROTOCOL: (Submission, (SubmitReply,)),
        STATUS_PROTOCOL: (StatusRequest, (HubStatus,)),
    }


async def scenario_oversized_frame(x: Client, control: Client, db: HubDB) -> ScenarioResult:
    from shared.wire import HEADER

    r = ScenarioResult("oversized_frame")
    for protocol, (request_type, types) in _frame_protocols().items():
        # Header claims 2 GiB; the hub must refuse from the header alone, not wait for or allocate the body.
        reply = await x.send(protocol, HEADER.pack(request_type.TYPE, 2**31) + b"x" * 1024, types, close_write=False)
        r.attempts += 1
        r.detected += refused(reply)
        r.accepted += not refused(reply)
    r.false_rejections += await control.honest_round()
    return r


async def scenario_garbage_frame(x: Client, control: Client, db: HubDB) -> ScenarioResult:
    from shared.wire import HEADER

    r = ScenarioResult("garbage_frame")
    rng = random.Random(7)
    for protocol, (request_type, types) in _frame_protocols().items():
        for frame in (
            bytes(rng.randrange(256) for _ in range(64)),  # noise
            HEADER.pack(250, 16) + b"\0" * 16,  # unknown type tag
            HEADER.pack(request_type.TYPE, 20) + b"{not json at all!!!}",  # malformed body (unsigned, for submit)
            b"\x02\x00",  # truncated header
        ):
            reply = await x.send(protocol, frame, types)
            r.attempts += 1
            r.detected += refused(reply)
            r.accepted += not refused(reply)
    r.false_rejections += await control.honest_round()
    return r


async def scenario_stream_flood(x: Client, control: Client, db: HubDB, streams: int) -> ScenarioResult:
    """`streams` heartbeat streams opened at once, counted as one attack of `streams` attempts.

    The guard admits up to `max_streams_per_peer` of them by design (a peer's first streams look like
    anyone's), so answering those is not the cheat succeeding, and whether one is answered before the
    disconnect cuts it is a race. The flood is detected when the guard disconnects the peer; a stream
    answered beyond the per-peer cap is one the guard let through."""
    from hub.config import TrustConfig
    from shared.messages import HEARTBEAT_PROTOCOL, Heartbeat, HeartbeatReply
    from shared.wire import encode_message

    r = ScenarioResult("stream_flood")
    frame = encode_message(Heartbeat(version_held=0))
    outcomes: list[object] = []

    async def one() -> None:
        outcomes.append(await x.send(HEARTBEAT_PROTOCOL, frame, (HeartbeatReply,)))

    control_rejections = 0

    async def control_during() -> None:
        nonlocal control_rejections
        await trio.sleep(0.2)
        control_rejections += await control.honest_round()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(control_during)
        for _ in range(streams):
            nursery.start_soon(one)
    r.attempts = streams
    answered = sum(isinstance(o, HeartbeatReply) for o in outcomes)
    r.accepted = max(0, answered - TrustConfig().max_streams_per_peer)
    deadline = time.monotonic() + 5.0
    while not (disconnected := db.events("disconnect", x.peer_id) > 0) and time.monotonic() < deadline:
        await trio.sleep(0.1)
    r.detected = streams if disconnected else streams - answered
    r.false_rejections = control_rejections
    return r


async def scenario_caught_later(
    name: str, db: HubDB, cheat: Client, control: Client, make: Rewrite, attempts: int, settle_s: float = 5.0
) -> ScenarioResult:
    """A cheat the submission checks cannot see (audits or the copy detector must catch it after the fact): the
    cheat's worker submits what `make` makes of the groups it generated."""
    r = ScenarioResult(name)
    paid_before = db.paid(cheat.peer_id)
    leases: list[str] = []
    for _ in range(attempts):
        try:
            lease = await cheat.take_lease(wait_s=15.0)
        except (Refused, TimeoutError):
            break  # banned, or no more work for it: refused from now on
        leases.append(lease.lease_id)
        reply = await cheat.worker.work(lease, rewrite=make)
        r.attempts += 1
        r.detected += refused(reply)
        r.false_rejections += await control.honest_round()
    await trio.sleep(settle_s)
    caught = db.banned(cheat.peer_id) or db.events("copy_detected", cheat.peer_id) > 0
    r.detected = r.attempts if caught else r.detected
    # Only the cheat's own leases count: its honest work before the cheat is not at stake (a ban keeps
    # its pay only up to the last passed audit; the rest of the penalty shows here as negative pay).
    r.accepted = db.standing_in(leases)
    r.paid = db.paid(cheat.peer_id) - paid_before
    r.false_rejections += db.banned(control.peer_id)
    deadline = time.monotonic() + 3 * STATUS_PERIOD_S
    while (shown := db.shown_cost(cheat.peer_id)) is None or abs(shown - db.paid(cheat.peer_id)) > 1e-12:
        if time.monotonic() > deadline:
            r.shown_cost_matches_ledger = False
            break
        await trio.sleep(0.2)
    return r


async def scenario_hostile_join(x: Client, control: Client, db: HubDB) -> ScenarioResult:
    """Numbers and strings no honest node sends (a 5e-324 B/s link, NaN, a version past SQLite's INTEGER,
    kilobytes of listen addresses, terminal escapes): each must be refused, and nothing stored."""
    from shared.messages import JOIN_PROTOCOL, JoinReply, JoinRequest
    from shared.wire import encode_frame

    r = ScenarioResult("hostile_join")
    base = {
        "price_per_hour": 0.5,
        "hardware": "x",
        "link_bps": 1e8,
        "backend": "hf",
        "dtype": "float32",
        "model_config_hash": x.config_hash,
        "version_held": 0,
        "listen_addrs": [],
    }
    for override in (
        {"link_bps": 5e-324},
        {"price_per_hour": float("nan")},
        {"version_held": 2**70},
        {"listen_addrs": ["/ip4/1.2.3.4/tcp/1/" + "x" * 2000] * 16},
        {"hardware": "\x1b[2J"},
    ):
        frame = encode_frame(JoinRequest.TYPE, json.dumps({**base, **override}).encode())
        reply = await x.send(JOIN_PROTOCOL, frame, (JoinReply,))
        r.attempts += 1
        r.detected += refused(reply)
        r.accepted += not refused(reply)
    r.false_rejections += await control.honest_round()
    return r


async def scenario_throwaway_identities(x: Client, control: Client, db: HubDB, count: int) -> ScenarioResult:
    """`count` fresh identities connect, join and leave (they used to fill py-libp2p's inbound slots for good,
    locking every later node out); then a fresh honest node must still get in."""

    r = ScenarioResult("throwaway_identities")
    limiter = trio.CapacityLimiter(8)

    async def come_and_go() -> None:
        async with limiter, AsyncExitStack() as stack:
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
            sybil = Client(host, identity, x.hub_addr, x.engine, x.config_hash)
            try:
                await sybil.join_once()
            except Exception:  # noqa: BLE001 - refused or throttled: not the lockout this measures
                pass

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(come_and_go)
    r.attempts = 1
    async with AsyncExitStack() as stack:
        identity = Identity.generate()
        host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
        fresh = Client(host, identity, x.hub_addr, x.engine, x.config_hash)
        try:
            await fresh.join_once()
            r.detected = 1  # the flood changed nothing for the next node
        except Exception as exc:  # noqa: BLE001 - locked out: the failure this scenario looks for
            log.warning("fresh node locked out after %d throwaway identities: %r", count, exc)
            r.accepted = 1
    r.false_rejections += await control.honest_round()
    return r


async def scenario_stranger_big_frames(x: Client, control: Client, db: HubDB, streams: int) -> ScenarioResult:
    """Strangers (never joined) open submissions claiming 30 MiB: refused from the header, before anything is
    read, so an honest node's work goes on unhindered."""
    from shared.messages import SUBMIT_PROTOCOL, Submission
    from shared.wire import HEADER

    r = ScenarioResult("stranger_big_frames")
    outcomes: list[object] = []
    async with AsyncExitStack() as stack:
        identity = Identity.generate()
        host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
        stranger = Client(host, identity, x.hub_addr, x.engine, x.config_hash)
        await stranger.connect()

        async def one() -> None:
            started = time.monotonic()
            reply = await stranger.send(
                SUBMIT_PROTOCOL, HEADER.pack(Submission.TYPE, 30 << 20), (SubmitReply,), close_write=False
            )
            outcomes.append((reply, time.monotonic() - started))

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)
            r.false_rejections += await control.honest_round()
    r.attempts = streams
    # Detected: refused as a stranger at once (a Reject), not read for the stream's whole deadline.
    r.detected = sum(isinstance(reply, Reject) and seconds < 5.0 for reply, seconds in outcomes)
    r.accepted = streams - r.detected
    return r


async def scenario_pay_inflation(x: Client, control: Client, db: HubDB) -> ScenarioResult:
    """A node declares $1000/h (refused: above the hub's ceiling), then holds a lease for 5 s at the ceiling
    and answers with a few tokens: paid for the tokens, not for the hold."""

    r = ScenarioResult("pay_inflation")
    reply = await x.join(x.join_request(price_per_hour=1000.0))
    r.attempts += 1
    r.detected += isinstance(reply, Reject)
    paid_before = db.paid(x.peer_id)
    tokens = 0

    async def hold(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
        nonlocal tokens
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        await trio.sleep(5.0)
        return groups

    answer = await x.worker.work(await x.take_lease(), rewrite=hold)
    paid = db.paid(x.peer_id) - paid_before
    r.attempts += 1
    # Paid at most for the tokens at the slowest rate the hub pays in full, at the price it joined at.
    from hub.config import LeaseConfig

    fair = 0.35 * tokens / LeaseConfig().paid_tokens_per_s_floor / 3600.0
    r.detected += isinstance(answer, SubmitReply) and paid <= fair * (1 + 1e-9)
    r.paid = max(0.0, paid - fair)  # what the hold earned on top of the work
    r.false_rejections += await control.honest_round()
    return r


async def scenario_rejected_disk(x: Client, control: Client, db: HubDB, attempts: int) -> ScenarioResult:
    """Submissions of large groups the hub refuses: kept as hashes, so the store grows by rows, not payloads (or,
    since frame caps follow the lease, refused at the frame's header before a byte of it is read or kept)."""
    r = ScenarioResult("rejected_disk")
    store = db.data_dir / "hub.sqlite"
    sent: dict[str, tuple[SubmittedGroup, ...]] = {}

    async def bloat(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
        # Completions far past the lease's length cap are refused; tens of kB each is what a filler sends.
        sent["made"], sent["bloated"] = (
            groups,
            tuple(
                g.model_copy(
                    update={
                        "completions": tuple(
                            c.model_copy(update={"token_ids": c.token_ids * 500, "logprobs": c.logprobs * 500})
                            for c in g.completions
                        )
                    }
                )
                for g in groups
            ),
        )
        return sent["bloated"]

    for _ in range(attempts):
        lease = await x.take_lease()
        before = sum(p.stat().st_size for p in store.parent.glob("hub.sqlite*"))
        reply = await x.worker.work(lease, rewrite=bloat)
        grown = sum(p.stat().st_size for p in store.parent.glob("hub.sqlite*")) - before
        payload = sum(len(g.model_dump_json()) for g in sent["bloated"])
        r.attempts += 1
        refused = isinstance(reply, Reject) or (isinstance(reply, SubmitReply) and reply.accepted == 0)
        r.detected += refused and grown < payload
        r.accepted += accepted_of(reply)
        if isinstance(reply, Reject):
            # Refused from the frame's header, the lease is still open: the genuine answer closes it, as a node
            # would (left open, leases count against the node's quota, and the next attempt waits for them to expire).
            await x.submit_answer(lease, sent["made"])
        r.false_rejections += await control.honest_round()
    return r


async def scenario_status_snooping(x: Client, control: Client, db: HubDB) -> ScenarioResult:
    """A stranger asks the hub's status: it sees the run, not what any node is paid or runs on."""

    r = ScenarioResult("status_snooping")
    async with AsyncExitStack() as stack:
        identity = Identity.generate()
        host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
        stranger = Client(host, identity, x.hub_addr, x.engine, x.config_hash)
        await stranger.connect()
        status = await stranger.status()
    r.attempts = 1
    leaked = [n for n in status.nodes if n.price_per_hour or n.cost_usd or n.hardware]
    r.detected = int(status.redacted and not leaked)
    r.accepted = len(leaked)
    r.false_rejections += await control.honest_round()
    return r


async def scenario_silent_stranger(x: Client, control: Client, db: HubDB, strangers: int) -> ScenarioResult:
    """Bare libp2p hosts that connect and never answer identify, held past the idle sweep (py-libp2p never recorded
    them, and forgetting them raised in the sweeper: the hub exited). The hub must live on and serve."""
    from libp2p.identity.identify.identify import ID as IDENTIFY
    from libp2p.identity.identify_push.identify_push import ID_PUSH as IDENTIFY_PUSH

    from shared.net import connect

    r = ScenarioResult("silent_stranger")
    async with AsyncExitStack() as stack:
        for _ in range(strangers):
            host, _ = await stack.enter_async_context(running_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]))
            host.remove_stream_handler(IDENTIFY)
            host.remove_stream_handler(IDENTIFY_PUSH)
            await connect(host, x.hub_addr)
        await trio.sleep(SILENT_STRANGER_HOLD_S)
    r.attempts = 1
    r.false_rejections += await control.honest_round()  # raises if the hub is gone
    r.detected = 1
    return r


async def scenario_relay_reservations(x: Client, control: Client, db: HubDB, attempts: int) -> ScenarioResult:
    """A member reserves relay slots in the names of random peers (it filled all 4,096 for an hour): every such
    reservation is refused and counted against it, and its own still works."""
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, PeerId, Status
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    from shared.net import open_stream

    async def reserve(peer: str | None) -> int | None:
        message = HopMessage(type=HopMessage.RESERVE)
        if peer is not None:
            message.peer.CopyFrom(PeerId(id=ID.from_base58(peer).to_bytes()))
        stream = await open_stream(x.host, x.hub_peer_id, PROTOCOL_ID)
        try:
            await write_delimited_msg(stream, message)
            with trio.fail_after(10):
                return (await read_delimited_msg(stream, HopMessage)).status
        except Exception:  # noqa: BLE001 - a reset is a refusal without an answer
            return None
        finally:
            await stream.reset()

    r = ScenarioResult("relay_reservations")
    for _ in range(attempts * 10):
        status = await reserve(Identity.generate().peer_id)
        r.attempts += 1
        r.detected += status != Status.OK
        r.accepted += status == Status.OK
    if await reserve(None) != Status.OK:
        r.false_rejections += 1
    r.false_rejections += await control.honest_round()
    return r


# -- running the scenarios against real hubs --------------------------------------------------


def trained_model_dir(base: Path, out: Path) -> Path:
    """The default model after three AdamW steps at lr 3e-4: the hub's policy in the wrong-model scenario."""
    from testbed.models import nudged_model

    model, tokenizer = nudged_model(base)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def with_clients(hub: HubProc, engines: list, body: Callable) -> object:
    """Join one client of a fresh identity per (engine, model dir) to `hub`, each of them answering its probe lease
    (a node is measured, then activated), and run `body(clients)`."""
    async with linked_clients(hub, [(Identity.generate(), engine, model_dir) for engine, model_dir in engines]) as clients:
        for client in clients:
            if await client.honest_round():
                raise RuntimeError("the hub rejected an honest probe answer")
        return await body(clients)


PROTOCOL_CHEATS = (
    "bad_signature",
    "replay",
    "fake_reward",
    "oversized_frame",
    "garbage_frame",
    "stream_flood",
    "hostile_join",
    "throwaway_identities",
    "stranger_big_frames",
    "pay_inflation",
    "rejected_disk",
    "status_snooping",
    "silent_stranger",
    "relay_reservations",
)
AUDIT_CHEATS = ("fake_logprobs", "wrong_model", "copied_completions", "nudged_copies", "partial_fabrication")
# Measured by bench/faults.py only: each is tested in process, faster, where the defence lives
# (tests/test_attacks.py, test_state.py, test_store.py).
BENCH_ONLY = frozenset(
    {
        "hostile_join",
        "throwaway_identities",
        "stranger_big_frames",
        "pay_inflation",
        "rejected_disk",
        "status_snooping",
        "silent_stranger",
        "relay_reservations",
    }
)


def start_protocol_hub(work: Path) -> HubProc:
    """The hub the protocol cheats run against: the embedded default model."""
    return start_hub(work / "hub-protocol", *HUB_ARGS)


def start_audit_hub(work: Path) -> HubProc:
    """The hub the caught-later cheats run against: a trained policy, so the base model is a wrong model."""
    from shared.default_model import ensure_default_model

    trained_dir = trained_model_dir(ensure_default_model(progress=False), work / "trained-model")
    return start_hub(work / "hub-audit", *HUB_ARGS, "--model", str(trained_dir))


def run_row(name: str, run: Callable[[], ScenarioResult]) -> ScenarioResult:
    """`run()`'s result; when it fails, a row of its own naming the error, so that the other scenarios still run."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a scenario that fails is its row's finding, not the end of the bench
        log.warning("scenario %s failed", name, exc_info=exc)
        return ScenarioResult(name, error=describe_failure(exc))


def run_cheat(name: str, hub: HubProc, quick: bool) -> ScenarioResult:
    """One cheat class against a running hub (a protocol hub for PROTOCOL_CHEATS, an audit hub for AUDIT_CHEATS),
    by fresh identities next to an honest control node."""
    if hub.process.poll() is not None:  # an earlier scenario ended it: say so, rather than wait to join
        raise RuntimeError(f"the hub is not running (exit status {hub.process.returncode})")
    from node.hf_engine import HFEngine
    from shared.default_model import ensure_default_model

    attempts = 2 if quick else 5
    db = HubDB(hub.data_dir)
    base_dir = ensure_default_model(progress=False)
    if name in PROTOCOL_CHEATS:
        engine = HFEngine(base_dir)

        async def protocol(clients) -> ScenarioResult:
            x, control = clients
            if name == "bad_signature":
                return await scenario_bad_signature(x, control, db, attempts)
            if name == "replay":
                return await scenario_replay(x, control, db, attempts)
            if name == "fake_reward":
                return await scenario_fake_reward(x, control, db, attempts)
            if name == "oversized_frame":
                return await scenario_oversized_frame(x, control, db)
            if name == "garbage_frame":
                return await scenario_garbage_frame(x, control, db)
            if name == "hostile_join":
                return await scenario_hostile_join(x, control, db)
            if name == "throwaway_identities":
                return await scenario_throwaway_identities(x, control, db, 300)
            if name == "stranger_big_frames":
                return await scenario_stranger_big_frames(x, control, db, 20)
            if name == "pay_inflation":
                return await scenario_pay_inflation(x, control, db)
            if name == "rejected_disk":
                return await scenario_rejected_disk(x, control, db, attempts)
            if name == "status_snooping":
                return await scenario_status_snooping(x, control, db)
            if name == "silent_stranger":
                return await scenario_silent_stranger(x, control, db, 4)
            if name == "relay_reservations":
                return await scenario_relay_reservations(x, control, db, attempts)
            return await scenario_stream_flood(x, control, db, FLOOD_STREAMS // (3 if quick else 1))

        result = trio.run(with_clients, hub, [(engine, base_dir)] * 2, protocol)
        if hub.process.poll() is not None:
            raise RuntimeError(f"hub died during {name}:\n{hub.output()[-2000:]}")
        return result
    if name not in AUDIT_CHEATS:
        raise ValueError(f"unknown cheat class {name!r}: one of {PROTOCOL_CHEATS + AUDIT_CHEATS}")
    trained_dir = hub.data_dir.parent / "trained-model"
    right, wrong = HFEngine(trained_dir), HFEngine(base_dir)

    async def caught_later(clients) -> ScenarioResult:
        control, cheat, original = clients
        if name == "fake_logprobs":
            rng = random.Random(3)

            async def fake(lease, groups):
                return tuple(
                    g.model_copy(
                        update={
                            "completions": tuple(
                                c.model_copy(
                                    update={"logprobs": tuple(min(0.0, lp + rng.uniform(-0.5, 0.5)) for lp in c.logprobs)}
                                )
                                for c in g.completions
                            )
                        }
                    )
                    for g in groups
                )

            return await scenario_caught_later(name, db, cheat, control, fake, attempts * 2)
        if name == "wrong_model":

            async def base_model(lease, groups):
                return await cheat.groups(lease, engine=wrong, claim_version=0)

            return await scenario_caught_later(name, db, cheat, control, base_model, attempts * 2)

        if name == "partial_fabrication":
            for _ in range(3):  # passed audits buy full-size leases while the node is still on probation
                await cheat.honest_round()

            async def one_fake_group(lease, groups):
                fake = groups[-1].model_copy(
                    update={
                        "completions": tuple(
                            c.model_copy(update={"logprobs": (0.0,) * len(c.logprobs)}) for c in groups[-1].completions
                        )
                    }
                )
                return (*groups[:-1], fake)

            return await scenario_caught_later(name, db, cheat, control, one_fake_group, attempts)
        nudge = 1e-7 if name == "nudged_copies" else 0.0

        async def copied(lease, own):
            first = await original.take_lease()
            groups = await original.groups(first)
            await original.submit_answer(first, groups)
            # The copier answers its own lease with the original's groups, prompt ids swapped in (and, for
            # nudged_copies, every log-prob moved by 1e-7: the fingerprint over exact floats missed those).
            return tuple(
                g.model_copy(
                    update={
                        "prompt_id": p.prompt_id,
                        "completions": tuple(
                            c.model_copy(update={"logprobs": tuple(min(0.0, lp + nudge) for lp in c.logprobs)})
                            for c in g.completions
                        ),
                    }
                )
                for g, p in zip(groups, lease.prompts)
            )

        return await scenario_caught_later(name, db, cheat, control, copied, attempts)

    return trio.run(with_clients, hub, [(right, trained_dir)] * 3, caught_later)


# -- crash: SIGKILL of the hub, restart, check the books ---------------------------------------


def run_crash(work: Path, kills: int, say: Callable[[str], None]) -> dict:
    from node.hf_engine import HFEngine
    from shared.default_model import ensure_default_model

    base_dir = ensure_default_model(progress=False)
    data_dir = work / "hub-crash"
    port = free_port()
    args = (
        "--local-nodes",
        "0",
        "--steps",
        "0",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--staleness",
        "2",
        "--max-new-tokens",
        "8",
    )
    engine = HFEngine(base_dir)
    acked: set[tuple[str, str]] = set()
    kill_log: list[str] = []
    rng = random.Random()

    async def session(hub: HubProc, mid_submission: bool) -> None:
        """Work honestly against `hub` until it is killed (by us, at a random moment)."""
        identity = Identity.load_or_create(work / "crash-client.key")
        async with linked_clients(hub, [(identity, engine, base_dir)]) as (client,):
            kill_at = time.monotonic() + rng.uniform(1.0, 6.0)
            while True:
                lease = await client.take_lease()
                if mid_submission and time.monotonic() >= kill_at:
                    # Kill while the hub holds this submission: it may or may not commit; we never see an ack.
                    async with trio.open_nursery() as inner:

                        async def kill_in_flight(lease: Lease, groups: tuple[SubmittedGroup, ...]):
                            inner.start_soon(kill_after, rng.uniform(0.0, 0.05), inner.cancel_scope)
                            return groups

                        async def kill_after(delay_s: float, scope: trio.CancelScope) -> None:
                            await trio.sleep(delay_s)
                            hub.process.send_signal(signal.SIGKILL)
                            kill_log.append("mid-submission")
                            scope.cancel()

                        inner.start_soon(partial(client.worker.work, lease, rewrite=kill_in_flight))
                    break
                reply = await client.worker.work(lease)
                if isinstance(reply, SubmitReply):
                    rejected = {pid for pid, _ in reply.rejected + reply.late}
                    acked.update((lease.lease_id, p.prompt_id) for p in lease.prompts if p.prompt_id not in rejected)
                if not mid_submission and time.monotonic() >= kill_at:
                    await trio.sleep(rng.uniform(0.0, 0.3))
                    hub.process.send_signal(signal.SIGKILL)  # mostly mid learner step: it steps every 4 groups
                    kill_log.append("random")
                    break

    for k in range(kills):
        say(f"crash {k + 1}/{kills}")
        hub = start_hub(data_dir, *args, port=port)
        try:
            trio.run(session, hub, k % 2 == 1)
            hub.process.wait(timeout=30)
        finally:
            hub.kill()
    say("crash: final restart")
    hub = start_hub(data_dir, *args, port=port)
    try:
        wait_until(lambda: hub.status() is not None, 60, "the restarted hub's status")
    finally:
        hub.stop()
    db = HubDB(data_dir)
    accepted = db.query(
        "SELECT lease_id, prompt_id, COUNT(*) FROM trajectories WHERE verdict = 'accepted' GROUP BY lease_id, prompt_id"
    )
    stored = {(lease, prompt) for lease, prompt, _ in accepted}
    double = sum(n - 1 for _, _, n in accepted if n > 1)
    paid_twice = db.query(
        "SELECT COUNT(*) FROM (SELECT lease_id FROM ledger WHERE voided = 0 AND lease_id IS NOT NULL GROUP BY lease_id HAVING COUNT(*) > 1)"
    )[0][0]
    versions = [v for (v,) in db.query("SELECT version FROM snapshots ORDER BY published_at")]
    steps = [s for (s,) in db.query("SELECT step FROM steps ORDER BY step")]
    integrity = db.query("PRAGMA integrity_check")[0][0]
    return {
        "kills": len(kill_log),
        "kill_points": kill_log,
        "acknowledged": len(acked),
        "lost": len(acked - stored),
        "double_counted": double,
        "paid_twice": paid_twice,
        "versions_monotone": versions == sorted(set(versions)) and steps == list(range(1, len(steps) + 1)),
        "steps": len(steps),
        "integrity_ok": integrity == "ok",
    }


# -- churn: nodes killed mid broadcast and mid lease ------------------------------------------


def run_churn(work: Path, nodes: int, say: Callable[[str], None]) -> dict:
    # The hub trains until stopped, so the kills cannot outlast a short run; it must keep
    # stepping after the last kill and then stop cleanly.
    staleness = 2
    hub = start_hub(
        work / "hub-churn",
        "--local-nodes",
        "0",
        "--steps",
        "0",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--staleness",
        str(staleness),
        "--max-new-tokens",
        "8",
    )
    procs = [start_node(hub.addr, work / f"churn-node-{i}") for i in range(nodes)]
    kills = max(2, round(0.3 * nodes))
    killed: list[str] = []
    try:
        ids = [node_peer_id(p, timeout_s=120) for p in procs]
        alive = dict(zip(ids, procs))
        rng = random.Random()
        # Half the kills right after a snapshot is published (its broadcast is in flight): the
        # survivors must still finish that snapshot (pulling around the dead relay).
        seen = hub.status().version if hub.status() else 0
        finished: set[str] = set()
        while len(killed) < kills // 2:
            status = wait_until(lambda seen=seen: (s := hub.status()) and s.version > seen and s, 300, "a new snapshot")
            seen = status.version
            victim = rng.choice(sorted(alive))
            alive.pop(victim).kill()
            killed.append(victim)
            say(f"churn: killed {victim[-6:]} during the broadcast of v{seen}")

            def holding(v=seen) -> set[str]:
                s = hub.status()
                return {n.peer_id for n in (s.nodes if s else ()) if n.peer_id in alive and n.version_held >= v}

            try:
                wait_until(lambda: len(holding()) == len(alive), BROADCAST_FINISH_S, f"the survivors to hold v{seen}")
            except TimeoutError:
                pass
            finished = holding()
        # ... the rest while they hold open leases.
        while len(killed) < kills:
            status = wait_until(lambda: (s := hub.status()) and s.open_leases > 0 and s, 300, "open leases")
            holders = [n.peer_id for n in status.nodes if n.peer_id in alive and n.state == "active"]
            victim = rng.choice(holders or sorted(alive))
            alive.pop(victim).kill()
            killed.append(victim)
            say(f"churn: killed {victim[-6:]} during leases")
        at_last_kill = hub.status().step
        try:
            wait_until(
                lambda: (s := hub.status()) and s.step >= at_last_kill + STEPS_AFTER_CHURN,
                300,
                "the run to keep stepping after the kills",
            )
            continued = True
        except TimeoutError:
            continued = False
        code = hub.stop()
        final = hub.status()
        # Survivors that finished the snapshot whose broadcast lost a node (the ones killed later,
        # during leases, are not survivors).
        with_snapshot = len(finished & alive.keys())
        return {
            "killed": len(killed),
            "survivors_with_snapshot": with_snapshot,
            "survivors": len(alive),
            "run_completed": continued and code in (0, 130) and final is not None and not final.running,
        }
    finally:
        for p in procs:
            p.kill()
        hub.kill()
