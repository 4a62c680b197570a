"""A node's session (SESSION_PROTOCOL) against a real hub service: its requests share one stream, a request on a
stream of its own is still served, and a peer misusing a session is refused and counted like any other.

The hub is the in-process HubService on a real libp2p host (tests/test_p2p_negative.py's harness).
"""

from __future__ import annotations

import pytest
import trio

import hub.service.handlers as handlers
from node.client import HubClient
from shared.crypto import Identity
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    SESSION_PROTOCOL,
    SESSION_REQUESTS,
    SESSIONS_PER_PEER,
    SUBMIT_PROTOCOL,
    Heartbeat,
    HeartbeatReply,
    Reject,
    RejectCode,
    SubmitReply,
)
from shared.net import open_stream, request
from shared.wire import StreamEOF, encode_message, encode_signed, read_message
from testbed.inproc import PERMISSIVE_TRUST, inproc_hub
from tests.test_p2p_negative import CONFIG, TEST_TIMEOUT_S, clients, joined_and_active, running_hub

HEARTBEAT = SESSION_REQUESTS.index(HEARTBEAT_PROTOCOL)


@pytest.fixture
def hub_args(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    return tmp_path, default_model_dir, AutoTokenizer.from_pretrained(default_model_dir)


async def open_session(client: HubClient):
    return await open_stream(client.host, client.hub_peer_id, SESSION_PROTOCOL)


async def ask_raw(stream, data: bytes, *reply_types):
    await stream.write(data)
    return await read_message(stream, *reply_types, Reject)


async def assert_ended(stream) -> None:
    """The hub ended the stream: nothing more comes."""
    with pytest.raises(StreamEOF):
        await read_message(stream, HeartbeatReply, Reject)


@pytest.mark.trio
async def test_a_nodes_requests_share_one_session_and_a_stream_per_request_is_still_served(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            peer = node.peer_id
            for _ in range(5):
                assert isinstance(await node.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            lease = await node.lease()
            reply = await HubClient.submit(node, node.answer(lease))  # the node's own submit, not the raw one
            assert isinstance(reply, SubmitReply) and reply.accepted == len(lease.prompts), reply
            assert len(node._idle) == 1
            assert hub.service.sessions_of(peer) == 1  # every one of those requests on one stream
            # A request on a stream of its own: served as well.
            beat = await request(
                node.host, node.hub_peer_id, HEARTBEAT_PROTOCOL, Heartbeat(version_held=0), HeartbeatReply, Reject, timeout_s=10
            )
            assert isinstance(beat, HeartbeatReply)
            # Concurrent requests open sessions up to the client's own bound, below the hub's.
            replies = []

            async def beat() -> None:
                replies.append(await node.heartbeat(Heartbeat(version_held=0)))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(beat)
            assert all(isinstance(r, HeartbeatReply) for r in replies), replies
            assert 1 <= len(node._idle) < SESSIONS_PER_PEER


@pytest.mark.trio
async def test_a_kept_session_is_replaced_when_stale_or_on_a_dropped_connection_and_the_hub_ends_idle_ones(hub_args, monkeypatch):
    import node.client

    monkeypatch.setattr(handlers, "SESSION_IDLE_S", 0.6)
    monkeypatch.setattr(node.client, "SESSION_REUSE_S", 0.3)  # as in production, well within the hub's idle time
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node_,):
            await joined_and_active(node_)
            peer = node_.peer_id
            assert isinstance(await node_.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            ((kept, _),) = node_._idle
            await trio.sleep(0.4)  # past its reuse time, before the hub's idle end
            assert isinstance(await node_.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            ((fresh, _),) = node_._idle
            assert fresh is not kept
            await trio.sleep(1.0)
            assert hub.service.sessions_of(peer) == 0  # ended idle by the hub: every slot went back
            # The connection drops and is dialled again: the session kept on the old one is not used.
            assert isinstance(await node_.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            ((kept, _),) = node_._idle
            await node_.host.disconnect(kept.muxed_conn.peer_id)
            await node_.connect()
            assert isinstance(await node_.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            ((fresh, _),) = node_._idle
            assert fresh is not kept and fresh.muxed_conn is not kept.muxed_conn


# -- a session misused: refused, counted, and the hub keeps serving -------------------------------------


@pytest.mark.trio
async def test_a_stranger_gets_no_session(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (stranger,):
            stream = await open_session(stranger)
            reply = await ask_raw(stream, bytes((HEARTBEAT,)) + encode_message(Heartbeat(version_held=0)), HeartbeatReply)
            assert isinstance(reply, Reject) and reply.code == RejectCode.UNKNOWN_NODE, reply
            await assert_ended(stream)
            assert not hub.service._sessions  # not one, of anyone


@pytest.mark.trio
async def test_a_selector_naming_no_request_is_refused_and_ends_the_session(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            refused = hub.state.membership.known(node.peer_id).tallies.refused
            stream = await open_session(node)
            reply = await ask_raw(
                stream, bytes((len(SESSION_REQUESTS),)) + encode_message(Heartbeat(version_held=0)), HeartbeatReply
            )
            assert isinstance(reply, Reject) and reply.code == RejectCode.BAD_REQUEST and "selector" in reply.reason
            await assert_ended(stream)
            assert hub.state.membership.known(node.peer_id).tallies.refused == refused + 1
            assert isinstance(await node.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)  # still served


@pytest.mark.trio
async def test_a_refused_request_ends_its_session_and_the_next_request_opens_another(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            before = hub.trusted()
            lease = await node.lease()
            stream = await open_session(node)
            forged = encode_signed(node.answer(lease), Identity.generate())  # signed by another key
            reply = await ask_raw(stream, bytes((SESSION_REQUESTS.index(SUBMIT_PROTOCOL),)) + forged, SubmitReply)
            assert isinstance(reply, Reject) and reply.code == RejectCode.BAD_REQUEST, reply
            await assert_ended(stream)
            assert hub.trusted() == before
            reply = await HubClient.submit(node, node.answer(lease))
            assert isinstance(reply, SubmitReply) and reply.accepted == len(lease.prompts), reply


@pytest.mark.trio
async def test_a_reject_on_the_clients_own_session_ends_it_and_it_is_not_kept(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            assert len(node._idle) == 1
            lease = await node.lease()
            reply = await HubClient.submit(node, node.answer(lease, lease_id="x" * 24))  # no such lease
            assert isinstance(reply, Reject) and reply.code == RejectCode.BAD_LEASE, reply
            assert node._idle == []
            with trio.fail_after(5):
                while hub.service.sessions_of(node.peer_id):
                    await trio.sleep(0.02)
            assert isinstance(await node.heartbeat(Heartbeat(version_held=0)), HeartbeatReply)
            assert len(node._idle) == 1 and hub.service.sessions_of(node.peer_id) == 1


@pytest.mark.trio
async def test_opening_sessions_in_a_loop_is_throttled_then_disconnected(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    strict = CONFIG.model_copy(
        update={
            "trust": PERMISSIVE_TRUST.model_copy(
                update={"requests_per_s": 1.0, "request_burst": 3, "violations_to_disconnect": 3}
            )
        }
    )
    with trio.fail_after(TEST_TIMEOUT_S):
        async with (
            inproc_hub(tmp_path, default_model_dir, strict) as hub,
            clients(hub, AutoTokenizer.from_pretrained(default_model_dir), 1) as (stranger,),
        ):
            codes = []
            beat = bytes((HEARTBEAT,)) + encode_message(Heartbeat(version_held=0))
            for _ in range(10):
                try:
                    reply = await ask_raw(await open_session(stranger), beat, HeartbeatReply)
                except Exception:  # noqa: BLE001 - disconnected: the stream (or the dial) fails
                    codes.append("gone")
                    break
                codes.append(reply.code)
            assert codes[:3] == [RejectCode.UNKNOWN_NODE] * 3, codes
            assert RejectCode.BUSY in codes and codes[-1] == "gone", codes


@pytest.mark.trio
async def test_a_node_past_the_cap_ends_its_oldest_waiting_session_or_is_busy_when_all_are_in_a_request(hub_args):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            for stream, _ in node._idle:  # the node's own session goes: the test holds every one itself
                await stream.close()
            node._idle.clear()
            with trio.fail_after(5):
                while hub.service.sessions_of(node.peer_id):
                    await trio.sleep(0.02)
            frame = encode_message(Heartbeat(version_held=0))
            beat = bytes((HEARTBEAT,)) + frame
            held = [await open_session(node) for _ in range(SESSIONS_PER_PEER)]
            for stream in held:  # each served, then waiting for its next request
                assert isinstance(await ask_raw(stream, beat, HeartbeatReply), HeartbeatReply)
            assert hub.service.sessions_of(node.peer_id) == SESSIONS_PER_PEER
            # One more (the node redialled, say): the oldest waiting one is ended, the new one served.
            newest = await open_session(node)
            assert isinstance(await ask_raw(newest, beat, HeartbeatReply), HeartbeatReply)
            await assert_ended(held[0])
            assert hub.service.sessions_of(node.peer_id) == SESSIONS_PER_PEER
            # Every one in a request (half a frame sent): one more is refused as busy, and none is ended.
            busy = [*held[1:], newest]
            for stream in busy:
                await stream.write(bytes((HEARTBEAT,)) + frame[:3])
            await trio.sleep(0.2)
            reply = await ask_raw(await open_session(node), beat, HeartbeatReply)
            assert isinstance(reply, Reject) and reply.busy and "each in a request" in reply.reason, reply
            for stream in busy:  # the rest of their frames: each answered
                await stream.write(frame[3:])
                assert isinstance(await read_message(stream, HeartbeatReply, Reject), HeartbeatReply)


@pytest.mark.trio
async def test_a_session_cut_mid_request_is_ended_by_the_request_deadline(hub_args, monkeypatch):
    monkeypatch.setattr(handlers, "HANDLER_TIMEOUT_S", 0.5)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with running_hub(*hub_args) as hub, clients(hub, hub_args[2], 1) as (node,):
            await joined_and_active(node)
            sessions = hub.service.sessions_of(node.peer_id)  # the node's own, kept from its lease request
            stream = await open_session(node)
            frame = encode_message(Heartbeat(version_held=0))
            await stream.write(bytes((HEARTBEAT,)) + frame[: len(frame) // 2])  # then nothing
            reply = await read_message(stream, HeartbeatReply, Reject)
            assert isinstance(reply, Reject) and reply.code == RejectCode.BAD_REQUEST and "TooSlow" in reply.reason
            await assert_ended(stream)
            with trio.fail_after(5):
                while hub.service.sessions_of(node.peer_id) != sessions:
                    await trio.sleep(0.02)
