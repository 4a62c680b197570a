"""`run_hub`: the hub process — learner, libp2p service, broadcaster, scheduler, status board and,
for the embedded default, local volunteer nodes — wired together in one trio nursery."""

from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path

import trio

from hub.audit import penalize
from hub.buffer import BufferSignal, ReplayBuffer
from hub.config import HubConfig
from hub.fleet import Fleet, NodeRecord
from hub.leases import LeaseBook
from hub.local_nodes import LocalNode, spawn_local_nodes, stop_local_nodes
from hub.service import Defences
from hub.snapshots import SnapshotShelf
from hub.store import STORE_FILE, SchemaMismatch, Store
from shared.crypto import Identity
from shared.net import running_host
from shared.signals import Stopper
from shared.tasks import load_task

log = logging.getLogger("echo2.hub")

MBIT_BYTES = 1e6 / 8
LOG_FILE = "hub.log"


def _setup_logging(config: HubConfig) -> None:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(config.data_dir / LOG_FILE)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(config.log_level.upper())
    # py-libp2p logs ordinary peer churn (a node leaving) at ERROR; it belongs in the file, not the terminal.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)


def dialable_addrs(addrs: list[str]) -> list[str]:
    """Addresses a node can dial: a 0.0.0.0 listener is reachable on loopback and on each local IPv4."""
    out: list[str] = []
    for addr in addrs:
        if "/ip4/0.0.0.0/" not in addr:
            out.append(addr)
            continue
        ips = ["127.0.0.1"]
        try:
            ips += sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
        except OSError:
            pass
        out += [addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in dict.fromkeys(ips)]
    return out


class Hub:
    """Everything the hub runs, and the glue between components."""

    def __init__(self, config: HubConfig, identity: Identity, model_dir: Path, progress: bool) -> None:
        from transformers import AutoTokenizer

        from hub.learner import LearnerComponent
        from hub.submissions import SubmissionRules

        self.config = config
        self.identity = identity
        self.progress = progress
        self.task = load_task(config.task)
        self.store = Store(config.data_dir / STORE_FILE)
        lc = config.learner
        self.buffer = ReplayBuffer(lc.buffer_max_groups, lc.staleness, lc.skip_zero_variance)
        self.signal = BufferSignal()
        self.snapshot_send, self.snapshot_recv = trio.open_memory_channel(4)
        self.learner = LearnerComponent(
            lc, config.sampling, model_dir, config.data_dir, self.store, self.buffer, self.signal, identity,
            self.snapshot_send, config.steps, config.broadcast.chunk_kib * 1024,
            extra_metrics=lambda step: self.scheduler.step_metrics(step, self.status.cost_usd(time.time())),
        )
        # The service decodes in worker threads while the learner tokenizes in its own: separate instances.
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.rules = SubmissionRules(
            task=self.task, group_size=lc.group_size, sampling=config.sampling, eos_id=tokenizer.eos_token_id,
            vocab_size=self.learner.learner.model.config.vocab_size,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        self.fleet = Fleet()
        self.leases = LeaseBook(self.task, seed=lc.seed)
        self.shelf = SnapshotShelf(keep=lc.staleness + 1)
        self.defences = Defences.build(
            config.trust, model_dir, self.shelf, config.sampling, config.lease.prompts_per_lease, lc.seed,
            on_pass=self._audit_pass, on_fail=self._audit_fail,
        )
        self.audits = self.defences.audits
        self.local_nodes: list[LocalNode] = []
        self.addrs: list[str] = []
        self.stopper = Stopper()

    # -- glue --------------------------------------------------------------------------

    async def event(self, kind: str, node_id: str | None, detail: str) -> None:
        log.info("event %s %s %s", kind, node_id or "-", detail)
        await trio.to_thread.run_sync(self.store.add_event, kind, node_id, detail)

    async def set_state(self, record: NodeRecord, state: str, reason: str) -> None:
        if record.state == state:
            return
        previous, record.state = record.state, state
        if state in ("gone", "banned"):
            # A released (standby) node may still finish the lease it holds: it did what it was told.
            for lease in self.leases.drop_node(record.peer_id):
                log.info("lease %s of %s back to the pool", lease.lease_id[:8], record.peer_id[-8:])
        await trio.to_thread.run_sync(
            self.store.set_node_state, record.peer_id, state, reason if state == "banned" else None
        )
        kind = {"active": "activate", "standby": "release" if previous == "active" else "standby",
                "gone": "leave", "banned": "ban"}.get(state, state)
        await self.event(kind, record.peer_id, reason)
        if state in ("gone", "banned") or previous in ("gone", "banned"):
            self.broadcaster.replan()

    async def ban(self, record: NodeRecord, reason: str) -> None:
        await self.set_state(record, "banned", reason)

    async def _audit_pass(self, node_id: str) -> None:
        if (record := self.fleet.get(node_id)) is not None:
            record.audits_passed += 1
        await trio.to_thread.run_sync(self.store.count_audit_pass, node_id)

    async def _audit_fail(self, node_id: str, reason: str) -> None:
        """Ban the node, drop its untrained work from the buffer, void what it was paid since its last passed audit."""
        record = self.fleet.get(node_id)
        if record is not None:
            await self.ban(record, f"audit failed: {reason}")
        penalty = await penalize(
            self.store, self.buffer, node_id, self.audits.vouched_lease.get(node_id), "banned: audit failed"
        )
        await self.event(
            "audit_fail", node_id,
            f"{reason}; dropped {len(penalty.dropped_row_ids)} groups, voided {penalty.voided_ledger_rows} payments",
        )

    async def record_t_bcast(self, version: int, seconds: float) -> None:
        await trio.to_thread.run_sync(self.store.set_broadcast_time, version, seconds)
        await self.event("broadcast_done", None, f"v{version} on every node in {seconds:.2f}s")

    def on_fleet_change(self) -> None:
        self.broadcaster.replan()
        self.scheduler.poke()

    async def _publisher(self) -> None:
        async for published in self.snapshot_recv:
            self.shelf.add(published.snapshot)
            await self.broadcaster.publish(published.version)

    # -- run ---------------------------------------------------------------------------

    async def run(self) -> None:
        from hub.broadcast import Broadcaster, HubUplink
        from hub.scheduler import LearnerTiming, Scheduler
        from hub.service import HubService, LearnerView
        from hub.status import RunInfo, StatusBoard

        config, lc = self.config, self.config.learner
        async with running_host(self.identity, [config.listen]) as (host, addrs):
            self.addrs = dialable_addrs(addrs)
            bc = config.broadcast
            hub_bps = bc.hub_uplink_mbps * MBIT_BYTES if bc.hub_uplink_mbps else None
            uplink = HubUplink(hub_bps, bc.link_mbps * MBIT_BYTES if bc.link_mbps else None)
            self.broadcaster = Broadcaster(
                host, self.fleet, self.shelf, bc.mode, hub_bps,
                ban=self.ban, event=self.event, record_t_bcast=self.record_t_bcast,
            )
            self.scheduler = Scheduler(
                config.scheduler, self.fleet,
                LearnerTiming(lc.effective_kappa, lc.prompts_per_step * lc.group_size,
                              t_train_s=lambda: self.status.t_train_recent_s,
                              t_bcast_s=self.broadcaster.last_t_bcast_s,
                              usable_fraction=lambda: self.status.usable_fraction),
                set_state=self.set_state,
            )
            self.status = StatusBoard(
                RunInfo(self.identity.peer_id, tuple(self.addrs), config.steps, lc.staleness, lc.effective_kappa,
                        config.task, config.broadcast.mode, lc.learner_price_per_hour, time.time()),
                config.data_dir, self.store, self.fleet, self.leases, self.broadcaster, self.scheduler,
                learner_step=lambda: self.learner.step, dropped_stale=lambda: self.buffer.dropped_stale,
            )
            service = HubService(
                host, store=self.store, fleet=self.fleet, leases=self.leases, buffer=self.buffer,
                buffer_signal=self.signal, shelf=self.shelf, rules=self.rules,
                learner=LearnerView(self.learner.min_useful_version, lc.staleness, lc.prompts_per_step),
                config=config.lease, model_config_hash=self.learner.learner.config_hash, task_name=config.task,
                heartbeat_period_s=2.0, status=self.status.snapshot, chain_links=self.broadcaster.links,
                on_fleet_change=self.on_fleet_change, uplink=uplink,
                on_heartbeat=self.broadcaster.check_done, defences=self.defences,
                on_report=self.broadcaster.on_report,
            )
            self._announce()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.stopper.run, nursery.cancel_scope)
                for component in (service, self.broadcaster, self.scheduler, self.status, self.audits):
                    nursery.start_soon(component.run)
                nursery.start_soon(self._publisher)
                if config.local_nodes:
                    self.local_nodes = spawn_local_nodes(
                        config.local_nodes, self.addrs[0], config.data_dir, link_mbps=config.broadcast.link_mbps
                    )
                if self.progress:
                    from hub.progress import live_progress

                    nursery.start_soon(live_progress, self)
                await self.learner.run()
                self.status.running = False
                await self.status.refresh()
                nursery.cancel_scope.cancel()

    def _announce(self) -> None:
        print(f"echo-hub {self.identity.peer_id}", flush=True)
        print("listening on:", flush=True)
        for addr in self.addrs:
            print(f"  {addr}", flush=True)
        print(f"volunteers join with:\n  echo-node join --hub {self.addrs[0]}", flush=True)
        print(f"data dir: {self.config.data_dir.resolve()}  (logs: {LOG_FILE}, metrics: metrics.jsonl)", flush=True)


def run_hub(config: HubConfig, progress: bool = True) -> int:
    _setup_logging(config)
    import torch
    import transformers

    from hub.summary import print_summary
    from shared.default_model import ensure_default_model

    torch.set_num_threads(config.learner.threads)
    transformers.utils.logging.disable_progress_bar()  # our own progress display owns the terminal
    identity = Identity.load_or_create(config.key_path)
    model_dir = config.model or ensure_default_model(progress=progress and sys.stderr.isatty())
    try:
        hub = Hub(config, identity, Path(model_dir), progress)
    except SchemaMismatch as exc:
        print(f"echo-hub: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(hub.run)
    finally:
        stop_local_nodes(hub.local_nodes)
    interrupted = hub.stopper.signal_name is not None
    if interrupted:
        print(f"\necho-hub: {hub.stopper.signal_name}: nodes stopped; saving state", file=sys.stderr, flush=True)
        hub.learner.save_state()
        hub.status.running = False
        hub.status.refresh_sync()
    hub.store.close()
    print_summary(config.data_dir, interrupted=interrupted)
    return 130 if interrupted else 0
