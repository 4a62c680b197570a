"""The node's link to its hub: join, heartbeat, and rejoin with backoff when the hub goes away.

The hub's identity is the /p2p/ part of the address the volunteer was given; the Noise
handshake proves we reached that key, so a hub restart at the same address needs no
action from the volunteer: heartbeats fail, the link rejoins with exponential backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost

from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    EventRecord,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Reject,
)
from shared.net import connect, request

log = logging.getLogger("echo2.node.hub_link")

REQUEST_TIMEOUT_S = 15.0
BACKOFF_START_S = 0.5
EVENTS_KEPT = 50


@dataclass
class LinkState:
    connected: bool = False
    state: str = "connecting"
    latest_version: int = -1
    last_reply: HeartbeatReply | None = None
    joins: int = 0
    events: list[EventRecord] = field(default_factory=list)

    def note(self, kind: str, detail: str) -> None:
        self.events.append(EventRecord(at=time.time(), kind=kind, detail=detail))
        del self.events[:-EVENTS_KEPT]


class HubLink:
    """Keeps this node joined to the hub and hands every heartbeat reply to `on_reply`."""

    def __init__(
        self,
        host: IHost,
        hub_addr: str,
        hub_peer_id: str,
        join_request: Callable[[], JoinRequest],
        heartbeat: Callable[[], Heartbeat],
        on_reply: Callable[[HeartbeatReply], None],
        period_s: float,
        backoff_max_s: float,
    ) -> None:
        self.host = host
        self.hub_addr = hub_addr
        self.hub_peer_id = hub_peer_id
        self.join_request = join_request
        self.heartbeat = heartbeat
        self.on_reply = on_reply
        self.period_s = period_s
        self.backoff_max_s = backoff_max_s
        self.state = LinkState()
        self.beat_now = trio.Event()

    async def _join(self) -> JoinReply:
        backoff = BACKOFF_START_S
        while True:
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    await connect(self.host, self.hub_addr)
                reply = await request(
                    self.host, self.hub_peer_id, JOIN_PROTOCOL, self.join_request(), JoinReply, Reject,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            except Exception as exc:  # noqa: BLE001 - any dial or stream failure means "hub not reachable yet"
                log.info("hub not reachable (%s); retrying in %.1fs", type(exc).__name__, backoff)
                self.state.connected = False
                self.state.state = "connecting"
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            if isinstance(reply, Reject):
                if reply.reason == "banned":
                    raise SystemExit(f"the hub banned this node: {reply.reason}")
                log.warning("hub refused join: %s; retrying in %.1fs", reply.reason, backoff)
                self.state.note("join_refused", reply.reason)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            return reply

    async def run(self) -> None:
        while True:
            reply = await self._join()
            self.state.connected = True
            self.state.state = reply.state
            self.state.latest_version = reply.latest_version
            self.state.joins += 1
            self.state.note("joined", f"state {reply.state}, hub at v{reply.latest_version}")
            log.info("joined hub %s as %s (hub at v%d)", self.hub_peer_id[-8:], reply.state, reply.latest_version)
            await self._heartbeats()

    async def _heartbeats(self) -> None:
        """Heartbeat until the hub stops answering (then return, to rejoin)."""
        failures = 0
        while True:
            try:
                reply = await request(
                    self.host, self.hub_peer_id, HEARTBEAT_PROTOCOL, self.heartbeat(), HeartbeatReply, Reject,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            except Exception as exc:  # noqa: BLE001 - hub gone or restarting
                failures += 1
                log.info("heartbeat failed (%s)", type(exc).__name__)
                if failures >= 2:
                    self.state.connected = False
                    self.state.note("hub_lost", type(exc).__name__)
                    return
                await trio.sleep(BACKOFF_START_S)
                continue
            if isinstance(reply, Reject):
                # A restarted hub no longer knows us: join again.
                self.state.note("heartbeat_refused", reply.reason)
                if reply.reason == "banned":
                    raise SystemExit("the hub banned this node")
                return
            failures = 0
            if reply.state != self.state.state:
                self.state.note("state", f"{self.state.state} -> {reply.state}")
            self.state.state = reply.state
            self.state.latest_version = reply.latest_version
            self.state.last_reply = reply
            self.on_reply(reply)
            with trio.move_on_after(self.period_s):
                await self.beat_now.wait()
            self.beat_now = trio.Event()
