"""Framing, typed messages and signed messages over an in-memory stream that returns short reads."""

from __future__ import annotations

import random
import struct

import pydantic
import pytest
from libp2p.network.stream.exceptions import StreamReset

from shared.crypto import Identity
from shared.wire import (
    BadSignature,
    FrameError,
    Message,
    StreamEOF,
    decode_signed,
    encode_frame,
    encode_message,
    encode_signed,
    protocol_id,
    read_exact,
    read_frame,
    read_message,
    read_signed,
    signed_caps,
    write_frame,
    write_message,
)

# Tags 180-189 belong to this test module (real messages use lower tags).


class Hello(Message):
    TYPE = 180
    MAX_BYTES = 256
    name: str
    count: int


class Bye(Message):
    TYPE = 181
    MAX_BYTES = 64
    reason: str


class Blob(Message):
    TYPE = 182
    MAX_BYTES = 1 << 20
    data: str


class FakeStream:
    """Byte pipe whose reads return at most `max_read` bytes, like py-libp2p's frame-sized reads."""

    def __init__(self, data: bytes = b"", max_read: int = 7, end_exc: Exception | None = None) -> None:
        self.buffer = bytearray(data)
        self.max_read = max_read
        self.end_exc = end_exc
        self.requested: list[int] = []

    async def read(self, n: int) -> bytes:
        self.requested.append(n)
        if not self.buffer:
            if self.end_exc is not None:
                raise self.end_exc
            return b""
        take = min(n, self.max_read, len(self.buffer))
        piece = bytes(self.buffer[:take])
        del self.buffer[:take]
        return piece

    async def write(self, data: bytes) -> None:
        self.buffer += data


def test_protocol_id():
    assert protocol_id("lease") == "/echo2/lease/2.11.0"


@pytest.mark.trio
async def test_read_exact_loops_over_short_reads():
    data = bytes(range(256)) * 40
    stream = FakeStream(data, max_read=100)
    assert await read_exact(stream, len(data)) == data
    assert len(stream.requested) == -(-len(data) // 100)


@pytest.mark.trio
async def test_read_exact_maps_libp2p_reset_to_eof():
    stream = FakeStream(b"abc", max_read=2, end_exc=StreamReset())
    with pytest.raises(StreamEOF):
        await read_exact(stream, 10)


@pytest.mark.trio
async def test_frame_round_trip():
    stream = FakeStream(max_read=5)
    await write_frame(stream, 201, b"x" * 1000)
    await write_frame(stream, 202, b"")
    assert await read_frame(stream, {201: 1000, 202: 0}) == (201, b"x" * 1000)
    assert await read_frame(stream, {201: 1000, 202: 0}) == (202, b"")


@pytest.mark.trio
async def test_message_round_trip():
    stream = FakeStream(max_read=3)
    await write_message(stream, Hello(name="héllo", count=3))
    await write_message(stream, Bye(reason="done"))
    assert await read_message(stream, Hello, Bye) == Hello(name="héllo", count=3)
    assert await read_message(stream, Hello, Bye) == Bye(reason="done")


def test_message_is_frozen_and_strict():
    msg = Hello(name="a", count=1)
    with pytest.raises(pydantic.ValidationError):
        msg.count = 2
    with pytest.raises(pydantic.ValidationError):
        Hello(name="a", count=1, extra=True)


def test_encode_refuses_body_above_cap():
    with pytest.raises(ValueError, match="Bye body is .* MAX_BYTES is 64"):
        encode_message(Bye(reason="x" * 100))


@pytest.mark.trio
async def test_oversized_length_rejected_before_allocation():
    claimed = 3_000_000_000
    stream = FakeStream(struct.pack(">BI", Hello.TYPE, claimed) + b"{}", max_read=1 << 20)
    with pytest.raises(FrameError, match=f"claims {claimed} bytes, cap is 256"):
        await read_message(stream, Hello)
    assert max(stream.requested) <= 5


@pytest.mark.trio
async def test_unexpected_type_rejected():
    stream = FakeStream(encode_message(Bye(reason="x")))
    with pytest.raises(FrameError, match="unexpected frame type 181"):
        await read_message(stream, Hello)
    assert max(stream.requested) <= 5


@pytest.mark.trio
async def test_truncated_frame_is_eof():
    frame = encode_message(Hello(name="abc", count=1))
    for cut in (0, 3, len(frame) - 1):
        with pytest.raises(StreamEOF):
            await read_message(FakeStream(frame[:cut]), Hello)


@pytest.mark.trio
async def test_garbage_is_frame_error():
    rng = random.Random(1234)
    for _ in range(200):
        body = rng.randbytes(rng.randrange(0, 256))
        stream = FakeStream(encode_frame(Hello.TYPE, body))
        with pytest.raises(FrameError):
            await read_message(stream, Hello)


@pytest.mark.trio
async def test_wrong_schema_is_frame_error():
    stream = FakeStream(encode_frame(Hello.TYPE, b'{"name": "a", "count": "many"}'))
    with pytest.raises(FrameError, match="malformed Hello"):
        await read_message(stream, Hello)


@pytest.mark.trio
async def test_signed_round_trip():
    signer = Identity.generate()
    stream = FakeStream(max_read=11)
    await stream.write(encode_signed(Hello(name="n", count=2), signer))
    assert await read_signed(stream, signer.peer_id, Hello, Bye) == Hello(name="n", count=2)


@pytest.mark.trio
async def test_signed_tampered_non_json_body_fails_signature_first():
    signer = Identity.generate()
    frame = bytearray(encode_signed(Hello(name="n", count=2), signer))
    frame[-1] = 0xFF  # the JSON is now invalid UTF-8: only a verify-first reader says BadSignature
    with pytest.raises(BadSignature):
        await read_signed(FakeStream(bytes(frame)), signer.peer_id, Hello)


@pytest.mark.trio
async def test_signed_by_someone_else_rejected():
    signer, other = Identity.generate(), Identity.generate()
    frame = encode_signed(Hello(name="n", count=2), other)
    with pytest.raises(BadSignature):
        await read_signed(FakeStream(frame), signer.peer_id, Hello)


def test_signature_binds_type_tag():
    signer = Identity.generate()

    class Alias(Message):
        TYPE = 183
        MAX_BYTES = 256
        name: str
        count: int

    frame = encode_signed(Hello(name="n", count=2), signer)
    body = frame[5:]
    assert decode_signed(Hello.TYPE, body, signer.peer_id, Hello) == Hello(name="n", count=2)
    with pytest.raises(BadSignature):
        decode_signed(Alias.TYPE, body, signer.peer_id, Alias)


def test_signed_cap_includes_signature():
    assert signed_caps(Hello) == {Hello.TYPE: 256 + 64}
    with pytest.raises(FrameError, match="less than a signature"):
        decode_signed(Hello.TYPE, b"short", Identity.generate().peer_id, Hello)


def test_duplicate_type_tag_raises():
    with pytest.raises(TypeError, match="tag 180 .* already used by .*Hello"):

        class Clash(Message):
            TYPE = 180
            MAX_BYTES = 10


def test_binary_range_and_missing_constants_refused():
    with pytest.raises(TypeError, match="reserved for binary frames"):

        class Binary(Message):
            TYPE = 200
            MAX_BYTES = 10

    with pytest.raises(TypeError, match="must define both TYPE and MAX_BYTES"):

        class NoCap(Message):
            TYPE = 184
