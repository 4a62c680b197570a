"""Where a dashboard's data comes from: a data dir's status file, or a running hub over libp2p.

Every source has `async fetch()` returning the status model or a reason why there is none
(`NoStatus`: no usable file yet; `Unreachable`: the hub did not answer). Nothing here blocks
the Textual (asyncio) event loop: files are read in a worker thread, and libp2p runs in its
own thread.

The trio/asyncio bridge (HubSource): py-libp2p needs trio, Textual runs on asyncio. We run
`trio.run` in a daemon thread that owns one libp2p host for the life of the source and parks
in a nursery. `fetch()` hands a job to that loop with `TrioToken.run_sync_soon` (thread-safe,
never waits for the trio side), the trio task completes a `concurrent.futures.Future`, and the
asyncio side awaits it through `asyncio.wrap_future`. A thread was chosen over
`trio.lowlevel.start_guest_run` because it keeps libp2p's CPU work (Noise handshakes, decoding
a multi-MiB HubStatus) and any misbehaviour of the trio side away from the UI loop, and it
works the same under `App.run`, `App.run_test` and pytest's loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from shared.crypto import Identity, peer_id_from_multiaddr
from shared.failures import plain_failure
from shared.layout import HUB_STATUS_FILE, NODE_STATUS_FILE
from shared.messages import STATUS_PROTOCOL, HubStatus, NodeView, Reject, StatusRequest
from shared.net import connect, request, running_host

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 3.0
DEFAULT_EVENTS = 200
# The dashboard only dials out; it still listens on loopback because py-libp2p hosts expect
# at least one listener.
DASHBOARD_LISTEN = "/ip4/127.0.0.1/tcp/0"
HOST_START_TIMEOUT_S = 10.0
# Slack on top of the trio-side timeout before the asyncio side gives up on its own.
BRIDGE_SLACK_S = 2.0


@dataclass(frozen=True)
class NoStatus:
    """A data dir with no usable status file yet (missing, partial, garbage)."""

    reason: str


@dataclass(frozen=True)
class Throttled:
    """The hub answered but asked us to slow down (its per-address status limit): it is up, nothing new to show."""

    reason: str


@dataclass(frozen=True)
class Unreachable:
    """The hub did not answer this time; the next fetch tries again."""

    reason: str


class DataDirSource:
    """Reads DATA_DIR/status.json (kind "hub", HubStatus) or DATA_DIR/node_status.json (kind "node", NodeView)."""

    def __init__(self, data_dir: Path | str, kind: Literal["hub", "node"] = "hub") -> None:
        self.data_dir = Path(data_dir)
        self.kind = kind
        self.model: type[HubStatus] | type[NodeView] = HubStatus if kind == "hub" else NodeView
        self.path = self.data_dir / (HUB_STATUS_FILE if kind == "hub" else NODE_STATUS_FILE)

    def describe(self) -> str:
        return str(self.path)

    def read(self) -> HubStatus | NodeView | NoStatus:
        """Blocking read; use `fetch` from the UI."""
        try:
            with self.path.open("rb") as f:
                # Capped before parsing: one byte past the cap is enough to refuse it.
                body = f.read(self.model.MAX_BYTES + 1)
        except FileNotFoundError:
            return NoStatus(f"no status yet: {self.path} does not exist")
        except OSError as exc:
            return NoStatus(f"no status yet: cannot read {self.path}: {exc.strerror or exc}")
        if not body.strip():
            return NoStatus(f"no status yet: {self.path} is empty")
        if len(body) > self.model.MAX_BYTES:
            return NoStatus(f"{self.path} is larger than {self.model.MAX_BYTES} bytes; refusing to parse it")
        try:
            return self.model.model_validate_json(body)
        except pydantic.ValidationError as exc:
            return NoStatus(f"no status yet: {self.path} is not a valid {self.model.__name__} ({exc.error_count()} errors)")

    async def fetch(self) -> HubStatus | NodeView | NoStatus:
        return await asyncio.to_thread(self.read)

    def close(self) -> None:
        """Nothing to release; present so every source closes the same way."""


class _TrioHost:
    """A libp2p host living in its own thread under trio.run, taking jobs from other threads."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.host: IHost | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop_requested = False
        self._thread = threading.Thread(target=self._run, name="tui-libp2p", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the waiting UI; the source starts a new host next time
            if not self.ready.done():
                self.ready.set_exception(exc)
            else:
                log.warning("dashboard libp2p host stopped: %r", exc)

    async def _main(self) -> None:
        async with running_host(self.identity, [DASHBOARD_LISTEN]) as (host, _addrs):
            async with trio.open_nursery() as nursery:
                self.host = host
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self.ready.set_result(None)
                # stop() may have run before the token existed; it set the flag first.
                if not self._stop_requested:
                    await trio.sleep_forever()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job, *args) -> None:
        """Start `job(*args)` as a trio task; returns at once (thread-safe)."""
        assert self._token is not None and self._nursery is not None
        self._token.run_sync_soon(self._nursery.start_soon, job, *args)

    def stop(self) -> None:
        self._stop_requested = True
        if self._token is not None and self._nursery is not None:
            try:
                self._token.run_sync_soon(self._nursery.cancel_scope.cancel)
            except trio.RunFinishedError:
                return
        self._thread.join(timeout=5.0)


class HubSource:
    """Fetches HubStatus over STATUS_PROTOCOL from the hub at `addr` (a multiaddr ending in /p2p/<hub id>)."""

    def __init__(
        self,
        addr: str,
        timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        events: int = DEFAULT_EVENTS,
        identity: Identity | None = None,
    ) -> None:
        self.addr = addr
        self.hub_peer_id = peer_id_from_multiaddr(addr)
        self.timeout_s = timeout_s
        self.events = events
        self.identity = identity or Identity.generate()
        self._trio: _TrioHost | None = None

    def describe(self) -> str:
        return self.addr

    async def fetch(self) -> HubStatus | Throttled | Unreachable:
        if self._trio is None or not self._trio.alive:
            self._trio = _TrioHost(self.identity)
        trio_host = self._trio
        try:
            # Shielded: giving up waiting must not cancel `ready`, which the trio thread still sets.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(trio_host.ready)), HOST_START_TIMEOUT_S)
        except asyncio.TimeoutError:
            return Unreachable(f"the dashboard's libp2p host is still starting after {HOST_START_TIMEOUT_S:.0f} s")
        except Exception as exc:  # its thread has ended; the next fetch starts a new one
            self._trio = None
            return Unreachable(f"the dashboard's libp2p host did not start: {exc!r}")
        done: concurrent.futures.Future[HubStatus | Throttled | Unreachable] = concurrent.futures.Future()
        try:
            trio_host.submit(self._fetch_in_trio, trio_host.host, done)
        except trio.RunFinishedError:
            self._trio = None
            return Unreachable("the dashboard's libp2p thread stopped; restarting it on the next refresh")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s + BRIDGE_SLACK_S)
        except asyncio.TimeoutError:
            return Unreachable(f"no answer from the dashboard's libp2p thread within {self.timeout_s + BRIDGE_SLACK_S:.0f} s")

    async def _fetch_in_trio(self, host: IHost, done: concurrent.futures.Future) -> None:
        # Once running, the future can no longer be cancelled, so set_result below cannot race
        # with the UI giving up; if the UI already gave up (app exit), there is nothing to do.
        if not done.set_running_or_notify_cancel():
            return
        try:
            result = await self._ask(host)
        except Exception as exc:  # any network failure is a normal outcome: shown, then retried next refresh
            log.debug("status request to %s failed: %r", self.hub_peer_id, exc)
            result = Unreachable(f"the hub {plain_failure(exc)}")
            await self._forget_connection(host)
        done.set_result(result)

    async def _ask(self, host: IHost) -> HubStatus | Throttled | Unreachable:
        hub = ID.from_base58(self.hub_peer_id)
        with trio.fail_after(self.timeout_s):
            reused = bool(host.get_network().get_connections(hub))
            try:
                reply = await self._connect_and_request(host)
            except trio.TooSlowError:
                raise
            except Exception as exc:
                if not reused:
                    raise
                # A connection left over from before the hub restarted looks alive to py-libp2p
                # until a stream on it fails: drop it and dial once more within the same deadline.
                log.debug("status request to %s failed (%r); redialling once", self.hub_peer_id, exc)
                await self._forget_connection(host)
                reply = await self._connect_and_request(host)
        if isinstance(reply, Reject) and reply.busy:
            return Throttled(reply.reason)
        if isinstance(reply, Reject):
            return Unreachable(f"hub refused the status request: {reply.reason}")
        return reply

    async def _connect_and_request(self, host: IHost) -> HubStatus | Reject:
        await connect(host, self.addr)
        return await request(
            host,
            self.hub_peer_id,
            STATUS_PROTOCOL,
            StatusRequest(events=self.events),
            HubStatus,
            Reject,
            timeout_s=self.timeout_s,
        )

    async def _forget_connection(self, host: IHost) -> None:
        """Drop a possibly half-dead connection so the next fetch dials afresh."""
        with trio.move_on_after(1.0, shield=True):  # type: ignore[call-arg]  # trio_typing's stubs (libp2p's) predate it
            try:
                await host.disconnect(ID.from_base58(self.hub_peer_id))
            except Exception as exc:
                log.debug("disconnect from %s after a failed fetch: %r", self.hub_peer_id, exc)

    def close(self) -> None:
        if self._trio is not None:
            self._trio.stop()
            self._trio = None
