"""`run_hub`: the hub process — learner, libp2p service, broadcaster, scheduler, status board and,
for the embedded default, local volunteer nodes — wired together in one trio nursery."""

from __future__ import annotations

import functools
import logging
import socket
import sys
import time
from pathlib import Path
from typing import IO

import trio

from hub.cli.local_nodes import LocalNode, local_nodes_device, spawn_local_nodes, stop_local_nodes
from hub.cli.preflight import Resume
from hub.config import HubConfig
from hub.records.snapshots import SnapshotShelf
from hub.training.distributed import (
    RANK_POLL_S,
    Collective,
    LearnerRankLost,
    RankGroup,
    RankWatch,
    broadcast,
    device_for,
    follow,
    init_ranks,
    join_ranks,
    rank_store,
)
from hub.training.ranks import RankEnv, rank_env
from hub.training.trackers import open_trackers
from shared.checks import disk_full, found_in, free_space
from shared.crypto import Identity
from shared.layout import HUB_LOG_FILE, METRICS_FILE, SNAPSHOTS_DIR
from shared.logs import OperatorLines, setup_logging
from shared.messages import EvalPoint, RejectCode, RunOver
from shared.model_identity import ModelIdentity, load_model_identity
from shared.net import address_key, running_host
from shared.precision import device_phrase
from shared.signals import Stopper, trio_owns_ctrl_c
from shared.tasks.base import RewardError
from shared.units import BYTES_PER_MBIT

log = logging.getLogger("echo2.hub")


def dialable_addrs(addrs: list[str]) -> list[str]:
    """Addresses a node can dial: a 0.0.0.0 listener is reachable on loopback and on each local IPv4."""
    out: list[str] = []
    for addr in addrs:
        if "/ip4/0.0.0.0/" not in addr:
            out.append(addr)
            continue
        ips = ["127.0.0.1"]
        try:
            ips += sorted({str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
        except OSError:
            pass
        out += [addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in dict.fromkeys(ips)]
    return out


class Hub:
    """Everything the hub runs, built in order and wired together: HubState's three owners hold the state, the
    rest read it or call their commands; no component stands in for one built later."""

    def __init__(
        self,
        config: HubConfig,
        identity: Identity,
        model: ModelIdentity,
        progress: bool,
        asked: HubConfig | None = None,
        warnings: OperatorLines | None = None,
    ) -> None:
        """`asked`: the config before this machine resolved its devices (what final/ and checkpoints record, so
        the run's echo2.toml starts on another machine); `config` when omitted. `warnings`: the lines the hub logs for
        its operator, which its status shows (None: none shown). `model`: read once, every component's."""
        self.warnings = warnings
        from hub.agents.evaluation import tool_groups
        from hub.cli.build import build_hub_state
        from hub.cli.card import run_card
        from hub.control.scheduler import LearnerTiming, Scheduler, StalenessBounds
        from hub.training.evaluation import EvalRunner, Evaluator
        from hub.training.loop import LearnerComponent
        from hub.training.metrics import MetricsWriter
        from shared.adapters import LoraSpec
        from shared.precision import resolve_dtype
        from shared.probe import PROBE_ROWS, probe_rows

        lc = config.learner
        self.dtype = resolve_dtype(lc.dtype, lc.device)
        self.config = config
        self.model = model
        self.identity = identity
        self.progress = progress
        # S + 1 versions on the shelf (a rollout may be that stale), files of older ones deleted.
        self.shelf = SnapshotShelf(keep=lc.staleness_bound + 1, directory=config.data_dir / SNAPSHOTS_DIR)
        core = build_hub_state(config, model, self.shelf)
        self.task, eval_task, auditor = core.task, core.eval_task, core.auditor
        self.state, self.context_tokens, self.model_offer = core.state, core.context_tokens, core.model_offer
        rules = self.state.intake.rules
        assert rules is not None, "echo-hub start's hub takes submissions"
        rows = probe_rows([p.text for p in self.task.prompts()[: PROBE_ROWS + 1]], model.tokenizer, rules.stop_ids)
        # Files of versions out of the window (a crash's orphans, versions that left it before a restart) go now. The
        # newest S + 1 go back on the shelf, so that work made with one older than the newest is audited, and paid, as
        # before the restart; the learner publishes the newest again (hub/training/loop.py), which the shelf holds once.
        published = self.state.store.shelf.newest_versions(self.shelf.keep)
        self.shelf.prune(set(published))
        self.shelf.reopen(published, identity.peer_id)
        # Unbuffered: the learner writes its next snapshot only once the shelf took (and pruned for) the last,
        # so the snapshot dir never holds more than S + 2 of them.
        self.snapshot_send, self.snapshot_recv = trio.open_memory_channel(0)
        self.trackers = open_trackers(config.tracking, config.data_dir, config.model_dump(mode="json"))
        # metrics.jsonl, before the evaluations and the learner that both write it.
        self.metrics = MetricsWriter(config.data_dir / METRICS_FILE, self.trackers)
        self.evaluation = None
        if eval_task is not None:
            lora = LoraSpec(rank=lc.lora_rank, alpha=lc.lora_alpha, targets=lc.lora_targets) if lc.lora_rank else None
            tools = functools.partial(tool_groups, self.state.agents) if self.state.agents is not None else None
            evaluator = Evaluator(model, eval_task, config.eval, config.sampling, self.dtype, lc.device, lc.seed, lora, tools)
            self.evaluation = EvalRunner(evaluator, config.eval.every, self._record_eval, self.state.event)
        # The scheduler before the learner, which asks it for S under --staleness auto: what it reads of the learner
        # (T_train, the usable fraction, the S and kappa a resumed run goes on at) is in the state's measurements.
        window = self.state.measurements.learner
        self.scheduler = Scheduler(
            config.scheduler,
            self.state.fleet,
            LearnerTiming(
                window.kappa,
                lc.prompts_per_step * lc.group_size,
                self.state.measurements,
                staleness=window.staleness,
                rollouts_per_lease=config.lease.prompts_per_lease * lc.group_size,
            ),
            set_state=self.state.membership.set_state,
            adaptive=StalenessBounds(lc.staleness_max, lc.drift_max, lc.learner_price_per_hour) if lc.staleness_auto else None,
            start_step=window.step,
        )
        self.watch: RankWatch | None = None
        self.learner = LearnerComponent(
            lc,
            config.sampling,
            model,
            config.data_dir,
            self.state,
            identity,
            self.snapshot_send,
            config.steps,
            config.broadcast.chunk_kib * 1024,
            config.broadcast.delta_max_ratio,
            extra_metrics=self._step_metrics,
            trackers=self.trackers,
            evaluation=self.evaluation,
            ranks=self._join_ranks(),
            log_completions=config.tracking.log_completions,
            uses_tools=config.agents.enabled,
            probe=functools.partial(auditor.install_probe, rows=rows),
            card=functools.partial(run_card, asked or config, model.model_dir),
            rollouts=rollout_export(config),
            staleness_control=self.scheduler.adapt_staleness if lc.staleness_auto else None,
            metrics=self.metrics,
        )
        self.local_nodes: list[LocalNode] = []
        self.addrs: list[str] = []
        self.stopper = Stopper()

    def stop_helpers(self) -> None:
        """Stop the processes the hub started beside itself: its local nodes and its tool sandbox's workers."""
        stop_local_nodes(self.local_nodes)
        if self.state.agents is not None:
            self.state.agents.stop()

    def _address_key(self, peer: str) -> str | None:
        record = self.state.fleet.get(peer)
        return address_key(record.remote_ip) if record is not None else None

    def _join_ranks(self) -> tuple[Collective, str, RankWatch | None] | None:
        """A learner sharded over several processes: spawn the other ranks (--learner-procs) unless torchrun
        launched them, and join their process group as rank 0. None: one learner process."""
        lc = self.config.learner
        env = rank_env()
        world = env.world if env is not None else lc.procs
        if world == 1:
            return None
        if env is None:
            store_file = rank_store(self.config.data_dir)
            env = RankEnv(rank=0, world=world, local_rank=0, store_file=str(store_file))
            self.watch = RankWatch()
            self.watch.spawn(world, Path(store_file), self.config.data_dir, sys.argv[1:])
        device = device_for(lc.device, env)
        where = f"in {env.store_file}" if env.store_file else f"at {env.master_addr}:{env.master_port}"
        print(
            f"echo-hub: waiting for {world - 1} learner ranks to join {where} "
            f"(torch.distributed, {'nccl' if device.startswith('cuda') else 'gloo'})",
            flush=True,
        )
        collective = join_ranks(env, device, self.watch)
        print(f"echo-hub: learner sharded over {world} processes (FSDP2)", flush=True)
        return collective, device, self.watch

    async def _watch_ranks(self) -> None:
        """A spawned learner rank that exits ends the run (one line naming it), even while the learner waits."""
        watch = self.watch
        assert watch is not None, "only a hub that spawned its ranks watches them"
        while True:
            await trio.sleep(RANK_POLL_S)
            if (gone := watch.dead()) is not None:
                raise LearnerRankLost(gone)

    async def _record_eval(self, row: EvalPoint) -> None:
        await self.state.record_eval(row)
        await trio.to_thread.run_sync(self.metrics.append_row, row.as_metrics_row())

    def _step_metrics(self, step: int) -> dict[str, float | None]:
        """The capacity model and the money spent, for each step's metrics line."""
        return self.scheduler.step_metrics(step, self.state.cost_usd(time.time()))

    def on_membership(self) -> None:
        self.broadcaster.replan_soon()
        self.scheduler.poke()

    async def _relay_refused(self, peer: str, reason: str) -> None:
        """A relay request the gate refused: counted against the peer as any refused request."""
        await self.state.membership.record_refusal(peer, RejectCode.BAD_REQUEST)

    # -- run ---------------------------------------------------------------------------

    async def run(self) -> None:
        from hub.distribution.broadcast import Broadcaster
        from hub.distribution.publisher import SnapshotPublisher
        from hub.service.handlers import build_hub_service
        from hub.service.status import RunInfo, StatusBoard
        from shared.bulk import channel_for

        config, lc, state = self.config, self.config.learner, self.state
        # The nodes this hub spawns all dial from loopback: room for them on top of the per-address cap.
        per_ip = config.trust.max_connections_per_ip + config.local_nodes
        async with running_host(self.identity, [config.listen], per_ip) as (host, addrs):
            self.addrs = dialable_addrs(addrs)
            bc = config.broadcast
            self.broadcaster = Broadcaster(
                host,
                state.fleet,
                self.shelf,
                bc.mode,
                bc.hub_uplink_mbps * BYTES_PER_MBIT if bc.hub_uplink_mbps else None,
                ban=state.membership.ban,
                event=state.event,
                record_t_bcast=state.record_broadcast_time,
                reports=state.membership,
                measurements=state.measurements,
            )
            publisher = SnapshotPublisher(self.snapshot_recv, self.shelf, self.broadcaster)
            self.status = StatusBoard(
                RunInfo(
                    self.identity.peer_id,
                    tuple(self.addrs),
                    config.steps,
                    lc.staleness,
                    lc.effective_kappa,
                    config.task,
                    config.broadcast.mode,
                ),
                config.data_dir,
                state,
                broadcaster=self.broadcaster,
                scheduler=self.scheduler,
                warnings=self.warnings.newest if self.warnings is not None else tuple,
            )
            state.membership.on_change.append(self.on_membership)
            bulk = channel_for(config.listen, config.broadcast.bulk_port)
            service = build_hub_service(
                host,
                self.identity,
                config,
                state,
                self.shelf,
                self.status.encoded,
                self.context_tokens,
                self.broadcaster,
                bulk,
                self.model_offer,
            )
            from libp2p.tools.anyio_service import background_trio_service

            from hub.distribution.reachability import RelayGate, guard_relay, relay_service

            # The relay NATed nodes reserve on, for hole-punch signalling between them (node/nat.py).
            relay = relay_service(host)
            gate = RelayGate(relay, state.fleet.is_member, self._address_key, self.broadcaster.planned_punch, self._relay_refused)
            async with background_trio_service(relay), trio.open_nursery() as nursery:
                nursery.start_soon(guard_relay, host, relay, gate)
                # Catching stop signals before the address is out: a stop sent on seeing it is never lost. It ends the
                # run, not the hub: the nodes are told below (a crash raises past it, and they retry as for a restart).
                learning = trio.CancelScope()
                await nursery.start(self.stopper.run, learning)
                with learning:
                    self._announce()
                    await nursery.start(self.broadcaster.run)  # before anything can publish
                    if bulk is not None:
                        await bulk.start(nursery)
                    if state.agents is not None:  # the tool sandbox's workers, before any lease opens a rollout
                        await state.agents.start()
                        nursery.start_soon(state.agents.run)
                    for component in (state, service, self.scheduler, self.status):
                        nursery.start_soon(component.run)
                    if config.http != "off":
                        await self._serve_web(nursery)
                    nursery.start_soon(publisher.run)
                    if self.evaluation is not None:
                        await nursery.start(self.evaluation.run)
                    if config.local_nodes:
                        # In a thread: the first fork waits for the node server to finish its imports.
                        self.local_nodes = await trio.to_thread.run_sync(
                            functools.partial(
                                spawn_local_nodes,
                                config.local_nodes,
                                self.addrs[0],
                                config.data_dir,
                                link_mbps=config.broadcast.link_mbps,
                                model=self.model.model_dir,
                                extra_args=("--dtype", self.dtype),
                                device=config.local_device,
                                log=(config.log_max_mb, config.log_backups),
                            )
                        )
                        state.leasing.exempt(n.peer_id for n in self.local_nodes)
                    from hub.cli.progress import live_progress, plain_progress, watch

                    # A live bar on a terminal; plain lines in a log file or a pipe (a bar there is one truncated line).
                    nursery.start_soon(live_progress if self.progress and sys.stdout.isatty() else plain_progress, self)
                    nursery.start_soon(watch, self, lc.stall_warning_s)
                    if self.watch is not None:
                        nursery.start_soon(self._watch_ranks)
                    await self.learner.run()
                self.status.running = False
                over = RunOver(finished=self.stopper.signal_name is None, step=self.learner.step, steps=config.steps)
                await service.end_run(over)
                await self.status.refresh()
                nursery.cancel_scope.cancel()

    async def _serve_web(self, nursery: trio.Nursery) -> None:
        """The public status page, /api/status and /metrics, served by a process of its own (hub/service/web.py)."""
        from hub.service.web import serve_web

        bound = await nursery.start(serve_web, self.status, self.config.http)
        print(f"status page: {' '.join(bound)}", flush=True)

    def _announce(self) -> None:
        print(f"echo-hub {self.identity.peer_id}", flush=True)
        print("listening on:", flush=True)
        for addr in self.addrs:
            print(f"  {addr}", flush=True)
        # A LoRA run's snapshots carry only the adapters: its volunteers bring the base model.
        base = f" --model <a copy of {self.model.model_dir.name}>" if self.config.learner.lora_rank else ""
        print(f"volunteers join with:\n  echo-node join --hub {self.addrs[0]}{base}", flush=True)
        print(f"data dir: {self.config.data_dir.resolve()}  (logs: {HUB_LOG_FILE}, metrics: {METRICS_FILE})", flush=True)


def on_this_machine(config: HubConfig) -> HubConfig:
    """`config` with its devices resolved here, once: the learner's (auto: cuda when torch sees a GPU) and the local
    nodes' (auto: the learner's)."""
    from shared.precision import resolve_device

    learner = resolve_device(config.learner.device, "--device")
    return config.model_copy(
        update={
            "learner": config.learner.model_copy(update={"device": learner}),
            "local_device": local_nodes_device(config.local_device, learner),
        }
    )


def announce_device(device: str) -> None:
    """Say, and log, where the learner runs."""
    import torch

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else ""
    line = f"learner on {device_phrase(device, torch.cuda.is_available(), gpu)}"
    print(f"echo-hub: {line}", flush=True)
    log.info(line)


def rollout_export(config: HubConfig):
    """--save-rollouts' writer (None: off); pyarrow is imported only then."""
    if config.save_rollouts is None:
        return None
    from hub.training.rollout_export import RolloutExport

    return RolloutExport(config.save_rollouts, int(config.save_rollouts_max_gb * 1e9), config.learner.advantage_scale)


def run_hub(
    config: HubConfig,
    progress: bool = True,
    resume: Resume | None = None,
    lock: IO[str] | None = None,
    model: ModelIdentity | None = None,
) -> int:
    """Run the hub until its steps are done or it is interrupted. `lock`: the data dir lock, held until we return.
    `model`: --model's identity as the start's checks read it (None: read here, the embedded default built first)."""
    if resume is not None:
        changed = f"; on resume (--resume-anyway): {', '.join(resume.changed)}" if resume.changed else ""
        print(
            f"echo-hub: resuming the run in {config.data_dir} at step {resume.step}{resume.policy_text()} "
            f"({resume.groups_waiting} groups waiting; task {resume.task}){changed}",
            flush=True,
        )
    setup_logging(config.data_dir / HUB_LOG_FILE, config.log_level, max_mb=config.log_max_mb, backups=config.log_backups)
    # From here on, a line the hub logs for its operator is also printed, and shown in its status.
    warnings = OperatorLines("echo-hub")
    logging.getLogger("echo2.hub").addHandler(warnings)
    import torch
    import transformers

    from hub.cli.summary import print_summary
    from shared.default_model import default_model_dir, ensure_default_model
    from shared.tool_model import embedded_recipe

    torch.set_num_threads(config.learner.threads)
    transformers.utils.logging.disable_progress_bar()  # our own progress display owns the terminal
    asked, config = config, on_this_machine(config)
    announce_device(config.learner.device)
    identity = Identity.load_or_create(config.key_path)
    if model is None:
        recipe = embedded_recipe(config.task)
        if not (built := default_model_dir(recipe=recipe)).is_dir():  # a wait of its own: said, with or without a bar
            print(
                f"echo-hub: building the embedded {recipe.label} ({recipe.warmup_steps} warm-up steps, once: kept in {built})",
                flush=True,
            )
        model = load_model_identity(ensure_default_model(progress=progress and sys.stderr.isatty(), recipe=recipe))
    try:
        hub = Hub(config, identity, model, progress, asked=asked, warnings=warnings)
    except LearnerRankLost as exc:
        print(f"echo-hub: {exc}", file=sys.stderr, flush=True)
        return 1
    failure: BaseException | None = None  # the RewardError that stopped the run
    try:
        with trio_owns_ctrl_c():
            trio.run(hub.run)
    except BaseException as exc:  # noqa: BLE001 - a lost learner rank or a failed reward is handled, the rest re-raised
        lost = found_in(exc, lambda e: isinstance(e, LearnerRankLost))
        if lost is not None:
            return _stop_without_checkpoint(hub, str(lost), "Start it again", code=1)
        if disk_full(exc) is not None:
            where = config.data_dir
            return _stop_without_checkpoint(
                hub, f"the disk of --data-dir {where} is full ({free_space(where)})", "Free some space and start it again", code=2
            )
        failure = found_in(exc, lambda e: isinstance(e, RewardError))
        if failure is None:
            raise
    finally:
        hub.stop_helpers()
    interrupted = hub.stopper.signal_name is not None or failure is not None
    if interrupted:
        _save_stopped_run(hub, failure)
    if hub.watch is not None or rank_env() is not None:
        if isinstance(hub.learner.learner, RankGroup):
            hub.learner.learner.stop()  # the other ranks leave their command loop
        if hub.watch is not None:
            hub.watch.stop()
    hub.state.flush_sync()
    hub.status.refresh_sync()
    hub.trackers.close()
    hub.state.store.close()
    print_summary(config.data_dir, interrupted=interrupted)
    if failure is not None:
        saved = " with a checkpoint" if hub.learner.step > 0 else ""
        print(
            f"echo-hub: {failure}: the run stopped at step {hub.learner.step}{saved} (the traceback is in "
            f"{HUB_LOG_FILE}); start it again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 130 if interrupted else 0


def _save_stopped_run(hub: Hub, failure: BaseException | None) -> None:
    """A run stopped before its last step (Ctrl-C, SIGTERM, the task's reward failing): its checkpoint and policy
    saved, so that starting it again resumes."""
    if failure is None:
        stopped = f"{len(hub.local_nodes)} local nodes stopped; " if hub.local_nodes else ""
        print(f"\necho-hub: {hub.stopper.signal_name}: {stopped}saving state", file=sys.stderr, flush=True)
    hub.learner.save_state()
    hub.status.running = False


def _stop_without_checkpoint(hub: Hub, why: str, how: str, code: int) -> int:
    """A failure after which no checkpoint can be saved (a learner rank died: no collective runs any more; the data
    dir's disk is full): keep what the store holds, close the rest, and say in one line `why` and `how` to go on.
    Each closing write is tried: on a full disk it may fail for that same reason."""
    from hub.training.checkpoint import latest_checkpoint
    from shared.layout import CHECKPOINTS_DIR

    if hub.watch is not None:
        hub.watch.kill()
    hub.status.running = False
    for close in (hub.state.flush_sync, hub.status.refresh_sync, hub.trackers.close, hub.state.store.close):
        try:
            close()
        except Exception as exc:
            if disk_full(exc) is None:
                raise
    checkpoint = latest_checkpoint(hub.config.data_dir / CHECKPOINTS_DIR)
    resume = f"checkpoint step {checkpoint.step}" if checkpoint else "the start (no checkpoint yet)"
    print(
        f"echo-hub: {why}: the run stopped at step {hub.learner.step}. {how} to resume from {resume}; "
        "acknowledged groups are kept.",
        file=sys.stderr,
        flush=True,
    )
    return code


def run_learner_rank(config: HubConfig, env: RankEnv) -> int:
    """Ranks 1..N-1 of a sharded learner: the learner alone, running what rank 0 (the hub) broadcasts."""
    import torch
    import transformers

    from hub.training.learner import Learner
    from shared.default_model import ensure_default_model
    from shared.tool_model import embedded_recipe

    logging.basicConfig(level=config.log_level.upper(), format=f"%(asctime)s rank {env.rank} %(levelname)s %(name)s: %(message)s")
    lc = on_this_machine(config).learner
    torch.set_num_threads(lc.threads)
    transformers.utils.logging.disable_progress_bar()
    # A process of its own reads the model itself (the command line rank 0 was started with names it).
    model = load_model_identity(Path(config.model or ensure_default_model(progress=False, recipe=embedded_recipe(config.task))))
    device = device_for(lc.device, env)
    collective = init_ranks(env, device)
    checkpoint = broadcast(None).checkpoint  # rank 0's choice: every rank must resume the same one
    if checkpoint is not None and not checkpoint.path.is_dir():
        print(
            f"echo-hub learner rank {env.rank}: rank 0 resumes from {checkpoint.path}, which this machine does not "
            "see: the data dir must be on a filesystem every machine mounts",
            file=sys.stderr,
            flush=True,
        )
        return 1
    learner = Learner(model, lc, config.sampling, checkpoint, collective, device)
    try:
        follow(learner)
    except RuntimeError as exc:  # rank 0 (the hub) or another rank went away: nothing to do but leave
        print(f"echo-hub learner rank {env.rank}: the learner group broke ({exc}); leaving", file=sys.stderr, flush=True)
        return 1
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0
