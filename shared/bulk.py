"""The bulk channel: a snapshot transfer on its own TCP connection, keyed through the libp2p stream that asked for it.

Why: py-libp2p moves bytes in Python, message by message (one Noise message of at most 64 KiB per
Yamux frame, each with its locks, task switches and socket calls). That costs 10-14 CPU seconds
per GB per hop on this project's reference CPU, and a relay, which receives and sends every byte,
about 16: at 1 Gbit/s a volunteer would be CPU-bound. A transfer needs neither Yamux nor Noise's
cipher: its bytes are already bound to the hub's signed manifest and to the sender's per-frame
commitments (shared/transfer.py). What it still needs from the network is privacy and an
authenticated peer, which one key agreed over the libp2p stream gives it.

Handshake (the secrets travel over the Noise-encrypted libp2p stream that carries the request):
1. receiver -> sender, libp2p: a SnapshotRequest with bulk=True.
2. sender -> receiver, libp2p: a BulkOffer: a TCP port, a one-time ticket and a fresh AES-256 key,
   valid for BULK_ACCEPT_S; or a BulkOffer without a port (the sender runs no channel): the
   transfer then follows on the libp2p stream as usual.
3. The receiver dials the address it reaches the sender at (the libp2p connection's remote IP) on
   that port within BULK_CONNECT_S and sends the ticket; the sender's listener takes each ticket
   once and answers with a sealed empty record, which proves the key to the receiver. The sender
   then serves the request on the new connection, exactly as it would on the libp2p stream.
4. Records: a 4-byte length (checked against MAX_SEALED_BYTES before anything is allocated), then
   AES-256-GCM ciphertext and tag. The nonce is the direction (4 bytes) and the record's number
   (8 bytes): a record cannot be dropped, replayed, reordered or reflected without failing its tag.

A receiver that cannot dial the port (a firewall, a NAT in front of the sender, a relayed libp2p
connection whose remote address is the relay's) gives up after BULK_CONNECT_S, says so in its log,
asks again over the libp2p stream and does not try that sender's channel again for BULK_RETRY_S.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import struct
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from multiaddr import Multiaddr

from shared.messages import BulkOffer, SnapshotRequest
from shared.net import address_key, canonical_ip, remote_ip
from shared.wire import StreamEOF, write_message

log = logging.getLogger("echo2.bulk")

KEY_BYTES = 32
TICKET_BYTES = 16
TAG_BYTES = 16
RECORD_HEADER = struct.Struct(">I")
# Plaintext per record: a default 1 MiB chunk frame goes out as one record, a 16 MiB one as five.
RECORD_BYTES = 4 << 20
MAX_SEALED_BYTES = RECORD_BYTES + TAG_BYTES
# What a sender reads on its channel (the receiver's TransferAck) fits in far less: a receiver cannot make
# a sender (the hub) allocate a full record per connection by announcing one.
MAX_ANSWER_SEALED_BYTES = 64 * 1024
_DIALER, _LISTENER = b"dial", b"lstn"
# The receiver's deadline to connect and see the sender prove the key.
BULK_CONNECT_S = 3.0
# The sender waits this long for the receiver to present the ticket, then gives the offer up.
BULK_ACCEPT_S = BULK_CONNECT_S + 2.0
# A new connection must present a ticket this soon.
TICKET_READ_S = 2.0
# A record goes out in pieces of PROGRESS_BYTES, each of which must leave within PROGRESS_S: a receiver that
# stops reading frees its transfer (and what it holds of ours) in seconds, at any record size, while a link
# at MIN_LINK_BPS still makes it (64 KiB in 6.6 s).
PROGRESS_BYTES = 64 * 1024
PROGRESS_S = 8.0
# A sender whose channel could not be reached is asked over libp2p for this long.
BULK_RETRY_S = 300.0
# Offers waiting for their connection (each at most BULK_ACCEPT_S), in all, per receiver (an honest one pulls
# one version at a time from a sender) and per address key (shared.net.address_key: an IPv4 address or an
# IPv6 /64); a connection still to present a ticket needs an open offer of its address that no other such
# connection waits on. Transfers running at once, in all and per address key: past them, requests are served
# on libp2p, under the peer guard's memory budget.
MAX_OPEN_OFFERS = 256
MAX_OPEN_OFFERS_PER_PEER = 4
MAX_OPEN_OFFERS_PER_ADDRESS = 8
MAX_TRANSFERS = 32
MAX_TRANSFERS_PER_ADDRESS = 4
# What accept() raises when the process is out of descriptors or buffers: wait this long and accept again.
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_S = 0.1


class BulkUnreachable(OSError):
    """The receiver could not open the sender's bulk channel; the transfer goes over libp2p instead."""


class BulkBroken(StreamEOF):
    """A record failed its length bound or its tag. Tampering on the way and a broken peer look alike and
    nothing proves which, so it counts as the stream ending, against nobody."""


class BulkStream:
    """One bulk connection as a stream (`read(n)`, `write(data)`, `close()`, `reset()`) for shared/transfer.py."""

    def __init__(self, sock: trio.SocketStream, key: bytes, dialer: bool, peer_id: str) -> None:
        self._sock = sock
        self._aead = AESGCM(key)
        self._send_prefix, self._receive_prefix = (_DIALER, _LISTENER) if dialer else (_LISTENER, _DIALER)
        self._max_sealed = MAX_SEALED_BYTES if dialer else MAX_ANSWER_SEALED_BYTES
        self._sent = 0
        self._received = 0
        self._plain = b""
        self._offset = 0
        self.peer_id = peer_id

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), RECORD_BYTES):
            await self._send_record(view[start : start + RECORD_BYTES])

    async def _send_record(self, plain) -> None:
        sealed = self._aead.encrypt(self._send_prefix + self._sent.to_bytes(8, "big"), plain, None)
        self._sent += 1
        # A receiver that stops reading must not hold the sender (py-libp2p's Yamux gives up after 5 s).
        with trio.fail_after(PROGRESS_S):
            await self._sock.send_all(RECORD_HEADER.pack(len(sealed)))
        view = memoryview(sealed)
        for start in range(0, len(view), PROGRESS_BYTES):
            with trio.fail_after(PROGRESS_S):
                await self._sock.send_all(view[start : start + PROGRESS_BYTES])

    async def read(self, n: int) -> bytes:
        """At most `n` bytes; b"" once the sender closed the connection between records."""
        while self._offset >= len(self._plain):
            record = await self._receive_record()
            if record is None:
                return b""
            self._plain, self._offset = record, 0
        piece = self._plain[self._offset : self._offset + n]
        self._offset += len(piece)
        return piece

    async def _receive_into(self, view: memoryview) -> bool:
        """Fill `view` from the socket; False if the connection ended cleanly before its first byte."""
        got = 0
        while got < len(view):
            try:
                count = await self._sock.socket.recv_into(view[got:])
            except OSError as exc:  # as trio's own stream methods report a broken connection
                raise trio.BrokenResourceError(f"bulk connection broke: {exc!r}") from exc
            if not count:
                if not got:
                    return False
                raise StreamEOF(f"bulk connection closed inside a record ({got} of {len(view)} bytes)")
            got += count
        return True

    async def _receive_record(self) -> bytes | None:
        header = bytearray(RECORD_HEADER.size)
        if not await self._receive_into(memoryview(header)):
            return None
        (length,) = RECORD_HEADER.unpack(header)
        if not TAG_BYTES <= length <= self._max_sealed:
            raise BulkBroken(f"bulk record of {length} bytes (must be {TAG_BYTES}..{self._max_sealed})")
        sealed = bytearray(length)
        if not await self._receive_into(memoryview(sealed)):
            raise StreamEOF(f"bulk connection closed inside a record (0 of {length} bytes)")
        try:
            plain = self._aead.decrypt(self._receive_prefix + self._received.to_bytes(8, "big"), sealed, None)
        except InvalidTag:
            raise BulkBroken(f"bulk record {self._received} failed authentication") from None
        self._received += 1
        return plain

    async def close(self) -> None:
        await self._sock.aclose()

    reset = close


@dataclass
class _Offer:
    peer_id: str
    ip: str  # the receiver's, as the libp2p connection shows it: only that address may present the ticket
    address: str  # address_key(ip): what its limits count by
    key: bytes
    expires_at: float
    arrived: trio.Event = field(default_factory=trio.Event)
    claimed: bool = False  # a connection presented the ticket (it is good for one)
    abandoned: bool = False  # accept() gave up on it: a connection handed now is closed
    stream: BulkStream | None = None


def channel_for(listen: str, port: int) -> BulkChannel | None:
    """The bulk channel of a process whose libp2p host listens on `listen`: on the same interface, at `port`
    (0: any free port; -1: None, no channel)."""
    if port == -1:
        return None
    addr = Multiaddr(listen)
    for protocol in ("ip4", "ip6"):
        if protocol in [p.name for p in addr.protocols()]:
            return BulkChannel(addr.value_for_protocol(protocol), port)
    raise ValueError(f"listen address {listen} names no IP to put the bulk channel on")


class BulkChannel:
    """A process's bulk channel: the listener that serves its offers, and the dialer that takes other peers' offers."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._offers: dict[bytes, _Offer] = {}
        self._unticketed: collections.Counter[str] = collections.Counter()  # by address key
        self._transfers: collections.Counter[str] = collections.Counter()  # running, by address key
        self._unreachable: dict[str, float] = {}
        self.served = 0  # transfers this process sent on the channel
        self.dialed = 0  # and received on other peers' channels

    async def start(self, nursery: trio.Nursery) -> int:
        """Listen (on `host`, `port`; port 0: any free one) and return the port bound."""
        listeners = await trio.open_tcp_listeners(self.requested_port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        for listener in listeners:
            nursery.start_soon(self._accept_loop, listener, nursery)
        log.info("bulk channel listening on %s port %d", self.host, self.port)
        return self.port

    # -- sender side -------------------------------------------------------------------------------

    def offer(self, peer_id: str, ip: str | None) -> BulkOffer:
        """A one-time ticket and key for `peer_id`, to be presented from `ip` (an offer without a port when the
        receiver's IP is unknown or too many offers are open: a member asking and never dialing takes at most
        MAX_OPEN_OFFERS_PER_PEER of them, so a few such members cannot push everyone back onto libp2p)."""
        now = trio.current_time()
        for ticket in [t for t, o in self._offers.items() if o.expires_at < now]:
            del self._offers[ticket]
        if self.port is None or ip is None or len(self._offers) >= MAX_OPEN_OFFERS:
            return BulkOffer()
        address = address_key(ip)
        if (
            sum(o.peer_id == peer_id for o in self._offers.values()) >= MAX_OPEN_OFFERS_PER_PEER
            or sum(o.address == address for o in self._offers.values()) >= MAX_OPEN_OFFERS_PER_ADDRESS
            or sum(self._transfers.values()) >= MAX_TRANSFERS
            or self._transfers[address] >= MAX_TRANSFERS_PER_ADDRESS
        ):
            return BulkOffer()
        ticket, key = os.urandom(TICKET_BYTES), os.urandom(KEY_BYTES)
        self._offers[ticket] = _Offer(peer_id, canonical_ip(ip), address, key, now + BULK_ACCEPT_S)
        return BulkOffer(port=self.port, ticket=ticket.hex(), key=key.hex())

    @asynccontextmanager
    async def transfer(self, offer: BulkOffer):
        """accept(offer) as a context: the transfer counts against its address's and the channel's caps until it
        ends, and its connection is closed then."""
        waiting = self._offers.get(bytes.fromhex(offer.ticket))
        stream = await self.accept(offer)  # TooSlowError for an offer no longer open
        assert waiting is not None
        address = waiting.address
        self._transfers[address] += 1
        try:
            yield stream
        finally:
            self._transfers[address] -= 1
            if self._transfers[address] <= 0:
                del self._transfers[address]
            with trio.CancelScope(shield=True):
                await stream.close()

    async def accept(self, offer: BulkOffer) -> BulkStream:
        """The connection that presented `offer`'s ticket (trio.TooSlowError if none came in time)."""
        ticket = bytes.fromhex(offer.ticket)
        waiting = self._offers.get(ticket)
        if waiting is None:
            raise trio.TooSlowError("the bulk offer expired before it was sent")
        try:
            with trio.move_on_after(max(0.0, waiting.expires_at - trio.current_time())):
                await waiting.arrived.wait()
        finally:
            self._offers.pop(ticket, None)
            if waiting.stream is None:  # timed out or cancelled: a connection still on its way is closed
                waiting.abandoned = True
        if waiting.stream is None:
            raise trio.TooSlowError(f"{waiting.peer_id[-8:]} did not open the bulk channel in {BULK_ACCEPT_S:.0f}s")
        self.served += 1
        return waiting.stream

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    sock = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    # Out of descriptors or buffers: wait for some to free rather than end the process.
                    log.warning("bulk channel cannot accept now: %s", exc)
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                try:
                    ip = canonical_ip(sock.socket.getpeername()[0])
                except OSError:  # gone already
                    await trio.aclose_forcefully(sock)
                    continue
                # One connection waiting for its ticket per open offer of its address: strangers get no slot,
                # and a receiver's silent connections cannot crowd out others' (nor its own next offers).
                address = address_key(ip)
                waiting_offers = sum(o.address == address and not o.claimed for o in self._offers.values())
                if self._unticketed[address] >= waiting_offers:
                    await trio.aclose_forcefully(sock)
                    continue
                self._unticketed[address] += 1
                nursery.start_soon(self._take_ticket, sock, ip, address)

    async def _take_ticket(self, sock: trio.SocketStream, ip: str, address: str) -> None:
        """Hand a connection to the offer whose ticket it presents from the offer's address; else close it."""
        stream, waiting = None, None
        waits = True  # it holds one of its address's waiting slots until it claims a ticket or ends

        def stop_waiting() -> None:
            nonlocal waits
            if waits:
                waits = False
                self._unticketed[address] -= 1
                if self._unticketed[address] <= 0:
                    del self._unticketed[address]

        try:
            with trio.move_on_after(TICKET_READ_S):
                ticket = await _receive_exactly(sock, TICKET_BYTES)
                waiting = self._offers.get(ticket) if ticket is not None else None
                if (
                    waiting is not None
                    and not waiting.claimed
                    and not waiting.abandoned
                    and waiting.ip == ip
                    and waiting.expires_at >= trio.current_time()
                ):
                    waiting.claimed = True  # before any await: one connection per ticket
                    stop_waiting()  # its offer no longer counts as open, so its slot goes with it
                    stream = BulkStream(sock, waiting.key, dialer=False, peer_id=waiting.peer_id)
                    await stream._send_record(b"")  # proves the key: the dialer trusts nothing before it
                    if not waiting.abandoned:
                        waiting.stream = stream
                        waiting.arrived.set()
            if stream is None or waiting is None or waiting.stream is not stream:
                log.debug("bulk connection from %s without a ticket in use closed", ip)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
            log.debug("bulk connection from %s failed before its ticket: %r", ip, exc)
        finally:
            stop_waiting()
            if stream is None or waiting is None or waiting.stream is not stream:
                await trio.aclose_forcefully(sock)

    # -- receiver side -----------------------------------------------------------------------------

    def usable(self, peer_id: str) -> bool:
        """Whether to ask `peer_id` for its bulk channel (not if it could not be reached lately)."""
        now = trio.current_time()
        for peer in [p for p, until in self._unreachable.items() if until <= now]:
            del self._unreachable[peer]
        return peer_id not in self._unreachable

    async def dial(self, peer_id: str, ip: str | None, offer: BulkOffer) -> BulkStream:
        """Open `peer_id`'s channel at `ip` as `offer` says; BulkUnreachable if it cannot be reached or does not
        prove the key within BULK_CONNECT_S. A channel that cannot be connected to at all (refused, filtered)
        is not asked for again for BULK_RETRY_S; one that answers but refuses the ticket (an offer that
        expired meanwhile) is asked again next time."""
        sock = None
        try:
            with trio.fail_after(BULK_CONNECT_S):
                try:
                    if ip is None or offer.port is None:
                        raise OSError(
                            "the libp2p connection has no remote IP address" if ip is None else "the offer names no port"
                        )
                    sock = await trio.open_tcp_stream(ip, offer.port)
                except OSError:
                    self._unreachable[peer_id] = trio.current_time() + BULK_RETRY_S
                    raise
                await sock.send_all(bytes.fromhex(offer.ticket))
                stream = BulkStream(sock, bytes.fromhex(offer.key), dialer=True, peer_id=peer_id)
                hello = await stream._receive_record()
            if hello != b"":
                raise StreamEOF(
                    "the channel closed without accepting the ticket"
                    if hello is None
                    else "the channel's first record was not the empty hello"
                )
            self.dialed += 1
            return stream
        except trio.TooSlowError as exc:
            self._unreachable[peer_id] = trio.current_time() + BULK_RETRY_S
            if sock is not None:
                await trio.aclose_forcefully(sock)
            raise BulkUnreachable(f"bulk channel of {peer_id[-8:]} at {ip} port {offer.port}: {exc!r}") from exc
        except (OSError, trio.BrokenResourceError, StreamEOF) as exc:
            if sock is not None:
                await trio.aclose_forcefully(sock)
            raise BulkUnreachable(f"bulk channel of {peer_id[-8:]} at {ip} port {offer.port}: {exc!r}") from exc


async def _receive_exactly(sock: trio.SocketStream, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        more = await sock.receive_some(n - len(data))
        if not more:
            return None
        data += more
    return bytes(data)


@asynccontextmanager
async def serving_stream(stream, request: SnapshotRequest, channel: BulkChannel | None, peer_id: str):
    """The stream to serve `request` on: the libp2p `stream` itself, or, when the receiver asked for it and we
    run a channel, the bulk connection it opens (closed on exit). trio.TooSlowError if it never opens one."""
    if not request.bulk:
        yield stream
        return
    offer = channel.offer(peer_id, remote_ip(stream)) if channel is not None else BulkOffer()
    await write_message(stream, offer)
    if offer.port is None or channel is None:
        yield stream
        return
    async with channel.transfer(offer) as bulk:
        yield bulk
