"""Misbehaving volunteers against a real hub service: the hub refuses, keeps serving, and trusts nothing they say.

The hub side is the real HubService and HubState on a real libp2p host (Noise + Yamux on loopback)
with a real SQLite store, assembled in-process by the factory `echo-hub start` uses (the learner is
replaced by a version counter the test moves). The volunteers are libp2p clients with fresh
identities built on the node's own HubClient, speaking the protocols directly and misbehaving.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from transformers import AutoTokenizer

from hub.config import HubConfig, LearnerConfig, LeaseConfig
from hub.service.handlers import MEMBERS_ONLY
from hub.service.leasing import HANDLER_TIMEOUT_S
from hub.trust.submissions import REASON_CLAIMED_REWARD
from node.client import HubClient
from shared.crypto import Identity
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    LEAVE_PROTOCOL,
    LEFT_REASON,
    SNAPSHOT_PROTOCOL,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Lease,
    LeaseReply,
    LeaseRequest,
    LeaveReply,
    Reject,
    RejectCode,
    Submission,
    SubmitReply,
    SubmittedGroup,
    Tallies,
)
from shared.net import running_host
from shared.rollout import Completion, SamplingParams
from shared.wire import HEADER, StreamEOF, encode_frame, encode_signed
from testbed.inproc import PERMISSIVE_TRUST, InprocHub, inproc_hub, wait_state

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
STALENESS = 2
PROMPTS_PER_LEASE = 2
GROUP_SIZE = 2
MAX_NEW_TOKENS = 8
TEST_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 10
log = logging.getLogger("test_p2p_negative")

CONFIG = HubConfig(
    learner=LearnerConfig(staleness=STALENESS, prompts_per_step=8, group_size=GROUP_SIZE, buffer_max_groups=1000),
    sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
    lease=LeaseConfig(prompts_per_lease=PROMPTS_PER_LEASE, lease_timeout_s=60.0),
    trust=PERMISSIVE_TRUST,
)


@asynccontextmanager
async def running_hub(tmp_path, model_dir, tokenizer, identity: Identity | None = None) -> AsyncIterator[InprocHub]:
    async with inproc_hub(tmp_path, model_dir, CONFIG, identity) as hub:
        yield hub


# -- the volunteers ----------------------------------------------------------------------------


class Client(HubClient):
    """A volunteer speaking the protocols by hand; `tokenizer` lets it make genuinely valid work too."""

    def __init__(self, host, identity: Identity, hub: InprocHub, tokenizer) -> None:
        super().__init__(host, identity, hub.addr, timeout_s=REQUEST_TIMEOUT_S)
        self.hub, self.tokenizer = hub, tokenizer

    async def join(self, config_hash: str | None = None) -> JoinReply | Reject:
        return await super().join(
            JoinRequest(
                price_per_hour=0.5,
                hardware="test",
                link_bps=1e8,
                backend="hf",
                dtype="float32",
                model_config_hash=config_hash or self.hub.config_hash,
                version_held=self.hub.version,
            )
        )

    async def lease(self) -> Lease:
        reply = await super().lease(self.hub.version)
        assert isinstance(reply, LeaseReply) and reply.lease is not None, reply
        return reply.lease

    def completion(self, text: str, version: int) -> Completion:
        ids = (*self.tokenizer.encode(text), self.tokenizer.eos_token_id)
        return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=version, text=text)

    def answer(
        self,
        lease: Lease,
        version: int | None = None,
        wrong_only: bool = False,
        claimed: tuple[float, ...] | None = None,
        lease_id: str | None = None,
        node_id: str | None = None,
    ) -> Submission:
        """One right and one wrong completion per prompt (or two wrong ones), at the hub's current version."""
        version = self.hub.version if version is None else version
        groups = []
        for p in lease.prompts:
            word = p.text[:-1]
            texts = (word + "q", word + "z") if wrong_only else (word[::-1], word)
            groups.append(
                SubmittedGroup(
                    prompt_id=p.prompt_id, completions=tuple(self.completion(t, version) for t in texts), claimed_rewards=claimed
                )
            )
        return Submission(lease_id=lease_id or lease.lease_id, node_id=node_id or self.peer_id, groups=tuple(groups))

    async def send_raw(self, protocol: str, data: bytes, *reply_types) -> SubmitReply | Reject | None:
        """Write raw bytes, half-close, read one reply; None when the hub reset or closed the stream instead."""
        try:
            return await self.send_frame(protocol, data, *reply_types)
        except StreamEOF:
            return None

    async def submit(self, submission: Submission, signer: Identity | None = None) -> SubmitReply | Reject:
        return await self.send_raw(SUBMIT_PROTOCOL, encode_signed(submission, signer or self.identity), SubmitReply)


@asynccontextmanager
async def clients(hub: InprocHub, tokenizer, n: int) -> AsyncIterator[list[Client]]:
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            client = Client(host, identity, hub, tokenizer)
            await client.connect()
            out.append(client)
        yield out


async def joined_and_active(client: Client) -> None:
    """Join, then answer the probe lease honestly so the hub measures and activates the node."""
    assert isinstance(await client.join(), JoinReply)
    probe = await client.lease()
    assert len(probe.prompts) == 1
    reply = await client.submit(client.answer(probe))
    assert isinstance(reply, SubmitReply) and reply.accepted == 1, reply
    await wait_state(client.hub, client.peer_id, "active")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture
def hub_args(tmp_path, default_model_dir, tokenizer):
    return tmp_path, default_model_dir, tokenizer


async def assert_still_serving(hub: InprocHub, tokenizer) -> None:
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
            paid_before = hub.state.store.groups.ledger_total_usd(node.peer_id)
            reply = await node.submit(node.answer(lease))
            assert (reply.accepted, reply.rejected, reply.late) == (PROMPTS_PER_LEASE, (), ())
            # The node is told what it was paid, and that is what the ledger booked.
            assert reply.paid_usd > 0
            assert reply.paid_usd == pytest.approx(hub.state.store.groups.ledger_total_usd(node.peer_id) - paid_before)
            assert hub.state.store.leases.lease(lease.lease_id).state == "answered"
            assert hub.trusted()[0] == 1 + PROMPTS_PER_LEASE
            assert hub.state.store.groups.ledger_total_usd(node.peer_id) > 0
            assert len(hub.state.buffer) == 1 + PROMPTS_PER_LEASE
            assert reply.next_lease is None  # not asked for
            # One round trip per lease: a submission may ask for the next lease, which its reply carries.
            lease = await node.lease()
            reply = await node.submit(node.answer(lease).model_copy(update={"next_lease_for": hub.version}))
            assert reply.accepted == PROMPTS_PER_LEASE and reply.next_lease.lease is not None
            following = reply.next_lease.lease
            assert (
                following.lease_id in hub.state.leasing.book.open
                and hub.state.store.leases.lease(following.lease_id).state == "open"
            )
            assert (await node.submit(node.answer(following))).accepted == PROMPTS_PER_LEASE
            # The piggybacked request obeys the same rules as a lease request: no snapshot held, no lease.
            lease = await node.lease()
            reply = await node.submit(node.answer(lease).model_copy(update={"next_lease_for": -1}))
            assert reply.accepted == PROMPTS_PER_LEASE
            assert reply.next_lease.lease is None and "fetch a snapshot" in reply.next_lease.reason


@pytest.mark.trio
async def test_full_buffer_says_busy_and_the_node_resubmits(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            hub.state.buffer.capacity_groups = len(hub.state.buffer)
            before = hub.trusted()
            reply = await node.submit(node.answer(lease))
            assert isinstance(reply, Reject) and reply.busy and "buffer full" in reply.reason
            assert hub.trusted() == before and lease.lease_id in hub.state.leasing.book.open
            assert hub.state.fleet.get(node.peer_id).tallies.refused == 0  # the hub's own limit, not the node's fault
            hub.state.buffer.capacity_groups = 1000
            assert (await node.submit(node.answer(lease))).accepted == PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_a_node_rejoining_a_restarted_hub_keeps_its_tallies(hub_args):
    tmp_path, model_dir, tokenizer = hub_args
    identity = Identity.generate()
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args, identity=identity) as hub, clients(hub, tokenizer, 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            reply = await node.submit(node.answer(lease, version=hub.version + 5))  # never published
            assert isinstance(reply, SubmitReply) and len(reply.rejected) == PROMPTS_PER_LEASE
            await node.submit(node.answer(lease), signer=Identity.generate())  # refused outright
            for _ in range(3):
                hub.state.store.members.record_audit_pass(node.peer_id, time.time())
            paid = hub.state.totals.paid_usd[node.peer_id]
            node_identity = node.identity
        # A new hub process on the same data dir and key: the store is all that is left.
        async with running_hub(*hub_args, identity=identity) as hub, AsyncExitStack() as stack:
            record = hub.state.fleet.get(node_identity.peer_id)
            assert record.state == "gone" and hub.state.totals.paid_usd[node_identity.peer_id] == paid
            host, _ = await stack.enter_async_context(running_host(node_identity, [LOOPBACK]))
            node = Client(host, node_identity, hub, tokenizer)
            await node.connect()
            assert isinstance(await node.join(), JoinReply)
            record = hub.state.fleet.get(node.peer_id)
            assert record.tallies == Tallies(accepted=1, rejected=PROMPTS_PER_LEASE, refused=1)
            assert record.audits_passed == 3  # its probation and lease quota carry over the restart
            assert record.state != "probing" and record.measured  # no second probe: its throughput is known


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
            assert hub.state.store.leases.lease(lease.lease_id).state == "open" and lease.lease_id in hub.state.leasing.book.open
            # Counted against the node as refused requests, in memory and in the store; not as rejected groups.
            tallies = hub.state.fleet.get(node.peer_id).tallies
            assert (tallies.refused, tallies.rejected) == (2, 0)
            assert hub.state.store.members.node(node.peer_id).tallies == tallies
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
            await thief.lease()  # a lease holder, so its submission is read and judged
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
async def test_replayed_submission_gets_its_first_reply_and_is_not_paid_twice(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            frame = encode_signed(node.answer(lease), node.identity)
            first = await node.send_raw(SUBMIT_PROTOCOL, frame, SubmitReply)
            assert first.accepted == PROMPTS_PER_LEASE
            before = hub.trusted()
            # The same signed bytes again (their reply lost on the way, say) get the first reply back, holding no
            # lease or another one: nothing is booked, paid or counted twice.
            assert await node.send_raw(SUBMIT_PROTOCOL, frame, SubmitReply) == first
            lease2 = await node.lease()
            for _ in range(2):
                assert await node.send_raw(SUBMIT_PROTOCOL, frame, SubmitReply) == first
            # Other bytes for the answered lease are refused as answered.
            answer = node.answer(lease)
            other = encode_signed(answer.model_copy(update={"groups": answer.groups[:1]}), node.identity)
            reply = await node.send_raw(SUBMIT_PROTOCOL, other, SubmitReply)
            assert isinstance(reply, Reject) and "already answered" in reply.reason, reply
            assert hub.trusted() == before
            # Two copies of the same group inside one submission are answered once.
            doubled = node.answer(lease2)
            doubled = doubled.model_copy(update={"groups": doubled.groups + doubled.groups[:1]})
            reply = await node.submit(doubled)
            assert reply.accepted == PROMPTS_PER_LEASE
            assert reply.rejected == ((lease2.prompts[0].prompt_id, "prompt already answered"),)
            assert hub.trusted()[0] == before[0] + PROMPTS_PER_LEASE
            rows = [r for r in hub.state.store.groups.trajectories() if r.lease_id == lease.lease_id]
            assert len(rows) == PROMPTS_PER_LEASE


@pytest.mark.trio
async def test_stale_and_unpublished_versions_are_rejected_and_not_paid(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            for v in range(1, 6):
                hub.publish(v)  # the learner moved on: oldest accepted is now 5 - S = 3
            before, speed = hub.trusted(), hub.state.fleet.get(node.peer_id).rollouts_per_s
            reply = await node.submit(node.answer(lease, version=0))
            assert isinstance(reply, SubmitReply) and reply.accepted == 0
            assert reply.rejected == ()
            assert [why for _, why in reply.late] == ["stale version 0 (oldest accepted 3)"] * PROMPTS_PER_LEASE
            assert hub.trusted() == before  # rejected rows are recorded, nothing accepted or paid
            assert hub.state.fleet.get(node.peer_id).rollouts_per_s < speed  # measured on accepted work only
            # A version the hub never published is no better.
            lease = await node.lease()
            reply = await node.submit(node.answer(lease, version=9))
            assert reply.accepted == 0 and all("never published" in why for _, why in reply.rejected)
            assert hub.trusted() == before
            # A node holding too old a snapshot gets no work at all.
            reply = await node.ask(LEASE_PROTOCOL, LeaseRequest(version_held=1), LeaseReply)  # below the window
            assert reply.lease is None and "fetch a snapshot >= v3" in reply.reason


@pytest.mark.trio
async def test_oversized_frames_are_refused_from_the_header(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            await node.lease()  # a lease holder's submission header is read against the full cap
            before = hub.trusted()
            caps = {
                SUBMIT_PROTOCOL: Submission,
                JOIN_PROTOCOL: JoinRequest,
                HEARTBEAT_PROTOCOL: Heartbeat,
                LEASE_PROTOCOL: LeaseRequest,
            }
            for protocol, cls in caps.items():
                # The header alone claims more than the cap; the body never comes. A hub that waited for it would
                # answer only when its handler timed out: half that is the bound, far past any loaded machine's lag.
                with trio.fail_after(HANDLER_TIMEOUT_S / 2):
                    reply = await node.send_raw(protocol, HEADER.pack(cls.TYPE, cls.MAX_BYTES + 65), SubmitReply)
                assert isinstance(reply, Reject) and "cap is" in reply.reason, (protocol, reply)
            # A 4 GiB claim is refused just the same, without allocating it.
            reply = await node.send_raw(SUBMIT_PROTOCOL, HEADER.pack(Submission.TYPE, 2**32 - 1), SubmitReply)
            assert isinstance(reply, Reject) and "cap is" in reply.reason
            # Far below the protocol's cap, a submission is still capped at what an honest answer to the
            # node's lease takes (2 prompts x 2 completions x 8 tokens here): one byte more is refused.
            cap = hub.state.intake.frame_cap(node.peer_id)
            assert 0 < cap < 64 * 1024
            reply = await node.send_raw(SUBMIT_PROTOCOL, HEADER.pack(Submission.TYPE, cap + 1), SubmitReply)
            assert isinstance(reply, Reject) and f"cap is {cap}" in reply.reason
            assert hub.trusted() == before
            await assert_still_serving(hub, hub_args[2])


GARBAGE_PROTOCOLS = (
    JOIN_PROTOCOL,
    HEARTBEAT_PROTOCOL,
    LEASE_PROTOCOL,
    SUBMIT_PROTOCOL,
    STATUS_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    LEAVE_PROTOCOL,
)


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
async def test_leave_drops_only_the_peer_that_asks_and_gives_its_leases_back(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S * 2):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 3) as (node, other, stranger):
            for client in (node, other):
                await joined_and_active(client)
            lease = await node.lease()
            # a peer the hub never heard of is told to join first, and nobody else moves
            refused = await stranger.leave(REQUEST_TIMEOUT_S)
            assert isinstance(refused, Reject) and refused.code == RejectCode.UNKNOWN_NODE, refused
            assert hub.state.fleet.get(node.peer_id).state == "active"
            reply = await node.leave(REQUEST_TIMEOUT_S)
            assert reply == LeaveReply(leases_released=1)
            assert hub.state.fleet.get(node.peer_id).state == "standby"  # a member until its silence drops it
            assert hub.state.fleet.get(other.peer_id).state == "active"
            assert hub.state.leasing.book.leases_of(node.peer_id) == []
            left = [(e.kind, e.node_id) for e in hub.state.store.journal.events() if e.detail == LEFT_REASON]
            assert left == [("release", node.peer_id)]
            # the lease it gave back is no longer its own to answer
            late = await node.submit(node.answer(lease))
            assert isinstance(late, Reject) and late.code == RejectCode.BAD_LEASE, late
            await assert_still_serving(hub, hub_args[2])


@pytest.mark.trio
async def test_garbage_on_every_protocol_changes_nothing(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S * 2):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 2) as (node, stranger):
            await joined_and_active(node)
            lease = await node.lease()
            before = hub.trusted()
            nodes_before = [(n.peer_id, n.state) for n in hub.state.store.members.nodes()]
            refused_before = hub.state.fleet.get(node.peer_id).tallies.refused
            sent = 0
            for client in (node, stranger):  # a joined node and one the hub has never heard of
                for protocol in GARBAGE_PROTOCOLS:
                    for payload in garbage_payloads():
                        reply = await client.send_raw(protocol, payload, SubmitReply)
                        # Every one is answered with a Reject that says why, never a silent reset.
                        expected = (
                            RejectCode.UNKNOWN_NODE if client is stranger and protocol in MEMBERS_ONLY else RejectCode.BAD_REQUEST
                        )
                        assert isinstance(reply, Reject) and reply.code == expected, (protocol, payload[:20], reply)
                        sent += client is node
            assert hub.trusted() == before
            assert [(n.peer_id, n.state) for n in hub.state.store.members.nodes()] == nodes_before
            assert hub.state.store.leases.lease(lease.lease_id).state == "open"
            # Counted against the joined node, once per refused request; the stranger has nothing to count against.
            assert hub.state.fleet.get(node.peer_id).tallies.refused == refused_before + sent
            assert hub.state.fleet.get(stranger.peer_id) is None
            # The joined node's lease is still good, and heartbeats still answer.
            assert (await node.submit(node.answer(lease))).accepted == PROMPTS_PER_LEASE
            beat = await node.ask(HEARTBEAT_PROTOCOL, Heartbeat(version_held=0), HeartbeatReply)
            assert isinstance(beat, HeartbeatReply) and beat.state == "active"
            await assert_still_serving(hub, hub_args[2])


@pytest.mark.trio
async def test_a_claimed_reward_the_hub_does_not_score_is_refused_unpaid_and_counted(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            lease = await node.lease()
            before = hub.trusted()
            # Wrong answers, each claimed to be worth 1.0: a lie about the reward.
            reply = await node.submit(node.answer(lease, wrong_only=True, claimed=(1.0, 1.0)))
            assert reply.accepted == 0 and reply.paid_usd == 0.0
            assert [why for _, why in reply.rejected] == [REASON_CLAIMED_REWARD] * PROMPTS_PER_LEASE
            assert hub.trusted()[:3] == before[:3]  # nothing accepted, paid or buffered
            assert hub.state.fleet.get(node.peer_id).tallies.rejected == PROMPTS_PER_LEASE
            assert [e.detail for e in hub.state.store.journal.events() if e.kind == "reward_claim_mismatch"] == [
                f"{PROMPTS_PER_LEASE} groups claimed other rewards"
            ]
            # Claims that match the hub's scores are fine.
            lease = await node.lease()
            reply = await node.submit(node.answer(lease, claimed=(1.0, 0.0)))
            assert reply.accepted == PROMPTS_PER_LEASE and reply.paid_usd > 0


@pytest.mark.trio
async def test_strangers_and_wrong_models_get_nothing(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (stranger,):
            reply = await stranger.ask(LEASE_PROTOCOL, LeaseRequest(version_held=0), LeaseReply)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            reply = await stranger.ask(HEARTBEAT_PROTOCOL, Heartbeat(version_held=0), HeartbeatReply)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            reply = await stranger.join(config_hash="0" * 64)
            assert isinstance(reply, Reject) and "model config differs" in reply.reason
            assert hub.state.fleet.nodes == {} and hub.state.store.members.nodes() == []
            # A submission from a stranger is verified (it is signed by the stranger) and then refused.
            fake = Submission(lease_id="0" * 24, node_id=stranger.peer_id, groups=())
            reply = await stranger.submit(fake)
            assert isinstance(reply, Reject) and "join first" in reply.reason
            assert hub.trusted() == (0, {}, 0, ())


@pytest.mark.trio
async def test_a_growing_fleet_is_told_to_heartbeat_less_often(hub_args):
    """At most scheduler.heartbeats_per_s in all: the join and heartbeat replies stretch the period."""
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 3) as nodes:
            state = hub.state
            state.membership.heartbeats_per_s = 1.0  # three nodes at one beat/s in all: every 3 s each (configured: 2 s)
            first = await nodes[0].join()
            assert first.heartbeat_period_s == 2.0
            for node in nodes[1:]:
                assert isinstance(await node.join(), JoinReply)
            state.membership._period_counted_at -= 60  # the count is refreshed once a second: let this beat recount
            reply = await nodes[0].heartbeat(Heartbeat(version_held=0))
            assert reply.heartbeat_period_s == 3.0 and state.fleet.get(nodes[0].peer_id).heartbeat_period_s == 3.0
