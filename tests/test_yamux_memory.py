"""Memory a peer can make a host hold through Yamux, attacked with real libp2p hosts on loopback: bytes sent past
a stream's receive window, bytes pushed on a stream the hub has answered (a stranger's status, a member's
heartbeat), and many streams each filled within its window and never read. Each attacker floods at most
FLOOD_BYTES, stops once disconnected, and must be disconnected with this process's RSS (hub and attacker both
live here) grown by at most RSS_GROWTH_BYTES; honest requests are answered afterwards
(shared/libp2p_patches.py, shared.net.close_answered)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import SimpleNamespace

import pytest
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE

from hub.service.handlers import REFUSE_LINGER_S, REFUSE_WRITE_TIMEOUT_S
from hub.service.leasing import HANDLER_TIMEOUT_S
from shared import libp2p_patches
from shared.crypto import Identity
from shared.libp2p_patches import CONNECTION_BUFFER_BYTES
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    STATUS_PROTOCOL,
    Heartbeat,
    HeartbeatReply,
    HubStatus,
    JoinReply,
    JoinRequest,
    StatusRequest,
)
from shared.net import connect, open_stream, request, running_host, set_handler
from shared.wire import encode_frame, read_exact, read_message, write_message
from testbed.inproc import PERMISSIVE_CONFIG, InprocHub, inproc_hub
from testbed.strangers import GARBAGE_BYTE, NODE_PROTOCOLS, WRITE_PATTERNS, StreamFate, echo2_protocols, probe_stream

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TEST_TIMEOUT_S = 30
# What a hub may grow by per attacking connection (the bound), and what one attacker may push at most.
RSS_GROWTH_BYTES = 64 << 20
FLOOD_BYTES = 192 << 20
FLOOD_WRITE_BYTES = 1 << 20
NOT_READ = "/echo2-test/not-read/1"
ECHO = "/echo2-test/echo/1"
HELLO = b"still here"
log = logging.getLogger("test_yamux_memory")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def connected(host: IHost, peer_id: str) -> bool:
    return bool(host.get_network().get_connections(ID.from_base58(peer_id)))


async def flood(streams: list[INetStream], write_bytes: int, ignore_window: bool) -> tuple[int, int]:
    """Write `write_bytes` at a time round the streams (with `ignore_window`, as if each had all the window it
    wants) until FLOOD_BYTES or the connection fails; the bytes written and the most RSS grew meanwhile."""
    start = peak = rss_bytes()
    sent = 0
    chunk = b"\xee" * write_bytes
    try:
        while sent < FLOOD_BYTES:
            stream = streams[(sent // write_bytes) % len(streams)]
            if ignore_window:
                stream.muxed_stream.send_window = FLOOD_BYTES  # what a hostile Yamux does: never wait for credit
            await stream.write(chunk)
            sent += len(chunk)
            peak = max(peak, rss_bytes())
    except Exception as exc:  # noqa: BLE001 - the attacker's connection ends however py-libp2p reports it
        log.info("flood ended after %d bytes: %r", sent, exc)
    return sent, max(peak, rss_bytes()) - start


async def disconnected(victim: IHost, attacker_id: str) -> None:
    with trio.fail_after(10):
        while connected(victim, attacker_id):
            await trio.sleep(0.05)


@asynccontextmanager
async def attacker(stack: AsyncExitStack, addr: str) -> AsyncIterator[tuple[IHost, Identity]]:
    identity = Identity.generate()
    host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
    await connect(host, addr)
    yield host, identity


@asynccontextmanager
async def unread_server() -> AsyncIterator[tuple[IHost, Identity, str]]:
    """A host whose NOT_READ handler reads nothing (a handler busy elsewhere), and which answers ECHO."""
    identity = Identity.generate()
    done = trio.Event()

    async def hold(stream: INetStream) -> None:
        await done.wait()
        await stream.reset()

    async with running_host(identity, [LOOPBACK]) as (host, addrs):
        set_handler(host, NOT_READ, hold, log)
        set_handler(host, ECHO, echo_handler, log)
        try:
            yield host, identity, addrs[0]
        finally:
            done.set()


async def echo_handler(stream: INetStream) -> None:
    await stream.write(await read_exact(stream, len(HELLO)))
    await stream.close()


async def assert_echo_answered(addr: str, server_id: str) -> None:
    async with running_host(Identity.generate(), [LOOPBACK]) as (honest, _):
        await connect(honest, addr)
        stream = await open_stream(honest, server_id, ECHO)
        await stream.write(HELLO)
        await stream.close_write()
        assert await read_exact(stream, len(HELLO)) == HELLO
        await stream.close()


@pytest.mark.trio
async def test_bytes_past_the_receive_window_close_the_connection():
    with trio.fail_after(TEST_TIMEOUT_S):
        async with unread_server() as (server, server_id, addr), AsyncExitStack() as stack:
            async with attacker(stack, addr) as (host, identity):
                stream = await open_stream(host, server_id.peer_id, NOT_READ)
                sent, growth = await flood([stream], FLOOD_WRITE_BYTES, ignore_window=True)
                assert sent < FLOOD_BYTES and growth <= RSS_GROWTH_BYTES, (sent, growth)
                await disconnected(server, identity.peer_id)
            assert libp2p_patches.overruns(identity.peer_id) == 1
            await assert_echo_answered(addr, server_id.peer_id)


@pytest.mark.trio
async def test_streams_each_within_its_window_but_never_read_are_capped_per_connection():
    """A peer that keeps to every window, on more streams than the cap holds at a window each, the host reading
    none of them (its handlers busy elsewhere)."""
    per_stream = DEFAULT_WINDOW_SIZE - 1024  # the window less what protocol negotiation took of it
    streams_needed = CONNECTION_BUFFER_BYTES // per_stream + 8
    with trio.fail_after(TEST_TIMEOUT_S):
        async with unread_server() as (server, server_id, addr), AsyncExitStack() as stack:
            async with attacker(stack, addr) as (host, identity):
                streams = [await open_stream(host, server_id.peer_id, NOT_READ) for _ in range(streams_needed)]
                _, growth = await flood(streams, per_stream, ignore_window=False)
                assert growth <= RSS_GROWTH_BYTES, growth
                await disconnected(server, identity.peer_id)
            assert libp2p_patches.overruns(identity.peer_id) == 1
            await assert_echo_answered(addr, server_id.peer_id)


def join_frame(hub: InprocHub) -> bytes:
    body = {
        "price_per_hour": 0.5,
        "hardware": "x",
        "link_bps": 1e8,
        "backend": "hf",
        "dtype": "float32",
        "model_config_hash": hub.config_hash,
        "version_held": 0,
        "listen_addrs": [],
    }
    return encode_frame(JoinRequest.TYPE, json.dumps(body).encode())


async def answered_then_flooded(hub: InprocHub, host: IHost, protocol: str, ask, reply_type) -> tuple[int, int]:
    """Ask on a stream of its own, read the hub's answer, then keep writing on that stream past every window."""
    stream = await open_stream(host, hub.identity.peer_id, protocol)
    await write_message(stream, ask)
    assert isinstance(await read_message(stream, reply_type), reply_type)
    return await flood([stream], FLOOD_WRITE_BYTES, ignore_window=True)


def held_unread(hub: InprocHub, peer_id: str) -> int:
    """Bytes the hub's Yamux holds received from `peer_id` and not yet read."""
    (conn,) = hub.service.host.get_network().get_connections(ID.from_base58(peer_id))
    return sum(map(len, conn.muxed_conn.stream_buffers.values()))


async def assert_hub_answers(stack: AsyncExitStack, hub: InprocHub) -> None:
    async with attacker(stack, hub.addr) as (honest, _):
        status = await request(honest, hub.identity.peer_id, STATUS_PROTOCOL, StatusRequest(events=0), HubStatus, timeout_s=10)
        assert status.hub_id == hub.identity.peer_id


@pytest.mark.trio
async def test_a_stranger_flooding_its_answered_status_stream_is_disconnected(tmp_path, default_model_dir):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with inproc_hub(tmp_path, default_model_dir, PERMISSIVE_CONFIG) as hub, AsyncExitStack() as stack:
            async with attacker(stack, hub.addr) as (host, identity):
                sent, growth = await answered_then_flooded(hub, host, STATUS_PROTOCOL, StatusRequest(events=0), HubStatus)
                assert sent < FLOOD_BYTES and growth <= RSS_GROWTH_BYTES, (sent, growth)
                await disconnected(hub.service.host, identity.peer_id)
            assert libp2p_patches.overruns(identity.peer_id) == 1
            await assert_hub_answers(stack, hub)


@pytest.mark.trio
async def test_a_member_flooding_its_answered_heartbeat_stream_is_disconnected(tmp_path, default_model_dir):
    with trio.fail_after(TEST_TIMEOUT_S):
        async with inproc_hub(tmp_path, default_model_dir, PERMISSIVE_CONFIG) as hub, AsyncExitStack() as stack:
            async with attacker(stack, hub.addr) as (host, identity):
                joined = await open_stream(host, hub.identity.peer_id, JOIN_PROTOCOL)
                await joined.write(join_frame(hub))
                assert isinstance(await read_message(joined, JoinReply), JoinReply)
                await joined.close()
                assert hub.state.membership.is_member(identity.peer_id)
                sent, growth = await answered_then_flooded(
                    hub, host, HEARTBEAT_PROTOCOL, Heartbeat(version_held=hub.version), HeartbeatReply
                )
                assert sent < FLOOD_BYTES and growth <= RSS_GROWTH_BYTES, (sent, growth)
                await disconnected(hub.service.host, identity.peer_id)
            assert libp2p_patches.overruns(identity.peer_id) == 1
            await assert_hub_answers(stack, hub)


@pytest.mark.trio
async def test_an_answered_stream_is_closed_for_reading(tmp_path, default_model_dir):
    """Bytes sent on an answered stream within its window are dropped, not held: a half-close alone kept them."""
    with trio.fail_after(TEST_TIMEOUT_S):
        async with inproc_hub(tmp_path, default_model_dir, PERMISSIVE_CONFIG) as hub, AsyncExitStack() as stack:
            async with attacker(stack, hub.addr) as (host, identity):
                stream = await open_stream(host, hub.identity.peer_id, STATUS_PROTOCOL)
                await write_message(stream, StatusRequest(events=0))
                assert isinstance(await read_message(stream, HubStatus), HubStatus)
                await stream.write(b"\xee" * (DEFAULT_WINDOW_SIZE // 2))
                # Frames arrive in order on the connection: once a later request is answered, those bytes were too.
                await request(host, hub.identity.peer_id, STATUS_PROTOCOL, StatusRequest(events=0), HubStatus, timeout_s=10)
                assert held_unread(hub, identity.peer_id) == 0
                assert connected(hub.service.host, identity.peer_id)


# The most a refused stranger's stream lives on the hub: the Reject's write, then the linger for the peer's close.
REFUSED_STREAM_S = REFUSE_WRITE_TIMEOUT_S + REFUSE_LINGER_S
# A message larger than a stream's initial receive window (256 KiB), as a js-libp2p peer sends in one `send`.
ONE_MESSAGE_BYTES = 1 << 20


def hub_streams(hub: InprocHub, peer_id: str) -> int:
    """Streams the hub's Yamux still keeps of `peer_id`'s connection (open, or kept for their unread bytes)."""
    (conn,) = hub.service.host.get_network().get_connections(ID.from_base58(peer_id))
    return len(conn.muxed_conn.streams)


@pytest.mark.trio
@pytest.mark.parametrize("pattern", sorted(WRITE_PATTERNS))
async def test_a_strangers_message_past_the_window_ends_every_stream_and_leaves_nothing_held(
    tmp_path, default_model_dir, caplog, pattern
):
    """Issue 65 item 7: a js-libp2p stranger wrote 1 MiB (a 4 GiB length prefix, then garbage) in one `send` on every
    /echo2/ protocol, half-closed, then read. Each write pattern a Yamux peer may use, from a raw py-libp2p host: the
    hub refuses each stream (the refusal logged as it happens), ends it within REFUSED_STREAM_S, and then holds none of
    its bytes and no entry for it (py-libp2p kept a reset stream's unread window, 256 KiB, for its 60 s sweep). The
    waits are bounded by half the handler's timeout: a hub that waited on the peer would end them only then, or never."""
    protocols = [p for p in echo2_protocols() if p not in NODE_PROTOCOLS]  # the hub does not serve them
    garbage = bytes([GARBAGE_BYTE]) * ONE_MESSAGE_BYTES
    with trio.fail_after(TEST_TIMEOUT_S):
        async with inproc_hub(tmp_path, default_model_dir, PERMISSIVE_CONFIG) as hub, AsyncExitStack() as stack:
            async with attacker(stack, hub.addr) as (host, identity):
                started = trio.current_time()
                fates = [StreamFate(protocol) for protocol in protocols]
                with trio.move_on_after(HANDLER_TIMEOUT_S / 2):
                    async with trio.open_nursery() as nursery:
                        for fate in fates:
                            nursery.start_soon(
                                probe_stream, host, hub.identity.peer_id, fate.protocol, garbage, started, fate, pattern
                            )
                # Logged while the stranger is still connected (once per peer and window: the others are counted).
                assert any(
                    r.getMessage().startswith("refused /echo2/") and identity.peer_id in r.getMessage() for r in caplog.records
                )
                for fate in fates:
                    assert fate.ended_by in ("closed", "reset") and fate.ended_s is not None, fate
                    assert fate.ended_s - fate.opened_s < REFUSED_STREAM_S, fate
                # The hub's side: every stream ended and dropped, nothing of the peer held, the peer still served.
                with trio.move_on_after(HANDLER_TIMEOUT_S / 2):
                    while hub_streams(hub, identity.peer_id) or hub.service.guard.buffered_bytes:
                        await trio.sleep(0.05)
                assert (hub_streams(hub, identity.peer_id), held_unread(hub, identity.peer_id)) == (0, 0)
                assert hub.service.guard.buffered_bytes == 0
            await assert_hub_answers(stack, hub)


def test_overruns_are_counted_per_peer_for_the_most_recent_peers_only(monkeypatch):
    """Throwaway identities overrunning in turn must not grow the table: the oldest peer is forgotten first."""
    monkeypatch.setattr(libp2p_patches, "_overruns", type(libp2p_patches._overruns)())
    monkeypatch.setattr(libp2p_patches, "OVERRUN_PEERS", 2)
    conns = {name: SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda name=name: name)) for name in "abc"}
    for name in "aab":
        assert isinstance(libp2p_patches._overran(conns[name], "test"), libp2p_patches.PeerOverran)
    assert (libp2p_patches.overruns("a"), libp2p_patches.overruns("b")) == (2, 1)
    libp2p_patches._overran(conns["c"], "test")
    assert [libp2p_patches.overruns(name) for name in "abc"] == [0, 1, 1]
