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
"""

from __future__ import annotations

import functools
from importlib.metadata import version as package_version

from libp2p.io.exceptions import IncompleteReadError
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, SIZE_NOISE_MESSAGE_LEN, NoiseTransportReadWriter
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import YamuxStream

LIBP2P_PATCHED_VERSION = "0.8.1"
# Noise carries at most 65,535 bytes a message, 16 of them its tag. py-libp2p's Yamux data frames are
# 64 KiB with their 12-byte header, one message too many: each would go out as two (65,519 bytes and 17),
# two encryptions, two sends, and four socket reads at the other end.
YAMUX_FRAME_BYTES = MAX_PLAINTEXT_LENGTH
# Bytes one socket read may take for a Noise session: it takes every message that has queued, where
# py-libp2p reads each one's 2-byte length and its body separately.
NOISE_RECEIVE_BYTES = 256 * 1024
NOISE_LENGTH_BYTES = SIZE_NOISE_MESSAGE_LEN


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
            raise IncompleteReadError(f"connection closed after {len(pending)} of {wanted} bytes of a Noise message",
                                      expected_bytes=wanted, received_bytes=len(pending))
        pending += more
    return self.decrypt(message[len(self.prefix):] if prefix_encoded else message)
