"""The main job end to end: `echo-hub start --local-nodes 2 --steps N` as a user runs it, with the
dashboard attached to the live hub over libp2p and, afterwards, to the finished data dir."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from shared.layout import HUB_STORE_FILE
from shared.messages import NodeView
from testbed.harness import start_hub
from tui.hub_app import HubDashboard
from tui.sources import DataDirSource, HubSource

STEPS = 8
STALENESS = 3


def table_peers(app) -> list[str]:
    from textual.widgets import DataTable

    table = app.query_one(DataTable)
    return [str(key.value) for key in table.rows]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_echo_hub_start_trains_with_local_nodes_and_the_dashboard_follows(tmp_path: Path) -> None:
    data = tmp_path / "data"
    hub = start_hub(
        data,
        "--local-nodes",
        "2",
        "--steps",
        str(STEPS),
        "--staleness",
        str(STALENESS),
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
    )
    try:
        # The dashboard against the running hub's status protocol: the real nodes show up.
        app = HubDashboard(HubSource(hub.addr, timeout_s=5.0), refresh_s=0.5)
        async with app.run_test(size=(120, 40)) as pilot:
            await app.loaded.wait()
            for _ in range(240):
                await pilot.pause(0.25)
                if len(table_peers(app)) == 2:
                    break
            assert len(table_peers(app)) == 2, "the two local nodes never appeared on the dashboard"
        assert hub.process.wait(timeout=300) == 0, hub.output()[-3000:]
    finally:
        hub.kill()

    rows = [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["version"] for r in rows] == sorted(r["version"] for r in rows)
    assert max(r["staleness_max"] for r in rows) <= STALENESS
    status = hub.status()
    assert status is not None and not status.running and status.step == STEPS
    assert len(status.nodes) == 2 and all(n.tallies.accepted > 0 for n in status.nodes)
    assert "learner steps" in hub.output() and "final policy" in hub.output()

    # Each volunteer kept its own view (what `echo-node join --dashboard` shows).
    views = [NodeView.model_validate_json(p.read_text()) for p in sorted(data.glob("nodes/node-*/node_status.json"))]
    assert len(views) == 2 and all(v.tallies.accepted > 0 and v.earnings_usd > 0 and v.version_held >= 0 for v in views)

    # The final policy loads like any Hugging Face model.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from transformers import AutoModelForCausalLM as M; "
            "m = M.from_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))",
            str(data / "final"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0 and int(probe.stdout.strip().splitlines()[-1]) > 0, probe.stderr[-2000:]

    # And the dashboard on the finished data dir.
    app = HubDashboard(DataDirSource(data), refresh_s=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        assert sorted(table_peers(app)) == sorted(n.peer_id for n in status.nodes)

    report = subprocess.run(
        [sys.executable, "-m", "hub.cli", "report", "--data-dir", str(data)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0 and (data / "report.png").stat().st_size > 10_000, report.stderr


@pytest.mark.slow
def test_invalid_combinations_are_refused_with_the_reason(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hub.cli", "start", "--staleness", "2", "--kappa", "3", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "kappa" in result.stderr and "S-1" in result.stderr or "kappa must satisfy" in result.stderr


@pytest.mark.slow
def test_data_dir_of_another_schema_is_refused_with_the_reason(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / HUB_STORE_FILE)
    old.execute("CREATE TABLE nodes (peer_id TEXT PRIMARY KEY, accepted INTEGER)")
    old.commit()
    old.close()
    result = subprocess.run(
        [sys.executable, "-m", "hub.cli", "start", "--local-nodes", "0", "--no-progress", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "schema 0" in result.stderr and "another --data-dir" in result.stderr and "--fresh" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_is_fast_and_imports_no_torch() -> None:
    for module in ("hub.cli.main", "node.cli"):
        code = (
            f"import sys, {module} as m\n"
            "try:\n    m.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported before --help'\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout


def test_a_mistake_is_refused_before_torch_or_libp2p_is_imported(tmp_path: Path) -> None:
    """A mistake costs one interpreter start-up and the config's models (~0.4 s), not torch's or libp2p's import."""
    for module, argv, word in (
        ("hub.cli.main", ["start", "--kappa", "0", "--data-dir", str(tmp_path / "data")], "kappa"),
        ("node.cli", ["join", "--hub", "x", "--data-dir", str(tmp_path / "data")], "hub address"),
    ):
        code = (
            f"import sys, {module} as m\n"
            f"code = m.main({argv!r})\n"
            "assert 'torch' not in sys.modules, 'torch imported before the mistake was refused'\n"
            "assert 'libp2p' not in sys.modules, 'libp2p imported before the mistake was refused'\n"
            "sys.exit(code)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert word in result.stderr and not (tmp_path / "data").exists()


def test_local_nodes_are_forked_from_one_node_server_and_stop_on_sigint(tmp_path: Path) -> None:
    """Local nodes run `echo-node join` in processes forked from the node server (not from this process),
    each in its own session writing its own node.out, and exit 0 when the hub stops them."""
    from hub.cli.local_nodes import spawn_local_nodes, start_node_server, stop_local_nodes
    from shared.crypto import Identity
    from testbed.harness import free_port, wait_until

    start_node_server()
    nobody = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"  # the nodes keep retrying
    nodes = spawn_local_nodes(2, nobody, tmp_path)
    try:
        for node in nodes:
            out = node.data_dir / "node.out"
            wait_until(
                lambda out=out: "unreachable" in (out.read_text() if out.exists() else ""),
                120,
                f"{out} to say the hub is unreachable",
            )
            assert f"echo-node {node.peer_id} joining {nobody}" in out.read_text()
            assert os.getsid(node.process.pid) == node.process.pid
        parents = {int(Path(f"/proc/{n.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for n in nodes}
        assert len(parents) == 1 and os.getpid() not in parents, parents
    finally:
        stop_local_nodes(nodes)
    assert [n.process.exitcode for n in nodes] == [0, 0], [n.data_dir.joinpath("node.out").read_text() for n in nodes]


def test_a_local_node_stops_when_its_hub_is_killed(tmp_path: Path) -> None:
    """SIGKILL the process that spawned a local node (a stand-in for the hub): the node stops on its own."""
    from testbed.harness import wait_until

    code = (
        "import sys, time\n"
        "from hub.cli.local_nodes import spawn_local_nodes, start_node_server\n"
        "from shared.crypto import Identity\n"
        "start_node_server()\n"
        f"(node,) = spawn_local_nodes(1, '/ip4/127.0.0.1/tcp/9/p2p/' + Identity.generate().peer_id, {str(tmp_path)!r})\n"
        "print(node.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    hub = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(hub.stdout.readline())
        out = tmp_path / "nodes" / "node-0" / "node.out"
        wait_until(lambda: "unreachable" in (out.read_text() if out.exists() else ""), 120, "the node to run")
        hub.kill()
        hub.wait()

        def gone() -> bool:
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        wait_until(gone, 30, f"node {pid} to stop after its hub was killed")
        assert "stopped (SIGINT)" in out.read_text()
    finally:
        hub.kill()


@pytest.mark.slow
def test_echo_hub_start_with_a_model_dir_gives_its_local_nodes_that_model(tmp_path: Path) -> None:
    """`--model DIR` with local nodes: each spawned node loads DIR too (a Qwen3 here, another config hash
    than the embedded default's), so every join is accepted and the run finishes its steps."""
    from testbed.models import random_model_dir

    model = random_model_dir(tmp_path / "my-model", "qwen3", hidden=64, layers=2)
    # A random model scores 0 on every prompt: train on zero-variance groups too, or no step would ever come.
    (tmp_path / "hub.toml").write_text("[learner]\nskip_zero_variance = false\n")
    data = tmp_path / "data"
    hub = start_hub(
        data,
        "--model",
        str(model),
        "--local-nodes",
        "2",
        "--steps",
        "3",
        "--config",
        str(tmp_path / "hub.toml"),
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--max-new-tokens",
        "10",
    )
    try:
        assert hub.process.wait(timeout=300) == 0, hub.output()[-3000:]
    finally:
        hub.kill()
    assert "echo-hub: your own model: TRL's defaults --lr 1e-06 (" in hub.output()
    status = hub.status()
    assert status is not None and status.step == 3
    # Joined (a refused node never shows in the status) and their work trained the model; on a busy machine
    # the first node may finish the three steps before the second has loaded its model.
    assert 1 <= len(status.nodes) <= 2 and sum(n.tallies.accepted for n in status.nodes) >= 3 * 4
    assert "model config differs" not in hub.output()
    # Retention: the snapshots of the last S + 1 versions at most, each written once.
    snapshot_files = sorted(p.name for p in (data / "snapshots").iterdir())
    assert all(name.startswith("v") for name in snapshot_files) and len(snapshot_files) <= 2 * (4 + 1)
