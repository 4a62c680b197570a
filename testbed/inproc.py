"""The real hub service, state and store assembled in-process (tests and bench/p2p.py), built as `echo-hub start`
builds them (hub.cli.build, hub.service.handlers.build_hub_service), with the hub's own Scheduler switched off
(every measured node works) and poked on membership changes as the hub pokes it. A version counter the caller
moves stands in for the learner; the oldest version a lease may be made with is the learner's own rule
(hub.training.loop.LearnerComponent.min_useful_version) run on that counter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

from hub.cli.build import HubCore, build_hub_state
from hub.config import HubConfig, LearnerConfig, LeaseConfig, TrustConfig
from hub.control.scheduler import LearnerTiming, Scheduler
from hub.records.snapshots import SnapshotShelf
from hub.service.handlers import HubService, build_hub_service
from hub.service.state import HubState
from hub.service.status import RunInfo, StatusBoard
from hub.training.loop import LearnerComponent
from shared.crypto import Identity
from shared.layout import SNAPSHOTS_DIR
from shared.messages import SUBMIT_PROTOCOL
from shared.model_identity import load_model_identity
from shared.model_io import build_snapshot
from shared.net import running_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"

# No audits, full-size leases from the first one, limits far above what a test drives; checks in a thread of the
# hub's process (no check workers to spawn: tests of the pool ask for one).
PERMISSIVE_TRUST = TrustConfig(
    audit_rate=0.0,
    audit_first_n=0,
    trusted_after_audits=0,
    max_open_leases_per_peer=64,
    max_open_leases_per_ip=100_000,
    requests_per_s=1e5,
    request_burst=100_000,
    max_streams_per_peer=1024,
    max_connections_per_ip=100_000,
    check_procs=0,
)
# A small hub that trusts everyone: for tests and benches of the protocol, not of the audits.
PERMISSIVE_CONFIG = HubConfig(
    learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=2),
    lease=LeaseConfig(prompts_per_lease=2),
    trust=PERMISSIVE_TRUST,
)


class LearnerAt:
    """Stands in for the learner: at the version the caller puts in `step`, never training, its S never lowered.
    What it answers is LearnerComponent's own code run on these fields (its methods are taken as they are, so a
    change of the rule reaches the tests; a pure function of the leases' window would make this a plain call)."""

    min_useful_version = LearnerComponent.min_useful_version
    takes_served = LearnerComponent.takes_served
    window_staleness = LearnerComponent.window_staleness

    def __init__(self, staleness: int, step: int = 0) -> None:
        self.step = step
        self.training = False
        self.staleness = staleness
        self._grace = (staleness, 0)  # LearnerComponent's (S before a lowering, until which step): none in force


def open_core(data_dir: Path, model_dir: Path, config: HubConfig, shelf: SnapshotShelf, learner: LearnerAt) -> HubCore:
    """The hub's state over DATA_DIR's store, built as `echo-hub start` builds it, its learner `learner`."""
    model = load_model_identity(Path(model_dir))
    return build_hub_state(config.model_copy(update={"data_dir": Path(data_dir)}), model, shelf, learner)


def open_state(data_dir: Path, model_dir: Path, config: HubConfig, shelf: SnapshotShelf, learner: LearnerAt) -> HubState:
    """open_core's HubState alone (tests of the state)."""
    return open_core(data_dir, model_dir, config, shelf, learner).state


@dataclass
class InprocHub:
    identity: Identity
    addr: str
    config: HubConfig
    state: HubState
    shelf: SnapshotShelf
    service: HubService
    config_hash: str
    weights: dict[str, torch.Tensor] | None
    learner: LearnerAt
    board: StatusBoard  # what `echo-hub status`, the dashboards and /metrics read

    @property
    def version(self) -> int:
        """The version the learner is at (the newest published)."""
        return self.learner.step

    def publish(self, version: int) -> None:
        """What the learner does every kappa steps: a new signed snapshot, and the learner is at that version."""
        weights = self.weights if self.weights is not None else {"w": torch.full((4,), float(version))}
        self.shelf.add(build_snapshot(weights, version, self.identity, self.config_hash, self.shelf.directory))
        self.learner.step = version

    def trusted(self) -> tuple:
        """What a misbehaving node must not be able to move: accepted work, money, what the learner will train on."""
        state = self.state
        return (
            state.totals.groups.accepted,
            dict(state.totals.paid_usd),
            len(state.buffer),
            tuple(sorted((n.peer_id, n.tallies.accepted) for n in state.fleet.nodes.values())),
        )


def scheduler_off(config: HubConfig, state: HubState) -> Scheduler:
    """The hub's Scheduler with its capacity model off (every measured node works; the silent are dropped), told of
    every membership change as `echo-hub start` tells it. The learner never steps here: no T_train, no T_bcast."""
    lc = config.learner
    timing = LearnerTiming(
        lc.effective_kappa,
        lc.prompts_per_step * lc.group_size,
        state.measurements,
        staleness=lc.staleness,
        rollouts_per_lease=config.lease.prompts_per_lease * lc.group_size,
    )
    scheduler = Scheduler(config.scheduler.model_copy(update={"enabled": False}), state.fleet, timing, state.membership.set_state)
    state.membership.on_change.append(scheduler.poke)
    return scheduler


@asynccontextmanager
async def inproc_hub(
    data_dir: Path, model_dir: Path, config: HubConfig, identity: Identity | None = None, real_weights: bool = False
) -> AsyncIterator[InprocHub]:
    """Run the hub's service and state on loopback until the block ends. `real_weights`: snapshots carry the
    model's own weights (audits need them), else a small dummy tensor."""
    identity = identity or Identity.generate()
    learner = LearnerAt(config.learner.staleness)
    # As hub/cli/run.py opens it: S + 1 versions at the largest S the run may put in force.
    shelf = SnapshotShelf(keep=config.learner.staleness_bound + 1, directory=Path(data_dir) / SNAPSHOTS_DIR)
    core = open_core(data_dir, model_dir, config, shelf, learner)
    state = core.state
    weights = None
    if real_weights:
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    async with running_host(identity, [LOOPBACK], config.trust.max_connections_per_ip) as (host, addrs):
        status = StatusBoard(
            RunInfo(
                identity.peer_id,
                tuple(addrs),
                0,
                config.learner.staleness,
                config.learner.effective_kappa,
                config.task,
                config.broadcast.mode,
            ),
            data_dir,
            state,
            learner_step=lambda: learner.step,
        )
        service = build_hub_service(
            host, identity, config, state, shelf, status.encoded, core.context_tokens, model_offer=core.model_offer
        )
        hub = InprocHub(identity, addrs[0], config, state, shelf, service, state.model_config_hash, weights, learner, status)
        hub.publish(0)
        try:
            async with trio.open_nursery() as nursery:
                if state.agents is not None:  # a tool-using run's sandbox, as hub/cli/run.py starts it
                    await state.agents.start()
                    nursery.start_soon(state.agents.run)
                for run in (state.run, service.run, scheduler_off(config, state).run):
                    nursery.start_soon(run)
                while SUBMIT_PROTOCOL not in host.get_mux().handlers:
                    await trio.sleep(0.01)
                yield hub
                nursery.cancel_scope.cancel()
        finally:
            if state.agents is not None:
                state.agents.stop()
            state.store.close()


async def wait_state(hub: InprocHub, peer_id: str, state: str, timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while (record := hub.state.fleet.get(peer_id)) is None or record.state != state:
            await trio.sleep(0.01)
