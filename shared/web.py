"""A read-only public web server on the caller's trio event loop: hypercorn's trio connections, bounded (open
connections in all and per client address, idle ones closed to make room, header size, no request body, read and send
timeouts, a rate per client address and for everyone, concurrent requests; GET and HEAD only), with a share of each
bound everyone shares held back for the operator's /metrics scrape, and the Prometheus helpers its /metrics routes
share. The hub's status page (hub/service/web.py) and a node's own page (node/web.py) are its apps."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import trio
import trio.abc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
# Connections open at once. While all are held, a new one closes the connection idle longest (waiting for a request
# with no byte of it received: kept alive after an answer, or silent since it opened) and takes its slot, so a crowd
# of polite kept-alive connections cannot keep a visitor out; with none idle it waits in the kernel's accept backlog
# (BACKLOG), which refuses beyond it.
MAX_CONNECTIONS = 128
# Connections one client address (address_key: an IPv6 /64 is one) may hold open; beyond it one is closed at once.
MAX_CONNECTIONS_PER_ADDRESS = 8
BACKLOG = 128
# The operator's Prometheus scrape, at this path of both apps, has its own share of what everyone shares, so that a
# crowd of pages cannot starve it: connections beyond MAX_CONNECTIONS that a new connection takes only when none is
# idle to close (only METRICS_PATH is served there, one request each, anything else gets 503), requests at once
# beyond MAX_CONCURRENT_REQUESTS, and a rate of its own besides RATE_EVERYONE (a few scrapers' worth: Prometheus
# scrapes every 15 s or so). The scrape is public: a crowd asking for it shares only this among itself.
METRICS_PATH = "/metrics"
METRICS_CONNECTIONS = 1
METRICS_CONCURRENT_REQUESTS = 2
METRICS_RATE_EVERYONE = 2.0
METRICS_BURST_EVERYONE = 10.0
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
    keyed by address_key: an IPv6 /64 is one client), and RATE_EVERYONE for all clients together; scrapes
    (METRICS_PATH) count against METRICS_RATE_EVERYONE instead of RATE_EVERYONE."""

    def __init__(self) -> None:
        self.buckets = TokenBuckets(RATE_PER_ADDRESS, BURST_PER_ADDRESS, ADDRESSES_TRACKED)
        self.everyone = TokenBuckets(RATE_EVERYONE, BURST_EVERYONE, 1)
        self.scrapes = TokenBuckets(METRICS_RATE_EVERYONE, METRICS_BURST_EVERYONE, 1)

    def allow(self, address: str, now: float, *, scrape: bool = False) -> bool:
        everyone = self.scrapes if scrape else self.everyone
        return self.buckets.take(address_key(address) or address, now) == 0.0 and everyone.take("", now) == 0.0


def has_body(scope: Scope) -> bool:
    """Whether a request says it carries a body (nothing here reads one)."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0") for name, value in scope["headers"]
    )


class Bounded:
    """ASGI middleware: a rate per client address and for everyone (429 beyond; every request counts), GET and HEAD
    only (405 otherwise) without a body (413), and at most MAX_CONCURRENT_REQUESTS at once (503 beyond), scrapes
    METRICS_CONCURRENT_REQUESTS of their own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.limiter = trio.CapacityLimiter(MAX_CONCURRENT_REQUESTS)
        self.scrape_limiter = trio.CapacityLimiter(METRICS_CONCURRENT_REQUESTS)
        self.rate = RateLimit()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scrape = scope["path"] == METRICS_PATH
        # The rate first: every request counts, refused ones too.
        if not self.rate.allow((scope.get("client") or ("?",))[0], trio.current_time(), scrape=scrape):
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
        limiter = self.scrape_limiter if scrape else self.limiter
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            return await PlainTextResponse("busy", 503, headers={"Retry-After": "1"})(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            limiter.release()


class ScrapeOnly:
    """ASGI middleware on a connection held back for the scrape (METRICS_CONNECTIONS): METRICS_PATH, else 503; every
    answer closes the connection, so that the slot is free again for the next scrape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] != METRICS_PATH:
            return await PlainTextResponse("busy", 503, headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


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


class Connections:
    """The open connections: MAX_CONNECTIONS_PER_ADDRESS of each client address (address_key: an IPv6 /64 is one
    client), so that one client cannot hold every slot, and MAX_CONNECTIONS slots in all plus METRICS_CONNECTIONS held
    back for the scrape. While none is free, a new connection closes the one idle longest (see MAX_CONNECTIONS)."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.free, self.free_for_scrape = MAX_CONNECTIONS, METRICS_CONNECTIONS
        # In the order they went idle: the one idle longest first.
        self.idle: dict[ClosingStream, None] = {}
        # Parks an accept waiting for a slot until one is freed or a connection goes idle.
        self.changed = trio.lowlevel.ParkingLot()

    def take_share(self, stream: trio.SocketStream) -> str | None:
        """The key of the stream's client, counted; None when it holds its share already or has gone."""
        try:
            host = str(stream.socket.getpeername()[0])
        except OSError:  # the client reset the connection before it was accepted
            return None
        key = address_key(host) or host
        if self.open.get(key, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
            return None
        self.open[key] = self.open.get(key, 0) + 1
        return key

    async def take_slot(self) -> bool:
        """A slot, once one is free or an idle connection closed to free one; True when it is held back for the
        scrape (taken only with none idle to close)."""
        while True:
            if self.free:
                self.free -= 1
                return False
            if self.idle:
                oldest = next(iter(self.idle))
                del self.idle[oldest]
                oldest.scope.cancel()  # its task gives its slot back as it ends
            elif self.free_for_scrape:
                self.free_for_scrape -= 1
                return True
            await self.changed.park()

    def give_share(self, key: str) -> None:
        self.open[key] -= 1
        if not self.open[key]:
            del self.open[key]

    def give_back(self, connection: Admitted, stream: ClosingStream) -> None:
        """The share and the slot of an ended connection."""
        self.idle.pop(stream, None)
        if connection.for_scrape:
            self.free_for_scrape += 1
        else:
            self.free += 1
        self.give_share(connection.key)
        self.changed.unpark_all()

    def waiting(self, stream: ClosingStream) -> None:
        """`stream` waits for a request and has received no byte of it: the last to go idle is the last closed."""
        self.idle.pop(stream, None)
        self.idle[stream] = None
        self.changed.unpark_all()

    def busy(self, stream: ClosingStream) -> None:
        """`stream` is in a request (or its client is closing it): it is not closed to make room."""
        self.idle.pop(stream, None)


@dataclass(eq=False)
class Admitted(trio.abc.AsyncResource):
    """An accepted connection within its address's share, holding a slot (for_scrape: one held back for the scrape)."""

    stream: trio.SocketStream
    key: str
    for_scrape: bool

    async def aclose(self) -> None:
        await self.stream.aclose()


class SlotListener(trio.abc.Listener[Admitted]):
    """Accepts connections, closes at once those past their address's share, and hands on the others once each
    holds a slot (Connections.take_slot)."""

    def __init__(self, inner: trio.SocketListener, connections: Connections) -> None:
        self.inner, self.connections = inner, connections

    async def accept(self) -> Admitted:
        while True:
            stream = await self.inner.accept()
            if (key := self.connections.take_share(stream)) is None:
                await stream.aclose()
                continue
            try:
                return Admitted(stream, key, await self.connections.take_slot())
            except BaseException:
                self.connections.give_share(key)
                await trio.aclose_forcefully(stream)
                raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class ClosingStream:
    """A connection's stream for hypercorn's TCPServer whose end also ends the connection's task, at once on our
    close, CLOSE_GRACE_S after the client's (hypercorn's task lingers on its keep-alive timer, holding the slot):
    the methods TCPServer uses, no TLS. It tells `connections` when a request's first bytes come (it goes idle as it
    opens, and after each answer: tracking_server)."""

    def __init__(self, stream: trio.SocketStream, scope: trio.CancelScope, connections: Connections) -> None:
        self.stream, self.socket, self.scope, self.connections = stream, stream.socket, scope, connections
        connections.waiting(self)

    async def send_all(self, data: bytes) -> None:
        # A deadline set inside hypercorn's shielded scope still fires.
        with trio.move_on_after(SEND_TIMEOUT_S) as timer:
            await self.stream.send_all(data)
        if timer.cancelled_caught:
            await self.aclose()
            raise trio.BrokenResourceError(f"the client took no answer for {SEND_TIMEOUT_S:g} s")

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        self.connections.busy(self)
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


def tracking_server(connections: Connections):  # noqa: ANN201 (hypercorn imports lazily)
    """hypercorn's per-connection server (TCPServer), telling `connections` when its connection goes idle after an
    answer and when it starts the next request (hypercorn's Updated events; a pipelined request starts without a
    read)."""
    from hypercorn.events import Updated
    from hypercorn.trio.tcp_server import TCPServer

    class TrackingServer(TCPServer):
        async def protocol_send(self, event: object) -> None:
            if isinstance(event, Updated):
                (connections.waiting if event.idle else connections.busy)(self.stream)
            await super().protocol_send(event)

    return TrackingServer


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
    (hypercorn.trio.tcp_server.TCPServer, as tracking_server) behind SlotListener, so at most MAX_CONNECTIONS (and
    METRICS_CONNECTIONS for the scrape) are open at once, MAX_CONNECTIONS_PER_ADDRESS of one client, and idle ones
    make room for new ones (Connections)."""
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import wrap_app

    config = hypercorn_config(bind)
    sockets = listening_sockets(bind) if sockets is None else sockets
    connections, bounded, context = Connections(), Bounded(app), WorkerContext(None)
    server = tracking_server(connections)
    served = {
        for_scrape: wrap_app(ScrapeOnly(bounded) if for_scrape else bounded, config.wsgi_max_body_size, "asgi")
        for for_scrape in (False, True)
    }

    async def connection(admitted: Admitted) -> None:
        with trio.CancelScope() as scope:
            stream = ClosingStream(admitted.stream, scope, connections)
            try:
                await server(served[admitted.for_scrape], config, context, {}, stream)
            finally:
                connections.give_back(admitted, stream)

    listeners = [SlotListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), connections) for sock in sockets]
    task_status.started(urls(sockets))
    await trio.serve_listeners(connection, listeners)
