"""The public web server's bounds against a real server on loopback (shared/web.py): open connections, requests
with a body, the rate of everyone together, and a client that never reads its answer, none of which stalls the
event loop the hub runs on."""

from __future__ import annotations

import pytest
import trio
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from trio.testing import MockClock

import shared.web as web
from shared.web import BURST_EVERYONE, BURST_PER_ADDRESS, RATE_EVERYONE, RATE_PER_ADDRESS, RateLimit, serve

BIG_BYTES = 32 * 1024 * 1024  # far more than the kernel's socket buffers hold for a client that never reads


async def small(_request: object) -> Response:
    return PlainTextResponse("ok")


async def big(_request: object) -> Response:
    return Response(b"x" * BIG_BYTES)


APP = Starlette(routes=[Route("/", small), Route("/big", big)])


async def request(port: int, head: bytes = b"GET / HTTP/1.1") -> int:
    """The status code of one request on a connection of its own."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(head + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while b"\r\n" not in data and (chunk := await stream.receive_some(4096)):
            data += chunk
    return int(data.split(b" ", 2)[1])


async def started(nursery: trio.Nursery) -> int:
    (bound,) = await nursery.start(serve, APP, "127.0.0.1:0")
    return int(bound.rsplit(":", 1)[1])


@pytest.mark.trio
async def test_connections_past_the_bound_wait_until_one_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "MAX_CONNECTIONS", 3)
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        with trio.move_on_after(1.0) as waited:
            await request(port)
        assert waited.cancelled_caught  # accepted by the kernel, never by the server while three are open
        await idle[0].aclose()
        with trio.fail_after(3.0):
            assert await request(port) == 200
        for stream in idle[1:]:
            await stream.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_nothing_is_written_and_no_body_is_taken() -> None:
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        assert await request(port) == 200
        assert await request(port, b"POST / HTTP/1.1\r\nContent-Length: 0") == 405
        assert await request(port, b"GET / HTTP/1.1\r\nContent-Length: 5000000") == 413
        assert await request(port, b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked") == 413
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_client_that_never_reads_its_answer_stalls_nobody_else() -> None:
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        async with await trio.open_tcp_stream("127.0.0.1", port) as slow:
            await slow.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads a byte
            await trio.sleep(0.5)  # the server is now blocked sending to it, on that connection only
            with trio.fail_after(2.0):
                assert await request(port) == 200
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_refused_methods_count_against_the_rate(mock_clock: MockClock) -> None:
    """On trio's clock, which stands still here (a slow machine refills no token), then moves by hand."""
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        for _ in range(int(BURST_PER_ADDRESS)):
            assert await request(port, b"POST / HTTP/1.1\r\nContent-Length: 0") == 405
        assert await request(port) == 429  # a flood of POSTs spent this address's burst
        mock_clock.jump(0.9 / RATE_PER_ADDRESS)
        assert await request(port) == 429  # not a whole token back yet
        mock_clock.jump(0.2 / RATE_PER_ADDRESS)
        assert await request(port) == 200
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_client_that_never_reads_and_trickles_bytes_is_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(web, "SEND_TIMEOUT_S", 1.0)

    async def trickle(stream: trio.SocketStream) -> None:
        try:
            while True:  # a byte now and then keeps resetting the server's read timeout
                await trio.sleep(0.2)
                await stream.send_all(b" ")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads a byte
        nursery.start_soon(trickle, slow)
        with trio.fail_after(5.0):  # the one slot frees once its answer misses the send deadline
            assert await request(port) == 200
        await slow.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_one_address_holds_at_most_its_share_of_the_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "MAX_CONNECTIONS_PER_ADDRESS", 2)
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(2.0):  # closed at once, without an answer
            assert await extra.receive_some(1) == b""
        other = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
        with trio.fail_after(2.0):  # another address is served
            await other.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await other.receive_some(4096)).startswith(b"HTTP/1.1 200")
        for stream in (extra, other, idle[0]):
            await stream.aclose()
        await trio.sleep(web.CLOSE_GRACE_S + 0.5)
        with trio.fail_after(2.0):  # a closed one gives its place back to its address
            assert await request(port) == 200
        await idle[1].aclose()
        nursery.cancel_scope.cancel()


def test_a_crowd_of_addresses_is_capped_by_the_rate_of_everyone() -> None:
    rate = RateLimit()
    assert BURST_EVERYONE > BURST_PER_ADDRESS  # one client alone never reaches the crowd's cap
    assert all(rate.allow(f"10.0.{i // 200}.{i % 200}", 0.0) for i in range(int(BURST_EVERYONE)))
    assert not rate.allow("10.9.9.9", 0.0)  # a fresh address, within its own rate, past everyone's
    assert rate.allow("10.9.9.9", 1.0 / RATE_EVERYONE)
