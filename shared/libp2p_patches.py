"""The patches echo2 makes to py-libp2p's private methods and constants, applied once per process by `apply()`.

They are written against py-libp2p 0.8.1 (pyproject.toml pins libp2p>=0.8.1,<0.9) and read its
private internals, which any other release may change without notice: `apply()` refuses to run
(LibP2PVersionError) unless the installed py-libp2p is exactly LIBP2P_PATCHED_VERSION. shared/net.py
calls it before it builds a host; its per-host inbound handler (`_hold_inbound_slots_while_alive`)
relies on the same release's swarm internals and is covered by the same check.

- Yamux credit: py-libp2p sends a window update after every read, even of a few bytes, so a
  request and its reply cost 22 frames (each a Noise message and a send), 12 of them window
  updates. `_credit_like_go_yamux` replaces that rule with go-yamux's (credit once half the
  window is used, auto-tuning kept): 10 frames.
- Noise framing: py-libp2p's 64 KiB Yamux frames are 17 bytes over Noise's largest message, so each
  data frame would go out as two messages, and the receiver would make two socket reads per message (its
  length, then its body). YAMUX_FRAME_BYTES and `_read_noise_message` make that one message per frame and
  about one read per message, which saves about a third of the bare transport's CPU per GB
  (bench/scale.py's transport floor measures it).
- Receive memory: py-libp2p buffers every DATA byte a peer sends, even past the stream's receive window (it
  only logs the overrun), and keeps what a stream received until someone reads it. `_StreamBuffer` (installed
  on every Yamux connection by `_init_with_guarded_buffers`) refuses bytes past a stream's window, and more than
  CONNECTION_BUFFER_BYTES held unread on one connection's streams: the connection is closed and the overrun
  counted against the peer (`overruns`). `_close_read_in_muxer` makes NetStream.close_read, which py-libp2p
  only records in the stream's state, drop what the stream holds unread and whatever the peer sends after it
  (docs/upstream/yamux-window.md is the report for py-libp2p).
- Reset streams: py-libp2p's YamuxStream.reset keeps what the stream received unread, and adds what the peer still
  sends, until its stale-stream sweeper's grace is over (60 s), though nothing may read a reset stream; and resetting
  a stream both sides had closed sends nothing and keeps that too. A stranger whose one write exceeds the window left
  a window (256 KiB) of it held per refused stream. `_reset_dropping_unread` drops it and the stream's bookkeeping at
  once, and what the peer sends after it is ignored (docs/upstream/yamux-reset.md is the report for py-libp2p).
"""

from __future__ import annotations

import collections
import functools
import logging
from importlib.metadata import version as package_version

import trio
from libp2p.io.exceptions import IncompleteReadError
from libp2p.network.stream.net_stream import NetStream
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, SIZE_NOISE_MESSAGE_LEN, NoiseTransportReadWriter
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from shared.logs import PeerLogLimiter

LIBP2P_PATCHED_VERSION = "0.8.1"
# Noise carries at most 65,535 bytes a message, 16 of them its tag. py-libp2p's Yamux data frames are
# 64 KiB with their 12-byte header, one message too many: each would go out as two (65,519 bytes and 17),
# two encryptions, two sends, and four socket reads at the other end.
YAMUX_FRAME_BYTES = MAX_PLAINTEXT_LENGTH
# Bytes one socket read may take for a Noise session: it takes every message that has queued, where
# py-libp2p reads each one's 2-byte length and its body separately.
NOISE_RECEIVE_BYTES = 256 * 1024
NOISE_LENGTH_BYTES = SIZE_NOISE_MESSAGE_LEN
# Bytes one connection's streams may hold received and not yet read: two streams at the largest window
# py-libp2p grants (16 MiB). A peer within its windows stays under it unless the host leaves several streams
# of its own unread; a peer over it is disconnected.
CONNECTION_BUFFER_BYTES = 2 * yamux_module.MAX_WINDOW_SIZE
# Peers whose overruns are remembered, the most recent ones (throwaway identities must not grow the table).
OVERRUN_PEERS = 4096
log = logging.getLogger("echo2.net")


class LibP2PVersionError(RuntimeError):
    """The installed py-libp2p is not the release these patches were written against."""


def check_version() -> None:
    """LibP2PVersionError unless the installed py-libp2p is LIBP2P_PATCHED_VERSION."""
    found = package_version("libp2p")
    if found != LIBP2P_PATCHED_VERSION:
        raise LibP2PVersionError(
            f"echo2 patches private methods of py-libp2p {LIBP2P_PATCHED_VERSION} (shared/libp2p_patches.py) and "
            f"py-libp2p {found} is installed: pip install 'libp2p=={LIBP2P_PATCHED_VERSION}'"
        )


@functools.cache
def apply() -> None:
    """Check the installed release, then install the patches (once: later calls return at once)."""
    check_version()
    YamuxStream._auto_tune_and_send_window_update = _credit_like_go_yamux
    yamux_module.MAX_MESSAGE_SIZE = YAMUX_FRAME_BYTES
    NoiseTransportReadWriter.read_msg = _read_noise_message
    Yamux.__init__ = _init_with_guarded_buffers
    NetStream.close_read = _close_read_in_muxer
    YamuxStream.reset = _reset_dropping_unread


# py-libp2p's own rule, kept for comparison (tests/test_net.py).
PY_LIBP2P_CREDIT = YamuxStream._auto_tune_and_send_window_update


async def _credit_like_go_yamux(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Replaces YamuxStream._auto_tune_and_send_window_update: grant credit as go-yamux does, only once the
    slack (target window minus what the sender may still send and what is buffered unread) reaches half
    the target, growing the target as py-libp2p's auto-tuning does.

    py-libp2p also credits the bytes of every read while the slack is under half a window: one more
    Yamux frame, Noise message and send per read: a request and its reply cost 22 frames that way,
    12 of them such window updates, and 10 with this rule. The sender never waits for long: a reader that drained its
    buffer has slack of at least half the window once the sender has used it, and credits it then."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        slack = self.target_recv_window - (self.recv_window + buffered)
        if slack <= 0 or slack < self._grow_threshold():
            return
        increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
    await self.send_window_update(increment, skip_lock=True)


async def _read_noise_message(self: NoiseTransportReadWriter, prefix_encoded: bool = False) -> bytes:
    """Replaces NoiseTransportReadWriter.read_msg: the same messages, cut from a receive buffer filled by
    reads of up to NOISE_RECEIVE_BYTES, where py-libp2p made two exact reads each (one read per message
    or fewer, unless a message arrives in pieces). Only the transport phase buffers: the handshake's
    reader stops exactly at its last message, so no bytes of the session are left behind in it."""
    pending: bytearray | None = getattr(self, "_echo2_received", None)
    if pending is None:
        pending = self._echo2_received = bytearray()
    while True:
        if len(pending) >= NOISE_LENGTH_BYTES:
            end = NOISE_LENGTH_BYTES + int.from_bytes(pending[:NOISE_LENGTH_BYTES], "big")
            if len(pending) >= end:
                message = bytes(pending[NOISE_LENGTH_BYTES:end])
                del pending[:end]
                break
        more = await self.read_writer.read_write_closer.read(NOISE_RECEIVE_BYTES)
        if not more:
            # As py-libp2p's exact reads end: Yamux treats 0 bytes received as a clean close.
            wanted = end if len(pending) >= NOISE_LENGTH_BYTES else NOISE_LENGTH_BYTES
            raise IncompleteReadError(
                f"connection closed after {len(pending)} of {wanted} bytes of a Noise message",
                expected_bytes=wanted,
                received_bytes=len(pending),
            )
        pending += more
    return self.decrypt(message[len(self.prefix) :] if prefix_encoded else message)


class PeerOverran(trio.TooSlowError):
    """Raised from a Yamux connection's reader to close the connection. py-libp2p 0.8.1's reader contains
    other errors raised while it buffers DATA (it marks the stream closed and reads on); a TooSlowError is the
    one it answers by closing the connection, in its own task, with its own cleanup."""


_overruns: collections.OrderedDict[str, int] = collections.OrderedDict()
_overrun_log = PeerLogLimiter()  # a peer redialling to overrun in a loop must not fill the disk with lines


def overruns(peer_id: str) -> int:
    """How many of `peer_id`'s connections were closed for overrunning a window or the buffer cap (the
    OVERRUN_PEERS most recent peers are remembered)."""
    return _overruns.get(peer_id, 0)


def _overran(conn: Yamux, reason: str) -> PeerOverran:
    peer = conn.peer_id.to_base58()
    _overruns[peer] = _overruns.pop(peer, 0) + 1
    while len(_overruns) > OVERRUN_PEERS:
        _overruns.popitem(last=False)
    if (tail := _overrun_log.tail(peer)) is not None:
        log.warning("closing the connection of %s: %s%s", peer, reason, tail)
    return PeerOverran(f"peer {peer} {reason}")


class _StreamBuffer(bytearray):
    """A Yamux stream's receive buffer (Yamux.stream_buffers values): py-libp2p's reader extends it with each
    DATA frame's bytes before it takes them off the stream's window, so `extend` sees the window they must fit.
    Bytes on a stream closed for reading are dropped, and still take up its window, which is never credited
    again: a peer that keeps sending overruns it soon."""

    conn: Yamux
    stream_id: int

    def extend(self, data) -> None:
        conn = self.conn
        stream = conn.streams.get(self.stream_id)
        if stream is None:
            return
        if len(data) > stream.recv_window:
            raise _overran(
                conn,
                f"sent {len(data)} bytes on stream {self.stream_id} past its receive window ({stream.recv_window} bytes left)",
            )
        if getattr(stream, "_echo2_reads_closed", False):
            return
        held = sum(map(len, conn.stream_buffers.values())) + len(data)
        if held > CONNECTION_BUFFER_BYTES:
            raise _overran(conn, f"would have {held} bytes held unread on its streams, over {CONNECTION_BUFFER_BYTES}")
        super().extend(data)


class _GuardedBuffers(dict[int, bytearray]):
    """Yamux.stream_buffers: every buffer py-libp2p stores in it becomes a `_StreamBuffer` of its connection."""

    def __init__(self, conn: Yamux) -> None:
        super().__init__()
        self.conn = conn

    def __setitem__(self, stream_id: int, buffer: bytearray) -> None:
        guarded = _StreamBuffer(buffer)
        guarded.conn, guarded.stream_id = self.conn, stream_id
        super().__setitem__(stream_id, guarded)


_yamux_init = Yamux.__init__


def _init_with_guarded_buffers(self: Yamux, *args, **kwargs) -> None:
    """Replaces Yamux.__init__: py-libp2p's, then stream buffers that refuse overruns (`_StreamBuffer`)."""
    _yamux_init(self, *args, **kwargs)
    self.stream_buffers = _GuardedBuffers(self)


_net_stream_close_read = NetStream.close_read


async def _close_read_in_muxer(self: NetStream) -> None:
    """Replaces NetStream.close_read, which py-libp2p only records in the stream's state (reads still work, and
    Yamux keeps buffering): the Yamux stream also drops what it holds unread and whatever the peer sends on it
    from now on (see `_StreamBuffer`)."""
    await _net_stream_close_read(self)
    stream = self.muxed_stream
    if not isinstance(stream, YamuxStream):
        return
    stream._echo2_reads_closed = True  # read by _StreamBuffer.extend
    conn = stream.conn
    async with conn.streams_lock:
        buffer = conn.stream_buffers.get(stream.stream_id)
        if buffer:
            buffer.clear()
        if stream.closed:  # the peer closed its side already: nothing is left to hold
            conn._finalize_stream_locked(stream, fully_closed=True)


_yamux_reset = YamuxStream.reset


async def _reset_dropping_unread(self: YamuxStream) -> None:
    """Replaces YamuxStream.reset: py-libp2p's (an RST, unless both sides had closed the stream already), after which
    nothing of the stream is held: what it received unread is dropped, and with it the stream's entry, so that DATA
    the peer still sends on it is ignored (see the module docstring)."""
    self._echo2_reads_closed = True  # read by _StreamBuffer.extend: nothing more is kept until the entry goes
    conn = self.conn
    async with conn.streams_lock:
        buffer = conn.stream_buffers.get(self.stream_id)
        if buffer:
            buffer.clear()
    await _yamux_reset(self)
    await conn._finalize_stream(self, fully_closed=True)  # py-libp2p finalizes only a stream it sent the RST on
