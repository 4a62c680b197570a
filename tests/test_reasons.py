"""Reasons, everywhere a person looks (issue 52 item 3): a real hub service and a node made of node/'s own parts over
libp2p on loopback, one of whose groups is rejected and one late. The reason reaches the hub's log, the submit reply,
the node's log and exit summary, `echo-hub status`, /metrics and both dashboards (Textual's pilot); a stranger's status
keeps the fleet's counts and loses the per-node ones."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from hub.cli.status import render
from hub.service.web import StatusCollector
from node.hf_engine import HFEngine
from node.hub_link import LinkState, state_change_text
from node.summary import summary_text
from node.web import view_metrics
from node.worker import Worker
from shared.crypto import Identity
from shared.layout import HUB_LOG_FILE, HUB_STATUS_FILE, NODE_LOG_FILE, NODE_STATUS_FILE
from shared.messages import (
    MAX_REASONS,
    HubStatus,
    Lease,
    NodeView,
    SubmitReply,
    SubmittedGroup,
    reasons_text,
    short_id,
    standby_text,
)
from shared.net import running_host
from testbed.fault_scenarios import Client
from testbed.harness import HUB_TOML, free_port, start_hub, start_test_node, wait_until
from testbed.inproc import PERMISSIVE_CONFIG, inproc_hub
from tests.test_p2p import status_cli
from tui.hub_app import HubDashboard
from tui.node_app import NodeDashboard
from tui.sources import DataDirSource


def view_of(worker: Worker, peer_id: str) -> NodeView:
    """The node's view of its work as NodeRuntime.view writes it (the parts a worker fills)."""
    stats = worker.stats
    return NodeView(
        peer_id=peer_id,
        hub_addr="/ip4/127.0.0.1/tcp/1/p2p/12D3KooWhub",
        connected=True,
        state="active",
        updated_at=time.time(),
        price_per_hour=0.35,
        backend="hf",
        version_held=0,
        rollouts_per_s=stats.rollouts_per_s,
        leases_done=stats.leases_done,
        tallies=stats.tallies,
        earnings_usd=stats.earned_usd,
        busy_s=stats.busy_s,
        reasons=stats.reasons,
        last_refusals=tuple(stats.last_refusals),
        needed_rollouts_per_s=stats.needed_rollouts_per_s,
    )


async def one_rejected_one_late(data_dir: Path, model_dir: Path) -> tuple[list[SubmitReply], HubStatus, NodeView]:
    """Two leases: the first (the hub's probe) answered with its log-probs made positive (rejected), the second after
    the hub moved past its version (late)."""
    async with inproc_hub(data_dir, model_dir, PERMISSIVE_CONFIG) as hub, trio.open_nursery() as nursery:
        identity = Identity.generate()
        async with running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, _):
            node = Client(host, identity, hub.addr, HFEngine(model_dir), hub.config_hash)
            await nursery.start(node.run_link)

            async def broken(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
                first = groups[0]
                bad = tuple(c.model_copy(update={"logprobs": (0.5,) * len(c.logprobs)}) for c in first.completions)
                return (first.model_copy(update={"completions": bad}), *groups[1:])

            async def behind(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
                hub.publish(PERMISSIVE_CONFIG.learner.staleness + 1)  # v0 falls out of the window meanwhile
                return groups

            replies = []
            for rewrite in (broken, behind):
                lease = await node.take_lease()
                replies.append(await node.worker.work(lease, rewrite))
            status = hub.board.snapshot()
            view = view_of(node.worker, identity.peer_id)
            nursery.cancel_scope.cancel()
    assert all(isinstance(reply, SubmitReply) for reply in replies), replies
    return replies, status, view


def test_a_rejected_and_a_late_group_are_explained_everywhere(tmp_path, default_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="echo2")
    (rejected, late), status, view = trio.run(one_rejected_one_late, tmp_path / "hub", default_model_dir)
    peer = view.peer_id

    # The submit replies: counts by reason, and for late work the pace at which it would have come back in time.
    assert (len(rejected.rejected), rejected.reasons, rejected.needed_rollouts_per_s) == (1, {"tokens": 1}, None)
    assert late.accepted == 0 and len(late.late) == late.reasons["late"] >= 1 and set(late.reasons) == {"late"}
    late_groups = len(late.late)
    both = {"late": late_groups, "tokens": 1}
    both_text = reasons_text(both)  # "late 2, tokens 1": most first
    assert late.needed_rollouts_per_s is not None and late.needed_rollouts_per_s > 0

    # hub.log (the hub's echo2.hub loggers) names the node, the count, the reason and the hub's words.
    hub_lines = [r.getMessage() for r in caplog.records if r.name == "echo2.hub.intake"]
    assert f"node {short_id(peer)}: 1 group rejected (tokens): log-probs must be finite and <= 0" in hub_lines
    late_line = next(line for line in hub_lines if f"{late_groups} group{'s' if late_groups > 1 else ''} late (late)" in line)
    assert "stale version 0 (oldest accepted 1)" in late_line and "in time it needed" in late_line

    # The node's log and its exit summary.
    node_lines = [r.getMessage() for r in caplog.records if r.name == "echo2.node.worker"]
    assert any(line.startswith("hub: 1 group rejected (tokens 1): log-probs must be finite") for line in node_lines)
    assert any(" late (late " in line and "stale version 0" in line for line in node_lines)
    summary = summary_text(view)
    assert f"this hub needs {late.needed_rollouts_per_s:.3g} rollouts/s per node" in summary
    assert "late group" in summary and "your groups arrived after the hub moved on" in summary
    assert "1 group rejected (tokens): a malformed completion" in summary

    # echo-hub status: the fleet's counts and the node's own, for the operator.
    (node_status,) = status.nodes
    assert node_status.reasons == both and status.reasons == both
    console = Console(record=True, width=200)
    render(status, console)
    text = console.export_text()
    assert "refused by reason" in text and both_text in text
    assert f"refused {short_id(peer)}: {both_text}" in text
    # A stranger keeps the fleet's counts; why a named node was refused is the operator's.
    stranger = status.redact()
    assert stranger.reasons == both and stranger.nodes[0].reasons == {}
    console = Console(record=True, width=200)
    render(stranger, console)
    assert f"refused {short_id(peer)}" not in console.export_text()

    # /metrics: a `reason` label on the refused groups' counter, every reason present.
    collector = StatusCollector(registry := CollectorRegistry(auto_describe=False))
    collector.update(status)
    metrics = generate_latest(registry).decode()
    assert 'echo2_refused_groups_total{reason="tokens"} 1.0' in metrics
    assert f'echo2_refused_groups_total{{reason="late"}} {late_groups:.1f}' in metrics
    assert 'echo2_refused_groups_total{reason="copy"} 0.0' in metrics
    node_metrics = {s.labels["reason"]: s.value for f in view_metrics(view) for s in f.samples if "reason" in s.labels}
    assert node_metrics["tokens"] == 1 and node_metrics["late"] == late_groups and node_metrics["copy"] == 0

    # Both dashboards, as a person sees them.
    hub_dir, node_dir = tmp_path / "hub-view", tmp_path / "node-view"
    hub_dir.mkdir(), node_dir.mkdir()
    (hub_dir / HUB_STATUS_FILE).write_text(status.model_dump_json())
    (node_dir / NODE_STATUS_FILE).write_text(view.model_dump_json())
    asyncio.run(dashboards_show_reasons(hub_dir, node_dir, peer, both_text))


async def dashboards_show_reasons(hub_dir: Path, node_dir: Path, peer: str, both_text: str) -> None:
    hub_app = HubDashboard(DataDirSource(hub_dir), refresh_s=3600)
    async with hub_app.run_test(size=(140, 40)) as pilot:
        await hub_app.loaded.wait()
        await pilot.pause()
        assert f"refused: {both_text}" in str(hub_app.query_one("#nodes-table").border_title)
        await pilot.press("ctrl+home")
        await pilot.pause()
        assert hub_app.selected_peer == peer
        assert f"refused: {both_text}" in str(hub_app.query_one("#node-events").render())
    node_app = NodeDashboard(DataDirSource(node_dir, kind="node"), refresh_s=3600)
    async with node_app.run_test(size=(140, 40)) as pilot:
        await node_app.loaded.wait()
        await pilot.pause()
        work = str(node_app.query_one("#work").render())
        assert f"refused by reason {both_text}" in work
        assert (
            "unpaid: " in work and "late group" in work and "your groups arrived after the hub moved on; this hub needs" in work
        )
        assert "last refusal (the hub's words):" in work


# The real processes' settings: S = 1, small leases and steps, so the learner moves past a held-back lease in seconds.
E2E_TOML = HUB_TOML + "[lease]\nprompts_per_lease = 2\n"
E2E_HUB = ("--local-nodes", "0", "--steps", "0", "--staleness", "1", "--prompts-per-step", "2", "--group-size", "4")
E2E_HUB += ("--max-new-tokens", "4", "--log-level", "info")
E2E_WAIT_S = 120.0  # past the lease timeout (60 s) that would otherwise end the held-back lease


@pytest.mark.slow
def test_a_real_hub_and_node_say_why_in_hub_log_status_metrics_and_the_nodes_summary(tmp_path, capsys):
    """`echo-hub start` and a real node runtime (testbed/laggard_node.py: its second lease answered with one broken
    group, its third held back until the learner moved past it): hub.log, `echo-hub status`, /metrics, the node's
    log and the summary it prints when stopped all say why."""
    hub_dir, node_dir, port = tmp_path / "hub", tmp_path / "node", free_port()
    hub_dir.mkdir()
    (hub_dir / "hub.toml").write_text(E2E_TOML)
    hub = start_hub(hub_dir, *E2E_HUB, "--config", str(hub_dir / "hub.toml"), "--http", f"127.0.0.1:{port}")
    node = start_test_node(hub.addr, node_dir, module="testbed.laggard_node")
    try:
        hub_log = hub_dir / HUB_LOG_FILE
        wait_until(
            lambda: hub_log.exists() and "group rejected (tokens)" in (text := hub_log.read_text()) and "late (late)" in text,
            E2E_WAIT_S,
            "hub.log to name a rejected and a late group",
        )
        # status.json is rewritten every second: the counts reach it within a period or two of the log's lines.
        wait_until(lambda: (s := hub.status()) is not None and {"late", "tokens"} <= set(s.reasons), 10.0, "status.json")
        code, out, _ = status_cli(capsys, "--data-dir", str(hub_dir))
        assert code == 0 and "refused by reason" in out
        (refused_line,) = [line for line in out.splitlines() if re.match(r"refused \w{8}: ", line)]
        assert "late" in refused_line and "tokens 1" in refused_line

        def metrics_page() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                return response.read().decode()

        # The web process serves the view the hub fed it last: up to a status period behind status.json.
        late = r'echo2_refused_groups_total\{reason="late"\} [1-9]'
        metrics = wait_until(lambda: page if re.search(late, page := metrics_page()) else None, 10.0, "/metrics' late count")
        assert 'echo2_refused_groups_total{reason="tokens"} 1.0' in metrics
        assert re.search(r'echo2_refused_groups_total\{reason="late"\} [1-9]', metrics)
    finally:
        assert node.stop() in (0, 130), node.output()[-3000:]
        hub.stop()
    node_log = (node_dir / NODE_LOG_FILE).read_text()
    assert "hub: 1 group rejected (tokens 1): log-probs must be finite" in node_log and " late (late " in node_log
    summary = node.output()
    assert "late group" in summary and "your groups arrived after the hub moved on; this hub needs" in summary
    assert "1 group rejected (tokens): a malformed completion" in summary


@pytest.mark.parametrize(
    "reply",
    [
        {"accepted": 0, "reasons": {"Tokens\x1b[2J": 1}},  # a reason that is not one word of the vocabulary's shape
        {"accepted": 0, "reasons": {f"r{i}": 1 for i in range(40)}},  # more reasons than any hub has
        {"accepted": 0, "reasons": {"late": -1}},
        {"accepted": 0, "needed_rollouts_per_s": float("nan")},
        {"accepted": 0, "needed_rollouts_per_s": 1e30},
    ],
)
def test_a_hostile_hubs_reasons_are_refused_at_the_frame(reply) -> None:
    with pytest.raises(ValueError):
        SubmitReply.model_validate(reply)


class _Instant:
    """An engine that answers every prompt at once with one token."""

    batch_rollouts = None

    def generate(self, texts, n, sampling):
        from shared.rollout import Completion

        return [[Completion(token_ids=(5,), logprobs=(-0.5,), finish_reason="length", version=0, text="a")] * n]


def _hostile_worker(reply: Callable[[], SubmitReply]) -> tuple[Worker, Lease]:
    """A node's worker whose hub answers every submission with `reply()`, and a one-prompt lease for it."""
    from shared.messages import LeasePrompt
    from shared.rollout import SamplingParams

    class Hostile:
        peer_id = "node"

        async def submit(self, submission, deadline=None):
            return reply()

    worker = Worker(Hostile(), _Instant(), trio.Lock(), can_work=lambda: True, version_held=lambda: 0, max_rollouts_per_s=None)
    lease = Lease(
        lease_id="l" * 24,
        prompts=(LeasePrompt(prompt_id="p", text="abc"),),
        group_size=1,
        sampling=SamplingParams(max_new_tokens=1),
        min_version=0,
        deadline_s=60.0,
    )
    return worker, lease


def _view(reasons: dict[str, int]) -> NodeView:
    """The node's view with `reasons` as its counts by reason (it validates them as a status file's would be)."""
    return NodeView(
        peer_id="p",
        hub_addr="/ip4/127.0.0.1/tcp/1",
        connected=True,
        state="active",
        updated_at=0.0,
        price_per_hour=0.0,
        backend="hf",
        version_held=0,
        reasons=reasons,
    )


@pytest.mark.trio
async def test_a_hostile_hubs_words_reach_the_log_and_screen_cleaned_and_cut(caplog) -> None:
    words = "\x1b]0;owned\x07" + "x" * 10_000
    worker, lease = _hostile_worker(
        lambda: SubmitReply(
            accepted=0, rejected=(("p\x1b[2J" * 50, words),), reasons={"newer_reason": 1}, needed_rollouts_per_s=None
        )
    )
    caplog.set_level(logging.INFO, logger="echo2.node.worker")
    await worker.work(lease)
    (kept,) = worker.stats.last_refusals
    assert "\x1b" not in kept and "\x07" not in kept and len(kept) < 300
    (line,) = [r.getMessage() for r in caplog.records if r.name == "echo2.node.worker"]
    assert "\x1b" not in line and len(line) < 400 and "(newer_reason 1)" in line
    assert worker.stats.reasons == {"newer_reason": 1}
    view = _view(worker.stats.reasons)
    assert view.unpaid() == ["1 group rejected (newer_reason): a reason this echo2 does not know (the hub runs a newer one)"]


@pytest.mark.trio
async def test_a_hostile_hubs_reasons_cannot_add_up_past_the_nodes_view() -> None:
    """Each reply within the frame's bounds (32 reasons, counts to 2**53), many of them: the node's counts stay a
    valid view, and a reply counts no more groups than it refused."""
    replies = iter([{f"r{chr(97 + i // 26)}{chr(97 + i % 26)}": 2**53 for i in range(j * 32, (j + 1) * 32)} for j in range(3)])
    worker, lease = _hostile_worker(
        lambda: SubmitReply(accepted=0, rejected=(("p", "no"),), reasons=next(replies), needed_rollouts_per_s=None)
    )
    for _ in range(3):
        await worker.work(lease)
    assert len(worker.stats.reasons) == MAX_REASONS and set(worker.stats.reasons.values()) == {1}
    _view(worker.stats.reasons)


def test_the_node_says_why_it_waits_in_standby_and_counts_the_time() -> None:
    now = [100.0]
    link = LinkState(clock=lambda: now[0])
    link.enter("probing")
    now[0] = 110.0
    link.enter("standby")
    assert state_change_text("probing", "standby") == "probing -> standby"  # why follows on its own line (node/run.py)
    # Why: the node's measured rate and the hub's rule, or that it was too slow; computed by hand ($0.20 / 0.08).
    assert standby_text(0.20, 0.08, too_slow=False) == (
        "the hub ranks nodes by price per measured rollout/s: $0.20/h at 0.08 rollouts/s is $2.5/h per rollout/s, "
        "and nodes cheaper per rollout/s cover the throughput it needs"
    )
    assert standby_text(0.20, 2.9, too_slow=True).startswith(
        "every group of your last two leases arrived late (the hub measured 2.9 rollouts/s): it activates you again once your "
        "measured rate changes"
    )
    assert standby_text(0.20, None, too_slow=False).startswith("the hub has not measured your throughput yet")
    assert state_change_text("standby", "active") == "standby -> active"
    now[0] = 130.0
    assert link.standby_s() == 20.0  # the stretch under way counts
    link.enter("active")
    now[0] = 200.0
    link.enter("standby")
    now[0] = 205.0
    link.enter("connecting")  # a lost hub ends the stretch too
    now[0] = 300.0
    assert link.standby_s() == 25.0
