"""The node's link to its hub: join, heartbeat, and rejoin with backoff when the hub goes away.

The hub's identity is the /p2p/ part of the address the volunteer was given; the Noise
handshake proves we reached that key, so a hub restart at the same address needs no
action from the volunteer: heartbeats fail, the link rejoins with exponential backoff.
The hub sets the heartbeat period (in its join reply). A refusal that cannot fix itself
(banned, another model than the hub's) ends the node with the hub's reason; so does another
peer answering at the hub's address before the first join (the /p2p/ part of --hub is wrong).
A hub whose run is over says so (node/run.py); a node that waits for the next run stops
heartbeating and rejoins without a line per failed try, until a hub answers at the address.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from node.client import HubClient, WrongHub
from shared.failures import plain_failure
from shared.messages import (
    PEER_TEXT_CHARS,
    EventRecord,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    PriceReply,
    Reject,
    RejectCode,
    printable_excerpt,
)

log = logging.getLogger("echo2.node.hub_link")

BACKOFF_START_S = 0.5
EVENTS_KEPT = 50
# After a price change the hub refused (or could not take: away, timed out), try again this late.
PRICE_RETRY_S = 600.0
# Refusals no retry can cure (the volunteer must change something): the node stops and says why.
FINAL_REFUSALS = (RejectCode.BANNED, RejectCode.MODEL_MISMATCH, RejectCode.PRICE_TOO_HIGH)


@dataclass
class LinkState:
    connected: bool = False
    state: str = "connecting"
    latest_version: int = -1
    last_reply: HeartbeatReply | None = None
    joins: int = 0
    # With a price schedule: the price the hub holds for this node (its join's, then each change it took).
    price_per_hour: float | None = None
    events: list[EventRecord] = field(default_factory=list)
    # Told every event as it happens: `echo-node join` prints them, so the volunteer sees what it waits for.
    on_note: Callable[[EventRecord], None] = lambda event: None
    # Time in standby (unpaid: the summary says why): the stretches before, and when this one began, on `clock`
    # (read after trio.run too, by the summary of a stopped node).
    standby_before_s: float = 0.0
    standby_since: float | None = None
    clock: Callable[[], float] = time.monotonic

    def enter(self, state: str) -> None:
        """Take the state the hub gives (or "connecting"), keeping the time spent in standby."""
        now = self.clock()
        if self.standby_since is not None and state != "standby":
            self.standby_before_s += now - self.standby_since
            self.standby_since = None
        elif self.standby_since is None and state == "standby":
            self.standby_since = now
        self.state = state

    def standby_s(self) -> float:
        """Seconds spent in standby since the node started, the current stretch included."""
        current = self.clock() - self.standby_since if self.standby_since is not None else 0.0
        return self.standby_before_s + current

    def note(self, kind: str, detail: str, said: bool = True) -> None:
        """Keep an event (the dashboard's list); tell `on_note` too unless not `said` (an install held back from the
        terminal's pace, node/run.py)."""
        event = EventRecord(at=time.time(), kind=kind, detail=detail)
        self.events.append(event)
        del self.events[:-EVENTS_KEPT]
        if said:
            self.on_note(event)


def state_change_text(old: str, new: str) -> str:
    """A state change as the volunteer reads it: "active -> standby". Why a node is in standby (unpaid) follows on a
    line of its own, with its measured rate (node/run.py), also when it joins in standby."""
    return f"{old} -> {new}"


class NodeRefused(Exception):
    """The hub refused this node for a reason no retry cures (banned, another model, too high a price)."""

    def __str__(self) -> str:
        return f"the hub refused this node: {self.args[0]}"


def describe_failure(exc: BaseException) -> str:
    """The innermost cause of a failed dial or request (trio and libp2p nest them), in a few words."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    while exc.__cause__ is not None and not str(exc):
        exc = exc.__cause__
    # A peer's words may be inside (a protocol it answered with): cleaned, as every peer text this node shows.
    text = printable_excerpt(str(exc).splitlines()[0], 120) if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class HubLink:
    """Keeps this node joined to the hub and hands every heartbeat reply to `on_reply`."""

    def __init__(
        self,
        client: HubClient,
        join_request: Callable[[], JoinRequest],
        heartbeat: Callable[[], Heartbeat],
        on_reply: Callable[[HeartbeatReply], None],
        backoff_max_s: float,
        on_join: Callable[[JoinReply], Awaitable[None]] | None = None,
        price: Callable[[], float] | None = None,
    ) -> None:
        """`on_join`: awaited with each join reply before the node heartbeats (it may raise to stop the node).
        `price`: the price this node asks now (a schedule); re-declared to the hub whenever it differs."""
        self.price = price
        self.next_price_change = 0.0  # trio.current_time() before which the hub takes no change
        self.client = client
        self.on_join = on_join
        self.join_request = join_request
        self.heartbeat = heartbeat
        self.on_reply = on_reply
        self.period_s = BACKOFF_START_S  # until the hub's join reply sets it
        self.backoff_max_s = backoff_max_s
        self.state = LinkState()
        self.beat_now = trio.Event()
        self.waiting = False  # for the next run: the hub said its run is over

    async def _join(self) -> JoinReply:
        backoff = BACKOFF_START_S
        while True:
            reply = await self._try_join(backoff)
            if reply is not None:
                return reply
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)

    async def _try_join(self, backoff: float) -> JoinReply | None:
        """One join: the hub's reply, or None once the failure is noted (the caller retries after `backoff`).
        Raises what no retry cures: a final refusal, or another peer at the hub's address before any join."""
        try:
            await self.client.connect()
            request = self.join_request()
            reply = await self.client.join(request)
        except WrongHub as exc:
            if self.state.joins == 0:
                raise  # the /p2p/ part of --hub names another key than the one there: the volunteer must fix it
            # The hub we joined gave way to another peer at its address: it may come back there.
            log.warning("%s; retrying in %.1fs", exc, backoff)
            self._unreachable("wrong_peer", f"{exc}; next try in {backoff:.0f}s")
            return None
        except Exception as exc:  # noqa: BLE001 - any dial or stream failure means "hub not reachable yet"
            log.info("hub not reachable (%s); retrying in %.1fs", type(exc).__name__, backoff)
            # Waiting for the next run, a hub away is what the node expects: no line per try.
            detail = f"the hub {plain_failure(exc)}; next try in {backoff:.0f}s"
            self._unreachable("unreachable", detail, said=not self.waiting)
            return None
        if isinstance(reply, Reject):
            reason = printable_excerpt(reply.reason, PEER_TEXT_CHARS)
            if reply.code in FINAL_REFUSALS:
                raise NodeRefused(reason)
            # Waiting, a refusal is most likely the ending hub's ("no more joins"): no line per try either.
            log.log(logging.INFO if self.waiting else logging.WARNING, "hub refused join: %s; retrying in %.1fs", reason, backoff)
            if not self.waiting:
                self.state.note("join_refused", f"{reason}; next try in {backoff:.0f}s")
            return None
        self.waiting = False
        if self.price is not None:  # a rejoin declared the schedule's price anew: the rate limit starts over
            self.state.price_per_hour, self.next_price_change = request.price_per_hour, 0.0
        return reply

    def _unreachable(self, kind: str, detail: str, said: bool = True) -> None:
        if said:
            self.state.note(kind, detail)
        self.state.connected = False
        self.state.enter("connecting")

    def wait_next_run(self, why: str) -> None:
        """The hub said its run is over (`why`) and the volunteer asked to wait for the next one: heartbeats stop
        now, and the link rejoins quietly until a hub answers at the address."""
        self.waiting = True
        self.state.note("run_over", f"{why}; waiting for the next run at this address")
        self.state.connected = False
        self.state.enter("connecting")
        self.beat_now.set()

    async def run(self) -> None:
        while True:
            reply = await self._join()
            self.state.connected = True
            self.period_s = reply.heartbeat_period_s
            self.state.enter(reply.state)
            self.state.latest_version = reply.latest_version
            self.state.joins += 1
            self.state.note(
                "joined",
                f"state {reply.state}, hub at v{reply.latest_version}, task {printable_excerpt(reply.task, PEER_TEXT_CHARS)}, "
                f"S={reply.staleness}, heartbeat every {reply.heartbeat_period_s:g}s",
            )
            log.info("joined hub %s as %s (hub at v%d)", self.client.hub_peer_id[-8:], reply.state, reply.latest_version)
            if self.on_join is not None:
                await self.on_join(reply)
            await self._heartbeats()
            # Lost or forgotten by the hub: rejoining, not standing by (a standby stretch is unpaid time it reports).
            self.state.enter("connecting")

    async def _heartbeats(self) -> None:
        """Heartbeat until the hub stops answering (then return, to rejoin)."""
        failures = 0
        while not self.waiting:
            try:
                reply = await self.client.heartbeat(self.heartbeat())
            except Exception as exc:  # noqa: BLE001 - hub gone or restarting
                failures += 1
                log.info("heartbeat failed (%s)", type(exc).__name__)
                if failures >= 2:
                    self.state.connected = False
                    self.state.note("hub_lost", f"the hub {plain_failure(exc)}; joining it again")
                    return
                await trio.sleep(BACKOFF_START_S)
                continue
            if isinstance(reply, Reject):
                reason = printable_excerpt(reply.reason, PEER_TEXT_CHARS)
                if reply.code in FINAL_REFUSALS:
                    raise NodeRefused(reason)
                if reply.code == RejectCode.UNKNOWN_NODE:
                    # A restarted hub, or one that dropped us as silent, no longer knows us: join again.
                    self.state.note("heartbeat_refused", reason)
                    return
                # Busy (the hub's own limits) or a one-off refusal: beat again a little later, still joined.
                log.info("heartbeat refused: %s", reason)
                await trio.sleep(BACKOFF_START_S)
                continue
            failures = 0
            if reply.state != self.state.state:
                self.state.note("state", state_change_text(self.state.state, reply.state))
            self.state.enter(reply.state)
            self.state.latest_version = reply.latest_version
            self.state.last_reply = reply
            self.period_s = reply.heartbeat_period_s  # the hub stretches it as its fleet grows
            self.on_reply(reply)
            await self._follow_price()
            with trio.move_on_after(self.period_s):
                await self.beat_now.wait()
            self.beat_now = trio.Event()

    async def _follow_price(self) -> None:
        """Re-declare the price when the schedule moved it, no sooner than the hub takes a change."""
        if self.price is None:
            return
        wanted = self.price()
        if wanted == self.state.price_per_hour or trio.current_time() < self.next_price_change:
            return
        try:
            reply = await self.client.reprice(wanted)
        except Exception as exc:  # noqa: BLE001 - away or timed out: it keeps the joined price
            reply = None
            reason = f"the hub {plain_failure(exc)}"
        if isinstance(reply, PriceReply):
            self.state.note("price", f"${self.state.price_per_hour:.2f}/h -> ${reply.price_per_hour:.2f}/h")
            self.state.price_per_hour = reply.price_per_hour
            self.next_price_change = trio.current_time() + reply.next_change_in_s
            return
        if isinstance(reply, Reject):
            reason = printable_excerpt(reply.reason, PEER_TEXT_CHARS)
        log.warning("price change to $%.4g/h refused: %s", wanted, reason)
        self.state.note("price_refused", f"${wanted:.2f}/h: {reason}; next try in {PRICE_RETRY_S:.0f}s")
        self.next_price_change = trio.current_time() + PRICE_RETRY_S
