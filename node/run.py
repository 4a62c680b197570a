"""`run_node`: a volunteer node's process — libp2p host, hub link, snapshot keeper, worker, status file."""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from node.client import WrongHub
from node.config import NodeConfig
from node.engine import InstallFailed
from node.hub_link import NodeRefused
from node.model_fetch import ModelFetch, write_status
from node.price_schedule import parse_price_schedule, scheduled_price
from node.summary import run_over_text, summary_text
from shared.crypto import Identity, peer_id_from_multiaddr
from shared.layout import NODE_LOG_FILE, NODE_MODEL_DIR, NODE_STATUS_FILE, SNAPSHOTS_DIR
from shared.logs import PeerLogLimiter, setup_logging
from shared.messages import (
    RELAY_PROTOCOL,
    RUN_OVER_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    EventRecord,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    LeaveReply,
    NodeView,
    RunOver,
    RunOverReply,
    standby_text,
)
from shared.model_files import ModelFilesRefused
from shared.net import RateLimiter, admit_only, close_answered, running_host, set_handler, until_hung_up
from shared.probe import InstallProbe
from shared.signals import Stopper, trio_owns_ctrl_c
from shared.units import BYTES_PER_MBIT
from shared.wire import read_message, write_message

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from node.engine import Engine
    from node.nat import NatTraversal

log = logging.getLogger("echo2.node")
# How long a stopping node waits for the hub to take its leave: a hub away is dropping it at its heartbeat timeout.
LEAVE_TIMEOUT_S = 3.0
# How long the hub may take to send that its run is over, and to read this node's answer.
RUN_OVER_TIMEOUT_S = 10.0
# How long a node the run's end stopped keeps its connection to the hub at most, for the hub to read its answer (the hub
# hangs up sooner as it exits): a connection closed under an answer not read yet takes the answer with it, and the hub
# counts the node as not told.
RUN_OVER_LINGER_S = 2.0

# Ends the volunteer is told in one line, with the exit code: 2 for a mistake in the flags, 1 for a hub's refusal.
ONE_LINE_ENDS: dict[type[Exception], int] = {WrongHub: 2, NodeRefused: 1, InstallFailed: 1, ModelFilesRefused: 1}


def _hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} ({os.cpu_count()} CPUs)"
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}"


class NodeRuntime:
    """Wires the node's components together in one trio nursery."""

    def __init__(
        self, config: NodeConfig, identity: Identity, engine: Engine, model_config_hash: str, device: str, max_snapshot_bytes: int
    ) -> None:
        self.config = config
        self.max_snapshot_bytes = max_snapshot_bytes  # what a snapshot of this model takes at most (the keeper's bound)
        self.identity = identity
        self.engine = engine
        self.model_config_hash = model_config_hash
        # Once: platform.processor() may run `uname -p`, which must not happen on the event loop at every join.
        self.hardware = _hardware(device)
        self.hub_peer_id = peer_id_from_multiaddr(config.hub)
        self.engine_lock = trio.Lock()
        self.listen_addrs: tuple[str, ...] = ()
        self._nursery: trio.Nursery | None = None
        self.nat: NatTraversal  # once the host runs
        self.stopper = Stopper()
        self.versions_installed = 0
        from node.keeper import INSTALL_LINE_S  # torch is imported by now (the engine)

        self.install_lines = PeerLogLimiter(INSTALL_LINE_S, trio.current_time)
        self.standby_said: str | None = None  # why this node is in standby, as last said (None: not in standby)
        self.run_over: RunOver | None = None  # the hub's run ended, and this node stopped for it

    async def _install(self, path: Path, version: int, probe: InstallProbe | None) -> None:
        from shared.snapshot import SnapshotError

        async with self.engine_lock:
            try:
                await trio.to_thread.run_sync(self.engine.install, path, version)
            except SnapshotError as exc:  # signed by the hub, yet not for this engine: no later version will be
                raise InstallFailed(f"cannot install v{version}: {exc}") from exc
            # Before the worker may generate with it: EngineBroken (an InstallFailed) stops the node in one line.
            gap = await trio.to_thread.run_sync(self.engine.check_install, probe, version)
        if gap is None:
            log.warning("v%d carries no install probe (its learner was built without one): not checked", version)
        else:
            log.info("v%d reproduces the hub's install probe: mean |log-prob gap| %.2g", version, gap)

    async def _on_join(self, reply: JoinReply) -> None:
        """Size the engine by the context the hub's leases need (vLLM starts here, off the event loop), and stop
        it on exactly the EOS set the hub checks against."""
        from node.engine import EngineUnavailable

        async with self.engine_lock:
            try:
                await trio.to_thread.run_sync(self.engine.fit_context, reply.context_tokens)
            except EngineUnavailable as exc:
                raise InstallFailed(str(exc)) from exc
            if reply.stop_ids is not None and frozenset(reply.stop_ids) != self.engine.stop_ids:
                log.info(
                    "stopping on the hub's EOS ids %s (this model directory declares %s)",
                    list(reply.stop_ids),
                    sorted(self.engine.stop_ids),
                )
                await trio.to_thread.run_sync(self.engine.use_stop_ids, reply.stop_ids)

    def _price_now(self) -> float:
        """The price this node asks now: its schedule's at this local time, else --price."""
        if self.config.price_schedule is None:
            return self.config.price
        local = time.localtime()
        return scheduled_price(parse_price_schedule(self.config.price_schedule), local.tm_hour * 60 + local.tm_min)

    def _price_held(self) -> float:
        """The price the hub holds for this node: the schedule's last one it took, else the price it asks now."""
        held = self.link.state.price_per_hour
        return self._price_now() if held is None else held

    def _join_request(self) -> JoinRequest:
        return JoinRequest(
            price_per_hour=self._price_now(),
            hardware=self.hardware,
            link_bps=self.config.declared_link_mbps * BYTES_PER_MBIT,
            backend=self.engine.backend,
            model_config_hash=self.model_config_hash,
            dtype=self.engine.dtype,
            version_held=self.keeper.version_held,
            listen_addrs=self.listen_addrs,
            name=self.config.name,
        )

    def _heartbeat(self) -> Heartbeat:
        transfer = self.keeper.transfer
        return Heartbeat(
            version_held=self.keeper.version_held,
            punch_failed_with=self.keeper.punch_failed if self.keeper.punch_failed == self.keeper.upstream.peer_id else None,
            receiving_version=transfer.manifest.version if transfer else None,
            chunks_received=(len(transfer.manifest.chunk_hashes) - transfer.assembler.missing_count) if transfer else 0,
        )

    def _on_reply(self, reply: HeartbeatReply) -> None:
        from node.keeper import HUB, Upstream

        upstream = HUB if reply.upstream is None else Upstream(reply.upstream, reply.upstream_addrs, reply.upstream_link)
        self.keeper.update(reply.latest_version, upstream, reply.downstream, reply.downstream_addrs)
        if reply.reachability == "nated" and self.nat.needs_reservation() and self._nursery is not None:
            self.nat.reserving = True  # one attempt at a time, from the next heartbeat on too
            # NATed successors reach us through the hub's relay to hole-punch: hold a slot there.
            self._nursery.start_soon(self._reserve)
        if reply.state in ("active", "probing"):
            self.worker.wake.set()
            self.worker.wake = trio.Event()
        self._say_standby(reply)

    def _say_standby(self, reply: HeartbeatReply) -> None:
        """Why this node is in standby (unpaid: its measured rate and the hub's rule), once per stretch in standby
        and again when the reason changes."""
        why = standby_text(self._price_held(), reply.rollouts_per_s, reply.too_slow) if reply.state == "standby" else None
        if why is not None and why != self.standby_said:
            self.link.state.note("standby", why)
        self.standby_said = why

    async def _reserve(self) -> None:
        assert self._nursery is not None  # started from it
        try:
            await self.nat.reserve(self._nursery)
        except Exception as exc:  # noqa: BLE001 - the hub may be away; the next heartbeat reply retries
            log.info("relay reservation on the hub failed: %r", exc)

    def _on_installed(self, version: int) -> None:
        self.versions_installed += 1
        # On the terminal once per INSTALL_LINE_S at most, as in node.log: a run publishes every few seconds.
        tail = self.install_lines.tail("installed")
        self.link.state.note("installed", f"v{version}{tail or ''}", said=tail is not None)
        self.link.beat_now.set()  # tell the hub at once: it measures T_bcast from these

    def view(self) -> NodeView:
        link, keeper, stats = self.link.state, self.keeper, self.worker.stats
        reply = link.last_reply
        transfer = keeper.transfer
        return NodeView(
            peer_id=self.identity.peer_id,
            name=self.config.name or "",
            hub_addr=self.config.hub,
            connected=link.connected,
            state=link.state,
            updated_at=time.time(),
            price_per_hour=self._price_held(),
            backend=self.engine.backend,
            version_held=keeper.version_held,
            receiving_version=transfer.manifest.version if transfer else None,
            chunks_received=(len(transfer.manifest.chunk_hashes) - transfer.assembler.missing_count) if transfer else 0,
            chunks_total=len(transfer.manifest.chunk_hashes) if transfer else 0,
            chain=reply.chain if reply else None,
            chain_position=reply.chain_position if reply else None,
            upstream=reply.upstream if reply else None,
            downstream=reply.downstream if reply else None,
            tokens_per_s=stats.tokens_per_s,
            rollouts_per_s=stats.rollouts_per_s,
            leases_done=stats.leases_done,
            tallies=stats.tallies,
            earnings_usd=stats.earned_usd,
            reasons=stats.reasons,
            last_refusals=tuple(stats.last_refusals),
            needed_rollouts_per_s=stats.needed_rollouts_per_s,
            standby_s=link.standby_s(),
            busy_s=stats.busy_s,
            paid_s=stats.paid_s,
            unanswered=stats.unanswered,
            run_over=self.run_over,
            measured_rollouts_per_s=reply.rollouts_per_s if reply else None,
            too_slow=reply.too_slow if reply else False,
            versions_installed=self.versions_installed,
            relayed_bytes=keeper.bytes_served,
            events=tuple(link.events[-20:]),
        )

    async def run(self) -> None:
        from node.client import HubClient
        from node.hub_link import HubLink
        from node.keeper import SnapshotKeeper
        from node.nat import NatTraversal
        from node.worker import Worker
        from shared.bulk import channel_for

        limiter = RateLimiter(self.config.link_mbps * BYTES_PER_MBIT) if self.config.link_mbps else None
        bulk = channel_for(self.config.listen, self.config.bulk_port)
        async with running_host(self.identity, [self.config.listen]) as (host, addrs):
            # A port-forwarded host says where peers reach it; behind a NAT nothing is needed (the hub
            # finds out, hub/distribution/reachability.py, and plans links the node dials itself).
            public = self.config.public_addr
            self.listen_addrs = (f"{public}/p2p/{self.identity.peer_id}",) if public else tuple(addrs)
            client = HubClient(host, self.identity, self.config.hub)
            # Relayed connections and hole punches only with the peers the hub put next to us in a chain.
            self.nat = NatTraversal(
                host, self.config.hub, lambda peer: peer in (self.keeper.downstream, self.keeper.upstream.peer_id)
            )
            self.keeper = SnapshotKeeper(
                host,
                self.identity,
                self.hub_peer_id,
                self.config.data_dir / SNAPSHOTS_DIR,
                self._install,
                limiter,
                self._on_installed,
                client.report,
                self.max_snapshot_bytes,
                punch=self.nat.punch,
                bulk=bulk,
            )
            self.worker = Worker(
                client,
                self.engine,
                self.engine_lock,
                can_work=lambda: self.link.state.connected and self.link.state.state in ("active", "probing"),
                version_held=lambda: self.keeper.version_held,
                max_rollouts_per_s=self.config.max_rollouts_per_s,
                on_unknown=lambda: self.link.beat_now.set(),
            )
            self.link = HubLink(
                client,
                self._join_request,
                self._heartbeat,
                self._on_reply,
                self.config.reconnect_max_s,
                on_join=self._on_join,
                price=None if self.config.price_schedule is None else self._price_now,
            )
            self.link.state.on_note = _print_event
            set_handler(host, SNAPSHOT_PROTOCOL, self.keeper.serve, log)
            set_handler(host, RELAY_PROTOCOL, self.keeper.on_relay_offer, log)
            admit_only(host, RUN_OVER_PROTOCOL, self._on_run_over, lambda peer: peer == self.hub_peer_id, log)
            log.info("node %s listening on %s", self.identity.peer_id, ", ".join(addrs))
            async with self.nat.running(), trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.stopper.run, nursery.cancel_scope)
                if bulk is not None:
                    await bulk.start(nursery)
                await self.keeper.start(nursery)
                nursery.start_soon(self.link.run)
                nursery.start_soon(self.worker.run)
                nursery.start_soon(write_status, self.config.data_dir / NODE_STATUS_FILE, self.view)
                if self.config.http != "off":
                    from node.web import serve_node_web

                    bound = await nursery.start(serve_node_web, self.view, self.config.http)
                    print(f"node page: {' '.join(bound)}", flush=True)
            if self.stopper.signal_name is not None and self.link.state.connected:
                await self._leave(client)
            elif self.run_over is not None:
                await until_hung_up(host, self.hub_peer_id, RUN_OVER_LINGER_S)

    async def _on_run_over(self, stream: INetStream) -> None:
        """RUN_OVER_PROTOCOL, from the hub only: its run is over. The node stops (run_node prints why and its
        summary), or with --wait-next-run waits until a hub answers at the address again."""
        waits = self.config.wait_next_run
        with trio.fail_after(RUN_OVER_TIMEOUT_S):
            over = await read_message(stream, RunOver)
            await write_message(stream, RunOverReply(waits=waits))
        await close_answered(stream)
        log.info("%s", over.text())
        if waits:
            self.link.wait_next_run(over.text())
        elif self._nursery is not None:
            self.run_over = over
            self._nursery.cancel_scope.cancel()

    async def _leave(self, client) -> None:
        """Tell the hub this node stops, so that its open leases go back to the pool now rather than after the hub's
        heartbeat timeout, while its learner may be waiting for them."""
        with trio.move_on_after(LEAVE_TIMEOUT_S):
            try:
                reply = await client.leave(LEAVE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a hub away: it drops us after its heartbeat timeout
                log.info("leave not taken: %s", exc)
                return
            if isinstance(reply, LeaveReply):
                log.info("left the hub: %d leases given back", reply.leases_released)
            else:
                log.info("leave refused: %s", reply)


def _print_event(event: EventRecord) -> None:
    """One line per change of the node's state (joined, installed, active, reconnecting...)."""
    print(f"{time.strftime('%H:%M:%S', time.localtime(event.at))} {event.kind:<12} {event.detail}", flush=True)


def run_node(config: NodeConfig) -> int:
    setup_logging(
        config.data_dir / NODE_LOG_FILE,
        config.log_level,
        stderr_level=logging.WARNING,
        max_mb=config.log_max_mb,
        backups=config.log_backups,
    )
    import torch
    import transformers

    from node.backends import make_engine
    from node.engine import EngineUnavailable, VLLMResources
    from shared.model_io import model_dir_weights
    from shared.precision import ENGINE_DTYPE_BYTES, pick_device
    from shared.rollout import engine_seed
    from shared.snapshot import snapshot_bytes_bound

    torch.set_num_threads(config.threads)
    transformers.utils.logging.disable_progress_bar()  # our own progress display owns the terminal
    device = pick_device(config.device, torch.cuda.is_available())
    identity = Identity.load_or_create(config.key_path)
    print(f"echo-node {identity.peer_id} joining {config.hub}", flush=True)
    if (code := ask_hub_first(config, identity)) is not None:
        return code
    model_dir = config.model or config.data_dir / NODE_MODEL_DIR
    # Each process its own sampling seed unless one is configured: two nodes leased the same prompts in the
    # same order must not sample the same completions (copy detection would flag them).
    seed = engine_seed(config.seed)
    torch.manual_seed(seed)
    resources = VLLMResources(
        gpu_memory_fraction=config.gpu_memory_fraction,
        kv_cache_gib=config.kv_cache_gib,
        cpu_cores=config.cpu_cores,
        threads=config.threads,
    )
    try:
        engine = make_engine(
            config.backend,
            model_dir,
            device=None if config.device == "auto" else config.device,
            version=-1,
            dtype=config.dtype,
            seed=seed,
            vllm=resources,
            max_lora_rank=config.max_lora_rank,
        )
    except EngineUnavailable as exc:
        print(f"echo-node: {exc}", file=sys.stderr)
        return 2
    config_hash = engine.model_identity.config_hash
    max_snapshot_bytes = snapshot_bytes_bound(model_dir_weights(model_dir), ENGINE_DTYPE_BYTES[engine.dtype])
    runtime = NodeRuntime(config, identity, engine, config_hash, device, max_snapshot_bytes)
    try:
        code = _run_phase(runtime.run)
    finally:
        engine.close()
    if code is not None:
        return code
    if runtime.run_over is not None and runtime.stopper.signal_name is None:
        return _run_over(runtime.run_over, runtime.view())
    return _stopped(runtime.stopper, runtime.view())


def ask_hub_first(config: NodeConfig, identity: Identity) -> int | None:
    """Before the engine is built (seconds, minutes with vLLM): a node without --model fetches the hub's config and
    tokenizer files into DATA_DIR/hub-model (node/model_fetch.py), so it runs whatever model the hub trains; one with
    --model asks only for their list. Either way the list says the hub's price ceiling, which this node's prices are
    checked against now rather than refused at join. None to go on, else the exit code (a refusal, a signal)."""
    directory = None if config.model is not None else config.data_dir / NODE_MODEL_DIR
    fetch = ModelFetch(config, identity, directory, _print_event)
    code = _run_phase(fetch.run)
    if code is not None:
        return code
    if not fetch.answered:  # stopped before the hub answered
        return _stopped(fetch.stopper, fetch.view())
    if fetch.listing is not None and directory is not None:
        print(f"echo-node: the hub trains {fetch.listing.model}; its config and tokenizer are in {directory}", flush=True)
    ceiling = fetch.listing.max_price_per_hour if fetch.listing is not None else None
    refusal = None if ceiling is None else price_above(config, ceiling)
    if refusal is not None:
        print(f"echo-node: {refusal}", file=sys.stderr, flush=True)
        return 2
    return None


def price_above(config: NodeConfig, ceiling: float) -> str | None:
    """Why this node's price is one the hub refuses (above its `ceiling`, $/h), naming the value and the fix; None when
    every price it would ask (--price, or each of --price-schedule's) is within it."""
    if config.price_schedule is None:
        asked = [(f"--price {config.price:g}", config.price)]
    else:
        asked = [
            (f"--price-schedule's {m // 60:02d}:{m % 60:02d}={p:g}", p) for m, p in parse_price_schedule(config.price_schedule)
        ]
    over = [what for what, price in asked if price > ceiling]
    if not over:
        return None
    return f"{', '.join(over)} ($/h) is above this hub's ceiling ${ceiling:g}/h, which it refuses at join: ask at most that"


def _run_phase(run: Callable[[], Awaitable[None]]) -> int | None:
    """trio.run(run); the exit code of an end the volunteer is told in one line (printed), None when it returned."""
    try:
        with trio_owns_ctrl_c():
            trio.run(run)
    except BaseException as exc:
        end = one_line_end(exc)
        if end is None:
            raise
        print(f"echo-node: {end[0]}", file=sys.stderr)
        return end[1]
    return None


def _stopped(stopper: Stopper, view: NodeView) -> int:
    """A node stopped by a signal: say so, and what it did."""
    print(f"echo-node: stopped ({stopper.signal_name})", file=sys.stderr, flush=True)
    print(summary_text(view), flush=True)
    return 0


def _run_over(over: RunOver, view: NodeView) -> int:
    """A node the hub's end stopped: say so, and what it did."""
    print(f"echo-node: {run_over_text(over)}", flush=True)
    print(summary_text(view), flush=True)
    return 0


def one_line_end(exc: BaseException) -> tuple[Exception, int] | None:
    """The end the volunteer is told in one line (ONE_LINE_ENDS) and its exit code, even inside trio's exception
    groups; None when anything else ended the node (a bug: its traceback is the report)."""
    if isinstance(exc, BaseExceptionGroup):
        ends, rest = exc.split(tuple(ONE_LINE_ENDS))
        if ends is None or rest is not None:
            return None
        first: BaseException = ends
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        exc = first
    return next(((exc, code) for kind, code in ONE_LINE_ENDS.items() if isinstance(exc, kind)), None)
