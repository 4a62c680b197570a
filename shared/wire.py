"""Framing of echo2 messages on a byte stream: size-capped frames, typed JSON messages, signed messages.

A frame is a 5-byte header, struct ">BI" (u8 type tag, u32 body length), then the body.
The reader knows, per type tag, the largest body it accepts; it rejects an unknown tag or
an oversized length from the header alone, before reading or allocating the body.

Type tags:
- 0-199: typed JSON messages (`Message` subclasses); each class owns one tag, unique
  process-wide (enforced when the class is defined).
- 200-255: reserved for binary payload frames (snapshot chunks and the like), written and
  read with `write_frame` / `read_frame` directly and their own caps.

Signed messages put a 64-byte Ed25519 signature in front of the JSON body. The signature
covers the type tag byte followed by the JSON body (so a signed body cannot be replayed
under another message type), and the reader verifies it against the sender's peer id
before it parses a single byte of JSON.

Streams are duck-typed: anything with `async read(n) -> bytes` (returning at most n bytes,
b"" or a py-libp2p EOF/reset error at the end) and `async write(data)`.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar, overload

import pydantic
import trio

from shared.crypto import SIGNATURE_BYTES, Identity, verify_from_peer

HEADER = struct.Struct(">BI")
HEADER_BYTES = HEADER.size
MAX_BODY_BYTES = 2**32 - 1
MAX_MESSAGE_TYPE = 199
BINARY_TYPE_MIN = 200
BINARY_TYPE_MAX = 255


@functools.cache
def libp2p_end_of_stream() -> tuple[type[Exception], ...]:
    """py-libp2p's ways of saying "this stream ends here": NetStream raises StreamEOF, StreamReset, StreamClosed or
    a generic StreamError (all StreamError); a raw muxed stream raises MuxedStreamEOF or MuxedStreamReset.

    Imported when first needed (a stream exists by then, so libp2p is loaded): importing libp2p takes ~0.7 s, which a
    process that only reads messages' and configs' models (a flag mistake, echo-hub start's check) should not pay."""
    from libp2p.network.stream.exceptions import StreamError
    from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset

    return (StreamError, MuxedStreamEOF, MuxedStreamReset)


# Every protocol id carries it; bumped on any change of a message's fields (messages are extra="forbid").
PROTOCOL_VERSION = "2.11.0"


class StreamEOF(Exception):
    """The stream ended (peer closed or reset it) before the bytes we needed arrived."""


class PeerFault(Exception):
    """A peer sent something we refuse: malformed, unsigned, out of bounds, or not allowed now.

    Handlers raise it for the peer's faults only (the hub counts each against the peer);
    `code` is one of `shared.messages.RejectCode`'s values, sent back in the Reject.
    """

    def __init__(self, reason: str, code: str = "bad_request") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class FrameError(PeerFault):
    """A frame we refuse: unexpected type, oversized, or a malformed body."""


class BadSignature(FrameError):
    """A signed frame whose signature does not verify against the expected signer."""


class ReadableStream(Protocol):
    async def read(self, n: int) -> bytes: ...


class WritableStream(Protocol):
    async def write(self, data: bytes) -> None: ...


def protocol_id(name: str) -> str:
    return f"/echo2/{name}/{PROTOCOL_VERSION}"


async def read_exact(stream: ReadableStream, n: int) -> bytes:
    """Read exactly `n` bytes (the caller has already capped `n`); StreamEOF if the stream ends first.

    py-libp2p reads return at most what is buffered (often one ~64 KiB Yamux frame), so this loops.
    A first read that brings all `n` bytes (a bulk channel's record) is returned as it is, uncopied.
    """
    view: memoryview | None = None
    got = 0
    while got < n:
        try:
            piece = await stream.read(n - got)
        except libp2p_end_of_stream() as exc:
            raise StreamEOF(f"stream ended after {got} of {n} bytes ({type(exc).__name__})") from exc
        if not piece:
            raise StreamEOF(f"stream ended after {got} of {n} bytes")
        if len(piece) > n - got:
            raise RuntimeError(f"stream returned {len(piece)} bytes for a read of at most {n - got}")
        if view is None:
            if len(piece) == n:
                return bytes(piece)
            view = memoryview(bytearray(n))
        view[got : got + len(piece)] = piece
        got += len(piece)
    return b"" if view is None else bytes(view)


def encode_frame(type_tag: int, *body: bytes | bytearray | memoryview) -> bytes:
    """A frame whose body is the concatenation of `body`'s parts (joined once, so a chunk is copied once)."""
    if not 0 <= type_tag <= 255:
        raise ValueError(f"type tag {type_tag} is not a u8")
    length = sum(len(part) for part in body)
    if length > MAX_BODY_BYTES:
        raise ValueError(f"frame body of {length} bytes exceeds the u32 length field")
    return b"".join((HEADER.pack(type_tag, length), *body))


async def write_frame(stream: WritableStream, type_tag: int, body: bytes) -> None:
    # One write: header and body in a single muxer frame sequence, no separate tiny frame.
    await stream.write(encode_frame(type_tag, body))


async def read_frame(
    stream: ReadableStream, caps: Mapping[int, int], stall_s: float | None = None, min_bps: float | None = None
) -> tuple[int, bytes]:
    """Read one frame whose type is a key of `caps` and whose body is at most caps[type] bytes.

    With `stall_s` (and `min_bps`): the header must arrive within stall_s, the body within stall_s plus
    its length at min_bps (trio.TooSlowError otherwise): a sender trickling one byte now and then is as
    stalled as a silent one."""
    with trio.fail_after(math.inf if stall_s is None else stall_s):
        type_tag, length = HEADER.unpack(await read_exact(stream, HEADER_BYTES))
    if type_tag not in caps:
        raise FrameError(f"unexpected frame type {type_tag} (expected one of {sorted(caps)}), body {length} bytes")
    if length > caps[type_tag]:
        raise FrameError(f"frame type {type_tag} claims {length} bytes, cap is {caps[type_tag]}")
    budget = math.inf if stall_s is None else stall_s + (length / min_bps if min_bps else 0.0)
    with trio.fail_after(budget):
        return type_tag, await read_exact(stream, length)


_MESSAGE_TYPES: dict[int, type[Message]] = {}


class Message(pydantic.BaseModel):
    """A typed wire message. Subclasses set TYPE (unique tag 0-199) and MAX_BYTES (JSON body cap)."""

    # No NaN or infinity anywhere on the wire: a bound compared against NaN is no bound.
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    TYPE: ClassVar[int]
    MAX_BYTES: ClassVar[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TYPE" not in cls.__dict__ or "MAX_BYTES" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} must define both TYPE and MAX_BYTES")
        tag, cap = cls.__dict__["TYPE"], cls.__dict__["MAX_BYTES"]
        if not isinstance(tag, int) or not 0 <= tag <= MAX_MESSAGE_TYPE:
            raise TypeError(
                f"{cls.__qualname__}.TYPE = {tag!r}: message tags are ints 0-{MAX_MESSAGE_TYPE} "
                f"({BINARY_TYPE_MIN}-{BINARY_TYPE_MAX} are reserved for binary frames)"
            )
        if not isinstance(cap, int) or not 0 < cap <= MAX_BODY_BYTES - SIGNATURE_BYTES:
            raise TypeError(f"{cls.__qualname__}.MAX_BYTES = {cap!r} is not a positive u32 leaving room for a signature")
        owner = _MESSAGE_TYPES.get(tag)
        if owner is not None:
            raise TypeError(
                f"message type tag {tag} of {cls.__module__}.{cls.__qualname__} is already used by "
                f"{owner.__module__}.{owner.__qualname__}"
            )
        _MESSAGE_TYPES[tag] = cls


# The message types a read expects, so that the caller gets the union of them, not any Message.
M = TypeVar("M", bound=Message)
M2 = TypeVar("M2", bound=Message)
M3 = TypeVar("M3", bound=Message)


def _json_body(msg: Message) -> bytes:
    body = msg.model_dump_json().encode()
    if len(body) > msg.MAX_BYTES:
        raise ValueError(f"{type(msg).__name__} body is {len(body)} bytes, cap MAX_BYTES is {msg.MAX_BYTES}")
    return body


def _by_type(expected: tuple[type[Message], ...]) -> dict[int, type[Message]]:
    if not expected:
        raise TypeError("name at least one expected message class")
    return {cls.TYPE: cls for cls in expected}


def message_caps(*expected: type[Message]) -> dict[int, int]:
    return {cls.TYPE: cls.MAX_BYTES for cls in expected}


def signed_caps(*expected: type[Message]) -> dict[int, int]:
    return {cls.TYPE: cls.MAX_BYTES + SIGNATURE_BYTES for cls in expected}


def decode_message(cls: type[M], body: bytes) -> M:
    """Parse a frame body read for `cls` (FrameError when malformed)."""
    try:
        return cls.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise FrameError(f"malformed {cls.__name__} (type {cls.TYPE}, {len(body)} bytes): {exc}") from exc


def encode_message(msg: Message) -> bytes:
    return encode_frame(msg.TYPE, _json_body(msg))


async def write_message(stream: WritableStream, msg: Message) -> None:
    await stream.write(encode_message(msg))


@overload
async def read_message(stream: ReadableStream, expected: type[M], /) -> M: ...
@overload
async def read_message(stream: ReadableStream, expected: type[M], other: type[M2], /) -> M | M2: ...
@overload
async def read_message(stream: ReadableStream, expected: type[M], other: type[M2], third: type[M3], /) -> M | M2 | M3: ...
@overload
async def read_message(stream: ReadableStream, *expected: type[Message]) -> Message: ...
async def read_message(stream: ReadableStream, *expected: type[Message]) -> Message:
    """One message of one of the `expected` types (FrameError for any other, or a malformed one)."""
    by_type = _by_type(expected)
    type_tag, body = await read_frame(stream, message_caps(*expected))
    return decode_message(by_type[type_tag], body)


def _signed_data(type_tag: int, json_body: bytes) -> bytes:
    return bytes((type_tag,)) + json_body


def encode_signed(msg: Message, identity: Identity) -> bytes:
    body = _json_body(msg)
    return encode_frame(msg.TYPE, identity.sign(_signed_data(msg.TYPE, body)) + body)


async def write_signed(stream: WritableStream, msg: Message, identity: Identity) -> None:
    await stream.write(encode_signed(msg, identity))


@overload
def decode_signed(type_tag: int, body: bytes, signer_peer_id: str, expected: type[M], /) -> M: ...
@overload
def decode_signed(type_tag: int, body: bytes, signer_peer_id: str, *expected: type[Message]) -> Message: ...
def decode_signed(type_tag: int, body: bytes, signer_peer_id: str, *expected: type[Message]) -> Message:
    """Verify `body` (signature + JSON) as `signer_peer_id`'s, then parse it as the class owning `type_tag`."""
    by_type = _by_type(expected)
    cls = by_type.get(type_tag)
    if cls is None:
        raise FrameError(f"unexpected signed frame type {type_tag} (expected one of {sorted(by_type)})")
    if len(body) < SIGNATURE_BYTES:
        raise FrameError(f"signed frame type {type_tag} has {len(body)} bytes, less than a signature")
    if len(body) > cls.MAX_BYTES + SIGNATURE_BYTES:
        raise FrameError(f"signed frame type {type_tag} has {len(body)} bytes, cap is {cls.MAX_BYTES + SIGNATURE_BYTES}")
    signature, json_body = body[:SIGNATURE_BYTES], body[SIGNATURE_BYTES:]
    if not verify_from_peer(signer_peer_id, _signed_data(type_tag, json_body), signature):
        raise BadSignature(f"signed {cls.__name__} (type {type_tag}, {len(body)} bytes) is not signed by {signer_peer_id}")
    return decode_message(cls, json_body)


@overload
async def read_signed(stream: ReadableStream, signer_peer_id: str, expected: type[M], /) -> M: ...
@overload
async def read_signed(stream: ReadableStream, signer_peer_id: str, *expected: type[Message]) -> Message: ...
async def read_signed(stream: ReadableStream, signer_peer_id: str, *expected: type[Message]) -> Message:
    type_tag, body = await read_frame(stream, signed_caps(*expected))
    return decode_signed(type_tag, body, signer_peer_id, *expected)
