"""py-libp2p host plumbing for echo2 (trio): host construction, handlers, connect, request/reply, link emulation.

Security and transports are explicit: Noise is the only security protocol (py-libp2p's
defaults would also accept /plaintext/2.0.0, TLS and SECIO), Yamux the only muxer (the
defaults fall back to Mplex), TCP the only transport, one connection per peer, no mDNS,
no bootstrap. The host key is the process Identity, so host peer id == Identity.peer_id,
and Noise checks a dialled peer's key against the /p2p/<id> we dialled.

Stream semantics in py-libp2p 0.8.1 (checked in its source):
- `read(n)` returns at most n bytes, whatever Yamux has buffered (often one frame of
  <= 64 KiB), so exact reads loop (`shared.wire.read_exact`). At the end it raises
  libp2p StreamEOF (peer half-closed), StreamReset (peer reset) or StreamError;
  `shared.wire` maps all of them to its own StreamEOF.
- `close()` sends a Yamux FIN: a half-close. The peer still reads what we sent and can
  still reply, and we can still read the reply (NetStream.read refuses only RESET/ERROR).
  But NetStream.close() also marks the stream CLOSE_BOTH and releases its swarm
  bookkeeping at once, so `request` half-closes with `close_write()` (the same FIN) and
  calls `close()` once the reply is in.
- `reset()` sends RST. The receiver then raises StreamReset on its next read even if
  data is still buffered there: a reset discards undelivered data. So a transfer ends
  with close() plus an application-level ack, never with reset().
- Yamux `write` waits at most 5 s for the receiver to open its window (256 KiB at first,
  auto-tuned up to 16 MiB, buffered in the receiver's memory); a receiver that stops
  reading with the window full makes the writer fail after 5 s with StreamReset
  ("Timed out waiting for window update"; measured with a 40 MiB write to a reader that
  sleeps 7 s). Readers must keep draining while they do slow work.
- Yamux credit and Noise framing: patched, shared/libp2p_patches.py (applied before the first host
  is built, and only on the py-libp2p release they were written against).
- Receive memory (patched there too): py-libp2p buffers whatever a peer sends, past the stream's window
  and on a stream nobody reads any more. With the patches, a peer past a window, or past
  CONNECTION_BUFFER_BYTES held unread on its connection, is disconnected, and `close_read()` drops what a
  stream holds and will receive; `close_answered` ends an answered request that way.
- An exception escaping a stream handler propagates into the connection's nursery and
  from there can cancel the whole host; `safe_handler` contains it.
- Inbound connections (swarm.py, `_handle_inbound_connection`): each holds a slot of a
  250-token limiter, and the upstream handler keeps it until the whole swarm stops, so ~250
  peers that came and went lock every later one out. `_inbound_handler` replaces that
  handler: it holds the slot only while the connection lives, and refuses an address that
  already holds MAX_INBOUND_PER_IP live connections before any handshake. There is no idle
  timeout in py-libp2p; the hub disconnects idle strangers itself (hub/service/handlers.py), aging each
  connection from its start (`ConnectionStarts`, told by the swarm as it registers one).
- The swarm's auto-connector dials peers it learned of (targeting 200 connections), which
  would make our hosts dial whatever addresses peers advertise: it is stopped.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import sys
import types
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import overload

import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP
from multiaddr import Multiaddr

from shared import libp2p_patches
from shared.crypto import Identity
from shared.logs import PeerLogLimiter
from shared.peerstore import BoundedPeerStore, ForgetOnHangUp, QuietNotifee
from shared.wire import M2, M, Message, StreamEOF, WritableStream, libp2p_end_of_stream, read_message, write_message, write_signed

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# More than one connection per peer makes py-libp2p dial several in parallel and wait
# for them (measured: ~250 ms per connect instead of a few ms on loopback).
MAX_CONNECTIONS_PER_PEER = 1
# Live connections a host keeps: room for a large fleet (py-libp2p's default is 300, and its
# pruner starts at the high watermark, so both are raised together).
MAX_CONNECTIONS = 8192
# Live inbound connections one remote address may hold (an honest operator runs a few nodes).
MAX_INBOUND_PER_IP = 32
# What one operator is assumed to control: an IPv4 address, or an IPv6 /64.
IPV6_PREFIX_BITS = 64
log = logging.getLogger("echo2.net")

StreamHandler = Callable[[INetStream], Awaitable[None]]


def build_host(identity: Identity, inbound_per_ip: int = MAX_INBOUND_PER_IP) -> IHost:
    libp2p_patches.apply()
    key_pair = identity.libp2p_keypair()
    peerstore = BoundedPeerStore(ID.from_base58(identity.peer_id))
    host = new_host(
        key_pair=key_pair,
        peerstore_opt=peerstore,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        transports=[TCP()],
        connection_config=ConnectionConfig(
            max_connections_per_peer=MAX_CONNECTIONS_PER_PEER,
            max_connections=MAX_CONNECTIONS,
            high_watermark=MAX_CONNECTIONS,
            low_watermark=MAX_CONNECTIONS // 2,
        ),
        enable_mDNS=False,
        bootstrap=None,
    )
    if host.get_id().to_base58() != identity.peer_id:
        raise RuntimeError(f"libp2p host id {host.get_id()} differs from identity {identity.peer_id}")
    network = host.get_network()
    peerstore.is_live = lambda peer: bool(network.get_connections(peer))
    network.register_notifee(ForgetOnHangUp(peerstore, network.get_connections))
    _hold_inbound_slots_while_alive(host, inbound_per_ip)
    return host


def _hold_inbound_slots_while_alive(host: IHost, inbound_per_ip: int) -> None:
    """Replace the swarm's inbound handler (see the module docstring): slots freed when a connection ends,
    and at most `inbound_per_ip` live inbound connections per remote address (loopback included). Reads the
    swarm's private internals of the py-libp2p release shared/libp2p_patches.py checks for."""
    if inbound_per_ip < 1:
        raise ValueError(f"inbound_per_ip must be >= 1, got {inbound_per_ip}")
    swarm = host.get_network()
    swarm._inbound_limiter.total_tokens = MAX_CONNECTIONS
    per_ip: collections.Counter[str] = collections.Counter()
    refusal_log = PeerLogLimiter()  # an address dialling in a loop must not fill the disk with lines

    async def inbound(self, read_write_closer, maddr, failure_event) -> None:
        remote = self._build_remote_multiaddr(read_write_closer)
        ip = address_key(_multiaddr_ip(remote))  # an IPv6 /64 counts as one address, as for lease quotas
        if remote is not None and not await self.connection_gate.is_allowed(remote):
            await _close_quietly(read_write_closer)
            return
        if ip is not None and per_ip[ip] >= inbound_per_ip:
            if (tail := refusal_log.tail(ip)) is not None:
                log.info("refused an inbound connection from %s: %d already live%s", ip, per_ip[ip], tail)
            await _close_quietly(read_write_closer)
            return
        if ip is not None:
            per_ip[ip] += 1
        raw = RawConnection(read_write_closer, False)
        try:
            muxed = await self.upgrade_inbound_raw_conn(raw, maddr)
            conn = next((c for c in self.get_connections(muxed.peer_id) if c.muxed_conn is muxed), None)
            if conn is not None:  # else trimmed or closed already: the slot goes back at once
                await conn.event_closed.wait()
        except Exception as exc:  # noqa: BLE001 - a failed handshake is the remote's problem, not ours
            log.debug("inbound connection from %s failed: %r", remote, exc)
            await _close_quietly(raw)
        finally:
            if ip is not None:
                per_ip[ip] -= 1
                if per_ip[ip] <= 0:
                    del per_ip[ip]

    swarm._do_handle_inbound_connection = types.MethodType(inbound, swarm)


@overload
def address_key(ip: str) -> str: ...
@overload
def address_key(ip: str | None) -> str | None: ...
def address_key(ip: str | None) -> str | None:
    """What one operator is assumed to control: an IPv4 address, or an IPv6 /64 (None: unknown address)."""
    if ip is None:
        return None
    canonical = canonical_ip(ip)
    try:
        address = ipaddress.ip_address(canonical)
    except ValueError:
        return canonical
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{address}/{IPV6_PREFIX_BITS}", strict=False))
    return canonical


def canonical_ip(ip: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 address (how a dual-stack socket shows an IPv4 peer) as its
    IPv4; anything that is not an IP address as it is."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _multiaddr_ip(addr: Multiaddr | None) -> str | None:
    if addr is None:
        return None
    for protocol in ("ip4", "ip6"):
        try:
            return addr.value_for_protocol(protocol)
        except Exception:  # noqa: BLE001 - multiaddr raises its own errors for an absent protocol
            continue
    return None


async def _close_quietly(closer) -> None:
    try:
        await closer.close()
    except Exception:  # noqa: BLE001 - the remote may be gone already
        pass


@asynccontextmanager
async def running_host(
    identity: Identity, listen: list[str], inbound_per_ip: int = MAX_INBOUND_PER_IP
) -> AsyncIterator[tuple[IHost, list[str]]]:
    """Run a host listening on `listen`; yield it with its bound addresses, each ending in /p2p/<peer id>."""
    host = build_host(identity, inbound_per_ip)
    async with host.run(listen_addrs=[Multiaddr(a) for a in listen]):
        await host.get_network().auto_connector.stop()
        # Transport addrs carry the real bound port (tcp/0 resolved); get_addrs() would also
        # mix in addresses peers claim to observe.
        addrs = [f"{a}/p2p/{identity.peer_id}" for a in host.get_transport_addrs()]
        try:
            yield host, addrs
        finally:
            # Leaving without closing would leave our connections open on the peers' side.
            with trio.CancelScope(shield=True):
                await host.close()


class ConnectionStarts(QuietNotifee):
    """When each of a host's live connections started, on `clock`: stamped as py-libp2p registers the connection
    (once its handshake is done, which py-libp2p bounds by ConnectionConfig.inbound_upgrade_timeout), so an age
    counts from the connection's start, not from when a periodic sweep first saw it. Register it before the host
    takes connections (`watch`); a connection it was not told of is stamped when first asked about."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._started: weakref.WeakKeyDictionary[INetConn, float] = weakref.WeakKeyDictionary()

    def watch(self, host: IHost) -> ConnectionStarts:
        host.get_network().register_notifee(self)
        return self

    def started(self, host: IHost, peer: ID) -> float | None:
        """When the oldest of `peer`'s live connections started (None: none is live)."""
        conns = host.get_network().get_connections(peer)
        return min((self._started.setdefault(conn, self.clock()) for conn in conns), default=None)

    async def connected(self, network, conn: INetConn) -> None:
        self._started.setdefault(conn, self.clock())

    async def disconnected(self, network, conn: INetConn) -> None:
        self._started.pop(conn, None)


# How often `until_hung_up` looks at the peer's connections.
HUNG_UP_POLL_S = 0.05


async def until_hung_up(host: IHost, peer: str, at_most_s: float) -> None:
    """Return once `peer` has no connection to `host` left, or after `at_most_s`."""
    peer_id = ID.from_base58(peer)
    with trio.move_on_after(at_most_s):
        while host.get_network().get_connections(peer_id):
            await trio.sleep(HUNG_UP_POLL_S)


async def forget_peer(host: IHost, peer: ID) -> None:
    """Close every connection to `peer` and drop what the peerstore holds of it (a peer it never recorded, one
    that never answered identify, included)."""
    await host.disconnect(peer)
    peerstore = host.get_peerstore()
    assert isinstance(peerstore, BoundedPeerStore), "hosts come from build_host"
    peerstore.forget(peer)


def remote_peer_id(stream: INetStream) -> str:
    return stream.muxed_conn.peer_id.to_base58()


def remote_ip(stream: INetStream) -> str | None:
    address = stream.get_remote_address()
    return None if address is None else address[0]


async def _reset_after_failure(stream: INetStream, log: logging.Logger, peer: str) -> None:
    try:
        await stream.reset()
    except Exception:
        log.warning("could not reset stream from %s after handler failure", peer, exc_info=True)


def _peer_ended_stream(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_peer_ended_stream(e) for e in exc.exceptions)
    return isinstance(exc, (StreamEOF, *libp2p_end_of_stream()))


def _log_failure(log: logging.Logger, name: str, peer: str, exc: BaseException) -> None:
    # A peer that resets or closes mid-exchange (it stopped, timed out, or moved on) is normal traffic on a
    # volunteer network: one INFO line. Anything else is a bug of ours or a hostile frame: keep the traceback.
    if _peer_ended_stream(exc):
        log.info("stream %s ended by peer %s: %r", name, peer, exc)
    else:
        log.warning("stream handler %s failed for peer %s: %r", name, peer, exc, exc_info=exc)


def safe_handler(handler: StreamHandler, log: logging.Logger) -> StreamHandler:
    """Wrap a stream handler so that its errors are logged and reset the stream instead of killing the host.

    Cancellation passes through untouched; from an exception group only the Exception
    leaves are contained and any Cancelled is re-raised for trio to handle.
    """
    name = getattr(handler, "__qualname__", repr(handler))

    async def wrapped(stream: INetStream) -> None:
        try:
            await handler(stream)
        except Exception as exc:
            peer = remote_peer_id(stream)
            _log_failure(log, name, peer, exc)
            await _reset_after_failure(stream, log, peer)
        except BaseExceptionGroup as group:
            errors, rest = group.split(Exception)
            if errors is not None:
                peer = remote_peer_id(stream)
                _log_failure(log, name, peer, errors)
                with trio.CancelScope(shield=True):
                    await _reset_after_failure(stream, log, peer)
            if rest is not None:
                raise rest

    return wrapped


async def close_answered(stream: INetStream) -> None:
    """End a stream whose request we have answered: close() (a FIN after the reply, which the peer still
    reads), then close_read(), so that what the peer sends from now on is dropped unread and, once past the
    window the stream still grants, closes its connection (shared/libp2p_patches.py)."""
    await stream.close()
    await stream.close_read()


def set_handler(host: IHost, protocol: str, handler: StreamHandler, log: logging.Logger) -> None:
    host.set_stream_handler(TProtocol(protocol), safe_handler(handler, log))


async def connect(host: IHost, addr: str) -> str:
    """Dial `addr` (which must end in /p2p/<peer id>) and return that peer id.

    py-libp2p refuses to redial a peer for 60 s after a failed dial (its negative cache); a
    restarted hub or an upstream that was not up yet is back in seconds, and every caller paces
    its own retries, so the block is lifted first. A live connection is reused, not redialled.
    """
    info = info_from_p2p_addr(Multiaddr(addr))
    host.get_network().unblock_peer(info.peer_id)
    await host.connect(info)
    return info.peer_id.to_base58()


def admit_only(host: IHost, protocol: str, handler: StreamHandler, allowed: Callable[[str], bool], log: logging.Logger) -> None:
    """Put `handler` (a py-libp2p service's own, registered by it already) behind `allowed(peer id)`: a stream
    from anyone else is reset unread. Call once the service has started (its event_started)."""

    refusal_log = PeerLogLimiter()  # a stranger opening streams in a loop must not fill the disk with lines

    async def guarded(stream: INetStream) -> None:
        peer = remote_peer_id(stream)
        if not allowed(peer):
            if (tail := refusal_log.tail(peer)) is not None:
                log.info("refused %s from %s%s", protocol, peer[-8:], tail)
            await stream.reset()
            return
        await handler(stream)

    # A peer's malformed message may raise anywhere in the service's handler: contained like any handler's.
    host.set_stream_handler(TProtocol(protocol), safe_handler(guarded, log))


async def open_stream(host: IHost, peer_id: str, protocol: str) -> INetStream:
    return await host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])


def on_live_connection(host: IHost, stream: INetStream) -> bool:
    """Whether `stream` rides a connection the host still holds (one dropped and redialled leaves it dead)."""
    return any(conn.muxed_conn is stream.muxed_conn for conn in host.get_network().get_connections(stream.muxed_conn.peer_id))


@overload
async def request(
    host: IHost,
    peer_id: str,
    protocol: str,
    msg: Message,
    reply: type[M],
    /,
    *,
    timeout_s: float,
    sign_with: Identity | None = None,
) -> M: ...
@overload
async def request(
    host: IHost,
    peer_id: str,
    protocol: str,
    msg: Message,
    reply: type[M],
    other: type[M2],
    /,
    *,
    timeout_s: float,
    sign_with: Identity | None = None,
) -> M | M2: ...
@overload
async def request(
    host: IHost,
    peer_id: str,
    protocol: str,
    msg: Message,
    *reply_types: type[Message],
    timeout_s: float,
    sign_with: Identity | None = None,
) -> Message: ...
async def request(
    host: IHost,
    peer_id: str,
    protocol: str,
    msg: Message,
    *reply_types: type[Message],
    timeout_s: float,
    sign_with: Identity | None = None,
) -> Message:
    """Send `msg` (signed by `sign_with` when given) on a new stream, half-close, and return the one reply."""
    with trio.fail_after(timeout_s):
        stream = await open_stream(host, peer_id, protocol)
        try:
            if sign_with is None:
                await write_message(stream, msg)
            else:
                await write_signed(stream, msg, sign_with)
            await stream.close_write()
            reply = await read_message(stream, *reply_types)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.reset()
            raise
        await stream.close()
        return reply


# An emulated link meters in slices of this much of its time, and never less than MIN_SLICE_BYTES.
SLICE_S = 0.002
MIN_SLICE_BYTES = 16384


class RateLimiter:
    """Token bucket emulating a link of `bytes_per_s` (None: unlimited), shared by every stream written through it.

    Data goes out in slices of `slice_bytes`, so a 1 MiB chunk is metered smoothly rather
    than as one burst; the bucket holds at most one slice of credit. By default a slice is
    SLICE_S of the link (at least MIN_SLICE_BYTES): each slice is a write, and on a bulk channel
    a sealed record, so 16 KiB slices at 800 Mbit/s cost the emulation more CPU than the bytes.
    """

    def __init__(self, bytes_per_s: float | None, slice_bytes: int | None = None) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive or None, got {bytes_per_s}")
        if slice_bytes is None:
            slice_bytes = max(MIN_SLICE_BYTES, int((bytes_per_s or 0) * SLICE_S))
        if slice_bytes <= 0:
            raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
        self.bytes_per_s = bytes_per_s
        self.slice_bytes = slice_bytes
        self._tokens = float(slice_bytes)
        self._last_s: float | None = None

    async def _take(self, n: int, rate: float) -> None:
        now = trio.current_time()
        if self._last_s is not None:
            self._tokens = min(float(self.slice_bytes), self._tokens + (now - self._last_s) * rate)
        self._last_s = now
        # Debit before sleeping: concurrent writers queue up behind the accumulated debt.
        self._tokens -= n
        if self._tokens < 0:
            await trio.sleep(-self._tokens / rate)

    async def write(self, stream: WritableStream, data: bytes) -> None:
        rate = self.bytes_per_s
        if rate is None:
            await stream.write(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), self.slice_bytes):
            piece = view[start : start + self.slice_bytes]
            await self._take(len(piece), rate)
            await stream.write(bytes(piece))
