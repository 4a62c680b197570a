"""The bulk channel (shared/bulk.py): sealed records over real TCP on loopback, tickets, attacks, and a
snapshot relayed hub -> relay -> sink on it by real keepers, with the fall-back to libp2p when it is unreachable."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct

import pytest
import trio
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from node.keeper import HUB
from shared import bulk
from shared.bulk import (
    MAX_ANSWER_SEALED_BYTES,
    MAX_SEALED_BYTES,
    RECORD_BYTES,
    BulkBroken,
    BulkChannel,
    BulkStream,
    BulkUnreachable,
    serving_stream,
)
from shared.crypto import Identity
from shared.messages import BulkOffer, SnapshotRequest
from shared.transfer import RECEIVER_GONE
from shared.wire import StreamEOF, read_exact, read_message
from testbed.peers import hub_peer, node_peer, random_snapshot, wait_installed

pytestmark = pytest.mark.trio

PEER = Identity.from_seed(bytes([7]) * 32).peer_id
OTHER = Identity.from_seed(bytes([8]) * 32).peer_id


async def _pair(channel: BulkChannel, peer: str = PEER) -> tuple[BulkStream, BulkStream]:
    """(listener's end, dialer's end) of one channel connection on loopback."""
    offer = channel.offer(peer, "127.0.0.1")
    async with trio.open_nursery() as nursery:
        dialed: list[BulkStream] = []

        async def dial() -> None:
            dialed.append(await channel.dial(peer, "127.0.0.1", offer))

        nursery.start_soon(dial)
        served = await channel.accept(offer)
    return served, dialed[0]


async def test_records_carry_any_write_both_ways_and_end_cleanly():
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        served, dialed = await _pair(channel)
        assert (channel.served, channel.dialed) == (1, 1)
        payload = os.urandom(2 * RECORD_BYTES + 12345)  # three records, the last one short
        async with trio.open_nursery() as inner:
            inner.start_soon(served.write, payload)
            assert await read_exact(dialed, len(payload)) == payload
        await dialed.write(b"ack")
        await dialed.write(b"")  # an empty write sends nothing
        assert await read_exact(served, 3) == b"ack"
        await dialed.close()
        assert await served.read(10) == b""  # the dialer closed between records: a clean end
        await served.close()
        nursery.cancel_scope.cancel()


async def _raw_pair(key: bytes) -> tuple[trio.SocketStream, BulkStream, trio.SocketListener]:
    """A raw socket playing a hostile listener, and a dialer's BulkStream reading from it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    return server, BulkStream(client, key, dialer=True, peer_id=PEER), listeners[0]


async def test_tampered_replayed_and_reflected_records_fail_their_tag():
    key = os.urandom(32)
    aead = AESGCM(key)
    good = aead.encrypt(b"lstn" + (0).to_bytes(8, "big"), b"chunk bytes", None)
    cases = {
        "flipped": good[:3] + bytes([good[3] ^ 1]) + good[4:],
        "wrong number": aead.encrypt(b"lstn" + (1).to_bytes(8, "big"), b"chunk bytes", None),
        "reflected": aead.encrypt(b"dial" + (0).to_bytes(8, "big"), b"chunk bytes", None),
        "wrong key": AESGCM(os.urandom(32)).encrypt(b"lstn" + (0).to_bytes(8, "big"), b"chunk bytes", None),
    }
    for name, sealed in cases.items():
        server, stream, listener = await _raw_pair(key)
        await server.send_all(struct.pack(">I", len(sealed)) + sealed)
        with pytest.raises(BulkBroken, match="failed authentication"):
            await stream.read(100)
        await server.aclose(), await stream.close(), await listener.aclose()
    # The untampered record reads; the same record again (a replay) does not.
    server, stream, listener = await _raw_pair(key)
    await server.send_all((struct.pack(">I", len(good)) + good) * 2)
    assert await stream.read(100) == b"chunk bytes"
    with pytest.raises(BulkBroken, match="record 1 failed authentication"):
        await stream.read(100)
    await server.aclose(), await stream.close(), await listener.aclose()


@pytest.mark.parametrize("length", [0, 15, MAX_SEALED_BYTES + 1, 2**32 - 1])
async def test_a_record_length_out_of_bounds_is_refused_from_its_header(length):
    server, stream, listener = await _raw_pair(os.urandom(32))
    await server.send_all(struct.pack(">I", length))  # and nothing more: nothing is waited for or allocated
    with trio.fail_after(2):
        with pytest.raises(BulkBroken, match=f"bulk record of {length} bytes"):
            await stream.read(100)
    await server.aclose(), await stream.close(), await listener.aclose()


async def test_a_sender_reads_only_answer_sized_records():
    """The listener's end (the snapshot's sender, the hub) takes only what a receiver's ack needs."""
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        served, dialed = await _pair(channel)
        await dialed._sock.send_all(struct.pack(">I", MAX_ANSWER_SEALED_BYTES + 1))
        with pytest.raises(BulkBroken, match=f"bulk record of {MAX_ANSWER_SEALED_BYTES + 1} bytes"):
            await served.read(10)
        await served.close(), await dialed.close()
        nursery.cancel_scope.cancel()


async def test_a_connection_closed_inside_a_record_is_an_end_of_stream():
    server, stream, listener = await _raw_pair(os.urandom(32))
    await server.send_all(struct.pack(">I", 1000) + b"x" * 10)
    await server.aclose()
    with pytest.raises(StreamEOF, match="inside a record"):
        await stream.read(100)
    await stream.close(), await listener.aclose()


async def test_a_reset_connection_reads_as_broken_like_trios_own_streams():
    """What a sender's handler counts as its receiver gone (shared/transfer.py RECEIVER_GONE), not a bug of ours."""
    server, stream, listener = await _raw_pair(os.urandom(32))
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await server.send_all(struct.pack(">I", 100))
    await trio.sleep(0.05)
    server.socket.close()  # with SO_LINGER 0: a RST, not a FIN
    with pytest.raises(trio.BrokenResourceError, match="bulk connection broke"):
        await stream.read(100)
    await stream.close(), await listener.aclose()
    assert issubclass(trio.BrokenResourceError, RECEIVER_GONE)


async def test_tickets_are_one_time_bound_to_their_offer_and_its_address_and_expire(monkeypatch):
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        # A ticket nobody was offered: the connection is closed. The channel answers, so it is tried again next time.
        forged = BulkOffer(port=channel.port, ticket=os.urandom(16).hex(), key=os.urandom(32).hex())
        with pytest.raises(BulkUnreachable, match="closed without accepting the ticket"):
            await channel.dial(OTHER, "127.0.0.1", forged)
        assert channel.usable(OTHER)
        # The right ticket with another key: the listener's hello fails the dialer's tag.
        offer = channel.offer(PEER, "127.0.0.1")
        wrong_key = offer.model_copy(update={"key": os.urandom(32).hex()})
        with pytest.raises(BulkUnreachable, match="failed authentication"):
            await channel.dial(PEER, "127.0.0.1", wrong_key)
        # That ticket was taken by the connection above (which the dialer then closed): a second one with it
        # is refused, and the sender is handed the first, finds it closed, and serves nothing.
        with pytest.raises(BulkUnreachable, match="closed without accepting"):
            await channel.dial(PEER, "127.0.0.1", offer)
        taken = await channel.accept(offer)
        assert await taken.read(1) == b""
        await taken.close()
        # A ticket presented from another address than the receiver's is refused (127.0.0.2 is loopback too).
        elsewhere = channel.offer(PEER, "127.0.0.1")
        sock = await trio.open_tcp_stream("127.0.0.1", channel.port, local_address="127.0.0.2")
        await sock.send_all(bytes.fromhex(elsewhere.ticket))
        with trio.fail_after(2):
            assert await sock.receive_some(100) == b""
        await sock.aclose()
        # An offer nobody takes in time: the sender gives up after BULK_ACCEPT_S, and the ticket dies with it.
        monkeypatch.setattr(bulk, "BULK_ACCEPT_S", 0.2)
        late = channel.offer(OTHER, "127.0.0.1")
        with pytest.raises(trio.TooSlowError, match="did not open the bulk channel"):
            await channel.accept(late)
        with pytest.raises(BulkUnreachable, match="closed without accepting"):
            await channel.dial(OTHER, "127.0.0.1", late)
        assert channel.served == 1 and channel.dialed == 0
        nursery.cancel_scope.cancel()


async def test_two_connections_racing_with_one_ticket_get_one_hello():
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        offer = channel.offer(PEER, "127.0.0.1")
        socks = [await trio.open_tcp_stream("127.0.0.1", channel.port) for _ in range(2)]
        for sock in socks:
            await sock.send_all(bytes.fromhex(offer.ticket))
        answers: list[bytes] = []
        with trio.fail_after(3):
            for sock in socks:
                got = b""
                while more := await sock.receive_some(100):
                    got += more
                    if len(got) >= 4 + 16:
                        break
                answers.append(got)
        assert sorted(len(a) for a in answers) == [0, 20]  # one hello (length + tag), one closed
        served = await channel.accept(offer)
        await served.close()
        for sock in socks:
            await sock.aclose()
        nursery.cancel_scope.cancel()


async def test_connections_from_strangers_silent_ones_and_excess_ones_are_closed(mock_clock):
    """On trio's clock, which stands still here: "closed at once" takes no time at all, however slow the machine,
    and the silent one is closed when the clock is moved past TICKET_READ_S."""
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        # No offer open for an address: its connections get no slot at all.
        stranger = await trio.open_tcp_stream("127.0.0.1", channel.port)
        assert await stranger.receive_some(10) == b""
        channel.offer(PEER, "127.0.0.1")
        silent = await trio.open_tcp_stream("127.0.0.1", channel.port)
        while not channel._unticketed:  # accepted: waiting for its ticket
            await trio.sleep(0)
        excess = await trio.open_tcp_stream("127.0.0.1", channel.port)
        assert await excess.receive_some(10) == b""  # closed at once: its address's one open offer has one waiting
        mock_clock.jump(bulk.TICKET_READ_S)
        assert await silent.receive_some(10) == b""  # the silent one closed after TICKET_READ_S
        assert not channel._unticketed
        # The slot is free again: an honest dial goes through.
        served, dialed = await _pair(channel)
        await served.close(), await dialed.close()
        for sock in [stranger, silent, excess]:
            await sock.aclose()
        nursery.cancel_scope.cancel()


# -- untrusted peers, round three: the bulk channel crowded out and held by slow readers (items 6-7) -----------


async def test_members_on_many_addresses_cannot_crowd_an_honest_receiver_off_the_channel():
    """Item 6: eight members on eight addresses each held 8 silent connections; the global cap of 64 filled and an
    honest receiver got the channel on 0 of 6 tries. Now a connection waiting for its ticket needs an open offer of
    its address that no other waiting connection holds: each member holds one slot, for its own offer."""
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("0.0.0.0", 0)
        await channel.start(nursery)
        held = []
        for i in range(2, 10):
            ip = f"127.0.0.{i}"
            channel.offer(Identity.generate().peer_id, ip)
            for _ in range(8):
                sock = await trio.open_tcp_stream("127.0.0.1", channel.port, local_address=ip)
                held.append(sock)
        await trio.sleep(0.2)
        assert sum(channel._unticketed.values()) == 8  # one per offer, not 64
        for _ in range(6):
            served, dialed = await _pair(channel)
            await served.close(), await dialed.close()
        for sock in held:
            await sock.aclose()
        nursery.cancel_scope.cancel()


async def test_a_claimed_ticket_frees_its_waiting_slot_at_once(monkeypatch):
    """Two receivers on one address (nodes of one machine) dial at once: the first claims its ticket, and while
    its hello is on its way the second still gets a slot (its own offer is open). The claimed connection used
    to count as waiting while its offer no longer did, and the second was closed: it fell back to libp2p."""
    send_record = BulkStream._send_record

    async def slow_hello(self, plain) -> None:
        if not plain:
            await trio.sleep(0.3)
        await send_record(self, plain)

    monkeypatch.setattr(BulkStream, "_send_record", slow_hello)
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        offers = [channel.offer(peer, "127.0.0.1") for peer in (PEER, OTHER)]
        dialed: list[BulkStream] = []

        async def dial(peer: str, offer: BulkOffer, after_s: float) -> None:
            await trio.sleep(after_s)
            dialed.append(await channel.dial(peer, "127.0.0.1", offer))

        with trio.fail_after(5):
            async with trio.open_nursery() as dials:
                dials.start_soon(dial, PEER, offers[0], 0.0)
                dials.start_soon(dial, OTHER, offers[1], 0.1)
                served = [await channel.accept(offer) for offer in offers]
        assert len(dialed) == 2
        for stream in [*served, *dialed]:
            await stream.close()
        nursery.cancel_scope.cancel()


async def test_offers_are_counted_per_address_and_ipv6_slash_64():
    """Item 6: 88 identities on 4 addresses left honest requests with port-less offers; and limits counted exact
    addresses, not the /64 one operator holds."""
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        offers = [channel.offer(Identity.generate().peer_id, f"10.0.0.{i % 4}") for i in range(88)]
        assert sum(o.port is not None for o in offers) == 4 * bulk.MAX_OPEN_OFFERS_PER_ADDRESS
        assert channel.offer(PEER, "127.0.0.1").port == channel.port  # the honest receiver's
        v6 = [channel.offer(Identity.generate().peer_id, f"2001:db8:0:1::{i:x}") for i in range(1, 20)]
        assert sum(o.port is not None for o in v6) == bulk.MAX_OPEN_OFFERS_PER_ADDRESS  # one /64
        assert channel.offer(OTHER, "2001:db8:0:2::1").port == channel.port  # another /64
        nursery.cancel_scope.cancel()


async def test_a_receiver_that_stops_reading_frees_the_sender_in_seconds(monkeypatch):
    """Item 7: a receiver that stopped reading held a transfer 125 s on the bulk channel (a 4 MiB record: 439 s),
    against 5 s on libp2p. Now each piece of a record must leave within PROGRESS_S."""
    monkeypatch.setattr(bulk, "PROGRESS_S", 1.0)
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        served, dialed = await _pair(channel)
        started = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            for _ in range(64):  # the dialer never reads: socket buffers fill, then nothing moves
                await served.write(os.urandom(RECORD_BYTES))
        assert trio.current_time() - started < 1.0 + 3.0
        await served.close(), await dialed.close()
        nursery.cancel_scope.cancel()


async def test_transfers_at_once_are_capped_per_address_and_in_all(monkeypatch):
    """Item 7: 64 stalled transfers added 104 MB to the hub, with no cap per address or overall. Past the caps a
    request gets a port-less offer: it is served on libp2p, under the peer guard's memory budget."""
    monkeypatch.setattr(bulk, "MAX_TRANSFERS", 6)
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        async with contextlib.AsyncExitStack() as stack:
            for i in range(bulk.MAX_TRANSFERS_PER_ADDRESS):
                peer = Identity.generate().peer_id
                offer = channel.offer(peer, "127.0.0.1")
                nursery.start_soon(channel.dial, peer, "127.0.0.1", offer)
                await stack.enter_async_context(channel.transfer(offer))
            assert channel.offer(OTHER, "127.0.0.1") == BulkOffer()  # this address runs its four
            assert channel.offer(OTHER, "127.0.0.2").port == channel.port
            for ip in ("127.0.0.2", "127.0.0.3"):
                offer = channel.offer(OTHER, ip)
                nursery.start_soon(_dial_from, channel, ip, offer)
                await stack.enter_async_context(channel.transfer(offer))
            assert channel.offer(PEER, "127.0.0.4") == BulkOffer()  # six in all: the channel is full
        assert channel.offer(PEER, "127.0.0.4").port == channel.port  # and free again once they ended
        nursery.cancel_scope.cancel()


async def _dial_from(channel: BulkChannel, ip: str, offer: BulkOffer) -> None:
    """A receiver at `ip` taking `offer` (its connection comes from that address)."""
    sock = await trio.open_tcp_stream("127.0.0.1", channel.port, local_address=ip)
    await sock.send_all(bytes.fromhex(offer.ticket))
    await trio.sleep_forever()


async def test_running_out_of_descriptors_does_not_end_the_channel(monkeypatch):
    accept = trio.SocketListener.accept
    failures = [OSError(errno.EMFILE, "Too many open files")]

    async def accept_once_failing(self):
        if failures:
            raise failures.pop()
        return await accept(self)

    monkeypatch.setattr(trio.SocketListener, "accept", accept_once_failing)
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        served, dialed = await _pair(channel)
        assert not failures and channel.served == 1
        await served.close(), await dialed.close()
        nursery.cancel_scope.cancel()


async def test_offers_are_capped(monkeypatch):
    monkeypatch.setattr(bulk, "MAX_OPEN_OFFERS", 2)
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        assert channel.offer(PEER, "127.0.0.1").port == channel.port
        assert channel.offer(PEER, "127.0.0.1").port == channel.port
        assert channel.offer(PEER, "127.0.0.1") == BulkOffer()  # the third waits on libp2p instead
        nursery.cancel_scope.cancel()
    assert BulkChannel("127.0.0.1", 0).offer(PEER, "127.0.0.1") == BulkOffer()  # not listening
    assert channel.offer(PEER, None) == BulkOffer()  # no address to bind the ticket to


async def test_a_receiver_that_asks_and_never_dials_holds_few_offers():
    async with trio.open_nursery() as nursery:
        channel = BulkChannel("127.0.0.1", 0)
        await channel.start(nursery)
        hoarded = [channel.offer(PEER, "127.0.0.1") for _ in range(bulk.MAX_OPEN_OFFERS_PER_PEER + 3)]
        assert sum(o.port is not None for o in hoarded) == bulk.MAX_OPEN_OFFERS_PER_PEER
        assert channel.offer(OTHER, "127.0.0.1").port == channel.port  # everyone else is still offered one
        nursery.cancel_scope.cancel()


async def test_a_dial_to_nothing_is_unreachable_and_remembered():
    closed = trio.socket.socket()
    await closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    channel = BulkChannel("127.0.0.1", 0)
    offer = BulkOffer(port=port, ticket=os.urandom(16).hex(), key=os.urandom(32).hex())
    with trio.fail_after(bulk.BULK_CONNECT_S + 1):
        with pytest.raises(BulkUnreachable, match=f"port {port}"):
            await channel.dial(PEER, "127.0.0.1", offer)
    with pytest.raises(BulkUnreachable, match="no remote IP"):
        await channel.dial(OTHER, None, offer)
    assert not channel.usable(PEER)


async def test_an_offer_is_all_or_nothing():
    BulkOffer()
    BulkOffer(port=1, ticket="0" * 32, key="0" * 64)
    for bad in (
        {"port": 1},
        {"ticket": "0" * 32, "key": "0" * 64},
        {"port": 0, "ticket": "0" * 32, "key": "0" * 64},
        {"port": 1, "ticket": "0" * 31, "key": "0" * 64},
        {"port": 1, "ticket": "0" * 32, "key": "G" * 64},
    ):
        with pytest.raises(ValueError):
            BulkOffer(**bad)


class _Recorder:
    """A libp2p-like stream that records what is written to it."""

    def __init__(self) -> None:
        self.written = bytearray()

    async def write(self, data: bytes) -> None:
        self.written += data

    async def read(self, n: int) -> bytes:
        data, self.written[:n] = bytes(self.written[:n]), b""
        return data


async def test_serving_stream_offers_only_when_asked_and_able():
    stream = _Recorder()
    async with serving_stream(stream, SnapshotRequest(version=1), None, PEER) as transfer:
        assert transfer is stream and not stream.written  # not asked: no offer at all
    async with serving_stream(stream, SnapshotRequest(version=1, bulk=True), None, PEER) as transfer:
        assert transfer is stream  # asked, no channel here: an offer without a port, then this stream
    assert await read_message(stream, BulkOffer) == BulkOffer()


async def test_a_chain_relays_on_bulk_channels_end_to_end():
    """Real keepers and hosts: hub -> relay -> sink, every transfer on the bulk channel, verified bytes installed."""
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 1, 3 << 20, 256 << 10)
    async with hub_peer(hub_id, bulk=True) as hub, node_peer(hub, bulk=True) as relay, node_peer(hub, bulk=True) as sink:
        hub.shelf.add(snapshot)
        sink.keeper.update(1, relay.upstream, None)
        relay.keeper.update(1, HUB, sink.peer_id)
        await wait_installed([relay, sink], 1, 30)
        expected = snapshot.path.read_bytes()
        assert relay.installed[1] == expected and sink.installed[1] == expected
        assert hub.bulk.served == 1 and relay.keeper.bulk.dialed == 1
        assert relay.keeper.bulk.served == 1 and sink.keeper.bulk.dialed == 1
        assert all(request.bulk for _, request in hub.requests)


async def test_an_unreachable_channel_falls_back_to_libp2p(monkeypatch, caplog):
    """The relay's offers name a port nobody listens on (a firewall, a NAT): the sink says so, takes the
    snapshot over libp2p, and asks that relay over libp2p from then on."""
    caplog.set_level(logging.INFO)
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 1, 1 << 20, 256 << 10)
    async with hub_peer(hub_id, bulk=True) as hub, node_peer(hub, bulk=True) as relay, node_peer(hub, bulk=True) as sink:
        closed = trio.socket.socket()
        await closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()
        relay.keeper.bulk.port = dead_port
        hub.shelf.add(snapshot)
        sink.keeper.update(1, relay.upstream, None)
        relay.keeper.update(1, HUB, sink.peer_id)
        await wait_installed([relay, sink], 1, 30)
        assert sink.installed[1] == snapshot.path.read_bytes()
        assert sink.keeper.bulk.dialed == 0 and not sink.keeper.bulk.usable(relay.peer_id)
        assert any("taking it over libp2p" in r.getMessage() for r in caplog.records)
