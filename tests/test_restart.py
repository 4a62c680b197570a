"""A hub restarted mid-run shows what it showed: `echo-hub status --json` before and after agree on every
node (those that left included), their tallies and cost, the run totals and the stale drops; and a
failed audit after the restart voids only the pay booked since that node's last passed audit.

Real processes on loopback: `echo-hub start` (twice, same data dir and port) on a trained policy, two
in-process volunteers built from the node's HubLink and Worker, generating with the real tiny model."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from shared.crypto import Identity
from shared.messages import HubStatus
from testbed.fault_scenarios import linked_clients, trained_model_dir
from testbed.harness import HubProc, free_port, query, start_hub, wait_until

HUB_TOML = """
[scheduler]
heartbeat_period_s = 0.5
heartbeat_timeout_s = 2.0
control_period_s = 1.0
"""
HUB_ARGS = (
    "--local-nodes",
    "0",
    "--steps",
    "0",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-new-tokens",
    "8",
    "--staleness",
    "2",
)
HONEST_ROUNDS = 3


def echo_hub_status(*where: str) -> HubStatus:
    out = subprocess.run(
        [sys.executable, "-m", "hub.cli", "status", "--json", *where], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return HubStatus.model_validate_json(out.stdout)


def comparable(status: HubStatus) -> dict:
    """What must survive a restart exactly."""
    return {
        "nodes": {n.peer_id: (n.state, n.tallies, round(n.cost_usd, 12), n.price_per_hour) for n in status.nodes},
        "totals": status.totals,
        "dropped_stale": status.dropped_stale,
    }


async def volunteers(hub: HubProc, engine, model_dir: Path, identities: list[Identity], body):
    """Nodes with these identities (node/'s HubLink and Worker), joined to `hub` while `body(clients)` runs; then
    they go silent."""
    async with linked_clients(hub, [(identity, engine, model_dir) for identity in identities]) as clients:
        return await body(clients)


def wait_gone(hub: HubProc, peers: list[str]) -> HubStatus:
    def gone():
        status = hub.status()
        states = {n.peer_id: n.state for n in status.nodes} if status else {}
        return status if all(states.get(p) == "gone" for p in peers) else None

    return wait_until(gone, 30, "the volunteers to be dropped as gone")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_restarted_hub_shows_the_same_books_and_voids_only_pay_since_the_last_passed_audit(tmp_path, default_model_dir):
    import torch

    from node.hf_engine import HFEngine

    torch.set_num_threads(1)
    trained = trained_model_dir(default_model_dir, tmp_path / "trained")
    engine = HFEngine(trained)
    (tmp_path / "hub.toml").write_text(HUB_TOML)
    data, port = tmp_path / "hub", free_port()
    args = (*HUB_ARGS, "--model", str(trained), "--config", str(tmp_path / "hub.toml"))
    worker, leaver = Identity.generate(), Identity.generate()

    # -- first run: both volunteers work (every submission audited: they are on probation), then leave.
    hub = start_hub(data, *args, port=port)
    try:

        async def work(clients) -> None:
            a, b = clients
            for _ in range(HONEST_ROUNDS):
                assert await a.honest_round() == 0
            assert await b.honest_round() == 0

        trio.run(volunteers, hub, engine, trained, [worker, leaver], work)
        wait_gone(hub, [worker.peer_id, leaver.peer_id])
        wait_until(
            lambda: query(data, "SELECT audits_passed FROM nodes WHERE peer_id = ?", (worker.peer_id,))[0][0] >= HONEST_ROUNDS,
            30,
            "the worker's audits",
        )
    finally:
        assert hub.stop(signal.SIGINT) in (0, 130)
    before = echo_hub_status("--data-dir", str(data))
    assert {worker.peer_id, leaver.peer_id} <= {n.peer_id for n in before.nodes}
    paid_before = {n.peer_id: n.cost_usd for n in before.nodes}
    assert paid_before[worker.peer_id] > 0 and paid_before[leaver.peer_id] > 0

    # -- second run on the same data dir: the same books, live over the status protocol.
    restarted_at = time.time()
    hub = start_hub(data, *args, port=port)
    try:
        # Live over the status protocol, asked with the hub's own key (anyone else sees prices and costs hidden).
        after = echo_hub_status("--hub", hub.addr, "--key", str(data / "hub.key"))
        assert comparable(after) == comparable(before)
        learner_s = (time.time() - restarted_at) * 3.06 / 3600 + 1e-9
        assert before.cost_usd <= after.cost_usd <= before.cost_usd + learner_s
        assert before.all_on_cost_usd <= after.all_on_cost_usd <= before.all_on_cost_usd + learner_s

        # The worker comes back and lies about its log-probs: still on probation, so the audit catches it at once.
        rng = random.Random(3)

        async def lie(lease, groups):
            return tuple(
                g.model_copy(
                    update={
                        "completions": tuple(
                            c.model_copy(update={"logprobs": tuple(min(0.0, lp + rng.uniform(-0.5, 0.5)) for lp in c.logprobs)})
                            for c in g.completions
                        )
                    }
                )
                for g in groups
            )

        async def cheat(clients) -> None:
            (a,) = clients
            await a.worker.work(await a.take_lease(), rewrite=lie)

        trio.run(volunteers, hub, engine, trained, [worker], cheat)
        banned = wait_until(
            lambda: (
                (s := hub.status()) and next((n for n in s.nodes if n.peer_id == worker.peer_id and n.state == "banned"), None)
            ),
            30,
            "the ban",
        )
        # Only the lie's pay is voided: everything up to its last passed audit (before the restart) stands.
        assert banned.cost_usd == pytest.approx(paid_before[worker.peer_id], rel=1e-9)
        voided = query(data, "SELECT COUNT(*), MIN(created_at) FROM ledger WHERE node_id = ? AND voided = 1", (worker.peer_id,))[
            0
        ]
        assert voided[0] == 1 and voided[1] > restarted_at
        events = [json.dumps(e.model_dump()) for e in hub.status().events if e.kind == "audit_fail"]
        assert len(events) == 1 and worker.peer_id in events[0]
    finally:
        hub.stop(signal.SIGINT)
