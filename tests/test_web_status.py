"""The hub's public web view against a real `echo-hub start --http` with local nodes: /api/status lists them,
/metrics parses with prometheus_client's own parser, and headless chromium renders a row per node with a hostile
display name as inert text."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hub.service.web import StatusCollector, serve_web
from node.config import NodeConfig
from shared.messages import HubStatus, NodeStatus, StepPoint, Tallies
from shared.web import BURST_PER_ADDRESS, RATE_PER_ADDRESS, RateLimit
from testbed.harness import start_hub, start_node, stop_all, wait_until

HOSTILE = "<img src=x onerror=alert(1)>"
PRIVATE = ("price_per_hour", "cost_usd", "hardware")


def test_a_display_name_is_printable_bounded_text_and_markup_is_allowed() -> None:
    assert NodeConfig(hub="x", name=HOSTILE).name == HOSTILE  # shown as text everywhere, so it may say anything
    for bad in ("", " padded", "x" * 33, "right\u202eto left", "two\nlines"):
        with pytest.raises(ValueError):
            NodeConfig(hub="x", name=bad)


def test_metrics_of_a_status_count_nodes_by_state_and_groups_by_verdict() -> None:
    node = NodeStatus(
        peer_id="p" * 52,
        state="active",
        price_per_hour=9.0,
        rollouts_per_s=2.0,
        version_held=3,
        tallies=Tallies(accepted=5),
        cost_usd=1.0,
        reachability="nated",
        link="pushed",
    )
    status = HubStatus(
        hub_id="h",
        addrs=(),
        running=True,
        updated_at=0.0,
        step=4,
        steps_target=10,
        version=4,
        staleness=2,
        kappa=1,
        task="reverse",
        nodes=(node,),
        open_leases=1,
        totals=Tallies(accepted=5, late=2),
        dropped_stale=1,
        cost_usd=0.5,
        audits_passed=3,
        audits_failed=1,
    )

    registry = CollectorRegistry(auto_describe=False)
    collector = StatusCollector(registry)
    collector.update(status)
    steps = tuple(
        StepPoint(step=k, version=k, reward_mean=0.5, staleness_mean=1.0, bubble=0.1, t_train_s=0.3, t_idle_s=0.0) for k in (5, 6)
    )
    collector.update(status.model_copy(update={"history": steps}))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples[("echo2_nodes", (("state", "active"),))] == 1
    assert samples[("echo2_nodes", (("state", "banned"),))] == 0
    assert samples[("echo2_nodes_by_reachability", (("reachability", "nated"),))] == 1
    assert samples[("echo2_groups_total", (("verdict", "late"),))] == 2
    # Money never leaves through the web view: with one node on, the cost total moves with its price alone.
    assert not any(name.startswith("echo2_cost") for name, _ in samples)
    assert samples[("echo2_audits_total", (("result", "failed"),))] == 1
    assert samples[("echo2_audits_total", (("result", "passed"),))] == 3
    assert samples[("echo2_audits_total", (("result", "unverified"),))] == 0
    assert (samples[("echo2_staleness", ())], samples[("echo2_kappa", ())]) == (2, 1)  # the S and kappa in force
    assert samples[("echo2_learner_step_seconds_count", ())] == 2  # the steps after the first scrape
    assert samples[("echo2_learner_step_seconds_bucket", (("le", "0.5"),))] == 2
    assert ("echo2_bubble_ratio", ()) not in samples  # unknown until a step: no sample rather than a made-up 0


def test_a_busy_http_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "hub.cli.main",
                "start",
                "--data-dir",
                str(tmp_path / "data"),
                "--http",
                f"127.0.0.1:{port}",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"echo-hub: --http 127.0.0.1:{port}: port {port} is already in use (another hub or "
        f"node?); stop it or listen on another port, e.g. 127.0.0.1:{port + 1} or --http off"
    )
    assert not (tmp_path / "data").exists()


def test_a_busy_http_port_stops_a_node_before_it_writes_anything(tmp_path: Path) -> None:
    hub = "/ip4/127.0.0.1/tcp/4077/p2p/12D3KooWBQfx3WEjxhccpcx6oocrexqynsmUXa6uBjuKgWdjmdLR"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "node.cli",
                "join",
                "--hub",
                hub,
                "--data-dir",
                str(tmp_path / "node"),
                "--http",
                f"127.0.0.1:{port}",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"echo-node: --http 127.0.0.1:{port}: port {port} is already in use (another hub or "
        f"node?); stop it or listen on another port, e.g. 127.0.0.1:{port + 1} or --http off"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_client_past_its_rate_is_refused_until_its_bucket_refills() -> None:
    rate = RateLimit()
    assert all(rate.allow("a", 0.0) for _ in range(int(BURST_PER_ADDRESS)))
    assert not rate.allow("a", 0.0)
    assert rate.allow("b", 0.0)  # another address has its own bucket
    assert rate.allow("a", 1.0 / RATE_PER_ADDRESS)


def test_the_grafana_dashboard_queries_only_metrics_the_hub_exports() -> None:
    status = HubStatus(
        hub_id="h",
        addrs=(),
        running=True,
        updated_at=0.0,
        step=0,
        steps_target=0,
        version=0,
        staleness=0,
        kappa=1,
        task="t",
        nodes=(),
        open_leases=0,
        totals=Tallies(),
        dropped_stale=0,
    )
    registry = CollectorRegistry(auto_describe=False)
    StatusCollector(registry).update(status)
    exported = {f.name for f in registry.collect()}
    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-echo2.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"echo2_[a-z_]+", target["expr"])
    }
    assert queried and {re.sub(r"_(total|bucket|sum|count)$", "", q) for q in queried} <= exported


def printed_url(proc, label: str) -> str:
    """The address a hub or node printed for its page (`label: http://HOST:PORT`)."""
    found = wait_until(
        lambda: re.search(rf"^{label}: (http://\S+)", proc.output(), re.MULTILINE) or proc.process.poll() is not None,
        120,
        f"the {label} address",
    )
    assert found is not True, proc.output()[-2000:]
    return found.group(1)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory):
    """A hub with two local nodes and one joined with a hostile name, after a few steps (the guest
    serving its own page too); yields the hub's page URL and the guest's."""
    root = tmp_path_factory.mktemp("web")
    # Port 0 and the printed address: a port picked free beforehand could be taken by a parallel test meanwhile.
    hub = start_hub(
        root / "hub",
        "--local-nodes",
        "2",
        "--steps",
        "0",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "1",
        "--eval-prompts",
        "4",
        "--http",
        "127.0.0.1:0",
    )
    procs = [hub]
    try:
        url = printed_url(hub, "status page")
        guest = start_node(hub.addr, root / "guest", "--name", HOSTILE, "--http", "127.0.0.1:0")
        procs.append(guest)
        node_url = printed_url(guest, "node page")

        seen: list[str] = ["the page to answer"]

        def ready() -> dict | None:
            for proc in procs:
                if proc.process.poll() is not None:
                    raise AssertionError(f"a process of the run ended ({proc.process.returncode}): {proc.output()[-2000:]}")
            try:
                status = json.loads(get(f"{url}/api/status"))
            except urllib.error.URLError:  # the libp2p address is printed before the page listens
                return None
            active = [n for n in status["nodes"] if n["state"] == "active"]
            guest_led = any(v["name"] == HOSTILE for v in status["leaders"])
            seen[0] = (
                f"nodes {[(n['name'][-8:], n['state']) for n in status['nodes']]}, step {status['step']}, "
                f"{len(status['evals'])} evaluations, leaders {[v['name'][-8:] for v in status['leaders']]}"
            )
            return status if len(active) >= 3 and status["step"] >= 2 and len(status["evals"]) >= 2 and guest_led else None

        try:
            wait_until(ready, 240, "three active nodes, two steps, two evaluations, the guest on the leaderboard", poll_s=1.0)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; last seen: {seen[0]}") from None
        yield url, node_url
    finally:
        stop_all(procs)


@pytest.mark.slow
def test_api_status_lists_the_nodes_without_their_prices_costs_or_hardware(pages: tuple[str, str]) -> None:
    hub, _ = pages
    status = json.loads(get(f"{hub}/api/status"))
    assert status["redacted"] is True
    assert len(status["nodes"]) == 3
    assert {n["name"] for n in status["nodes"]} >= {HOSTILE}
    for node in status["nodes"]:
        assert (node["price_per_hour"], node["cost_usd"], node["hardware"]) == (0.0, 0.0, "")
        assert node["name"] == HOSTILE or node["name"] == node["peer_id"][-8:]
    guest = next(v for v in status["leaders"] if v["name"] == HOSTILE)
    assert guest["run"]["accepted"] >= guest["day"]["accepted"] > 0
    assert guest["day"]["tokens"] > 0 and guest["day"]["gpu_hours"] > 0


@pytest.mark.slow
def test_metrics_parse_with_prometheus_client(pages: tuple[str, str]) -> None:
    hub, _ = pages
    families = {f.name: f for f in text_string_to_metric_families(get(f"{hub}/metrics").decode())}
    for name in (
        "echo2_learner_step",
        "echo2_learner_version",
        "echo2_rollout_reward",
        "echo2_bubble_ratio",
        "echo2_broadcast_seconds",
        "echo2_mu_pool_rollouts_per_second",
        "echo2_mu_min_rollouts_per_second",
        "echo2_mu_target_rollouts_per_second",
        "echo2_nodes",
        "echo2_nodes_by_reachability",
        "echo2_groups",
        "echo2_snapshot_bytes",
        "echo2_submissions",
        "echo2_heartbeats",
        "echo2_learner_step_seconds",
        "echo2_eval_reward",
        "echo2_delta_bytes",
        "echo2_audits",
        "echo2_refused_groups",
    ):
        assert name in families, name
    assert families["echo2_groups"].type == families["echo2_heartbeats"].type == "counter"
    assert families["echo2_learner_step_seconds"].type == "histogram"
    assert families["echo2_learner_step"].samples[0].value >= 2
    nodes = {s.labels["state"]: s.value for s in families["echo2_nodes"].samples}
    assert nodes["active"] == 3
    accepted = {s.labels["verdict"]: s.value for s in families["echo2_groups"].samples if s.name == "echo2_groups_total"}
    assert accepted["accepted"] > 0


@pytest.mark.slow
def test_the_server_changes_nothing(pages: tuple[str, str]) -> None:
    hub, _ = pages
    request = urllib.request.Request(f"{hub}/api/status", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


@pytest.mark.slow
def test_the_node_serves_its_own_page_and_metrics(pages: tuple[str, str]) -> None:
    _, node = pages
    deadline = time.monotonic() + 60
    # The node hears of its activation at its next heartbeat reply, which a loaded machine may delay.
    while (view := json.loads(get(f"{node}/api/status")))["state"] != "active" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert view["state"] == "active" and view["version_held"] >= 0
    families = {f.name: f for f in text_string_to_metric_families(get(f"{node}/metrics").decode())}
    assert families["echo2_node_version_held"].samples[0].value >= 0
    accepted = {s.labels["verdict"]: s.value for s in families["echo2_node_groups"].samples if s.name.endswith("_total")}
    assert accepted["accepted"] > 0
    assert "echo2_node_earnings_usd" in families and "echo2_node_relayed_bytes" in families
    assert "echo2_node_paid_seconds" in families  # what the hub paid for, beside echo2_node_busy_seconds
    assert b"<table" in get(f"{node}/")


@pytest.mark.slow
def test_a_slow_client_does_not_stall_the_server(pages: tuple[str, str]) -> None:
    hub, _ = pages
    host, port = hub.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")  # and never finishes its headers
        started = time.monotonic()
        assert json.loads(get(f"{hub}/api/status"))["nodes"]
        assert time.monotonic() - started < 5.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "head",
    [b"X-Big: " + b"a" * 64 * 1024 + b"\r\n", b"".join(b"X-%d: a\r\n" % i for i in range(2000))],
    ids=["64KB-header", "2000-headers"],
)
def test_a_complete_oversized_head_is_refused_and_closed(pages: tuple[str, str], head: bytes) -> None:
    """Issue 54 item 7: h11 bounds only an incomplete head; one write of a complete one was answered 200."""
    hub, _ = pages
    host, port = hub.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        answer = b""
        while chunk := conn.recv(65536):  # read to the close: the server must end the connection
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    assert status in (400, 431), answer[:200]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_renders_a_row_per_node_and_the_hostile_name_as_text(pages: tuple[str, str], tmp_path: Path) -> None:
    hub, _ = pages
    dom = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            f"{hub}/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert len(re.findall(r'<tr [^>]*class="node"', dom)) == 3, dom[-3000:]
    assert 'data-state="ready"' in dom
    assert 'data-series="rollout"' in dom and 'data-series="eval"' in dom  # the reward and eval curves
    assert len(re.findall(r'<tr class="leader"', dom)) >= 2  # the day's and the run's leaderboards
    assert dom.count('class="chain-node"') >= 2  # the chain picture: the hub, then the nodes it feeds
    # Inert: the markup came through as text (escaped by the serializer), never as an element.
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom
    assert "<img" not in dom


def test_each_leaderboard_table_shows_at_most_leaders_max_rows() -> None:
    from hub.service.status import LEADERS_MAX
    from hub.service.web import PAGE

    node = shutil.which("node") or pytest.skip("needs node to run the page's script")
    constant = re.search(r"^const LEADERS_MAX = \d+;$", PAGE, re.M)
    render = re.search(r"^function renderLeaderboard\(.*?^}$", PAGE, re.M | re.S)
    assert constant and render and constant.group(0) == f"const LEADERS_MAX = {LEADERS_MAX};"
    # The hub sends the day's top and the run's top together: up to twice LEADERS_MAX volunteers.
    script = (
        constant.group(0)
        + render.group(0)
        + f"""
const rows = [];
const $ = () => ({{tBodies: [{{replaceChildren() {{}}, appendChild(r) {{ rows.push(r); }}, get rows() {{ return rows; }}}}]}});
const row = (cells) => ({{cells}});
const leaders = Array.from({{length: {2 * LEADERS_MAX}}}, (_, i) => {{
  const c = {{accepted: i + 1, tokens: 1, gpu_hours: 1, audits_passed: 0}};
  return {{name: "v" + i, day: c, run: c}};
}});
renderLeaderboard("leaders-day", "day", leaders);
console.log(JSON.stringify([rows.length, rows[0].cells[2]]));
"""
    )
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [LEADERS_MAX, 2 * LEADERS_MAX]  # the top LEADERS_MAX, the busiest first


def test_two_redacted_reads_do_not_give_a_lone_nodes_price() -> None:
    """Issue 54 item 4: one node on at $7.77/h and paid nothing between two reads 30 s apart; the attack
    3600 x (delta all_on - delta cost) / delta t recovered its price from the redacted totals."""
    price = 7.77
    node = NodeStatus(
        peer_id="p",
        name="n",
        state="active",
        price_per_hour=price,
        rollouts_per_s=1.0,
        version_held=1,
        tallies=Tallies(),
        hardware="H100",
        cost_usd=0.0,
    )

    def read(at_s: float, paid_s: float) -> HubStatus:
        return HubStatus(
            hub_id="h",
            addrs=(),
            running=True,
            updated_at=at_s,
            step=1,
            steps_target=10,
            version=1,
            staleness=1,
            kappa=1,
            task="t",
            nodes=(node,),
            open_leases=1,
            totals=Tallies(),
            dropped_stale=0,
            cost_usd=price * paid_s / 3600,
            cost_per_step_usd=price * paid_s / 3600,
            all_on_cost_usd=price * at_s / 3600,
        )

    first, second = read(100.0, 1.0), read(130.0, 1.0)
    leaked = 3600 * ((second.all_on_cost_usd - first.all_on_cost_usd) - (second.cost_usd - first.cost_usd)) / 30
    assert abs(leaked - price) < 0.1  # the attack works on what an operator sees
    a, b = first.redact(), second.redact()
    derived = 3600 * ((b.all_on_cost_usd - a.all_on_cost_usd) - (b.cost_usd - a.cost_usd)) / 30
    assert abs(derived - price) > 1.0 and derived == 0.0
    assert (b.cost_usd, b.all_on_cost_usd, b.cost_per_step_usd) == (0.0, 0.0, None)
    assert b.nodes[0].price_per_hour == 0.0 and b.nodes[0].cost_usd == 0.0


class OneStatusBoard:
    """The status board's side the web process reads: the redacted view of `status`, rebuilt (updated_at) per call."""

    def __init__(self, status: HubStatus) -> None:
        self.status, self.builds = status, 0

    async def public_json(self) -> bytes:
        self.builds += 1
        return self.status.model_copy(update={"updated_at": float(self.builds)}).redact().model_dump_json().encode()


@pytest.mark.trio
async def test_the_web_process_answers_while_the_hubs_loop_is_blocked_and_ends_with_it() -> None:
    """Issue 54 item 7: a web flood answered on the hub's loop moved heartbeat p50 from 2 to 150-240 ms. Served by a
    process of its own, the page answers while the hub's loop does nothing at all, and holds only the redacted view."""
    node = NodeStatus(
        peer_id="p" * 52, state="active", price_per_hour=9.0, rollouts_per_s=2.0, version_held=3, cost_usd=1.0, hardware="H100",
        tallies=Tallies(accepted=5),
    )  # fmt: skip
    status = HubStatus(
        hub_id="h", addrs=(), running=True, updated_at=0.0, step=4, steps_target=10, version=4, staleness=2, kappa=1,
        task="reverse", nodes=(node,), open_leases=1, totals=Tallies(accepted=5), dropped_stale=0, cost_usd=0.5,
    )  # fmt: skip
    hub = psutil.Process()
    others = set(hub.children())  # a module fixture's hub may be running
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="the web server's process exited with code -9")):
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(serve_web, OneStatusBoard(status), "127.0.0.1:0")
            await trio.to_thread.run_sync(get, f"{url}/api/status")  # started and fed
            answered: dict[str, bytes] = {}
            asking = threading.Thread(target=lambda: answered.update(api=get(f"{url}/api/status"), metrics=get(f"{url}/metrics")))
            asking.start()
            asking.join(timeout=30)  # on the trio thread: the hub's loop runs nothing until the answers come
            view = json.loads(answered["api"])
            assert view["redacted"] and view["nodes"][0]["price_per_hour"] == 0.0 and view["nodes"][0]["hardware"] == ""
            families = {f.name: f for f in text_string_to_metric_families(answered["metrics"].decode())}
            assert families["echo2_learner_step"].samples[0].value == 4
            (web,) = set(hub.children()) - others
            assert web.nice() > hub.nice()  # the protocol's loop gets the cores first
            web.kill()  # the page is part of the run: its process ending is the hub's error
    assert set(hub.children()) == others
