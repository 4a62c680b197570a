"""The one client of the hub's node protocols: join, heartbeat, lease, submit, bad-chunk report, status.

Every call opens one stream to the hub, writes one request (a submission signed with the node's
identity), and returns the hub's typed reply or its `Reject`; a transport failure (hub away,
timeout) raises, and another peer answering at the hub's address raises WrongHub. The node's hub
link, worker and keeper use it, and so do the tests and benchmarks, whose misbehaving peers
subclass it or send raw frames through `send_frame`.
"""

from __future__ import annotations

import re
import time

import trio
from libp2p.abc import IHost
from libp2p.exceptions import MultiError
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
from libp2p.transport.exceptions import SecurityUpgradeFailure

from shared.crypto import Identity, peer_id_from_multiaddr
from shared.messages import (
    HEARTBEAT_PROTOCOL,
    JOIN_PROTOCOL,
    LEASE_PROTOCOL,
    MIN_LINK_BPS,
    MODEL_FILE_FRAME,
    MODEL_PROTOCOL,
    PRICE_PROTOCOL,
    REPORT_PROTOCOL,
    STATUS_PROTOCOL,
    SUBMIT_PROTOCOL,
    BadChunkReport,
    Heartbeat,
    HeartbeatReply,
    HubStatus,
    JoinReply,
    JoinRequest,
    LeaseReply,
    LeaseRequest,
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
)
from shared.net import connect, open_stream, request
from shared.wire import Message, decode_message, encode_signed, read_frame, read_message, write_message

REQUEST_TIMEOUT_S = 30.0
# A bad-chunk report is answered only after the hub fetched the chunk from the accused itself.
REPORT_TIMEOUT_S = 40.0
BUSY_RETRY_S = 0.25
# How py-libp2p 0.8.1 names the key that answered a dial: Noise's PeerIDMismatchesPubkey, or the upgrader's own check.
_ANSWERED_RE = re.compile(r"(?:remote_peer_id_from_pubkey=|Peer ID mismatch: expected \S+, got )(\w+)")


class WrongHub(Exception):
    """Another peer answered at the hub's address: the Noise handshake proved a key other than the /p2p/ one."""

    def __init__(self, transport: str, expected: str, answered: str) -> None:
        super().__init__(transport, expected, answered)
        self.transport, self.expected, self.answered = transport, expected, answered

    def __str__(self) -> str:
        return (f"another peer answered at {self.transport} (peer id {self.answered}, not {self.expected}): "
                "check the /p2p/ part of --hub")


def answered_instead(exc: BaseException) -> str | None:
    """The peer id that answered a dial in place of the one dialled, found anywhere in the exceptions py-libp2p
    nests (causes, contexts, groups, its MultiError); None when the dial failed for another reason."""
    pending, seen = [exc], set()
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

    async def ask(self, protocol: str, msg: Message, reply_type: type[Message], timeout_s: float | None = None):
        return await request(self.host, self.hub_peer_id, protocol, msg, reply_type, Reject,
                             timeout_s=timeout_s or self.timeout_s)

    async def join(self, join: JoinRequest) -> JoinReply | Reject:
        return await self.ask(JOIN_PROTOCOL, join, JoinReply)

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply | Reject:
        return await self.ask(HEARTBEAT_PROTOCOL, beat, HeartbeatReply)

    async def reprice(self, price_per_hour: float) -> PriceReply | Reject:
        """Re-declare this node's price (PRICE_PROTOCOL); a hub that predates it refuses the protocol."""
        return await self.ask(PRICE_PROTOCOL, PriceChange(price_per_hour=price_per_hour), PriceReply)

    async def lease(self, version_held: int) -> LeaseReply | Reject:
        return await self.ask(LEASE_PROTOCOL, LeaseRequest(version_held=version_held), LeaseReply)

    async def submit(self, submission: Submission, deadline: float | None = None) -> SubmitReply | Reject:
        """Submit (signed by this node), sending again while the hub says it is busy and `deadline`
        (time.monotonic) leaves room; without a deadline, once."""
        while True:
            reply = await request(self.host, self.hub_peer_id, SUBMIT_PROTOCOL, submission, SubmitReply, Reject,
                                  timeout_s=self.timeout_s, sign_with=self.identity)
            if not (isinstance(reply, Reject) and reply.busy and deadline is not None
                    and time.monotonic() + BUSY_RETRY_S < deadline):
                return reply
            await trio.sleep(BUSY_RETRY_S)

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
