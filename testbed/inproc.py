"""The real hub service, state and store assembled in-process (tests and bench/p2p.py), built as `echo-hub start`
builds them (hub.cli.build, hub.service.handlers.build_hub_service); a version counter the caller moves stands
in for the learner, and a tiny control loop for the scheduler: the scheduler's own policy, switched off
(hub.control.policy.decide: measured nodes are activated)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from hub.cli.build import HubCore, build_hub_state
from hub.config import HubConfig, LearnerConfig, LeaseConfig, SchedulerConfig, TrustConfig
from hub.control.policy import decide, fleet_view
from hub.records.snapshots import SnapshotShelf
from hub.service.handlers import HubService, build_hub_service
from hub.service.state import HubState
from hub.service.status import NO_CAPACITY, RunInfo, StatusBoard
from shared.crypto import Identity
from shared.layout import SNAPSHOTS_DIR
from shared.messages import SUBMIT_PROTOCOL
from shared.model_io import build_snapshot
from shared.net import running_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ACTIVATE_PERIOD_S = 0.02

# No audits, full-size leases from the first one, limits far above what a test drives; checks in a thread of the
# hub's process (no check workers to spawn: tests of the pool ask for one).
PERMISSIVE_TRUST = TrustConfig(
    audit_rate=0.0, audit_first_n=0, trusted_after_audits=0, max_open_leases_per_peer=64, max_open_leases_per_ip=100_000,
    requests_per_s=1e5, request_burst=100_000, max_streams_per_peer=1024, max_connections_per_ip=100_000,
    check_procs=0,
)
# A small hub that trusts everyone: for tests and benches of the protocol, not of the audits.
PERMISSIVE_CONFIG = HubConfig(
    learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=2),
    lease=LeaseConfig(prompts_per_lease=2),
    trust=PERMISSIVE_TRUST,
)


def open_core(data_dir: Path, model_dir: Path, config: HubConfig, shelf: SnapshotShelf, version: list[int]) -> HubCore:
    """The hub's state over DATA_DIR's store, built as `echo-hub start` builds it, its learner at `version[0]`."""
    staleness = config.learner.staleness
    return build_hub_state(config.model_copy(update={"data_dir": Path(data_dir)}), Path(model_dir), shelf,
                           lambda: max(0, version[0] - staleness))


def open_state(data_dir: Path, model_dir: Path, config: HubConfig, shelf: SnapshotShelf, version: list[int]) -> HubState:
    """open_core's HubState alone (tests of the state)."""
    return open_core(data_dir, model_dir, config, shelf, version).state


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
    version: list[int] = field(default_factory=lambda: [0])

    def publish(self, version: int) -> None:
        """What the learner does every kappa steps: a new signed snapshot, and the learner is at that version."""
        weights = self.weights if self.weights is not None else {"w": torch.full((4,), float(version))}
        self.shelf.add(build_snapshot(weights, version, self.identity, self.config_hash, self.shelf.directory))
        self.version[0] = version

    def trusted(self) -> tuple:
        """What a misbehaving node must not be able to move: accepted work, money, what the learner will train on."""
        state = self.state
        return (
            state.totals.groups.accepted, dict(state.totals.paid_usd), len(state.buffer),
            tuple(sorted((n.peer_id, n.tallies.accepted) for n in state.fleet.nodes.values())),
        )


async def _activate_measured(state: HubState, config: SchedulerConfig) -> None:
    """The scheduler's policy with the scheduler off: every measured node works (no capacity model, no drops)."""
    off = config.model_copy(update={"enabled": False})
    while True:
        decision = decide(fleet_view(state.fleet), NO_CAPACITY, off, {}, time.time())
        for move in decision.moves:
            await state.set_state(state.fleet.get(move.node), move.state, move.reason)
        await trio.sleep(ACTIVATE_PERIOD_S)


@asynccontextmanager
async def inproc_hub(
    data_dir: Path, model_dir: Path, config: HubConfig, identity: Identity | None = None, real_weights: bool = False
) -> AsyncIterator[InprocHub]:
    """Run the hub's service and state on loopback until the block ends. `real_weights`: snapshots carry the
    model's own weights (audits need them), else a small dummy tensor."""
    identity = identity or Identity.generate()
    version = [0]
    shelf = SnapshotShelf(keep=config.learner.staleness + 1, directory=Path(data_dir) / SNAPSHOTS_DIR)
    core = open_core(data_dir, model_dir, config, shelf, version)
    state = core.state
    weights = None
    if real_weights:
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    async with running_host(identity, [LOOPBACK], config.trust.max_connections_per_ip) as (host, addrs):
        status = StatusBoard(
            RunInfo(identity.peer_id, tuple(addrs), 0, config.learner.staleness, config.learner.effective_kappa,
                    config.task, config.broadcast.mode),
            data_dir, state, learner_step=lambda: version[0],
        )
        service = build_hub_service(host, identity, config, state, shelf, status.encoded, core.context_tokens,
                                    model_offer=core.model_offer)
        hub = InprocHub(identity, addrs[0], config, state, shelf, service, state.model_config_hash, weights, version)
        hub.publish(0)
        try:
            async with trio.open_nursery() as nursery:
                for run in (state.run, service.run):
                    nursery.start_soon(run)
                nursery.start_soon(_activate_measured, state, config.scheduler)
                while SUBMIT_PROTOCOL not in host.get_mux().handlers:
                    await trio.sleep(0.01)
                yield hub
                nursery.cancel_scope.cancel()
        finally:
            state.store.close()


async def wait_state(hub: InprocHub, peer_id: str, state: str, timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while (record := hub.state.fleet.get(peer_id)) is None or record.state != state:
            await trio.sleep(0.01)

