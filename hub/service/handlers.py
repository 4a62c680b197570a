"""The hub's libp2p service: the node protocols translated into the commands of the hub's three owners.

Each handler reads one size-capped request, calls one command of Membership, Leasing or Intake (a submission's
frame is read, verified and decoded by the intake's pipeline, within the cap the guard reserved for it), or of a
tool-using run's rollouts (hub/agents/rollouts.py: a lease's rollouts open as it is granted, its turns are answered),
and writes the reply. No bookkeeping happens here. Every inbound stream
first passes the peer guard (per-peer stream, rate and memory caps). A peer fault (`PeerFault`:
bad frame, bad signature, a request it may not make) is counted against the peer and answered
with a Reject naming its code; `HubBusy` asks the peer to send the same request again later;
any other exception is our own bug and propagates to `safe_handler`, never counted against a peer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from hub.agents.rollouts import AgentsBusy
from hub.config import HubConfig
from hub.distribution.broadcast import Broadcaster, ChainLinks, HubUplink
from hub.records.snapshots import SnapshotShelf
from hub.service.intake import HubBusy
from hub.service.leasing import HANDLER_TIMEOUT_S
from hub.service.state import HubState
from hub.trust.guard import Admission, PeerGuard
from hub.trust.watchers import StatusWatchers
from shared.buckets import TokenBuckets
from shared.bulk import BulkChannel, serving_stream
from shared.crypto import Identity
from shared.logs import PeerLogLimiter
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    LEAVE_PROTOCOL,
    MIN_LINK_BPS,
    MODEL_FILE_FRAME,
    MODEL_PROTOCOL,
    PRICE_PROTOCOL,
    REPORT_PROTOCOL,
    RUN_OVER_PROTOCOL,
    RUN_OVER_REASON,
    SESSION_IDLE_S,
    SESSION_PROTOCOL,
    SESSION_REQUESTS,
    SESSIONS_PER_PEER,
    SNAPSHOT_PROTOCOL,
    STATUS_PROTOCOL,
    STRANGER_STATUS_PER_S,
    SUBMIT_PROTOCOL,
    TURN_PROTOCOL,
    BadChunkReport,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Lease,
    LeasePrompt,
    LeaseReply,
    LeaseRequest,
    Leave,
    LeaveReply,
    ModelFilesRequest,
    PriceChange,
    PriceReply,
    Reject,
    RejectCode,
    RunOver,
    RunOverReply,
    SnapshotRequest,
    StatusRequest,
    Submission,
    TurnRequest,
)
from shared.model_files import ModelOffer
from shared.net import ConnectionStarts, address_key, close_answered, forget_peer, remote_ip, remote_peer_id, set_handler
from shared.net import request as peer_request
from shared.transfer import RECEIVER_GONE, NotServable, servable, serve_snapshot
from shared.units import BYTES_PER_MBIT
from shared.wire import (
    FrameError,
    PeerFault,
    StreamEOF,
    libp2p_end_of_stream,
    read_exact,
    read_frame,
    read_message,
    signed_caps,
    write_frame,
    write_message,
)

log = logging.getLogger("echo2.hub.service")

GUARD_PRUNE_PERIOD_S = 1.0
GUARD_IDLE_S = 300.0
# The longest a peer that has not joined keeps a connection, busy or not, counted over its reconnections: a stranger
# that redials at once is let go at once, until it was away this long. A polite status watcher (a remote dashboard)
# is exempt, within its bounds (hub/trust/watchers.py).
NON_MEMBER_LIFETIME_S = 120.0
STRANGER_MEMORY_S = 600.0
# Status requests of peers that have not joined, per address key: a burst, then STRANGER_STATUS_PER_S.
STRANGER_STATUS_BURST = 5
# Model file bytes served per address key, counted in whole model kits (every file of the list once): a machine
# of MODEL_KITS_BURST GPUs fetches at once, then one kit per MODEL_KIT_REFILL_S. One 1 KiB request asks for up
# to MODEL_FILE_MAX_BYTES, so throwaway identities on one machine must not turn the hub's uplink into an amplifier.
MODEL_KITS_BURST = 8
MODEL_KIT_REFILL_S = 60.0
# After a refusal, how long the peer may take to read it and close its side before the stream is reset. A refused
# stream thus ends within REFUSE_WRITE_TIMEOUT_S + REFUSE_LINGER_S however its peer writes (one write past the Yamux
# window, small writes, no close), and its reset leaves nothing of it held (shared/libp2p_patches.py).
REFUSE_LINGER_S = 2.0
REFUSE_DRAIN_BYTES = 64 * 1024

REFUSE_WRITE_TIMEOUT_S = 2.0
# A submission answered, its next lease not granted for a reason of the peer's (a ban under way): ask again then.
NO_LEASE_RETRY_S = 5.0
REPLY_WRITE_TIMEOUT_S = 30.0
# How long a hub whose run is over waits, for all its nodes together, until they heard it (RUN_OVER_PROTOCOL).
RUN_OVER_TELL_S = 5.0

# Largest frame a handler of each protocol may read: what the guard reserves against a peer's memory budget.
PROTOCOL_FRAME_CAPS = {
    JOIN_PROTOCOL: JoinRequest.MAX_BYTES,
    HEARTBEAT_PROTOCOL: Heartbeat.MAX_BYTES,
    LEASE_PROTOCOL: LeaseRequest.MAX_BYTES,
    SUBMIT_PROTOCOL: signed_caps(Submission)[Submission.TYPE],
    STATUS_PROTOCOL: StatusRequest.MAX_BYTES,
    SNAPSHOT_PROTOCOL: SnapshotRequest.MAX_BYTES,
    REPORT_PROTOCOL: BadChunkReport.MAX_BYTES,
    MODEL_PROTOCOL: ModelFilesRequest.MAX_BYTES,
    PRICE_PROTOCOL: PriceChange.MAX_BYTES,
    LEAVE_PROTOCOL: Leave.MAX_BYTES,
    TURN_PROTOCOL: TurnRequest.MAX_BYTES,
}
# Protocols only joined nodes may use: a stranger is refused before one byte of its request is read.
MEMBERS_ONLY = frozenset(
    {
        HEARTBEAT_PROTOCOL,
        LEASE_PROTOCOL,
        SUBMIT_PROTOCOL,
        SNAPSHOT_PROTOCOL,
        REPORT_PROTOCOL,
        PRICE_PROTOCOL,
        LEAVE_PROTOCOL,
        TURN_PROTOCOL,
    }
)
# What a vLLM node that joins a tool-using hub is told (the multi-turn loop runs on the transformers engine only).
# A lease whose rollouts could not open (the tool sandbox is full): ask again then.
NO_ROOM_RETRY_S = 2.0
# What a stream from a peer that has not joined may pin in hub memory (a join or status request fits).
STRANGER_FRAME_CAP_BYTES = JoinRequest.MAX_BYTES
# How long a handler may take: one exchange, except a snapshot transfer, which lasts as long as the model
# takes to cross the link and is bounded by progress instead (shared.transfer.STALL_S, Yamux's window timeout).
PROTOCOL_TIMEOUTS_S = {SNAPSHOT_PROTOCOL: math.inf}


@dataclass(frozen=True)
class JoinTerms:
    """What every join reply tells a node besides its state."""

    staleness: int
    task: str
    context_tokens: int  # hub.training.tasks.context_tokens of the task
    stop_ids: tuple[int, ...] | None = None  # SubmissionRules.stop_ids: the EOS set every engine must stop on


def no_chains(peer: str) -> ChainLinks:
    """Where a node pulls from when the hub runs no broadcaster: from the hub itself."""
    return ChainLinks(None, (), None, None, None)


async def refuse_reports(stream: INetStream) -> None:
    """REPORT_PROTOCOL of a hub that runs no broadcaster: it has no chains, so no upstream to report."""
    await read_message(stream, BadChunkReport)
    raise PeerFault("this hub runs no broadcaster: there is no upstream to report", RejectCode.NOT_UPSTREAM)


class HubService:
    """Serves the hub's protocols on `host`; one component of the hub's trio nursery."""

    def __init__(
        self,
        host: IHost,
        identity: Identity,
        state: HubState,
        shelf: SnapshotShelf,
        guard: PeerGuard,
        uplink: HubUplink,
        terms: JoinTerms,
        status: Callable[[bool, int], Awaitable[bytes]],
        chain_links: Callable[[str], ChainLinks],
        on_heartbeat: Callable[[], None],
        on_report: Callable[[INetStream], Awaitable[None]],
        punch_failed: Callable[[str, str], None] = lambda peer, upstream: None,
        bulk: BulkChannel | None = None,
        model_offer: ModelOffer | None = None,
        clock: Callable[[], float] = time.monotonic,
        stranger_lifetime_s: float = NON_MEMBER_LIFETIME_S,
    ) -> None:
        self.host = host
        self.clock = clock  # what the per-address rates and the idle connections' ages are counted on
        self.stranger_lifetime_s = stranger_lifetime_s  # NON_MEMBER_LIFETIME_S, shorter in tests
        self.model_offer = model_offer  # the files a node without --model builds its engine from
        self.bulk = bulk
        self.identity = identity  # signs the commitments of the snapshot frames it serves
        self.state = state  # for the guard's refusals and events; the commands go to its owners
        self.membership = state.membership
        self.leasing = state.leasing
        self.intake = state.intake
        self.shelf = shelf
        self.guard = guard
        self.uplink = uplink
        self.terms = terms
        self.status = status
        self.chain_links = chain_links
        self.on_heartbeat = on_heartbeat
        self.on_report = on_report
        self.punch_failed = punch_failed
        self.operators = frozenset({host.get_id().to_base58(), *guard.config.status_operators})
        self._stranger_status = TokenBuckets(STRANGER_STATUS_PER_S, STRANGER_STATUS_BURST)
        kit_bytes = sum(f.size for f in model_offer.listing.files) if model_offer is not None else 1
        self._model_bytes = TokenBuckets(kit_bytes / MODEL_KIT_REFILL_S, MODEL_KITS_BURST * kit_bytes)
        self._refusal_log = PeerLogLimiter()
        self._disconnect_log = PeerLogLimiter()
        # Peers this hub let go in its last sweep -> when: their requests in flight end in a StreamEOF that is ours,
        # not theirs to be refused and counted for (bounded by the connections one sweep can close).
        self._let_go: dict[str, float] = {}
        self._closing_log = PeerLogLimiter()  # a stranger redialling at once is let go at every sweep: a line a window
        self.watchers = StatusWatchers(guard.config.idle_connection_s)
        self.run_over: RunOver | None = None  # set once the run is over: joins are refused, the nodes are told
        self._sessions: dict[str, list[_Session]] = {}  # open sessions by peer, oldest first
        self._handlers: dict[str, Callable[[INetStream], Awaitable[None]]] = {}

    async def run(self) -> None:
        handlers = {
            JOIN_PROTOCOL: self._on_join,
            HEARTBEAT_PROTOCOL: self._on_heartbeat,
            LEASE_PROTOCOL: self._on_lease,
            SUBMIT_PROTOCOL: self._on_submit,
            STATUS_PROTOCOL: self._on_status,
            SNAPSHOT_PROTOCOL: self._on_snapshot,
            REPORT_PROTOCOL: self.on_report,
            MODEL_PROTOCOL: self._on_model,
            PRICE_PROTOCOL: self._on_price,
            LEAVE_PROTOCOL: self._on_leave,
            TURN_PROTOCOL: self._on_turn,
        }
        self._handlers = {protocol: self._guarded(protocol, handler) for protocol, handler in handlers.items()}
        for protocol, guarded in self._handlers.items():
            set_handler(self.host, protocol, guarded, log)
        set_handler(self.host, SESSION_PROTOCOL, self._on_session, log)
        starts = ConnectionStarts(self.clock).watch(self.host)
        strangers: dict[str, tuple[float, float]] = {}
        while True:
            await trio.sleep(GUARD_PRUNE_PERIOD_S)
            self.guard.prune(idle_s=GUARD_IDLE_S)
            await self._close_idle_connections(starts, strangers)

    async def _close_idle_connections(self, starts: ConnectionStarts, strangers: dict[str, tuple[float, float]]) -> None:
        """Disconnect peers that are not joined nodes (strangers, nodes that left or were banned, dashboards)
        once idle for trust.idle_connection_s, or connected `stranger_lifetime_s` in all over their reconnections
        (`strangers`: peer -> (first connection's start, last seen connected)): py-libp2p never closes an idle
        connection, and every one held is a slot an honest node may need. Both count from the connection's start,
        whatever the peer keeps open on it (streams, half-closed or not, are no activity of their own)."""
        now = self.clock()
        for name in [p for p, (_, last) in strangers.items() if now - last > STRANGER_MEMORY_S]:
            del strangers[name]
        self.watchers.prune(now)
        self._let_go = {name: at for name, at in self._let_go.items() if now - at <= GUARD_PRUNE_PERIOD_S}
        for peer in list(self.host.get_network().get_connections_map()):
            name = peer.to_base58()
            started = starts.started(self.host, peer)
            if started is None:  # gone since the map was read
                continue
            if self.membership.is_member(name):
                strangers.pop(name, None)
                continue
            first = min(strangers[name][0], started) if name in strangers else started
            strangers[name] = (first, now)
            active = self.guard.last_active(name)
            idle = now - max(started, active if active is not None else started) > self.guard.config.idle_connection_s
            # Not idle but never joining (a stranger polling the status to keep its slot) goes too, later, unless it
            # is an operator's or a polite status watcher within the watchers' bounds.
            long_held = now - first > self.stranger_lifetime_s and name not in self.operators
            if idle or (long_held and not self.watchers.keeps(name, now)):
                if (tail := self._closing_log.tail(name)) is not None:
                    how = "idle" if idle else "long-held"
                    log.info("closing the %s connection of %s (not a joined node)%s", how, name, tail)
                self._let_go[name] = now
                await forget_peer(self.host, peer)

    # -- the guard around every handler ---------------------------------------------------

    def _guarded(self, protocol: str, handler: Callable[[INetStream], Awaitable[None]]):
        timeout_s = PROTOCOL_TIMEOUTS_S.get(protocol, HANDLER_TIMEOUT_S)

        async def guarded(stream: INetStream) -> None:
            peer = remote_peer_id(stream)
            member = self.membership.is_member(peer)
            # A submission's memory is reserved only for a node with a lease to answer, and only as much as
            # an honest answer to it takes (the intake's step 1): a member cannot pin the hub's frame budget with
            # submissions that could only be refused.
            lease_cap = self.intake.frame_cap(peer) if member and protocol == SUBMIT_PROTOCOL else 0
            if not member or (protocol == SUBMIT_PROTOCOL and not lease_cap):
                cap = min(PROTOCOL_FRAME_CAPS[protocol], STRANGER_FRAME_CAP_BYTES)
            else:
                cap = lease_cap or PROTOCOL_FRAME_CAPS[protocol]
            admission = self.guard.admit(peer, cap)
            if not admission.admitted:
                await self._turn_away(stream, peer, admission)
                return
            try:
                if protocol in MEMBERS_ONLY and not member:
                    self.membership.known(peer)  # raises the PeerFault that says why: nothing is read or parsed
                # The peer's reads and writes have a deadline; our own processing between them does not:
                # a slow audit or commit on our side is never counted against the peer.
                await handler(_PeerDeadline(stream, trio.current_time() + timeout_s, lease_cap))
            except HubBusy as exc:
                await _refuse(stream, RejectCode.BUSY, str(exc))
            except FrameError as exc:
                # A bad frame (a length past the cap, a type or body the protocol does not take): nothing more of
                # the stream is read, whatever its peer keeps sending.
                await self._misbehaved(stream, peer, protocol, RejectCode(exc.code), exc.reason, linger_s=0.0)
            except PeerFault as exc:
                await self._misbehaved(stream, peer, protocol, RejectCode(exc.code), exc.reason)
            except (StreamEOF, trio.TooSlowError) as exc:
                if isinstance(exc, StreamEOF) and peer in self._let_go:
                    return  # its connection was closed by our own sweep mid-request
                await self._misbehaved(stream, peer, protocol, RejectCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
            finally:
                self.guard.release(peer, admission)

        guarded.__qualname__ = f"HubService[{protocol}]"
        return guarded

    async def _misbehaved(
        self, stream: INetStream, peer: str, protocol: str, code: RejectCode, reason: str, linger_s: float = REFUSE_LINGER_S
    ) -> None:
        """A peer sent something we refuse: count it against the peer, tell it why, keep serving. Logged once per
        peer per window (a peer refused in a loop must not fill the disk with lines)."""
        if (tail := self._refusal_log.tail(peer)) is not None:
            log.warning("refused %s from %s: %s%s", protocol, peer, reason, tail)
        self.watchers.refused(peer, self.clock())
        await self.membership.record_refusal(peer, code)
        await _refuse(stream, code, reason, linger_s=linger_s)

    async def _turn_away(self, stream: INetStream, peer: str, admission: Admission) -> None:
        """A peer over its stream, rate or memory caps: told to retry later, disconnected if it keeps on (at once:
        its stream is not given time to close, the connection goes with it). A peer that redials while it is
        disconnected is turned away on every stream: its event row and line are written once per window."""
        disconnect = admission.verdict == "disconnect"
        await _refuse(
            stream,
            RejectCode.BUSY,
            f"retry in {admission.retry_after_s:.2f}s: {admission.reason}",
            linger_s=0.0 if disconnect else REFUSE_LINGER_S,
        )
        if disconnect:
            self.watchers.refused(peer, self.clock())
            if (tail := self._disconnect_log.tail(peer)) is not None:
                await self.state.event("disconnect", peer, admission.reason + tail)
            await self.host.disconnect(ID.from_base58(peer))

    # -- the run's end ---------------------------------------------------------------------

    async def end_run(self, over: RunOver) -> None:
        """The run is over (its last step done, or its operator stopped it): from now on joins are refused; every
        joined node is told (RUN_OVER_PROTOCOL, on its own connection), so that it stops or waits for the next run
        rather than retry a hub that is leaving, those that joined meanwhile too, for RUN_OVER_TELL_S at most; then
        each is marked gone (RUN_OVER_REASON), so the run's last status lists none as working. A node not reached
        retries, as after a crash."""
        self.run_over = over
        if not self.state.fleet.live():  # none to tell (stopped before it served, say, when nothing may be written)
            return
        told: dict[str, RunOverReply | None] = {}  # peer -> its answer (None: not reached)
        with trio.move_on_after(RUN_OVER_TELL_S):
            while pending := [n.peer_id for n in self.state.fleet.live() if n.peer_id not in told]:
                async with trio.open_nursery() as nursery:
                    for peer in pending:
                        nursery.start_soon(self._tell_run_over, peer, over, told)
        live = self.state.fleet.live()
        async with trio.open_nursery() as nursery:  # concurrently: the writer commits them in one batch
            for record in live:
                nursery.start_soon(self.membership.set_state, record, "gone", RUN_OVER_REASON)
        heard = [r for r in told.values() if r is not None]
        waiting = sum(r.waits for r in heard)
        await self.state.event(
            "run_over", None, f"{over.text()}: {len(heard)} of {len(live)} nodes told, {waiting} waiting for the next run"
        )

    async def _tell_run_over(self, peer: str, over: RunOver, told: dict[str, RunOverReply | None]) -> None:
        told[peer] = None
        try:
            reply = await peer_request(self.host, peer, RUN_OVER_PROTOCOL, over, RunOverReply, timeout_s=RUN_OVER_TELL_S)
        except Exception as exc:  # noqa: BLE001 - gone, or a node without the protocol: it retries as after a crash
            log.info("could not tell %s the run is over: %r", peer[-8:], exc)
            return
        told[peer] = reply

    # -- a node's session: its frequent requests on one stream -------------------------------

    def sessions_of(self, peer: str) -> int:
        """The sessions `peer` holds open."""
        return len(self._sessions.get(peer, ()))

    async def _on_session(self, stream: INetStream) -> None:
        """SESSION_PROTOCOL: each request (a selector byte, then its protocol's frame) goes through that protocol's
        guarded handler as if it had a stream of its own, until the node closes, a request is refused (which ends
        the stream) or none comes for SESSION_IDLE_S. Only joined nodes, SESSIONS_PER_PEER at once: a node past
        that ends its oldest session that waits between requests (left on a connection that died unseen, most
        likely), or is refused as busy when every one is in a request."""
        peer = remote_peer_id(stream)
        # Opening one is admitted like any stream (rate, violations, disconnect), then holds no stream slot.
        admission = self.guard.admit(peer, 0)
        if not admission.admitted:
            await self._turn_away(stream, peer, admission)
            return
        self.guard.release(peer, admission)
        try:
            self.membership.known(peer)  # the PeerFault that says why, counted as any members-only request of a stranger
        except PeerFault as exc:
            await self._misbehaved(stream, peer, SESSION_PROTOCOL, RejectCode(exc.code), exc.reason)
            return
        sessions = self._sessions.setdefault(peer, [])
        if len(sessions) >= SESSIONS_PER_PEER:
            waiting = [s.waiting for s in sessions if s.waiting is not None]
            if not waiting:
                await _refuse(stream, RejectCode.BUSY, f"{SESSIONS_PER_PEER} sessions open, each in a request")
                return
            waiting[0].cancel()  # ends it as if idle
        session = _Session()
        sessions.append(session)
        try:
            while (protocol := await self._next_request(stream, peer, session)) is not None:
                request = _SessionRequest(stream)
                await self._handlers[protocol](request)
                if not request.answered:  # refused: the stream was ended with the Reject
                    return
        finally:
            sessions.remove(session)
            if not sessions:
                del self._sessions[peer]

    async def _next_request(self, stream: INetStream, peer: str, session: _Session) -> str | None:
        """The protocol of the session's next request, or None once the session is over (ended here if the node
        did not end it)."""
        selector = None
        with trio.CancelScope(deadline=trio.current_time() + SESSION_IDLE_S) as session.waiting:
            try:
                selector = (await read_exact(stream, 1))[0]
            except StreamEOF:  # the node ended the session between requests
                await stream.close()
                return None
        session.waiting = None
        if selector is None:
            await stream.reset()  # idle, or ended for a newer one: its slot goes back
            return None
        if selector >= len(SESSION_REQUESTS):
            await self._misbehaved(
                stream,
                peer,
                SESSION_PROTOCOL,
                RejectCode.BAD_REQUEST,
                f"session selector {selector} names no request (0-{len(SESSION_REQUESTS) - 1})",
                linger_s=0.0,  # a bad frame: reset at once, as `_guarded` does
            )
            return None
        return SESSION_REQUESTS[selector]

    # -- protocols -------------------------------------------------------------------------

    async def _on_join(self, stream: INetStream) -> None:
        request = await read_message(stream, JoinRequest)
        if self.run_over is not None:
            raise HubBusy(f"{self.run_over.text()}: no more joins")
        record = await self.membership.join(remote_peer_id(stream), request, remote_ip(stream))
        await _reply(
            stream,
            JoinReply(
                state=record.state,
                latest_version=self.shelf.newest_version(),
                staleness=self.terms.staleness,
                task=self.terms.task,
                heartbeat_period_s=record.heartbeat_period_s,
                context_tokens=self.terms.context_tokens,
                stop_ids=self.terms.stop_ids,
            ),
        )

    async def _on_model(self, stream: INetStream) -> None:
        """The model's file list, or one file's bytes in a MODEL_FILE_FRAME: asked before a node's first join."""
        request = await read_message(stream, ModelFilesRequest)
        offer = self.model_offer
        if offer is None:
            raise PeerFault(
                "this hub offers no model files: start the node with --model and the hub's model", RejectCode.NOT_HELD
            )
        if request.name is None:
            await _reply(stream, offer.listing)
            return
        entry = offer.entry(request.name)
        if entry is None:
            raise PeerFault(f"no model file {request.name!r} here", RejectCode.NOT_HELD)
        wait_s = self._model_bytes.take(address_key(remote_ip(stream)) or remote_peer_id(stream), self.clock(), entry.size)
        if wait_s > 0:
            raise HubBusy(f"model files from this address: retry in {wait_s:.0f}s")
        await write_frame(stream, MODEL_FILE_FRAME, offer.read(entry))
        await close_answered(stream)

    async def _on_heartbeat(self, stream: INetStream) -> None:
        beat = await read_message(stream, Heartbeat)
        peer = remote_peer_id(stream)
        record = self.membership.heartbeat(peer, beat, self.shelf.newest_version())
        if beat.punch_failed_with is not None:
            self.punch_failed(peer, beat.punch_failed_with)
        self.on_heartbeat()
        links = self.chain_links(peer)
        await _reply(
            stream,
            HeartbeatReply(
                state=record.state,
                latest_version=self.shelf.newest_version(),
                upstream=links.upstream,
                upstream_addrs=links.upstream_addrs,
                downstream=links.downstream,
                chain=links.chain,
                chain_position=links.chain_position,
                downstream_addrs=links.downstream_addrs,
                reachability=record.reachability,
                upstream_link=links.kind,
                heartbeat_period_s=record.heartbeat_period_s,
                rollouts_per_s=record.rollouts_per_s if record.measured else None,
                too_slow=record.too_slow,
            ),
        )

    async def _on_price(self, stream: INetStream) -> None:
        change = await read_message(stream, PriceChange)
        next_in_s = await self.membership.reprice(remote_peer_id(stream), change.price_per_hour)
        await _reply(stream, PriceReply(price_per_hour=change.price_per_hour, next_change_in_s=next_in_s))

    async def _on_leave(self, stream: INetStream) -> None:
        await read_message(stream, Leave)
        await _reply(stream, LeaveReply(leases_released=await self.membership.leave(remote_peer_id(stream))))

    async def _lease_reply(self, peer: str, version_held: int) -> LeaseReply:
        grant = await self.leasing.grant(peer, version_held)
        lease = grant.lease
        if lease is None:
            return LeaseReply(lease=None, retry_after_s=grant.retry_after_s, reason=grant.reason)
        rules = self.intake.rules
        if rules is None:
            raise PeerFault("this hub takes no submissions", RejectCode.BAD_LEASE)
        agents = self.state.agents
        if agents is not None:
            try:
                self.leasing.rendered(lease, await agents.open_lease(lease))
            except AgentsBusy as exc:
                self.leasing.give_back(lease)
                return LeaseReply(lease=None, retry_after_s=NO_ROOM_RETRY_S, reason=f"the hub's tools are busy: {exc}"[:500])
        return LeaseReply(
            lease=Lease(
                lease_id=lease.lease_id,
                prompts=tuple(LeasePrompt(prompt_id=p.id, text=p.text) for p in lease.prompts),
                group_size=rules.group_size,
                sampling=rules.sampling,
                min_version=lease.min_version,
                deadline_s=lease.deadline - lease.issued_at,
                tools=agents.tool_use if agents is not None else None,
            )
        )

    async def _on_turn(self, stream: INetStream) -> None:
        """TURN_PROTOCOL: a multi-turn lease's model turns, answered with what each rollout appends next."""
        request = await read_message(stream, TurnRequest)
        agents = self.state.agents
        if agents is None:
            raise PeerFault("this hub's rollouts call no tools: it takes no turns")
        lease = self.leasing.held_lease(request.lease_id, remote_peer_id(stream))
        await _reply(stream, await agents.turns(lease, request))

    async def _on_lease(self, stream: INetStream) -> None:
        request = await read_message(stream, LeaseRequest)
        await _reply(stream, await self._lease_reply(remote_peer_id(stream), request.version_held))

    async def _on_submit(self, stream: _PeerDeadline) -> None:
        peer = remote_peer_id(stream)
        # The cap the guard reserved (the intake's step 1): nothing awaited since, so the peer's open leases are the same.
        submission, outcome = await self.intake.submit(peer, stream.lease_cap, functools.partial(read_frame, stream))
        next_lease = None
        if submission.next_lease_for is not None:
            try:
                next_lease = await self._lease_reply(peer, submission.next_lease_for)
            except PeerFault as exc:  # banned meanwhile, say: the submission is committed, so it is still answered
                next_lease = LeaseReply(lease=None, retry_after_s=NO_LEASE_RETRY_S, reason=exc.reason[:500])
        await _reply(stream, outcome.reply(next_lease))

    async def _on_status(self, stream: INetStream) -> None:
        request = await read_message(stream, StatusRequest)
        peer = remote_peer_id(stream)
        operator = peer in self.operators
        stranger = not operator and not self.membership.is_member(peer)
        address = address_key(remote_ip(stream)) or peer
        if stranger:
            wait_s = self._stranger_status.take(address, self.clock())
            if wait_s > 0:
                raise HubBusy(f"status requests from this address: retry in {wait_s:.1f}s")
        # What other volunteers are paid is the operator's business: strangers and nodes see it redacted.
        frame = await self.status(operator, request.events)
        await stream.write(frame)
        await close_answered(stream)
        if stranger:
            self.watchers.answered(peer, address, self.clock())

    async def _on_snapshot(self, stream: INetStream) -> None:
        """Serve a snapshot straight from the hub (first fetch, repair, or a chain head's pull)."""
        with trio.fail_after(HANDLER_TIMEOUT_S):
            request = await read_message(stream, SnapshotRequest)
        peer = remote_peer_id(stream)
        self.membership.known(peer)
        try:
            servable(self.shelf, request)
            async with serving_stream(stream, request, self.bulk, peer) as transfer:
                ack = await serve_snapshot(transfer, self.shelf, request, self.uplink.for_stream(), self.identity)
        except NotServable as exc:
            raise PeerFault(str(exc), RejectCode.NOT_HELD) from None
        except LookupError as exc:
            # The learner moved on and the shelf let this version go mid-transfer: ours, not the peer's.
            log.info("snapshot transfer to %s ended: %s", peer[-8:], exc)
            await stream.reset()
            return
        except (*RECEIVER_GONE, trio.TooSlowError) as exc:
            # The receiver left, re-linked or stopped reading mid-transfer: ordinary churn, not misbehaviour.
            log.info("snapshot transfer to %s ended early: %s", peer[-8:], exc)
            await stream.reset()
            return
        if not ack.ok:
            log.warning("snapshot v%d to %s ended badly: %s", ack.version, peer, ack.reason)
        await close_answered(stream)


class _PeerDeadline:
    """A stream whose reads must all be done by `deadline` (the peer's request), and whose each write must
    finish within REPLY_WRITE_TIMEOUT_S (the peer reading our reply); everything else passes through."""

    def __init__(self, stream: INetStream, deadline: float, lease_cap: int = 0) -> None:
        self._stream = stream
        self._deadline = deadline
        self.lease_cap = lease_cap  # a submission's: the frame the guard reserved for it (0: no open lease)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    async def read(self, n: int = -1) -> bytes:
        with trio.fail_at(self._deadline):
            return await self._stream.read(n)

    async def write(self, data: bytes) -> None:
        # A big write (a snapshot chunk) may take as long as its bytes take at the slowest link allowed.
        with trio.fail_after(REPLY_WRITE_TIMEOUT_S + len(data) / MIN_LINK_BPS):
            await self._stream.write(data)


@dataclass
class _Session:
    """One open session of a node; `waiting` is set while it waits for its next request (cancel it to end it)."""

    waiting: trio.CancelScope | None = None


class _SessionRequest:
    """One request of a session, as its handler sees the stream: the close that follows a reply ends the request,
    not the session; a refusal (which half-closes first, or resets) ends the session's stream too."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.answered = False
        self._ending = False

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    async def close_write(self) -> None:
        self._ending = True
        await self._stream.close_write()

    async def close(self) -> None:
        if self._ending:
            await self._stream.close()
        else:
            self.answered = True

    async def reset(self) -> None:
        self._ending = True
        await self._stream.reset()

    async def close_read(self) -> None:
        """An answered request leaves the session reading: its next request comes on the same stream."""


async def _reply(stream: INetStream, msg) -> None:
    await write_message(stream, msg)
    await close_answered(stream)


async def _refuse(stream: INetStream, code: RejectCode, reason: str, linger_s: float = REFUSE_LINGER_S) -> None:
    """Answer with a Reject, then end the stream on both sides: the peer has `linger_s` to read it and close its
    side (what our clients do); whatever else it sends meanwhile is dropped unread, and a stream still open
    after that is reset, so neither side holds it. With no linger the reset follows the Reject and its FIN at
    once: a py-libp2p reader still reads a reply that came before the reset (Yamux keeps what a stream buffered
    when its peer ended it), though a sender still writing its request loses it."""
    try:
        with trio.move_on_after(REFUSE_WRITE_TIMEOUT_S) as writing:
            await write_message(stream, Reject(code=code, reason=reason[:1000]))
            await stream.close_write()
        if not writing.cancelled_caught and linger_s > 0:  # a peer that does not read its Reject gets no linger either
            with trio.move_on_after(linger_s):
                with contextlib.suppress(*libp2p_end_of_stream()):
                    while await stream.read(REFUSE_DRAIN_BYTES):
                        pass
                await stream.close()  # the peer closed its side: the stream ends cleanly
                return
    except Exception:  # noqa: BLE001 - the peer may already be gone, or have reset the stream
        pass
    await stream.reset()


def build_hub_service(
    host: IHost,
    identity: Identity,
    config: HubConfig,
    state: HubState,
    shelf: SnapshotShelf,
    status: Callable[[bool, int], Awaitable[bytes]],
    context_tokens: int,
    broadcaster: Broadcaster | None = None,
    bulk: BulkChannel | None = None,
    model_offer: ModelOffer | None = None,
) -> HubService:
    """The hub's service as `echo-hub start` runs it; without a broadcaster, every node pulls from the hub."""
    bc = config.broadcast
    uplink = HubUplink(
        bc.hub_uplink_mbps * BYTES_PER_MBIT if bc.hub_uplink_mbps else None,
        bc.link_mbps * BYTES_PER_MBIT if bc.link_mbps else None,
    )
    terms = JoinTerms(
        config.learner.staleness_bound,
        config.task,
        context_tokens,
        tuple(sorted(state.intake.rules.stop_ids)) if state.intake.rules is not None else None,
    )
    return HubService(
        host,
        identity,
        state,
        shelf,
        PeerGuard(config.trust, time.monotonic),
        uplink,
        terms,
        status,
        chain_links=broadcaster.heartbeat_links if broadcaster else no_chains,
        on_heartbeat=broadcaster.check_done if broadcaster else lambda: None,
        on_report=broadcaster.on_report if broadcaster else refuse_reports,
        punch_failed=broadcaster.punch_failed if broadcaster else lambda peer, upstream: None,
        bulk=bulk,
        model_offer=model_offer,
    )
