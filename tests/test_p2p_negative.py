"""Misbehaving volunteers against a real hub service: the hub refuses, keeps serving, and trusts nothing they say.

The hub side is the real HubService on a real libp2p host (Noise + Yamux on loopback) with a
real SQLite store, fleet, lease book, replay buffer and snapshot shelf, assembled in-process
(the learner is replaced by a version counter the test moves). The volunteers are hand-built
libp2p clients with fresh identities that speak the protocols directly and misbehave.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import pytest
import torch
import trio
from transformers import AutoTokenizer

from hub.broadcast import ChainLinks, HubUplink
from hub.buffer import BufferSignal, ReplayBuffer
from hub.config import LeaseConfig
from hub.fleet import Fleet
from hub.leases import LeaseBook
from hub.service import HubService, LearnerView
from hub.snapshots import SnapshotShelf
from hub.store import Store
from hub.submissions import SubmissionRules
from shared.crypto import Identity
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    Heartbeat,
    HeartbeatReply,
    HubStatus,
    JoinReply,
    JoinRequest,
    Lease,
    LeaseReply,
    LeaseRequest,
    Reject,
    StatusRequest,
    Submission,
    SubmitReply,
    SubmittedGroup,
)
from shared.net import connect, open_stream, request, running_host
from shared.rollout import Completion, Group, SamplingParams
from shared.snapshot import build_snapshot, model_dir_config_hash
from shared.tasks.reverse import ReverseTask
from shared.wire import HEADER, StreamEOF, encode_frame, encode_signed, read_message
from tests.inproc import permissive_defences, refuse_reports

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
STALENESS = 2
PROMPTS_PER_LEASE = 2
GROUP_SIZE = 2
MAX_NEW_TOKENS = 8
TEST_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 10
log = logging.getLogger("test_p2p_negative")


# -- the hub ---------------------------------------------------------------------------------


@dataclass
class HubUnderTest:
    identity: Identity
    addr: str
    service: HubService
    store: Store
    fleet: Fleet
    leases: LeaseBook
    buffer: ReplayBuffer
    shelf: SnapshotShelf
    config_hash: str
    version: list[int] = field(default_factory=lambda: [0])

    def publish(self, version: int) -> None:
        """What the learner does every kappa steps: a new signed snapshot, and the learner is at that version."""
        self.shelf.add(build_snapshot({"w": torch.full((4,), float(version))}, version, self.identity, self.config_hash))
        self.version[0] = version

    def trusted(self) -> tuple:
        """What a misbehaving node must not be able to move: accepted work, money, what the learner will train on."""
        accepted = sum(1 for r in self.store.trajectories() if r.verdict == "accepted")
        return (
            accepted, self.store.ledger_by_node_usd(), len(self.buffer),
            tuple(sorted((n.peer_id, n.accepted) for n in self.fleet.nodes.values())),
        )


def _status(hub: HubUnderTest, addrs: tuple[str, ...]):
    def status(events: int) -> HubStatus:
        counts = hub.store.trajectory_counts()
        return HubStatus(
            hub_id=hub.identity.peer_id, addrs=addrs, running=True, updated_at=time.time(), step=hub.version[0],
            steps_target=0, version=hub.version[0], staleness=STALENESS, kappa=1, task="reverse", nodes=(),
            open_leases=len(hub.leases.open), accepted=counts["accepted"], rejected=counts["rejected"], late=counts["late"],
            dropped_stale=0,
        )

    return status


@asynccontextmanager
async def running_hub(tmp_path, model_dir, tokenizer) -> AsyncIterator[HubUnderTest]:
    identity = Identity.generate()
    task = ReverseTask()
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    rules = SubmissionRules(
        task=task, group_size=GROUP_SIZE, sampling=sampling, eos_id=tokenizer.eos_token_id,
        vocab_size=len(tokenizer), decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    async with running_host(identity, [LOOPBACK]) as (host, addrs):
        fleet = Fleet()
        hub = HubUnderTest(
            identity=identity, addr=addrs[0], service=None, store=Store(tmp_path / "hub.sqlite"), fleet=fleet,
            leases=LeaseBook(task, seed=0), buffer=ReplayBuffer(1000, STALENESS, skip_zero_variance=True),
            shelf=SnapshotShelf(keep=STALENESS + 1), config_hash=model_dir_config_hash(model_dir),
        )
        hub.publish(0)

        def activate_measured() -> None:
            # The scheduler's "activate all" without its control loop.
            for record in fleet.in_state("probing"):
                if record.measured:
                    record.state = "active"

        hub.service = HubService(
            host, store=hub.store, fleet=fleet, leases=hub.leases, buffer=hub.buffer, buffer_signal=BufferSignal(),
            shelf=hub.shelf, rules=rules,
            learner=LearnerView(lambda: max(0, hub.version[0] - STALENESS), STALENESS, prompts_per_step=8),
            config=LeaseConfig(prompts_per_lease=PROMPTS_PER_LEASE, lease_timeout_s=60.0),
            model_config_hash=hub.config_hash, task_name="reverse", heartbeat_period_s=2.0,
            status=_status(hub, tuple(addrs)),
            chain_links=lambda peer: ChainLinks(None, (), None, None, None),
            on_fleet_change=activate_measured, uplink=HubUplink(None, None), on_heartbeat=lambda: None,
            defences=permissive_defences(model_dir, hub.shelf, sampling, PROMPTS_PER_LEASE), on_report=refuse_reports,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.service.run)
            while SUBMIT_PROTOCOL not in host.get_mux().handlers:
                await trio.sleep(0.01)
            yield hub
            nursery.cancel_scope.cancel()
        hub.store.close()


# -- the volunteers ----------------------------------------------------------------------------


class Client:
    """A volunteer speaking the protocols by hand; `tokenizer` lets it make genuinely valid work too."""

    def __init__(self, host, identity: Identity, hub: HubUnderTest, tokenizer) -> None:
        self.host, self.identity, self.hub, self.tokenizer = host, identity, hub, tokenizer

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def ask(self, protocol: str, msg, *reply_types):
        return await request(self.host, self.hub.identity.peer_id, protocol, msg, *reply_types, Reject,
                             timeout_s=REQUEST_TIMEOUT_S)

    async def join(self, config_hash: str | None = None) -> JoinReply | Reject:
        return await self.ask(JOIN_PROTOCOL, JoinRequest(
            price_per_hour=0.5, hardware="test", link_bps=1e8, backend="hf",
            model_config_hash=config_hash or self.hub.config_hash, version_held=self.hub.version[0],
        ), JoinReply)

    async def lease(self) -> Lease:
        reply = await self.ask(LEASE_PROTOCOL, LeaseRequest(version_held=self.hub.version[0]), LeaseReply)
        assert isinstance(reply, LeaseReply) and reply.lease is not None, reply
        return reply.lease

    async def status(self) -> HubStatus:
        return await self.ask(STATUS_PROTOCOL, StatusRequest(events=0), HubStatus)

    def completion(self, text: str, version: int) -> Completion:
        ids = (*self.tokenizer.encode(text), self.tokenizer.eos_token_id)
        return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=version, text=text)

    def answer(self, lease: Lease, version: int | None = None, wrong_only: bool = False,
               claimed: tuple[float, ...] | None = None, lease_id: str | None = None,
               node_id: str | None = None) -> Submission:
        """One right and one wrong completion per prompt (or two wrong ones), at the hub's current version."""
        version = self.hub.version[0] if version is None else version
        groups = []
        for p in lease.prompts:
            word = p.text[:-1]
            texts = (word + "q", word + "z") if wrong_only else (word[::-1], word)
            groups.append(SubmittedGroup(prompt_id=p.prompt_id, completions=tuple(self.completion(t, version) for t in texts),
                                         claimed_rewards=claimed))
        return Submission(lease_id=lease_id or lease.lease_id, node_id=node_id or self.peer_id, groups=tuple(groups))

    async def send_raw(self, protocol: str, data: bytes, *reply_types) -> SubmitReply | Reject | None:
        """Write raw bytes, half-close, read one reply; None when the hub reset or closed the stream instead."""
        with trio.fail_after(REQUEST_TIMEOUT_S):
            stream = await open_stream(self.host, self.hub.identity.peer_id, protocol)
            try:
                await stream.write(data)
                await stream.close_write()
                return await read_message(stream, *reply_types, Reject)
            except StreamEOF:
                return None
            finally:
                await stream.reset()

    async def submit(self, submission: Submission, signer: Identity | None = None) -> SubmitReply | Reject:
        return await self.send_raw(SUBMIT_PROTOCOL, encode_signed(submission, signer or self.identity), SubmitReply)


@asynccontextmanager
async def clients(hub: HubUnderTest, tokenizer, n: int) -> AsyncIterator[list[Client]]:
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            await connect(host, hub.addr)
            out.append(Client(host, identity, hub, tokenizer))
        yield out


async def joined_and_active(client: Client) -> None:
    """Join, then answer the probe lease honestly so the hub measures and activates the node."""
    assert isinstance(await client.join(), JoinReply)
    probe = await client.lease()
    assert len(probe.prompts) == 1
    reply = await client.submit(client.answer(probe))
    assert isinstance(reply, SubmitReply) and reply.accepted == 1, reply
    assert client.hub.fleet.get(client.peer_id).state == "active"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture
def hub_args(tmp_path, default_model_dir, tokenizer):
    return tmp_path, default_model_dir, tokenizer


async def assert_still_serving(hub: HubUnderTest, tokenizer) -> None:
    """A fresh, honest volunteer can still join, lease and be paid for good work."""
    async with clients(hub, tokenizer, 1) as (honest,):
        await joined_and_active(honest)
        status = await honest.status()
        assert status.hub_id == hub.identity.peer_id


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.trio
async def test_honest_flow_is_accepted_and_paid(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            assert len(lease.prompts) == PROMPTS_PER_LEASE and lease.group_size == GROUP_SIZE
            reply = await node.submit(node.answer(lease))
            assert reply == SubmitReply(accepted=PROMPTS_PER_LEASE)
            assert hub.store.lease(lease.lease_id).state == "answered"
            assert hub.trusted()[0] == 1 + PROMPTS_PER_LEASE
            assert hub.store.ledger_total_usd(node.peer_id) > 0
            assert len(hub.buffer) == 1 + PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_full_buffer_says_busy_and_the_node_resubmits(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            hub.buffer.capacity_groups = len(hub.buffer)
            before = hub.trusted()
            reply = await node.submit(node.answer(lease))
            assert isinstance(reply, Reject) and reply.busy and "buffer full" in reply.reason
            assert hub.trusted() == before and lease.lease_id in hub.leases.open
            assert hub.fleet.get(node.peer_id).refused == 0  # the hub's own limit, not the node's fault
            hub.buffer.capacity_groups = 1000
            assert (await node.submit(node.answer(lease))).accepted == PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_a_node_rejoining_a_restarted_hub_keeps_its_tallies(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            reply = await node.submit(node.answer(lease, version=hub.version[0] + 5))  # never published
            assert isinstance(reply, SubmitReply) and len(reply.rejected) == PROMPTS_PER_LEASE
            await node.submit(node.answer(lease), signer=Identity.generate())  # refused outright
            for _ in range(3):
                hub.store.count_audit_pass(node.peer_id)
            hub.fleet.nodes.clear()  # what a hub restart leaves: the store, and no fleet in memory
            assert isinstance(await node.join(), JoinReply)
            record = hub.fleet.get(node.peer_id)
            assert (record.accepted, record.rejected, record.late, record.refused) == (1, PROMPTS_PER_LEASE, 0, 1)
            assert record.audits_passed == 3  # its probation and lease quota carry over the restart


@pytest.mark.trio
async def test_bad_signature_is_refused_and_the_lease_stays_answerable(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            before = hub.trusted()
            reply = await node.submit(node.answer(lease), signer=Identity.generate())
            assert isinstance(reply, Reject) and "not signed by" in reply.reason
            # Flip one byte of a correctly signed frame: the signature no longer covers it.
            frame = bytearray(encode_signed(node.answer(lease), node.identity))
            frame[-5] ^= 0x01
            reply = await node.send_raw(SUBMIT_PROTOCOL, bytes(frame), SubmitReply)
            assert isinstance(reply, Reject) and "not signed by" in reply.reason
            assert hub.trusted() == before
            assert hub.store.lease(lease.lease_id).state == "open" and lease.lease_id in hub.leases.open
            assert hub.service.counters["refused:" + SUBMIT_PROTOCOL] == 2
            # Counted against the node as refused requests, in memory and in the store; not as rejected groups.
            record = hub.fleet.get(node.peer_id)
            assert (record.refused, record.rejected) == (2, 0)
            assert (hub.store.node(node.peer_id).refused, hub.store.node(node.peer_id).rejected) == (2, 0)
            # The genuine answer still goes through.
            assert (await node.submit(node.answer(lease))).accepted == PROMPTS_PER_LEASE
            await assert_still_serving(hub, hub_args[2])


@pytest.mark.trio
async def test_another_nodes_lease_is_refused(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 2) as (owner, thief):
            await joined_and_active(owner)
            await joined_and_active(thief)
            lease = await owner.lease()
            before = hub.trusted()
            # The thief answers the owner's lease under its own name...
            reply = await thief.submit(thief.answer(lease))
            assert isinstance(reply, Reject) and "another node" in reply.reason
            # ...or in the owner's name, signed with its own key.
            reply = await thief.submit(thief.answer(lease, node_id=owner.peer_id))
            assert isinstance(reply, Reject) and "names another node" in reply.reason
            # ...or replays the owner's signed bytes over its own connection.
            reply = await thief.send_raw(SUBMIT_PROTOCOL, encode_signed(owner.answer(lease), owner.identity), SubmitReply)
            assert isinstance(reply, Reject) and "not signed by" in reply.reason
            assert hub.trusted() == before
            assert (await owner.submit(owner.answer(lease))).accepted == PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_replayed_submission_is_refused_and_not_paid_twice(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            frame = encode_signed(node.answer(lease), node.identity)
            assert (await node.send_raw(SUBMIT_PROTOCOL, frame, SubmitReply)).accepted == PROMPTS_PER_LEASE
            before = hub.trusted()
            for _ in range(2):
                reply = await node.send_raw(SUBMIT_PROTOCOL, frame, SubmitReply)
                assert isinstance(reply, Reject) and "already answered" in reply.reason
            # Two copies of the same group inside one submission are answered once.
            lease2 = await node.lease()
            doubled = node.answer(lease2)
            doubled = doubled.model_copy(update={"groups": doubled.groups + doubled.groups[:1]})
            reply = await node.submit(doubled)
            assert reply.accepted == PROMPTS_PER_LEASE
            assert reply.rejected == ((lease2.prompts[0].prompt_id, "prompt already answered"),)
            assert hub.trusted()[0] == before[0] + PROMPTS_PER_LEASE
            rows = [r for r in hub.store.trajectories() if r.lease_id == lease.lease_id]
            assert len(rows) == PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_stale_and_unpublished_versions_are_rejected_and_not_paid(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            for v in range(1, 6):
                hub.publish(v)  # the learner moved on: oldest accepted is now 5 - S = 3
            before, speed = hub.trusted(), hub.fleet.get(node.peer_id).rollouts_per_s
            reply = await node.submit(node.answer(lease, version=0))
            assert isinstance(reply, SubmitReply) and reply.accepted == 0
            assert reply.rejected == ()
            assert [why for _, why in reply.late] == ["stale version 0 (oldest accepted 3)"] * PROMPTS_PER_LEASE
            assert hub.trusted() == before  # rejected rows are recorded, nothing accepted or paid
            assert hub.fleet.get(node.peer_id).rollouts_per_s < speed  # measured on accepted work only
            # A version the hub never published is no better.
            lease = await node.lease()
            reply = await node.submit(node.answer(lease, version=9))
            assert reply.accepted == 0 and all("never published" in why for _, why in reply.rejected)
            assert hub.trusted() == before
            # A node holding too old a snapshot gets no work at all.
            reply = await node.ask(LEASE_PROTOCOL, LeaseRequest(version_held=1), LeaseReply)
            assert reply.lease is None and "fetch a snapshot >= v3" in reply.reason


@pytest.mark.trio
async def test_oversized_frames_are_refused_from_the_header(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            before = hub.trusted()
            caps = {SUBMIT_PROTOCOL: Submission, JOIN_PROTOCOL: JoinRequest, HEARTBEAT_PROTOCOL: Heartbeat,
                    LEASE_PROTOCOL: LeaseRequest}
            for protocol, cls in caps.items():
                started = time.monotonic()
                # The header alone claims more than the cap; the body never comes.
                reply = await node.send_raw(protocol, HEADER.pack(cls.TYPE, cls.MAX_BYTES + 65), SubmitReply)
                assert isinstance(reply, Reject) and "cap is" in reply.reason, (protocol, reply)
                assert time.monotonic() - started < 5
            # A 4 GiB claim is refused just the same, without allocating it.
            reply = await node.send_raw(SUBMIT_PROTOCOL, HEADER.pack(Submission.TYPE, 2**32 - 1), SubmitReply)
            assert isinstance(reply, Reject) and "cap is" in reply.reason
            assert hub.trusted() == before
            await assert_still_serving(hub, hub_args[2])


GARBAGE_PROTOCOLS = (JOIN_PROTOCOL, HEARTBEAT_PROTOCOL, LEASE_PROTOCOL, SUBMIT_PROTOCOL, STATUS_PROTOCOL, SNAPSHOT_PROTOCOL)


def garbage_payloads() -> list[bytes]:
    return [
        b"",  # nothing at all, then EOF
        b"\x00",  # a partial header
        os.urandom(200),  # random bytes
        encode_frame(250, os.urandom(64)),  # a binary tag no protocol expects
        encode_frame(Submission.TYPE, b"{not json"),
        encode_frame(JoinRequest.TYPE, b'{"price_per_hour": -5}'),
        encode_frame(LeaseRequest.TYPE, b"\xff" * 40),
        HEADER.pack(Heartbeat.TYPE, 100) + b"short",  # body shorter than the header says
        encode_frame(Submission.TYPE, os.urandom(64) + b'{"lease_id": "x"}'),
    ]


@pytest.mark.trio
async def test_garbage_on_every_protocol_changes_nothing(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S * 2):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 2) as (node, stranger):
            await joined_and_active(node)
            lease = await node.lease()
            before = hub.trusted()
            nodes_before = [(n.peer_id, n.state) for n in hub.store.nodes()]
            for client in (node, stranger):  # a joined node and one the hub has never heard of
                for protocol in GARBAGE_PROTOCOLS:
                    for payload in garbage_payloads():
                        reply = await client.send_raw(protocol, payload, SubmitReply)
                        assert reply is None or isinstance(reply, Reject), (protocol, payload[:20], reply)
            assert hub.trusted() == before
            assert [(n.peer_id, n.state) for n in hub.store.nodes()] == nodes_before
            assert hub.store.lease(lease.lease_id).state == "open"
            refused = sum(v for k, v in hub.service.counters.items() if k.startswith("refused:"))
            assert refused >= len(GARBAGE_PROTOCOLS) * 2
            # The joined node's lease is still good, and heartbeats still answer.
            assert (await node.submit(node.answer(lease))).accepted == PROMPTS_PER_LEASE
            beat = await node.ask(HEARTBEAT_PROTOCOL, Heartbeat(version_held=0, tokens_per_s=1.0, queue_depth=0),
                                  HeartbeatReply)
            assert isinstance(beat, HeartbeatReply) and beat.state == "active"
            await assert_still_serving(hub, hub_args[2])


@pytest.mark.trio
async def test_claimed_reward_is_ignored_the_hub_scores(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            # Wrong answers, each claimed to be worth 1.0.
            reply = await node.submit(node.answer(lease, wrong_only=True, claimed=(1.0, 1.0)))
            assert reply.accepted == PROMPTS_PER_LEASE
            rows = [r for r in hub.store.trajectories() if r.lease_id == lease.lease_id]
            assert len(rows) == PROMPTS_PER_LEASE and all(r.reward_mean == 0.0 for r in rows)
            stored = [
                Group.model_validate_json(hub.store.db.execute(
                    "SELECT group_json FROM trajectories WHERE id = ?", (r.id,)).fetchone()[0])
                for r in rows
            ]
            assert all(g.rewards == (0.0, 0.0) for g in stored)
            # All-zero groups teach nothing: the buffer refuses them, so they are never trained on.
            assert all(r.discard_reason == "zero reward variance" for r in hub.store.trajectories()
                       if r.lease_id == lease.lease_id)
            assert hub.service.counters["claimed_reward_mismatch"] == PROMPTS_PER_LEASE
            assert any(e.kind == "reward_claim_mismatch" and e.node_id == node.peer_id for e in hub.store.events())


@pytest.mark.trio
async def test_strangers_and_wrong_models_get_nothing(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (stranger,):
            reply = await stranger.ask(LEASE_PROTOCOL, LeaseRequest(version_held=0), LeaseReply)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            reply = await stranger.ask(HEARTBEAT_PROTOCOL, Heartbeat(version_held=0, tokens_per_s=0, queue_depth=0),
                                       HeartbeatReply)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            reply = await stranger.join(config_hash="0" * 64)
            assert isinstance(reply, Reject) and "model config differs" in reply.reason
            assert hub.fleet.nodes == {} and hub.store.nodes() == []
            # A submission from a stranger is verified (it is signed by the stranger) and then refused.
            fake = Submission(lease_id="0" * 24, node_id=stranger.peer_id, groups=())
            reply = await stranger.submit(fake)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            assert hub.trusted() == (0, {}, 0, ())
