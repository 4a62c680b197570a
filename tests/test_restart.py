"""A hub restarted mid-run shows what it showed: `echo-hub status --json` before and after agree on every
node (those that left included), their tallies and cost, the run totals and the stale drops; a
failed audit after the restart voids only the pay booked since that node's last passed audit; and a lease in flight
when the hub was killed is answered to the restarted hub and paid.

Real processes on loopback: `echo-hub start` (twice, same data dir and port) on a trained policy, two
in-process volunteers built from the node's HubLink and Worker, generating with the real tiny model."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from shared.crypto import Identity
from shared.layout import NODE_LOG_FILE
from shared.messages import HubStatus, SubmitReply
from testbed.fault_scenarios import linked_clients, trained_model_dir
from testbed.harness import HubProc, free_port, node_peer_id, query, start_hub, start_node, stop_all, wait_until

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
# Long enough for a kill, a restart and the node's answer on a busy machine: what the lease test waits at most.
LEASE_TIMEOUT_S = 150.0


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


def test_a_restarted_hub_reopens_the_leases_still_good_on_their_terms(tmp_path):
    """Leasing opens again what an earlier run of the hub granted and did not see answered, on the terms it granted
    (price, probe, the version the node held, its address), while the lease still holds; a lease past its deadline, or
    one whose prompts the task no longer has, is not."""
    from hub.config import HubConfig
    from hub.records.schema import LeaseTerms
    from hub.records.store import Store
    from hub.service.state import HubState
    from shared.tasks.reverse import ReverseTask

    task = ReverseTask(size=64)
    first, second, third = (p.id for p in task.prompts()[:3])
    store = Store(tmp_path / "hub.db")
    store.members.upsert_node("peerA", 0.35, "cpu", 1e8, "hf")
    now = time.time()
    store.leases.add_lease("good", "peerA", [first, second], 3, now - 10, now + 50, LeaseTerms(0.35, False, 4, "10.1.2.3"))
    store.leases.add_lease("lapsed", "peerA", [third], 3, now - 70, now - 10, LeaseTerms(0.35, True, 4, None))
    store.leases.add_lease("other-task", "peerA", ["not-a-prompt"], 3, now - 10, now + 50, LeaseTerms(0.35, False, 4, None))
    store.close()

    state = HubState(Store(tmp_path / "hub.db"), HubConfig(), task)  # a restart on the same store
    assert set(state.leasing.book.open) == {"good"} and state.leasing.holds("peerA")
    lease = state.leasing.book.open["good"]
    assert [p.id for p in lease.prompts] == [first, second] and lease.prompts[0].answer is not None
    assert (lease.min_version, lease.issued_at, lease.deadline) == (3, now - 10, now + 50)
    assert (lease.price_per_hour, lease.probe, lease.held_version, lease.address) == (0.35, False, 4, "10.1.2.3")
    assert state.leasing.book.open_by_address == {"10.1.2.3": 1} and state.leasing.book.outstanding_prompts() == 2
    assert state.store.leases.lease("lapsed").state == "expired"
    assert state.store.leases.lease("other-task").state == "open"  # let go in the book; the sweep expires its row


def test_a_restarted_hub_shelves_its_newest_versions_again_those_whose_files_still_pass(tmp_path):
    """What hub/cli/run.py does at a start: files of versions out of the window go (and a write the crash cut short);
    the newest `keep` versions published go back on the shelf, re-verified (one whose file no longer passes its
    manifest is left off, logged); the learner's publish of the newest again is held once, an older one refused."""
    import torch

    from hub.records.snapshots import SnapshotShelf
    from hub.records.store import Store
    from shared.layout import HUB_STORE_FILE, SNAPSHOTS_DIR
    from shared.model_io import build_snapshot
    from shared.snapshot import read_snapshot_files

    identity, snapshots = Identity.generate(), tmp_path / SNAPSHOTS_DIR
    store = Store(tmp_path / HUB_STORE_FILE)
    for version in range(6):
        built = build_snapshot({"w": torch.full((64,), float(version))}, version, identity, "0" * 64, snapshots)
        store.shelf.add_snapshot(version, str(built.path), built.manifest.whole_hash, built.manifest.total_bytes, 0.0)
    (snapshots / "v00000006.safetensors.tmp").write_bytes(b"a write the crash cut short")
    damaged = snapshots / "v00000004.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x01")

    shelf = SnapshotShelf(keep=4, directory=snapshots)
    window = store.shelf.newest_versions(shelf.keep)
    assert window == [2, 3, 4, 5]
    shelf.prune(set(window))
    assert shelf.reopen(window, identity.peer_id) == [2, 3, 5]
    assert shelf.versions() == [2, 3, 5] and shelf.get(2) is not None and shelf.newest_version() == 5
    assert sorted(p.name for p in snapshots.iterdir()) == [
        f"v{v:08d}.{ext}" for v in window for ext in ("manifest", "safetensors")
    ]
    shelf.add(read_snapshot_files(snapshots, 5, identity.peer_id))  # the learner's first publish: v5 again
    assert shelf.versions() == [2, 3, 5]
    with pytest.raises(ValueError, match="not newer"):
        shelf.add(read_snapshot_files(snapshots, 3, identity.peer_id))
    shelf.close()
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lease_in_flight_when_the_hub_is_killed_is_answered_to_the_restarted_hub_and_paid(tmp_path):
    """SIGKILL the hub while a real node generates for its lease: the node's answer finds no hub, and it sends it again
    until the hub, restarted on the same data dir and port, takes it in and pays it on the lease's terms."""
    toml = tmp_path / "hub.toml"
    toml.write_text(HUB_TOML + f"[lease]\nlease_timeout_s = {LEASE_TIMEOUT_S}\n")
    data, port = tmp_path / "hub", free_port()
    args = (*HUB_ARGS, "--config", str(toml))
    hub = start_hub(data, *args, port=port)
    # A probe lease (one prompt of 4 rollouts) takes the node 4 / 0.2 = 20 s: the hub is killed meanwhile.
    node = start_node(hub.addr, tmp_path / "node", "--max-rollouts-per-s", "0.2")
    node_log = tmp_path / "node" / NODE_LOG_FILE
    try:
        peer = node_peer_id(node)
        found = wait_until(
            lambda: query(data, "SELECT id, issued_at FROM leases WHERE node_id = ? AND state = 'open'", (peer,)),
            120,
            "the node's first lease",
        )
        lease_id, issued_at = found[0]
        hub.kill()
        # The node finishes its answer with no hub to take it, and says it tries again; then the hub comes back.
        wait_until(lambda: "was not delivered" in node_log.read_text(), LEASE_TIMEOUT_S / 2, "the node's failed delivery")
        hub = start_hub(data, *args, port=port)
        restarted_at = query(data, "SELECT MAX(started_at) FROM sessions")[0][0]
        assert issued_at < restarted_at

        def answered():
            return query(data, "SELECT state FROM leases WHERE id = ?", (lease_id,)) == [("answered",)]

        wait_until(answered, LEASE_TIMEOUT_S, "the lease granted before the kill to be answered")
        accepted = query(data, "SELECT COUNT(*) FROM trajectories WHERE lease_id = ? AND verdict = 'accepted'", (lease_id,))
        assert accepted == [(1,)]
        paid = query(data, "SELECT usd, seconds, created_at FROM ledger WHERE lease_id = ? AND node_id = ?", (lease_id, peer))
        assert len(paid) == 1 and paid[0][0] > 0 and paid[0][2] > restarted_at
    finally:
        stop_all([node, hub])
    assert "the hub leases its prompts again" not in node.output(), node.output()[-3000:]


async def _with_client(hub: HubProc, identity: Identity, engine, model_dir: Path, body):
    """A node of node/'s parts (testbed Client) joined to `hub`, holding the version its engine holds (it installs
    nothing from the hub's dir), while `body(client)` runs."""
    from shared.model_io import model_dir_config_hash
    from shared.net import running_host
    from testbed.fault_scenarios import Client

    async with running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, _):
        client = Client(host, identity, hub.addr, engine, model_dir_config_hash(model_dir))
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run_link)
            try:
                return await body(client)
            finally:
                nursery.cancel_scope.cancel()


def _settled(data: Path, lease_id: str) -> list[tuple] | None:
    """The lease's groups once their audit settled them (released, or discarded): (held, discard_reason) each."""
    rows = query(data, "SELECT held, discard_reason FROM trajectories WHERE lease_id = ?", (lease_id,))
    return rows if rows and all(held == 0 or why is not None for held, why in rows) else None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_after_a_kill_older_versions_are_audited_and_paid_and_a_committed_answer_sent_again_gets_its_reply(
    tmp_path, default_model_dir
):
    """Issue 67 item 1, with real hubs on one data dir and port. A hub trains with a local node and is SIGKILLed. Its
    restart audits (and pays) a node on probation whose answer was made with a version older than the newest, as
    before the kill: the newest S + 1 snapshots are back on its shelf. The node sends its committed answer again, as
    when the reply is lost, to this hub and, through the worker's own resend, to the hub restarted after a second
    SIGKILL: each time the reply it got, the ledger's one row, and no refusal counted."""
    from hub.records.buffer import REASON_ZERO_VARIANCE
    from node.hf_engine import HFEngine
    from shared.layout import LOCAL_NODES_DIR, NODE_LOCK_FILE, SNAPSHOTS_DIR
    from shared.snapshot import read_snapshot_files, snapshot_paths

    (tmp_path / "hub.toml").write_text(HUB_TOML)
    data, port = tmp_path / "hub", free_port()
    args = ("--local-nodes", "1", "--steps", "0", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4")
    args += ("--staleness", "2", "--config", str(tmp_path / "hub.toml"))
    hub = start_hub(data, *args, port=port)
    try:
        wait_until(lambda: query(data, "SELECT COUNT(*) FROM snapshots")[0][0] >= 4, 240, "four published versions")
    finally:
        hub.kill()
        local = data / LOCAL_NODES_DIR / "node-0" / NODE_LOCK_FILE
        if local.exists():  # in a session of its own, it outlives the hub: it must not feed the restarted one
            os.kill(int(local.read_text().strip()), signal.SIGKILL)
    # The node held the version before the newest when the hub died (its files copied: before the fix, the restart
    # deleted them).
    older = query(data, "SELECT MAX(version) FROM snapshots")[0][0] - 1
    held = tmp_path / "held"
    held.mkdir()
    for path in snapshot_paths(data / SNAPSHOTS_DIR, older):
        shutil.copy(path, held / path.name)
    # The restarts take no learner step (nor move the version window): 64 groups a step, none coming.
    again = (*args[2:], "--local-nodes", "0", "--prompts-per-step", "64", "--resume-anyway")
    hub = start_hub(data, *again, port=port)
    node = Identity.generate()
    engine = HFEngine(default_model_dir)
    hub_id = hub.addr.rsplit("/p2p/", 1)[1]
    engine.install(read_snapshot_files(held, older, hub_id).path, older)
    replies: list[object] = []

    async def body(client) -> None:
        nonlocal hub
        lease = await client.take_lease()
        assert lease.min_version <= older, (lease.min_version, older)
        submission = client.submission(lease, await client.groups(lease))
        replies.append(await client.submit(submission, deadline=trio.current_time() + lease.deadline_s))
        settled = await trio.to_thread.run_sync(lambda: wait_until(lambda: _settled(data, lease.lease_id), 60, "the audit"))
        # Audited with v{older} and released to the buffer (which may skip a group of equal rewards), not discarded.
        assert {why for _, why in settled} <= {None, REASON_ZERO_VARIANCE}, settled
        replies.append(await client.submit(submission))  # its reply lost: sent again
        await trio.to_thread.run_sync(hub.kill)
        hub = await trio.to_thread.run_sync(lambda: start_hub(data, *again, port=port))
        # The worker's own resend: it rejoins the restarted hub, which no longer knows it, and sends the answer again.
        replies.append(await client.worker._deliver(submission, trio.current_time() + 120))
        replies.append(lease.lease_id)

    try:
        trio.run(_with_client, hub, node, engine, default_model_dir, body)
    finally:
        hub.stop(signal.SIGINT)
    first, *resent, lease_id = replies
    assert isinstance(first, SubmitReply) and first.accepted == 1 and first.paid_s > 0, first
    assert resent == [first, first]
    assert query(data, "SELECT audits_passed, refused FROM nodes WHERE peer_id = ?", (node.peer_id,)) == [(1, 0)]
    paid = query(data, "SELECT usd, seconds, voided FROM ledger WHERE lease_id = ?", (lease_id,))
    assert paid == [(pytest.approx(first.paid_usd), pytest.approx(first.paid_s), 0)], paid
