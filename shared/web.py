"""A read-only public web server on the caller's trio event loop: hypercorn's trio worker, bounded (header size,
timeouts, a rate per client address, concurrent requests; GET and HEAD only), and the Prometheus helpers its
/metrics routes share. The hub's status page (hub/service/web.py) and a node's own page (node/web.py) are its apps."""

from __future__ import annotations

import trio
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
# A slow client is dropped after this long without sending; an idle kept-alive connection sooner.
READ_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 8 * 1024


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge with one sample, or none while `value` is unknown."""
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def by_label(family: GaugeMetricFamily | CounterMetricFamily, counts: dict[str, float]) -> GaugeMetricFamily | CounterMetricFamily:
    """`family` with one sample per label value."""
    for label, value in sorted(counts.items()):
        family.add_metric([label], value)
    return family



class RateLimit:
    """RATE_PER_ADDRESS requests per second per client, bursts up to BURST_PER_ADDRESS: shared.buckets.TokenBuckets
    keyed by address_key (an IPv6 /64 is one client)."""

    def __init__(self) -> None:
        self.buckets = TokenBuckets(RATE_PER_ADDRESS, BURST_PER_ADDRESS, ADDRESSES_TRACKED)

    def allow(self, address: str, now: float) -> bool:
        return self.buckets.take(address_key(address) or address, now) == 0.0


class Bounded:
    """ASGI middleware: GET and HEAD only (405 otherwise), a rate per client address (429 beyond) and at most
    MAX_CONCURRENT_REQUESTS at once (503 beyond)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.limiter = trio.CapacityLimiter(MAX_CONCURRENT_REQUESTS)
        self.rate = RateLimit()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] not in ("GET", "HEAD"):
            return await PlainTextResponse("read-only", 405, headers={"Allow": "GET, HEAD"})(scope, receive, send)
        if not self.rate.allow((scope.get("client") or ("?",))[0], trio.current_time()):
            return await PlainTextResponse("too many requests", 429, headers={"Retry-After": "1"})(scope, receive, send)
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
    return config


async def serve(app: ASGIApp, bind: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app`, bounded, at `bind` (HOST:PORT) until cancelled; reports the bound addresses when listening."""
    from hypercorn.trio import serve as hypercorn_serve

    await hypercorn_serve(Bounded(app), hypercorn_config(bind), task_status=task_status)
