"""The public web server's bounds against a real server on loopback (shared/web.py): open connections, requests
with a body, the rate of everyone together, a client that never reads its answer, and a crowd of kept-alive
connections, none of which stalls the event loop the hub runs on or keeps a visitor or the operator's scrape out."""

from __future__ import annotations

import pytest
import trio
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from trio.testing import MockClock

import shared.web as web
from shared.web import (
    BURST_EVERYONE,
    BURST_PER_ADDRESS,
    KEEP_ALIVE_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    METRICS_BURST_EVERYONE,
    METRICS_PATH,
    RATE_EVERYONE,
    RATE_PER_ADDRESS,
    READ_TIMEOUT_S,
    RateLimit,
    serve,
)

BIG_BYTES = 32 * 1024 * 1024  # far more than the kernel's socket buffers hold for a client that never reads


async def small(_request: object) -> Response:
    return PlainTextResponse("ok")


async def big(_request: object) -> Response:
    return Response(b"x" * BIG_BYTES)


APP = Starlette(routes=[Route("/", small), Route("/big", big), Route(METRICS_PATH, small)])
PAGE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"  # kept alive


async def request(port: int, head: bytes = b"GET / HTTP/1.1") -> int:
    """The status code of one request on a connection of its own."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(head + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while b"\r\n" not in data and (chunk := await stream.receive_some(4096)):
            data += chunk
    return int(data.split(b" ", 2)[1])


async def answer(stream: trio.SocketStream) -> int:
    """The status code of the next answer on a kept-alive `stream`, read whole (its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := await stream.receive_some(4096)):
            raise trio.BrokenResourceError("the server closed the connection")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        if not (chunk := await stream.receive_some(4096)):
            raise trio.BrokenResourceError("the server closed the connection")
        body += chunk
    return int(lines[0].split(b" ", 2)[1])


def holding(entered: list[None]) -> Starlette:
    """APP and /hold, a request that never ends (each noted in `entered` as it starts)."""

    async def hold(_request: object) -> Response:
        entered.append(None)
        await trio.sleep_forever()

    return Starlette(routes=[*APP.routes, Route("/hold", hold)])


async def started(nursery: trio.Nursery, app: Starlette = APP) -> int:
    (bound,) = await nursery.start(serve, app, "127.0.0.1:0")
    return int(bound.rsplit(":", 1)[1])


@pytest.mark.trio
async def test_past_the_bound_a_connection_closes_a_silent_one_or_waits_for_a_busy_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(web, "METRICS_CONNECTIONS", 0)  # none held back: the next waits for one of the three
    entered: list[None] = []
    async with trio.open_nursery() as nursery:
        port = await started(nursery, holding(entered))
        silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        with trio.fail_after(KEEP_ALIVE_S / 2):  # one that has sent nothing is idle: one of the three is closed
            assert await request(port) == 200
        busy = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        for stream in busy:
            await stream.send_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(READ_TIMEOUT_S / 2):  # the silent ones made room for them
            while len(entered) < 3:
                await trio.sleep(0.01)
        with trio.move_on_after(1.0) as waited:
            await request(port)
        assert waited.cancelled_caught  # accepted by the kernel, never by the server while three are in a request
        await busy[0].aclose()
        with trio.fail_after(3.0):
            assert await request(port) == 200
        for stream in silent + busy[1:]:
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
    monkeypatch.setattr(web, "METRICS_CONNECTIONS", 0)  # none held back: the visitor waits for the one slot
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


async def polite(port: int, address: str, stream: trio.SocketStream | None) -> None:
    """One of a crowd, on `stream` (kept alive from `address`, served once): it asks for the page again every
    KEEP_ALIVE_S / 2, within every bound, so the server's keep-alive timer never closes it, and comes back on a new
    connection when the server closes it (whatever it is answered: 429 and 503 are answers)."""
    while True:
        await trio.sleep(KEEP_ALIVE_S / 2)
        try:
            stream = stream or await trio.open_tcp_stream("127.0.0.1", port, local_address=address)
            await stream.send_all(PAGE)
            await answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            if stream is not None:
                await stream.aclose()
            stream = None


@pytest.mark.trio
async def test_a_polite_crowd_holding_every_connection_leaves_room_for_a_visitor_and_the_scrape() -> None:
    """MAX_CONNECTIONS kept-alive connections from as many addresses as the per-address bound needs, each served once,
    then idle between requests: a visitor's page and the operator's scrape each close one idle connection to get in.
    Each is given KEEP_ALIVE_S / 2: the crowd keeps its connections alive, so waiting longer frees nothing."""
    addresses = [f"127.0.0.{10 + i}" for i in range(MAX_CONNECTIONS // MAX_CONNECTIONS_PER_ADDRESS)]
    async with trio.open_nursery() as nursery:
        port = await started(nursery)
        with trio.fail_after(READ_TIMEOUT_S):  # a hang, not a slow machine: one at a time, each is answered at once
            for address in addresses:
                for _ in range(MAX_CONNECTIONS_PER_ADDRESS):
                    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=address)
                    await stream.send_all(PAGE)
                    assert await answer(stream) == 200
                    nursery.start_soon(polite, port, address, stream)
        pages = 0
        for _ in range(10):
            with trio.move_on_after(KEEP_ALIVE_S / 2):
                pages += await request(port) == 200
        assert pages >= 9
        with trio.fail_after(KEEP_ALIVE_S / 2):
            assert await request(port, f"GET {METRICS_PATH} HTTP/1.1".encode()) == 200
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_scrape_has_a_connection_and_a_request_slot_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection and every request slot held by requests still in progress (none idle, none to close):
    /metrics is served on the connection held back for it, any other page refused there."""
    monkeypatch.setattr(web, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(web, "MAX_CONCURRENT_REQUESTS", 2)
    entered: list[None] = []
    async with trio.open_nursery() as nursery:
        port = await started(nursery, holding(entered))
        holders = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in holders:
            await stream.send_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(READ_TIMEOUT_S / 2):  # the holders' requests end only past the read timeout
            while len(entered) < 2:
                await trio.sleep(0.01)
            assert await request(port) == 503
            assert await request(port, f"GET {METRICS_PATH} HTTP/1.1".encode()) == 200
        for stream in holders:
            await stream.aclose()
        nursery.cancel_scope.cancel()


def test_the_scrape_has_a_rate_of_its_own_past_everyones() -> None:
    rate = RateLimit()
    assert all(rate.allow(f"10.0.{i // 200}.{i % 200}", 0.0) for i in range(int(BURST_EVERYONE)))
    assert not rate.allow("10.9.9.9", 0.0)  # the crowd spent everyone's burst
    assert all(rate.allow(f"10.8.0.{i}", 0.0, scrape=True) for i in range(int(METRICS_BURST_EVERYONE)))
    assert not rate.allow("10.9.9.9", 0.0, scrape=True)  # a crowd of scrapers spends the scrape's own
