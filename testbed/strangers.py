"""A stranger's bad frames on every /echo2/ protocol, and a raw py-libp2p probe that sends them (tests and
bench/foreign_peer.py, whose js-libp2p probe in bench/foreign/ sends the same bytes).

Each frame is a header naming the protocol's own request type and claiming a body of 2**32 - 1 bytes, then
garbage, written in one of WRITE_PATTERNS; the probe times how long the hub takes to end each stream and the
connection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from shared import messages
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    LEAVE_PROTOCOL,
    MODEL_PROTOCOL,
    PRICE_PROTOCOL,
    RELAY_PROTOCOL,
    REPORT_PROTOCOL,
    RUN_OVER_PROTOCOL,
    SESSION_PROTOCOL,
    SESSION_REQUESTS,
    SNAPSHOT_PROTOCOL,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    TURN_PROTOCOL,
    BadChunkReport,
    Heartbeat,
    JoinRequest,
    LeaseRequest,
    Leave,
    Message,
    ModelFilesRequest,
    PriceChange,
    RelayOffer,
    RunOver,
    SnapshotRequest,
    StatusRequest,
    Submission,
    TurnRequest,
)
from shared.net import connect, open_stream
from shared.wire import HEADER, libp2p_end_of_stream

HUGE_LENGTH = 2**32 - 1
GARBAGE_BYTE = 0xA5
# The request each protocol's handler reads first: the bad frame names its type, so only its length is wrong.
REQUESTS: dict[str, type[Message]] = {
    JOIN_PROTOCOL: JoinRequest,
    HEARTBEAT_PROTOCOL: Heartbeat,
    LEASE_PROTOCOL: LeaseRequest,
    SUBMIT_PROTOCOL: Submission,
    STATUS_PROTOCOL: StatusRequest,
    SNAPSHOT_PROTOCOL: SnapshotRequest,
    RELAY_PROTOCOL: RelayOffer,
    REPORT_PROTOCOL: BadChunkReport,
    MODEL_PROTOCOL: ModelFilesRequest,
    PRICE_PROTOCOL: PriceChange,
    LEAVE_PROTOCOL: Leave,
    RUN_OVER_PROTOCOL: RunOver,
    TURN_PROTOCOL: TurnRequest,
}
# The protocols nodes serve and the hub does not: a stranger probing the hub finds them not negotiated.
NODE_PROTOCOLS = frozenset({RELAY_PROTOCOL, RUN_OVER_PROTOCOL})


def echo2_protocols() -> list[str]:
    """Every /echo2/ protocol id shared/messages.py names (a new one is probed without a change here)."""
    ids = {v for k, v in vars(messages).items() if k.endswith("_PROTOCOL") and isinstance(v, str) and v.startswith("/echo2/")}
    return sorted(ids)


def bad_frame_header(protocol: str) -> bytes:
    """What a stranger sends first on `protocol`: its request's type with a 4 GiB length (a session's selector
    byte first, naming a heartbeat)."""
    if protocol == SESSION_PROTOCOL:
        return bytes([SESSION_REQUESTS.index(HEARTBEAT_PROTOCOL)]) + HEADER.pack(Heartbeat.TYPE, HUGE_LENGTH)
    return HEADER.pack(REQUESTS[protocol].TYPE, HUGE_LENGTH)


@dataclass
class StreamFate:
    """How the hub ended one probed stream, in seconds from the connection's start (None: not within the probe)."""

    protocol: str
    opened_s: float | None = None
    half_closed_s: float | None = None
    ended_s: float | None = None
    ended_by: str = ""
    reply: bytes = b""  # what the hub answered before it ended the stream
    error: str = ""


@dataclass
class ProbeReport:
    implementation: str
    connection_closed_s: float | None
    give_up_s: float
    busy_streams: int  # bad streams opened while waiting for the connection to close
    streams: list[StreamFate]


# Bytes per write of the "small-writes" pattern.
SMALL_WRITE_BYTES = 4096


async def _one_write_then_close(stream: INetStream, frame: bytes, fate: StreamFate, started: float) -> None:
    """The whole frame in one write (py-libp2p sends a receive window of it, then waits for credit), then a half-close."""
    await stream.write(frame)
    await stream.close_write()
    fate.half_closed_s = trio.current_time() - started


async def _one_write(stream: INetStream, frame: bytes, fate: StreamFate, started: float) -> None:
    """The whole frame in one write, and the stream left open."""
    await stream.write(frame)


async def _small_writes(stream: INetStream, frame: bytes, fate: StreamFate, started: float) -> None:
    """The frame SMALL_WRITE_BYTES at a time, then more garbage the same way until the hub ends the stream, never
    closing."""
    for start in range(0, len(frame), SMALL_WRITE_BYTES):
        await stream.write(frame[start : start + SMALL_WRITE_BYTES])
    while True:
        await stream.write(bytes([GARBAGE_BYTE]) * SMALL_WRITE_BYTES)


# How a stranger's Yamux may write its bad frame: every one must end on the hub within the refusal's bound.
WRITE_PATTERNS: dict[str, Callable[[INetStream, bytes, StreamFate, float], Awaitable[None]]] = {
    "one-write": _one_write_then_close,
    "one-write-no-close": _one_write,
    "small-writes": _small_writes,
}


async def probe_stream(
    host: IHost, hub_id: str, protocol: str, garbage: bytes, started: float, fate: StreamFate, pattern: str = "one-write"
) -> None:
    """Open `protocol`, write its bad frame and `garbage` as `pattern` does (until the hub ends the stream, for a
    pattern that never stops), then read until the hub ends the stream."""
    try:
        stream = await open_stream(host, hub_id, protocol)
    except Exception as exc:  # noqa: BLE001 - a protocol the hub does not serve is refused at negotiation
        fate.error, fate.ended_by = f"{type(exc).__name__}: {exc}", "not negotiated"
        return
    fate.opened_s = trio.current_time() - started
    try:
        await WRITE_PATTERNS[pattern](stream, bad_frame_header(protocol) + garbage, fate, started)
    except libp2p_end_of_stream() as exc:  # ended by the hub before all of it went: what it answered is still read
        fate.error = f"write: {type(exc).__name__}"
    try:
        while piece := await stream.read(65536):
            fate.reply += piece
        fate.ended_by = "closed"
    except libp2p_end_of_stream() as exc:  # py-libp2p ends a read with an EOF (the hub's FIN) or a reset
        fate.ended_by = "reset" if "Reset" in type(exc).__name__ else "closed"
    except Exception as exc:  # noqa: BLE001 - whatever the hub's end looks like from here is what the probe reports
        fate.ended_by, fate.error = "error", f"{type(exc).__name__}: {exc}"
    fate.ended_s = trio.current_time() - started


async def raw_probe(
    host: IHost, hub_addr: str, protocols: list[str], garbage_bytes: int, give_up_s: float, busy_every_s: float | None = None
) -> ProbeReport:
    """The js-libp2p probe's attack from a py-libp2p host: every protocol at once on one connection, then wait
    (up to `give_up_s` from the dial) for the hub to end each stream and the connection, with `busy_every_s`
    opening one more bad status stream that often meanwhile (a stranger that is never idle)."""
    started = trio.current_time()
    hub_id = await connect(host, hub_addr)
    garbage = bytes([GARBAGE_BYTE]) * garbage_bytes
    fates = [StreamFate(protocol) for protocol in protocols]
    busy: list[StreamFate] = []
    closed_s = None
    with trio.move_on_after(give_up_s):
        async with trio.open_nursery() as nursery:
            for fate in fates:
                nursery.start_soon(probe_stream, host, hub_id, fate.protocol, garbage, started, fate)
            while host.get_network().get_connections(ID.from_base58(hub_id)):
                if busy_every_s is not None and trio.current_time() - started >= len(busy) * busy_every_s:
                    busy.append(StreamFate(STATUS_PROTOCOL))
                    nursery.start_soon(probe_stream, host, hub_id, STATUS_PROTOCOL, garbage, started, busy[-1])
                await trio.sleep(0.05)
            closed_s = trio.current_time() - started
    for fate in fates:
        if fate.ended_s is None and not fate.ended_by:
            fate.ended_by = "still open when the probe gave up"
    return ProbeReport("py-libp2p", closed_s, give_up_s, len(busy), fates)
