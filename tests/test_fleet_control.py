"""Cost-aware activation end to end: a real hub and real `echo-node join` processes whose speeds
(`--max-rollouts-per-s`) and declared prices differ.

Nodes, cheapest per unit of throughput first:
  F  unthrottled (batch-128 leases: several times the learner's speed), $0.40/h
  S1 throttled to 20 rollouts/s, $0.05/h
  S2 throttled to 30 rollouts/s, $1.60/h
  Z  throttled to 50 rollouts/s, $50/h

S1, S2 and Z join first and all work: together they stay far below the target. F joins: the
hub activates it (cheapest), and since the pool now keeps the target with margin without them,
releases the priciest nodes one by one (Z, S2, S1) and keeps F. Standby nodes keep receiving
snapshots and earn nothing. F is then killed: it stops heartbeating, the hub drops it and
activates standby nodes cheapest first (S1, then S2 and Z as long as the pool stays below target).

Why this does not depend on the machine's speed: the target tracks the learner's speed, and so
does F's (both are single-threaded CPU work on the same model). F's batch-128 leases make it
1.6x (machine at load 8 on 2 cores) to 4x (idle machine) the learner's speed; gamma = 1.0,
release_margin = 0.1 and a KL term (beta > 0: a reference forward pass per step) put
target * (1 + margin) at about 0.9x the learner's speed without it. The throttled nodes are a
few percent of a core and far below the target. Heavy load moves the target, not the outcome.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shared.messages import HubStatus
from testbed.harness import HubProc, Proc, node_peer_id, query, start_hub, start_node

HEARTBEAT_TIMEOUT_S = 5.0
NODE_START_S = 240.0
WAIT_S = 240.0
# name -> (price $/h, --max-rollouts-per-s or None for unthrottled)
FLEET = {"F": (0.40, None), "S1": (0.05, 20.0), "S2": (1.60, 30.0), "Z": (50.0, 50.0)}

HUB_TOML = f"""
steps = 0
local_nodes = 0
[learner]
staleness = 8
prompts_per_step = 1
group_size = 128
checkpoint_every = 100000
beta = 0.05
[lease]
prompts_per_lease = 1
lease_timeout_s = 30
[scheduler]
max_price_per_hour = 100.0
gamma = 1.0
control_period_s = 0.5
release_margin = 0.1
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}
"""


LEASE_SETTLE_S = 40.0  # > lease_timeout_s: by then a lease is answered or expired


def describe(status: HubStatus | None, names: dict[str, str]) -> str:
    if status is None:
        return "no status.json"
    head = (
        f"step {status.step} mu_pool {status.mu_pool} mu_min {status.mu_min} mu_target {status.mu_target} "
        f"T_train {status.t_train_s} T_bcast {status.t_bcast_s}"
    )
    lines = [head]
    for n in status.nodes:
        lines.append(
            f"  {names.get(n.peer_id, n.peer_id[-6:])}: {n.state} {n.rollouts_per_s:.1f}/s "
            f"${n.price_per_hour}/h v{n.version_held} accepted {n.tallies.accepted} cost {n.cost_usd:.6f}"
            + (" too slow" if n.too_slow else "")
        )
    for e in reversed(status.events[:40]):
        lines.append(f"  event {e.kind} {names.get(e.node_id or '', '-')}: {e.detail}")
    return "\n".join(lines)


def wait_for(hub: HubProc, names: dict[str, str], predicate, what: str, timeout_s: float = WAIT_S) -> HubStatus:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        if hub.process.poll() is not None:
            raise AssertionError(f"hub exited with {hub.process.returncode}:\n{hub.output()[-3000:]}")
        status = hub.status()
        if status is not None and predicate(status):
            return status
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{describe(status, names)}")


def states(status: HubStatus) -> dict[str, str]:
    return {n.peer_id: n.state for n in status.nodes}


def node(status: HubStatus, peer_id: str):
    return next(n for n in status.nodes if n.peer_id == peer_id)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cost_aware_activation_standby_and_replacement(tmp_path: Path):
    config = tmp_path / "hub.toml"
    config.write_text(HUB_TOML)
    hub = start_hub(tmp_path / "hub", "--config", str(config))
    procs: dict[str, Proc] = {}
    try:
        for name in ("S1", "S2", "Z"):
            price, throttle = FLEET[name]
            procs[name] = start_node(hub.addr, tmp_path / name, "--max-rollouts-per-s", str(throttle), price=price)
        ids = {name: node_peer_id(proc, timeout_s=NODE_START_S) for name, proc in procs.items()}
        names = {peer: name for name, peer in ids.items()}
        s1, s2, z = ids["S1"], ids["S2"], ids["Z"]
        # (On a very slow machine the target can fall so low that the priciest of them, Z and
        # then S2, go back to standby before F arrives; S1, the cheapest, keeps working.)
        wait_for(
            hub,
            names,
            lambda s: (
                s.mu_target is not None
                and states(s).get(s1) == "active"
                and states(s).get(s2) in ("active", "standby")
                and states(s).get(z) in ("active", "standby")
            ),
            "the slow nodes to work and a measured target",
        )
        procs["F"] = start_node(hub.addr, tmp_path / "F", price=FLEET["F"][0])
        f = ids["F"] = node_peer_id(procs["F"], timeout_s=NODE_START_S)
        names[f] = "F"

        def settled(s: HubStatus) -> bool:
            return [states(s).get(p) for p in (f, s1, s2, z)] == ["active"] + ["standby"] * 3

        status = wait_for(hub, names, settled, "F active alone, S1, S2, Z on standby")
        detail = describe(status, names)
        events = [(names.get(e.node_id or ""), e.kind, e.detail) for e in reversed(status.events)]
        joined = min(i for i, (n, k, _) in enumerate(events) if n == "F" and k == "join")
        assert [n for n, k, _ in events[joined:] if k == "activate"] == ["F"], detail
        # the surplus went back to standby, priciest first, each with its reason
        releases = [(n, d) for n, k, d in events[joined:] if k == "release"]
        assert [n for n, _ in releases] in (["Z", "S2", "S1"], ["S2", "S1"], ["S1"]), detail
        assert all("target with margin" in d for _, d in releases), detail
        # Each release kept the target with its margin as measured then (the rule's own check, its reason says so);
        # measured since (a busy machine slows F), the pool may drift within the margin, the hysteresis band, but not
        # under the target, which would buy a node back.
        assert status.mu_pool >= status.mu_target, detail

        # Standby: connected, keeps receiving snapshots, gets no leases, accrues no cost. A lease
        # it held when it was released may still be answered (and paid: it did what it was told; one
        # lease is 128 rollouts, over 4 s at S2's 30/s), so the count is taken once the store shows
        # none open for it and the status has caught up.
        deadline = time.monotonic() + LEASE_SETTLE_S
        while query(hub.data_dir, "SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = 'open'", (s2,))[0][0]:
            assert time.monotonic() < deadline, f"S2 still holds a lease {LEASE_SETTLE_S:g}s after its release"
            time.sleep(0.3)
        settled_at = time.time()
        status = wait_for(hub, names, lambda s: s.updated_at > settled_at, "a status after S2's last lease")
        before = node(status, s2)
        newest = status.version
        status = wait_for(
            hub,
            names,
            lambda s: s.version > newest and node(s, s2).version_held >= s.version - 1,
            "the standby node to hold a newer snapshot",
        )
        after = node(status, s2)
        assert after.state == "standby", describe(status, names)
        assert (after.tallies, after.cost_usd) == (before.tallies, before.cost_usd), describe(status, names)

        procs["F"].kill()
        # Together the standby nodes fall short of the target: each is wanted, the cheapest first. One whose groups all
        # came late at its measured rate (a busy machine starves a throttled node) is the rule's own exception: held
        # back, and the status says so.
        status = wait_for(
            hub,
            names,
            lambda s: (
                states(s).get(f) == "gone"
                and any(states(s).get(p) == "active" for p in (s1, s2, z))
                and all(states(s).get(p) == "active" or node(s, p).too_slow for p in (s1, s2, z))
            ),
            "F dropped and the standby nodes activated",
            timeout_s=HEARTBEAT_TIMEOUT_S + 60,
        )
        detail = describe(status, names)
        events = [(names.get(e.node_id or ""), e.kind, e.detail) for e in reversed(status.events)]
        leave = max(i for i, (n, k, _) in enumerate(events) if n == "F" and k == "leave")
        assert events[leave][2] == f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g}s", detail
        activated = [(n, d) for n, k, d in events[leave:] if k == "activate"]
        held = {names[p] for p in (s1, s2, z) if node(status, p).too_slow}
        # cheapest standby first, each because the pool was below target
        assert [n for n, _ in activated] == [n for n in ("S1", "S2", "Z") if n not in held][: len(activated)], detail
        assert activated and all("below target" in d for _, d in activated), detail
    finally:
        for proc in procs.values():
            proc.kill()
        hub.stop()
