"""A read-only public web server on the caller's trio event loop: hypercorn's trio connections, bounded (open
connections in all and per client address, header size, no request body, read and send timeouts, a rate per client
address and for everyone, concurrent requests; GET and HEAD only), and the Prometheus helpers its /metrics routes
share. The hub's status page (hub/service/web.py) and a node's own page (node/web.py) are its apps."""

from __future__ import annotations

import socket

import trio
import trio.abc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.buckets import TokenBuckets
from shared.net import address_key

# Requests served at once; more get 503 at once, so a crowd (or slow clients) cannot queue work on the hub's loop.
MAX_CONCURRENT_REQUESTS = 32
# Requests per second one client address may make (a refreshing page makes one per 2 s, a scraper fewer), with a
# burst for a page load; the table of addresses is bounded (a crowd of addresses empties it: each starts afresh).
RATE_PER_ADDRESS = 5.0
BURST_PER_ADDRESS = 20.0
ADDRESSES_TRACKED = 10_000
# Requests per second of all clients together: what a crowd of addresses (each within its own rate) may cost.
RATE_EVERYONE = 100.0
BURST_EVERYONE = 200.0
# Connections open at once; the next wait in the kernel's accept backlog (BACKLOG), which refuses beyond it.
MAX_CONNECTIONS = 128
# Connections one client address (address_key: an IPv6 /64 is one) may hold open; beyond it one is closed at once.
MAX_CONNECTIONS_PER_ADDRESS = 8
BACKLOG = 128
# A connection the client closed is done within this long (hypercorn winds down; an answer has nobody to go to).
CLOSE_GRACE_S = 1.0
# A slow client is dropped after this long without sending; an idle kept-alive connection sooner.
READ_TIMEOUT_S = 10.0
# A client that does not take one write of an answer within this long is dropped: a byte trickled now and then
# resets the read timeout, and hypercorn shields its writes from cancellation.
SEND_TIMEOUT_S = 20.0
KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 8 * 1024
# h11 bounds only a head still incomplete in its buffer (h11_max_incomplete_size): one write can carry a complete
# head of any size, so the middleware bounds complete heads too.
MAX_HEADERS = 100


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge with one sample, or none while `value` is unknown."""
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def by_label(
    family: GaugeMetricFamily | CounterMetricFamily, counts: dict[str, float]
) -> GaugeMetricFamily | CounterMetricFamily:
    """`family` with one sample per label value."""
    for label, value in sorted(counts.items()):
        family.add_metric([label], value)
    return family


class RateLimit:
    """RATE_PER_ADDRESS requests per second per client, bursts up to BURST_PER_ADDRESS (shared.buckets.TokenBuckets
    keyed by address_key: an IPv6 /64 is one client), and RATE_EVERYONE for all clients together."""

    def __init__(self) -> None:
        self.buckets = TokenBuckets(RATE_PER_ADDRESS, BURST_PER_ADDRESS, ADDRESSES_TRACKED)
        self.everyone = TokenBuckets(RATE_EVERYONE, BURST_EVERYONE, 1)

    def allow(self, address: str, now: float) -> bool:
        return self.buckets.take(address_key(address) or address, now) == 0.0 and self.everyone.take("", now) == 0.0


def has_body(scope: Scope) -> bool:
    """Whether a request says it carries a body (nothing here reads one)."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0") for name, value in scope["headers"]
    )


class Bounded:
    """ASGI middleware: a rate per client address and for everyone (429 beyond; every request counts), GET and HEAD
    only (405 otherwise) without a body (413), and at most MAX_CONCURRENT_REQUESTS at once (503 beyond)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.limiter = trio.CapacityLimiter(MAX_CONCURRENT_REQUESTS)
        self.rate = RateLimit()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # The rate first: every request counts, refused ones too.
        if not self.rate.allow((scope.get("client") or ("?",))[0], trio.current_time()):
            return await PlainTextResponse("too many requests", 429, headers={"Retry-After": "1"})(scope, receive, send)
        headers = scope["headers"]
        if len(headers) > MAX_HEADERS or sum(len(n) + len(v) + 4 for n, v in headers) > MAX_HEADER_BYTES:
            return await PlainTextResponse("request header fields too large", 431, headers={"Connection": "close"})(
                scope, receive, send
            )
        if scope["method"] not in ("GET", "HEAD"):
            return await PlainTextResponse("read-only", 405, headers={"Allow": "GET, HEAD"})(scope, receive, send)
        if has_body(scope):
            return await PlainTextResponse("no request body here", 413)(scope, receive, send)
        try:
            self.limiter.acquire_nowait()
        except trio.WouldBlock:
            return await PlainTextResponse("busy", 503, headers={"Retry-After": "1"})(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release()


def hypercorn_config(bind: str):  # noqa: ANN201 (hypercorn imports lazily)
    """hypercorn's settings for a public, read-only server: small headers, short timeouts, no access log."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [bind]
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.read_timeout = READ_TIMEOUT_S
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.keep_alive_max_requests = 100
    config.accesslog = None
    config.include_server_header = False
    config.backlog = BACKLOG
    return config


class SlotListener(trio.abc.Listener):
    """Accepts a connection only once one of `slots` is free (the connection's handler gives it back)."""

    def __init__(self, inner: trio.SocketListener, slots: trio.Semaphore) -> None:
        self.inner, self.slots = inner, slots

    async def accept(self) -> trio.SocketStream:
        await self.slots.acquire()
        try:
            return await self.inner.accept()
        except BaseException:
            self.slots.release()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class AddressShares:
    """The connections each client address (address_key: an IPv6 /64 is one client) holds open, at most
    MAX_CONNECTIONS_PER_ADDRESS each, so that one client cannot hold every slot."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, stream: trio.SocketStream) -> str | None:
        """The key of the stream's client, counted; None when it holds its share already or has gone."""
        try:
            host = str(stream.socket.getpeername()[0])
        except OSError:  # the client reset the connection before it was handled
            return None
        key = address_key(host) or host
        if self.open.get(key, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
            return None
        self.open[key] = self.open.get(key, 0) + 1
        return key

    def give_back(self, key: str) -> None:
        self.open[key] -= 1
        if not self.open[key]:
            del self.open[key]


class ClosingStream:
    """A connection's stream for hypercorn's TCPServer whose end also ends the connection's task, at once on our
    close, CLOSE_GRACE_S after the client's (hypercorn's task lingers on its keep-alive timer, holding the slot):
    the methods TCPServer uses, no TLS."""

    def __init__(self, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        self.stream, self.socket, self.scope = stream, stream.socket, scope

    async def send_all(self, data: bytes) -> None:
        # A deadline set inside hypercorn's shielded scope still fires.
        with trio.move_on_after(SEND_TIMEOUT_S) as timer:
            await self.stream.send_all(data)
        if timer.cancelled_caught:
            await self.aclose()
            raise trio.BrokenResourceError(f"the client took no answer for {SEND_TIMEOUT_S:g} s")

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        if not data:
            self.scope.deadline = min(self.scope.deadline, trio.current_time() + CLOSE_GRACE_S)
        return data

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            self.scope.cancel()


def listening_sockets(bind: str) -> list[socket.socket]:
    """The sockets `serve` accepts on for `bind` (HOST:PORT), bound and listening: the hub makes them and hands
    them to its web server's process (hub/service/web.py), so a busy port fails in the hub, before anything runs."""
    config = hypercorn_config(bind)
    sockets = config.create_sockets().insecure_sockets
    for sock in sockets:
        sock.listen(config.backlog)
    return sockets


def urls(sockets: list[socket.socket]) -> list[str]:
    """The http:// address of each listening socket."""
    from hypercorn.utils import repr_socket_addr

    return [f"http://{repr_socket_addr(sock.family, sock.getsockname())}" for sock in sockets]


async def serve(
    app: ASGIApp, bind: str, *, sockets: list[socket.socket] | None = None, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app`, bounded, at `bind` (HOST:PORT; or on `sockets`, listening already) until cancelled; reports the
    bound addresses when listening.

    hypercorn's own trio `serve` accepts every connection; this loop runs the same per-connection server
    (hypercorn.trio.tcp_server.TCPServer) behind SlotListener, so at most MAX_CONNECTIONS are open at once, and
    MAX_CONNECTIONS_PER_ADDRESS of one client (AddressShares)."""
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import wrap_app

    config = hypercorn_config(bind)
    sockets = listening_sockets(bind) if sockets is None else sockets
    slots, shares = trio.Semaphore(MAX_CONNECTIONS), AddressShares()
    served, context = wrap_app(Bounded(app), config.wsgi_max_body_size, "asgi"), WorkerContext(None)

    async def connection(stream: trio.SocketStream) -> None:
        try:
            if (key := shares.take(stream)) is None:
                await stream.aclose()
                return
            try:
                with trio.CancelScope() as scope:
                    await TCPServer(served, config, context, {}, ClosingStream(stream, scope))
            finally:
                shares.give_back(key)
        finally:
            slots.release()

    listeners = [SlotListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), slots) for sock in sockets]
    task_status.started(urls(sockets))
    await trio.serve_listeners(connection, listeners)
