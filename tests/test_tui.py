"""Dashboards (tui/): data sources, the hub and node apps driven by Textual's pilot, a real libp2p status server, screenshots."""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
import trio
from pydantic import ValidationError
from textual.widgets import DataTable, HelpPanel, ProgressBar, Static

from node.cli import main as node_cli
from shared.crypto import Identity
from shared.messages import (
    STATUS_PROTOCOL,
    EvalPoint,
    EventRecord,
    HubStatus,
    Leader,
    NodeStatus,
    NodeView,
    Reject,
    RejectCode,
    StatusRequest,
    StepPoint,
    Tallies,
    ToolTotals,
)
from shared.net import running_host, set_handler
from shared.wire import read_message, write_message
from testbed.harness import free_port
from tui import DEFAULT_REFRESH_S
from tui.cli import add_dashboard_arguments, build_dashboard, run_dashboard, run_node_dashboard
from tui.hub_app import HIDDEN, HubDashboard, cost_per_rollout, cost_text, display_state, node_row, rho, warnings_text
from tui.node_app import NodeDashboard
from tui.sources import DataDirSource, HubSource, NoStatus, Unreachable
from tui.widgets import Banner, short_id

NODE_IDS = [Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3)]
HUB_IDENTITY = Identity.from_seed(bytes([9]) * 32)
NO_AUTO_REFRESH_S = 3600.0


def hub_status(step: int = 10, now: float | None = None, running: bool = True) -> HubStatus:
    """3 nodes in 2 chains, 10 history points, events: the shape a mid-run hub writes."""
    now = time.time() if now is None else now
    a, b, c = NODE_IDS
    nodes = (
        NodeStatus(
            peer_id=a,
            state="active",
            price_per_hour=0.35,
            rollouts_per_s=2.0,
            version_held=step,
            tallies=Tallies(accepted=640, rejected=3, late=9),
            cost_usd=0.41,
            backend="hf",
            hardware="RTX 5090",
            chain=0,
            chain_position=0,
        ),
        NodeStatus(
            peer_id=b,
            state="active",
            price_per_hour=0.50,
            rollouts_per_s=1.6,
            version_held=step - 1,
            receiving_version=step,
            chunks_received=7,
            tallies=Tallies(accepted=512),
            cost_usd=0.55,
            backend="hf",
            chain=0,
            chain_position=1,
        ),
        NodeStatus(
            peer_id=c,
            state="standby",
            price_per_hour=3.06,
            rollouts_per_s=4.0,
            version_held=step,
            tallies=Tallies(accepted=128, rejected=12, late=2, refused=5),
            cost_usd=0.12,
            backend="vllm",
            chain=1,
            chain_position=0,
        ),
    )
    history = tuple(
        StepPoint(
            step=i,
            version=i,
            reward_mean=0.1 + 0.05 * i,
            staleness_mean=1.0 + (i % 3) * 0.5,
            bubble=0.02,
            t_train_s=12.0,
            t_idle_s=0.3,
        )
        for i in range(step - 9, step + 1)
    )
    events = (
        EventRecord(at=now - 60, kind="join", node_id=a, detail="RTX 5090 at $0.35/h"),
        EventRecord(at=now - 58, kind="join", node_id=b, detail="joined-b"),
        EventRecord(at=now - 50, kind="activate", node_id=a, detail="activated-a"),
        EventRecord(at=now - 40, kind="snapshot", detail=f"v{step} published"),
        EventRecord(at=now - 20, kind="ban", node_id=c, detail="banned-c reward mismatch"),
    )
    return HubStatus(
        hub_id=HUB_IDENTITY.peer_id,
        addrs=(f"/ip4/127.0.0.1/tcp/4001/p2p/{HUB_IDENTITY.peer_id}",),
        running=running,
        updated_at=now,
        step=step,
        steps_target=100,
        version=step,
        staleness=4,
        kappa=3,
        task="arith",
        nodes=nodes,
        chains=((a, b), (c,)),
        open_leases=2,
        totals=Tallies(accepted=1280, rejected=15, late=11, refused=5),
        dropped_stale=4,
        reward_mean=0.6,
        t_train_s=12.1,
        t_bcast_s=4.2,
        bubble=0.03,
        predicted_bubble=0.02,
        mu_pool=3.6,
        mu_min=3.0,
        mu_target=3.3,
        usable_fraction=0.57,
        cost_usd=1.08,
        cost_per_step_usd=0.108,
        all_on_cost_usd=2.5,
        history=history,
        events=events,
        evals=(
            EvalPoint(step=5, reward=0.25, pass_at_1=0.25, pass_at_k=0.5, k=4, prompts=64, seconds=1.0),
            EvalPoint(step=10, reward=0.375, pass_at_1=0.375, pass_at_k=0.625, k=4, prompts=64, seconds=1.0),
        ),
    )


def node_view(now: float | None = None) -> NodeView:
    now = time.time() if now is None else now
    return NodeView(
        peer_id=NODE_IDS[1],
        hub_addr=f"/ip4/127.0.0.1/tcp/4001/p2p/{HUB_IDENTITY.peer_id}",
        connected=True,
        state="active",
        updated_at=now,
        price_per_hour=0.5,
        backend="hf",
        version_held=9,
        receiving_version=10,
        chunks_received=7,
        chunks_total=20,
        chain=0,
        chain_position=1,
        upstream=NODE_IDS[0],
        downstream=None,
        tokens_per_s=850.0,
        rollouts_per_s=1.6,
        leases_done=12,
        tallies=Tallies(accepted=512, rejected=4, late=3),
        earnings_usd=0.55,
        busy_s=3960.0,
        events=(EventRecord(at=now - 10, kind="activate", detail="node-activated-event"),),
    )


def write_status(data_dir: Path, status: HubStatus | NodeView, name: str = "status.json") -> None:
    tmp = data_dir / (name + ".tmp")
    tmp.write_text(status.model_dump_json())
    tmp.replace(data_dir / name)


def static_text(app, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def table_peers(app) -> list[str]:
    table = app.query_one("#nodes-table", DataTable)
    return [row.key.value for row in table.ordered_rows]


@pytest.fixture
def hub_dir(tmp_path: Path) -> Path:
    write_status(tmp_path, hub_status())
    return tmp_path


# --- pure helpers -------------------------------------------------------------------------


def test_rho_cost_and_state_helpers() -> None:
    status = hub_status()
    a, b, c = status.nodes
    assert rho(a) == pytest.approx(0.35 / 2.0)
    assert rho(a.model_copy(update={"rollouts_per_s": 0.0})) is None
    assert cost_per_rollout(status) == pytest.approx(1.08 / 1280)
    assert cost_per_rollout(status.model_copy(update={"totals": Tallies()})) is None
    assert [display_state(n) for n in status.nodes] == ["active", "receiving", "standby"]
    assert display_state(b.model_copy(update={"state": "banned"})) == "banned"
    assert short_id(a.peer_id) == a.peer_id[-8:] and short_id(None) == "hub"


# --- DataDirSource --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_data_dir_source_missing_partial_garbage_oversized_and_good(tmp_path: Path) -> None:
    source = DataDirSource(tmp_path)
    missing = await source.fetch()
    assert isinstance(missing, NoStatus) and "does not exist" in missing.reason
    (tmp_path / "status.json").write_text(hub_status().model_dump_json()[:200])
    assert isinstance(await source.fetch(), NoStatus)
    (tmp_path / "status.json").write_bytes(b"\x00\xffgarbage")
    assert isinstance(await source.fetch(), NoStatus)
    (tmp_path / "status.json").write_bytes(b" " * (HubStatus.MAX_BYTES + 10))
    assert isinstance(await source.fetch(), NoStatus)
    (tmp_path / "status.json").write_bytes(b"[" * (HubStatus.MAX_BYTES + 10))
    oversized = await source.fetch()
    assert isinstance(oversized, NoStatus) and "larger than" in oversized.reason
    write_status(tmp_path, hub_status(step=12))
    good = await source.fetch()
    assert isinstance(good, HubStatus) and good.step == 12
    write_status(tmp_path, node_view(), "node_status.json")
    node = await DataDirSource(tmp_path, kind="node").fetch()
    assert isinstance(node, NodeView) and node.chunks_total == 20


# --- hub dashboard on a data dir ------------------------------------------------------------


@pytest.mark.asyncio
async def test_hub_dashboard_shows_learner_cost_chains_nodes_and_events(hub_dir: Path) -> None:
    app = HubDashboard(DataDirSource(hub_dir), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        assert not app.query_one(Banner).shown
        assert sorted(table_peers(app)) == sorted(NODE_IDS)
        chains = static_text(app, "#chains").splitlines()
        assert len(chains) == 2
        a, b, c = (short_id(p) for p in NODE_IDS)
        assert chains[0].index(a) < chains[0].index(b) and "↓v10 7ch" in chains[0]
        assert c in chains[1] and a not in chains[1]
        learner = static_text(app, "#learner-text")
        assert "step 10/100" in learner and "T_bcast 4.2 s" in learner and "predicted 0.020" in learner
        assert "min 3.00" in learner and "target 3.30" in learner and "usable 57%" in learner
        assert len(app.query_one("#reward-spark").data) == 10
        label = app.query_one("#reward-label")  # the mean of the sparkline's 10 steps, named on hover
        assert str(label.render()) == f"rollout {sum(app.query_one('#reward-spark').data) / 10:.3f}"
        assert label.tooltip == "rollout reward, mean of the last 10 learner steps"
        assert app.query_one("#eval-spark").data == [0.25, 0.375]
        assert str(app.query_one("#eval-label").render()) == "eval 0.375 @10"
        assert not app.query_one("#tools-row").display  # not a tool-using run
        cost = static_text(app, "#cost")
        assert "$1.080" in cost and "$0.00084" in cost and "$2.500" in cost and "57%" in cost
        assert "rej 15 late 11 stale 4" in cost
        assert "banned-c" in static_text(app, "#events") and "v10 published" in static_text(app, "#events")


@pytest.mark.asyncio
async def test_the_hubs_warnings_for_its_operator_show_above_the_dashboard_newest_first(tmp_path: Path) -> None:
    status = hub_status()
    warnings = tuple(
        EventRecord(at=status.updated_at - age, kind=kind, detail=f"{kind} said")
        for age, kind in ((600, "learner_stalled"), (300, "steps_lost"), (200, "no_delta"), (100, "reward_flat"))
    )
    write_status(tmp_path, status.model_copy(update={"warnings": warnings}))
    app = HubDashboard(DataDirSource(tmp_path), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        box = app.query_one("#warnings", Static)
        assert box.has_class("-shown") and box.display
        assert [line.split(" ", 2)[2] for line in static_text(app, "#warnings").splitlines()] == [
            "reward_flat: reward_flat said",
            "no_delta: no_delta said",
            "steps_lost: steps_lost said",
        ]
    # A stranger's view (no operator key) has the kinds only; a hub without warnings shows none.
    assert warnings_text(status.model_copy(update={"warnings": warnings}).redact()).plain.splitlines()[0].endswith(" reward_flat")
    write_status(tmp_path, status)
    app = HubDashboard(DataDirSource(tmp_path), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        assert not app.query_one("#warnings", Static).has_class("-shown")


@pytest.mark.asyncio
async def test_hub_dashboard_sort_key_header_click_and_node_events(hub_dir: Path) -> None:
    app = HubDashboard(DataDirSource(hub_dir), refresh_s=NO_AUTO_REFRESH_S)
    by_price = [NODE_IDS[0], NODE_IDS[1], NODE_IDS[2]]
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        assert table_peers(app) == sorted(NODE_IDS, key=short_id)
        await pilot.press("s")  # state
        assert table_peers(app) == [NODE_IDS[0], NODE_IDS[1], NODE_IDS[2]]  # active, receiving, standby
        await pilot.press("s")  # $/h
        assert table_peers(app) == by_price
        await pilot.press("S")
        assert table_peers(app) == by_price[::-1]
        assert "$/h ▼" in str(app.query_one("#nodes-table").border_title)
        table = app.query_one("#nodes-table", DataTable)
        # "late" (groups refused only for falling out of the window) sorts on its own.
        assert table.ordered_columns[8].label.plain == "late"
        table.post_message(DataTable.HeaderSelected(table, table.ordered_columns[8].key, 8, table.ordered_columns[8].label))
        await pilot.pause()
        assert table_peers(app) == [NODE_IDS[1], NODE_IDS[2], NODE_IDS[0]]
        # Clicking the "acc" header sorts by accepted work, ascending.
        table.post_message(DataTable.HeaderSelected(table, table.ordered_columns[6].key, 6, table.ordered_columns[6].label))
        await pilot.pause()
        assert table_peers(app) == [NODE_IDS[2], NODE_IDS[1], NODE_IDS[0]]

        # Selecting a node shows only its events.
        await pilot.press("ctrl+home")
        await pilot.pause()
        assert app.selected_peer == NODE_IDS[2]
        assert "banned-c" in static_text(app, "#node-events")
        await pilot.press("down", "down")
        await pilot.pause()
        assert app.selected_peer == NODE_IDS[0]
        mine = static_text(app, "#node-events")
        assert "activated-a" in mine and "RTX 5090" in mine and "banned-c" not in mine and "joined-b" not in mine
        # The selection survives a refresh that rebuilds the table.
        await app.refresh_data()
        await pilot.pause()
        assert app.selected_peer == NODE_IDS[0]


@pytest.mark.asyncio
async def test_help_key_toggles_bindings_panel(hub_dir: Path) -> None:
    app = HubDashboard(DataDirSource(hub_dir), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await pilot.press("question_mark")
        await pilot.pause()
        assert app.screen.query(HelpPanel)
        await pilot.press("question_mark")
        await pilot.pause()
        assert not app.screen.query(HelpPanel)
        write_status(hub_dir, hub_status(step=13))
        await pilot.press("r")
        await until(lambda: "step 13/100" in static_text(app, "#learner-text"))
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


@pytest.mark.asyncio
async def test_values_update_between_refreshes_and_final_status_banner(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{not json")
    app = HubDashboard(DataDirSource(tmp_path), refresh_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        banner = app.query_one(Banner)
        assert banner.shown and "no status yet" in str(banner.render())
        write_status(tmp_path, hub_status(step=10))
        await until(lambda: "step 10/100" in static_text(app, "#learner-text"))
        assert not banner.shown
        write_status(tmp_path, hub_status(step=11))
        await until(lambda: "step 11/100" in static_text(app, "#learner-text"))
        assert "v11 published" in static_text(app, "#events")
        write_status(tmp_path, hub_status(step=12, running=False))
        await until(lambda: banner.shown)
        assert "finished" in str(banner.render()) and "step 12/100" in static_text(app, "#learner-text")
        write_status(tmp_path, hub_status(step=12, now=time.time() - 120))
        await until(lambda: "may have stopped" in str(banner.render()))


class ShutdownRacingSource(DataDirSource):
    """Answers its first fetch at once; later ones only once the app's banner has been removed in shutdown."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.banner: Banner | None = None
        self.fetches = 0
        self.late_answers = 0

    async def fetch(self):
        self.fetches += 1
        if self.fetches > 1:
            while self.banner is None or self.banner.is_attached:
                await asyncio.sleep(0.001)
            self.late_answers += 1
            return NoStatus("answered while the dashboard shuts down")
        return await super().fetch()


@pytest.mark.asyncio
async def test_a_fetch_that_ends_during_shutdown_leaves_the_closing_screen_alone(hub_dir: Path) -> None:
    # A slow machine can finish a fetch while Textual removes the widgets; showing it then raised
    # NoMatches from the worker and failed the app.
    source = ShutdownRacingSource(hub_dir)
    app = HubDashboard(source, refresh_s=0.05)
    async with app.run_test(size=(120, 40)):
        await app.loaded.wait()
        source.banner = app.query_one(Banner)
        await until(lambda: source.fetches > 1)
    assert source.late_answers >= 1  # the race was run, and the app ended without an error


# --- hub dashboard over libp2p --------------------------------------------------------------


class TinyHub:
    """A real py-libp2p host in its own trio thread that answers STATUS_PROTOCOL with `status`."""

    def __init__(self, identity: Identity, port: int, status: HubStatus | Reject, delay_s: float = 0.0) -> None:
        self.identity, self.port, self.status, self.delay_s = identity, port, status, delay_s
        self.requests = 0
        self.addr: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, stream) -> None:
        request = await read_message(stream, StatusRequest)
        assert isinstance(request, StatusRequest)
        self.requests += 1
        await trio.sleep(self.delay_s)
        await write_message(stream, self.status)
        await stream.close()

    async def _main(self) -> None:
        async with running_host(self.identity, [f"/ip4/127.0.0.1/tcp/{self.port}"]) as (host, addrs):
            set_handler(host, STATUS_PROTOCOL, self._handle, logging.getLogger("tiny-hub"))
            self.addr = addrs[0]
            self._ready.set()
            while not self._stop.is_set():
                await trio.sleep(0.02)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def __enter__(self) -> TinyHub:
        self._thread.start()
        assert self._ready.wait(10), "tiny hub did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.asyncio
async def test_hub_source_unreachable_then_reachable_over_real_libp2p() -> None:
    port = free_port()
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{HUB_IDENTITY.peer_id}"
    app = HubDashboard(HubSource(addr, timeout_s=2.0), refresh_s=0.2)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        banner = app.query_one(Banner)
        assert banner.shown and "UNREACHABLE" in str(banner.render()) and str(port) in str(banner.render())
        assert isinstance(app.last_result, Unreachable)
        assert table_peers(app) == []

        with TinyHub(HUB_IDENTITY, port, hub_status(step=21)) as hub:
            assert hub.addr == addr
            await until(lambda: not banner.shown)
            await pilot.pause()
            assert sorted(table_peers(app)) == sorted(NODE_IDS)
            assert "step 21/100" in static_text(app, "#learner-text")
            assert hub.requests >= 1

        # The hub goes away: the banner comes back while the last data stays on screen.
        await until(lambda: banner.shown)
        assert "UNREACHABLE" in str(banner.render()) and "showing data from" in str(banner.render())
        assert sorted(table_peers(app)) == sorted(NODE_IDS)


@pytest.mark.asyncio
async def test_a_throttled_status_request_keeps_the_data_and_shows_no_banner() -> None:
    """The hub's per-address status limit answers BUSY: the hub is up, so the screen keeps its data unflagged."""
    identity = Identity.generate()
    port = free_port()
    app = HubDashboard(HubSource(f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}", timeout_s=5.0), refresh_s=0.1)
    with TinyHub(identity, port, hub_status(step=21)) as hub:
        async with app.run_test(size=(120, 40)) as pilot:
            await app.loaded.wait()
            await pilot.pause()
            assert isinstance(app.last_result, HubStatus)
            hub.status = Reject(code=RejectCode.BUSY, reason="status requests from this address: retry in 0.4s")
            answered = hub.requests
            await until(lambda: hub.requests >= answered + 3)
            await pilot.pause()
            assert not app.query_one(Banner).shown
            assert isinstance(app.last_result, HubStatus) and "step 21/100" in static_text(app, "#learner-text")


def test_remote_dashboard_polls_slower_than_the_hubs_status_limit(tmp_path: Path) -> None:
    from shared.messages import STRANGER_STATUS_PER_S

    parser = argparse.ArgumentParser()
    add_dashboard_arguments(parser)
    remote = build_dashboard(parser.parse_args(["--hub", f"/ip4/127.0.0.1/tcp/1/p2p/{HUB_IDENTITY.peer_id}"]))
    try:
        assert remote.refresh_s > 1.0 / STRANGER_STATUS_PER_S
    finally:
        remote.source.close()
    local = build_dashboard(parser.parse_args(["--data-dir", str(tmp_path)]))
    assert isinstance(local.source, DataDirSource) and local.refresh_s == DEFAULT_REFRESH_S


@pytest.mark.asyncio
async def test_hub_source_reports_a_refusal() -> None:
    identity = Identity.generate()
    port = free_port()
    source = HubSource(f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}", timeout_s=5.0)
    try:
        with TinyHub(identity, port, Reject(code=RejectCode.BAD_REQUEST, reason="dashboards not welcome")):
            refused = await source.fetch()
        assert isinstance(refused, Unreachable) and "dashboards not welcome" in refused.reason
    finally:
        source.close()


@pytest.mark.timing
@pytest.mark.asyncio
async def test_a_slow_hub_times_out_without_blocking_the_event_loop() -> None:
    identity = Identity.generate()
    port = free_port()
    source = HubSource(f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}", timeout_s=1.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    try:
        with TinyHub(identity, port, hub_status(), delay_s=30.0):
            task = asyncio.create_task(ticker())
            started = time.monotonic()
            slow = await source.fetch()
            elapsed_s = time.monotonic() - started
            task.cancel()
        assert isinstance(slow, Unreachable) and "did not answer in time" in slow.reason
        assert elapsed_s < 1.0 + 2.5
        # The asyncio loop kept running while libp2p waited in its own thread.
        assert ticks >= 10
    finally:
        source.close()


# --- screenshot and node dashboard ----------------------------------------------------------


def test_screenshot_writes_svg_with_short_ids(hub_dir: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_dashboard_arguments(parser)
    shot = tmp_path / "shots" / "hub.svg"
    args = parser.parse_args(["--data-dir", str(hub_dir), "--screenshot", str(shot)])
    assert run_dashboard(args) == 0
    svg = shot.read_text()
    assert svg.startswith("<svg") and short_id(NODE_IDS[0]) in svg and short_id(NODE_IDS[2]) in svg

    write_status(hub_dir, node_view(), "node_status.json")
    node_shot = tmp_path / "node.svg"
    args = parser.parse_args(["--data-dir", str(hub_dir), "--screenshot", str(node_shot)])
    assert run_dashboard(args, kind="node") == 0
    assert "7/20" in node_shot.read_text()


def test_volunteer_data_dir_opens_the_node_view(tmp_path: Path) -> None:
    """`echo-node dashboard` watches a node started elsewhere; `echo-hub dashboard` on a node's dir shows the same."""
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    write_status(node_dir, node_view(), "node_status.json")
    shot = tmp_path / "node.svg"
    assert node_cli(["dashboard", "--data-dir", str(node_dir), "--screenshot", str(shot)]) == 0
    assert "7/20" in shot.read_text() and "&#160;late&#160;" in shot.read_text()  # the work panel's late count
    parser = argparse.ArgumentParser()
    add_dashboard_arguments(parser)
    via_hub = tmp_path / "via-hub.svg"
    assert run_dashboard(parser.parse_args(["--data-dir", str(node_dir), "--screenshot", str(via_hub)])) == 0
    assert "7/20" in via_hub.read_text()


def test_dashboard_arguments_need_exactly_one_source() -> None:
    parser = argparse.ArgumentParser()
    add_dashboard_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    with pytest.raises(SystemExit):
        parser.parse_args(["--hub", "/ip4/127.0.0.1/tcp/1/p2p/x", "--data-dir", "d"])
    args = parser.parse_args(["--hub", "/ip4/127.0.0.1/tcp/1/p2p/x", "--refresh-s", "0.5"])
    assert args.hub.endswith("/p2p/x") and args.refresh_s == 0.5 and args.screenshot is None


@pytest.mark.timing
@pytest.mark.asyncio
async def test_node_dashboard_renders_node_view(tmp_path: Path) -> None:
    app = run_node_dashboard(tmp_path, refresh_s=0.1)
    assert isinstance(app, NodeDashboard)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        banner = app.query_one(Banner)
        assert banner.shown and "node_status.json" in str(banner.render())
        write_status(tmp_path, node_view(), "node_status.json")
        await until(lambda: app.view is not None)
        await pilot.pause()
        assert not banner.shown
        bar = app.query_one("#snapshot-progress", ProgressBar)
        assert (bar.progress, bar.total) == (7, 20)
        chain = static_text(app, "#chain")
        assert "position 1" in chain and short_id(NODE_IDS[0]) in chain and f"me {short_id(NODE_IDS[1])}" in chain
        work = static_text(app, "#work")
        assert "accepted 512" in work and "rejected 4" in work and "late 3" in work and "$0.5500" in work and "$0.50/h" in work
        assert "850 tok/s" in work
        assert "node-activated-event" in static_text(app, "#events")
        assert f"{short_id(HUB_IDENTITY.peer_id)} at /ip4/127.0.0.1/tcp/4001" in static_text(app, "#identity")


def test_a_redacted_price_reads_hidden_not_zero() -> None:
    """Issue 52: a non-operator saw "$/h 0.00" for a redacted price, which reads as a free node."""
    node = NodeStatus(
        peer_id="p" * 12, state="active", price_per_hour=7.77, rollouts_per_s=1.0, version_held=1, tallies=Tallies(), cost_usd=1.5
    )
    status = HubStatus(
        hub_id="h",
        addrs=(),
        running=True,
        updated_at=0.0,
        step=1,
        steps_target=10,
        version=1,
        staleness=1,
        kappa=1,
        task="t",
        nodes=(node,),
        open_leases=0,
        totals=Tallies(),
        dropped_stale=0,
        cost_usd=1.5,
        all_on_cost_usd=3.0,
    )
    shown = [str(cell) for cell in node_row(node)]
    assert "7.77" in " ".join(shown) and HIDDEN not in shown
    redacted = status.redact()
    cells = [str(cell) for cell in node_row(redacted.nodes[0], redacted.redacted)]
    assert cells.count(HIDDEN) == 2 and not any("0.00" in c for c in cells)
    assert HIDDEN in str(cost_text(redacted)) and "$" not in str(cost_text(redacted))
    assert "1.5" in str(cost_text(status)) or "1.50" in str(cost_text(status))


def test_a_volunteers_name_shows_in_status_and_both_dashboards() -> None:
    """--name beside the short id in `echo-hub status` and the hub dashboard's nodes table (as plain text, never
    markup; cut to LABEL_NAME_CHARS), and in the node's own dashboard."""
    import io

    from rich.console import Console

    from hub.cli.status import render
    from shared.messages import LABEL_NAME_CHARS
    from tui.node_app import identity_text

    status = hub_status()
    first, second, third = status.nodes
    long_name = "b" * 32
    named = status.model_copy(
        update={
            "nodes": (
                first.model_copy(update={"name": "alice [red]x"}),
                second.model_copy(update={"name": long_name}),
                third.model_copy(update={"name": short_id(third.peer_id)}),  # the hub's name for one that chose none
            )
        }
    )
    out = io.StringIO()
    render(named, Console(file=out, width=200))
    alice, cut = f"alice [red]x {short_id(first.peer_id)}", f"{'b' * (LABEL_NAME_CHARS - 1)}… {short_id(second.peer_id)}"
    assert alice in out.getvalue() and cut in out.getvalue()
    assert [str(node_row(node)[0]) for node in named.nodes] == [alice, cut, short_id(third.peer_id)]
    assert "(alice)" in identity_text(node_view().model_copy(update={"name": "alice"})).plain
    assert "(" not in identity_text(node_view()).plain.splitlines()[0]


@pytest.mark.parametrize(
    "field, value", [("name", "a\x1b[2Jb"), ("hardware", "gpu\x1b]0;owned\x07"), ("link", "\x1b[31m"), ("peer_id", "\x1b[2J" * 8)]
)
def test_a_remote_hubs_node_rows_carry_no_terminal_control_codes(field: str, value: str) -> None:
    """`echo-hub status --hub ADDR` and the dashboard print a remote hub's node rows: a field that reaches the screen is
    refused at the frame when it holds control codes, as the hub's own join refuses them (an honest hub's pass)."""
    status = hub_status()
    row = status.nodes[0].model_dump()
    NodeStatus.model_validate(row)
    with pytest.raises(ValidationError):
        NodeStatus.model_validate({**row, field: value})
    leader = {"peer_id": status.nodes[0].peer_id, "name": "ok", "run": {}, "day": {}}
    Leader.model_validate(leader)
    with pytest.raises(ValidationError):
        Leader.model_validate({**leader, "name": "a\x1b[2Jb"})


@pytest.mark.asyncio
async def test_a_tool_using_runs_calls_per_rollout_show_beside_its_reward(tmp_path: Path) -> None:
    base = hub_status()
    history = tuple(p.model_copy(update={"tool_calls": 0.1 * i}) for i, p in enumerate(base.history))
    write_status(tmp_path, base.model_copy(update={"history": history}))
    app = HubDashboard(DataDirSource(tmp_path), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        assert app.query_one("#tools-row").display
        assert app.query_one("#tools-spark").data == [p.tool_calls for p in history]
        assert str(app.query_one("#tools-label").render()) == "tools 0.45"  # the mean of the last 10 steps
    # With the tools' totals: their rate beside it, the rest in its tooltip.
    tools = ToolTotals(calls=1200, errors=3, ends={"tool_cpu": 2}, environment_s=41.0, calls_per_s=8.25)
    with pytest.raises(ValidationError):  # a hostile hub's reason: markup or an escape for the operator's terminal
        ToolTotals(ends={"[link=http://x]a\x1b[2J": 1})
    write_status(tmp_path, base.model_copy(update={"history": history, "tools": tools}))
    app = HubDashboard(DataDirSource(tmp_path), refresh_s=NO_AUTO_REFRESH_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        label = app.query_one("#tools-label")
        assert str(label.render()) == "tools 0.45 8.25/s"
        assert label.tooltip.endswith("; 1,200 calls (8.25/s), 3 errors, ended early: tool_cpu 2, 41 s in the sandbox")
