"""The one client of the hub's node protocols: join, heartbeat, lease, turns, submit, bad-chunk report, status.

Every call writes one request (a submission signed with the node's identity) and returns the
hub's typed reply or its `Reject`; a transport failure (hub away, timeout) raises, and another
peer answering at the hub's address raises WrongHub. Heartbeats, lease requests, submissions and
price changes and a multi-turn lease's turns go on long-lived session streams (SESSION_PROTOCOL, a few kept open for reuse);
the rest open one stream each. The node's hub link,
worker and keeper use it, and so do the tests and benchmarks, whose misbehaving peers subclass it
or send raw frames through `send_frame`.
"""

from __future__ import annotations

import re

import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import MultiError
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
from libp2p.transport.exceptions import SecurityUpgradeFailure

from shared.crypto import Identity, peer_id_from_multiaddr
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
    SESSION_IDLE_S,
    SESSION_PROTOCOL,
    SESSION_REQUESTS,
    SESSIONS_PER_PEER,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    TURN_PROTOCOL,
    BadChunkReport,
    Heartbeat,
    HeartbeatReply,
    HubStatus,
    JoinReply,
    JoinRequest,
    LeaseReply,
    LeaseRequest,
    Leave,
    LeaveReply,
    ModelFile,
    ModelFiles,
    ModelFilesRequest,
    PriceChange,
    PriceReply,
    Reject,
    StatusRequest,
    Submission,
    SubmitReply,
    TransferAck,
    TurnReply,
    TurnRequest,
)
from shared.net import connect, on_live_connection, open_stream, request
from shared.wire import Message, decode_message, encode_message, encode_signed, read_frame, read_message, write_message

REQUEST_TIMEOUT_S = 30.0
# A bad-chunk report is answered only after the hub fetched the chunk from the accused itself.
REPORT_TIMEOUT_S = 40.0
BUSY_RETRY_S = 0.25
# Sessions one client holds (below the hub's SESSIONS_PER_PEER: one may still be closing there), and how long an
# idle one is reused (well within SESSION_IDLE_S, after which the hub may have ended it unseen).
CLIENT_SESSIONS = SESSIONS_PER_PEER - 1
SESSION_REUSE_S = SESSION_IDLE_S / 2
# How py-libp2p 0.8.1 names the key that answered a dial: Noise's PeerIDMismatchesPubkey, or the upgrader's own check.
_ANSWERED_RE = re.compile(r"(?:remote_peer_id_from_pubkey=|Peer ID mismatch: expected \S+, got )(\w+)")


class WrongHub(Exception):
    """Another peer answered at the hub's address: the Noise handshake proved a key other than the /p2p/ one."""

    def __init__(self, transport: str, expected: str, answered: str) -> None:
        super().__init__(transport, expected, answered)
        self.transport, self.expected, self.answered = transport, expected, answered

    def __str__(self) -> str:
        return (
            f"another peer answered at {self.transport} (peer id {self.answered}, not {self.expected}): "
            "check the /p2p/ part of --hub"
        )


def answered_instead(exc: BaseException) -> str | None:
    """The peer id that answered a dial in place of the one dialled, found anywhere in the exceptions py-libp2p
    nests (causes, contexts, groups, its MultiError); None when the dial failed for another reason."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (PeerIDMismatchesPubkey, SecurityUpgradeFailure)) and (m := _ANSWERED_RE.search(str(err))):
            return m.group(1)
        pending += [err.__cause__, err.__context__]
        if isinstance(err, BaseExceptionGroup):
            pending += err.exceptions
        elif isinstance(err, MultiError):
            pending += err.errors
    return None


class HubClient:
    """Speaks the node protocols to the hub at `hub_addr` (a multiaddr ending in /p2p/<hub id>) from `host`."""

    def __init__(self, host: IHost, identity: Identity, hub_addr: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.host = host
        self.identity = identity
        self.hub_addr = hub_addr
        self.hub_peer_id = peer_id_from_multiaddr(hub_addr)
        self.timeout_s = timeout_s
        self._idle: list[tuple[INetStream, float]] = []  # open sessions between requests, with when they were used
        self._session_slots = trio.Semaphore(CLIENT_SESSIONS)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def connect(self) -> None:
        """Dial the hub (a live connection is reused); WrongHub when another peer answers at its address."""
        try:
            with trio.fail_after(self.timeout_s):
                await connect(self.host, self.hub_addr)
        except Exception as exc:
            answered = answered_instead(exc)
            if answered is None:
                raise
            raise WrongHub(self.hub_addr.partition("/p2p/")[0], self.hub_peer_id, answered) from exc

    async def ask(
        self,
        protocol: str,
        msg: Message,
        reply_type: type[Message],
        timeout_s: float | None = None,
        sign_with: Identity | None = None,
    ):
        """`msg` (signed by `sign_with` when given) on a session when its protocol may use one, else on a stream of
        its own; the hub's reply or Reject."""
        timeout_s = timeout_s or self.timeout_s
        if protocol in SESSION_REQUESTS:
            frame = encode_message(msg) if sign_with is None else encode_signed(msg, sign_with)
            return await self._in_session(protocol, frame, reply_type, timeout_s)
        return await request(
            self.host, self.hub_peer_id, protocol, msg, reply_type, Reject, timeout_s=timeout_s, sign_with=sign_with
        )

    async def _in_session(self, protocol: str, frame: bytes, reply_type: type[Message], timeout_s: float):
        """The reply to `frame` sent on a session. The session is kept for reuse after a reply; a Reject ended it on
        the hub's side, so it is closed here. A failure is not retried: the hub may have acted on what it read."""
        with trio.fail_after(timeout_s):
            async with self._session_slots:
                stream = await self._open_session()
                try:
                    await stream.write(bytes((SESSION_REQUESTS.index(protocol),)) + frame)
                    reply = await read_message(stream, reply_type, Reject)
                    if isinstance(reply, Reject):
                        await stream.close()
                        return reply
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await stream.reset()
                    raise
        self._idle.append((stream, trio.current_time()))
        return reply

    async def _open_session(self) -> INetStream:
        """A session for one request. Kept sessions are reused while fresh (the hub ends them idle) and on the live
        connection (one dropped and redialled left them dead)."""
        now = trio.current_time()
        while self._idle:
            stream, used = self._idle.pop()
            if now - used < SESSION_REUSE_S and on_live_connection(self.host, stream):
                return stream
            with trio.CancelScope(shield=True):
                await stream.reset()
        return await open_stream(self.host, self.hub_peer_id, SESSION_PROTOCOL)

    async def join(self, join: JoinRequest) -> JoinReply | Reject:
        return await self.ask(JOIN_PROTOCOL, join, JoinReply)

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply | Reject:
        return await self.ask(HEARTBEAT_PROTOCOL, beat, HeartbeatReply)

    async def reprice(self, price_per_hour: float) -> PriceReply | Reject:
        """Re-declare this node's price (PRICE_PROTOCOL)."""
        return await self.ask(PRICE_PROTOCOL, PriceChange(price_per_hour=price_per_hour), PriceReply)

    async def leave(self, timeout_s: float) -> LeaveReply | Reject:
        """Tell the hub this node stops (LEAVE_PROTOCOL)."""
        return await self.ask(LEAVE_PROTOCOL, Leave(), LeaveReply, timeout_s=timeout_s)

    async def lease(self, version_held: int) -> LeaseReply | Reject:
        return await self.ask(LEASE_PROTOCOL, LeaseRequest(version_held=version_held), LeaseReply)

    async def submit(self, submission: Submission, deadline: float | None = None) -> SubmitReply | Reject:
        """Submit (signed by this node), sending again while the hub says it is busy and `deadline`
        (trio.current_time) leaves room; without a deadline, once."""
        while True:
            reply = await self.ask(SUBMIT_PROTOCOL, submission, SubmitReply, sign_with=self.identity)
            if not (
                isinstance(reply, Reject)
                and reply.busy
                and deadline is not None
                and trio.current_time() + BUSY_RETRY_S < deadline
            ):
                return reply
            await trio.sleep(BUSY_RETRY_S)

    async def turns(self, request: TurnRequest, timeout_s: float) -> TurnReply | Reject:
        """A multi-turn lease's model turns (TURN_PROTOCOL): what each rollout appends next. The hub runs tools to
        answer, so the wait is the caller's (its lease's time left), not a request's."""
        return await self.ask(TURN_PROTOCOL, request, TurnReply, timeout_s=timeout_s)

    def signed(self, submission: Submission) -> bytes:
        """The exact frame `submit` sends, for a caller that wants to send (or tamper with) the bytes itself."""
        return encode_signed(submission, self.identity)

    async def report(self, report: BadChunkReport) -> TransferAck | Reject:
        return await self.ask(REPORT_PROTOCOL, report, TransferAck, timeout_s=REPORT_TIMEOUT_S)

    async def status(self, events: int = 0) -> HubStatus | Reject:
        return await self.ask(STATUS_PROTOCOL, StatusRequest(events=events), HubStatus)

    async def model_files(self) -> ModelFiles | Reject:
        """The hub's model: its name and the config and tokenizer files a node without --model needs."""
        return await self.ask(MODEL_PROTOCOL, ModelFilesRequest(), ModelFiles)

    async def model_file(self, entry: ModelFile) -> bytes | Reject:
        """One listed file's bytes, at most the size the list gave it (the caller checks its hash)."""
        with trio.fail_after(self.timeout_s + entry.size / MIN_LINK_BPS):
            stream = await open_stream(self.host, self.hub_peer_id, MODEL_PROTOCOL)
            try:
                await write_message(stream, ModelFilesRequest(name=entry.name))
                await stream.close_write()
                tag, body = await read_frame(stream, {MODEL_FILE_FRAME: entry.size, Reject.TYPE: Reject.MAX_BYTES})
            finally:
                with trio.CancelScope(shield=True):
                    await stream.reset()
        return body if tag == MODEL_FILE_FRAME else decode_message(Reject, body)

    async def send_frame(self, protocol: str, frame: bytes, *reply_types: type[Message], close_write: bool = True):
        """Write raw bytes on a new stream, then read one reply of `reply_types` or Reject (raises if the
        stream ends first). For tests and benchmarks that send what an honest node never would."""
        with trio.fail_after(self.timeout_s):
            stream = await open_stream(self.host, self.hub_peer_id, protocol)
            try:
                await stream.write(frame)
                if close_write:
                    await stream.close_write()
                return await read_message(stream, *reply_types, Reject)
            finally:
                with trio.CancelScope(shield=True):
                    await stream.reset()
