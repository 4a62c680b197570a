"""The hub's public web view: a status page, /api/status (the status protocol's redacted view as JSON) and /metrics
(Prometheus text), served by hypercorn's trio worker in a process of its own, off the hub's event loop. Read-only: no
route changes state.

Every request a flood makes is parsed and answered, if only with a 429, so none may be on the protocol's loop: the hub
(`serve_web`) binds the sockets, starts `python -m hub.service.web` at a lower CPU priority (WEB_NICENESS) with them,
and writes it the status board's public view (the redacted build, hub/service/status.py) once per build through its
stdin; the process (`main`) serves only that view, so whatever it is asked costs the hub one pipe write per board
period, and it holds nothing a stranger may not read (no price, cost or hardware of a node). It ends when the hub
closes the pipe, or dies.

This module imports nothing of the hub's state (the board is a type only), so the web process starts light."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib.resources import files
from typing import TYPE_CHECKING, get_args

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from shared.messages import GROUP_VERDICTS, LEADERS_MAX, GroupReason, HubStatus, NodeState, Reachability, ToolTotals
from shared.tools import RolloutEnd
from shared.web import by_label, gauge, listening_sockets, serve, urls

if TYPE_CHECKING:
    from hub.service.status import StatusBoard

# The web process runs at this much lower CPU priority (nice): under a flood the protocol's loop gets the cores first.
WEB_NICENESS = 10
# How long the web process has to end once the hub closes its pipe, before it is killed.
WEB_EXIT_S = 5.0
# A view frame's length prefix (bytes, big-endian); a frame is at most HubStatus.MAX_BYTES.
VIEW_LENGTH_BYTES = 4
STEP_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PAGE = files("hub.service").joinpath("web_page.html").read_text().replace("{LEADERS_MAX}", str(LEADERS_MAX))


class StatusCollector:
    """prometheus_client collector over one HubStatus (set once per board build), and the learner's step time as a
    histogram fed from the status's step history: every step since the last build it saw (the history holds the last
    HISTORY_POINTS, far more than a scrape interval's worth)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.status: HubStatus | None = None
        self.step_seconds = Histogram(
            "echo2_learner_step_seconds",
            "learner step time (this hub process's steps)",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.observed_step: int | None = None
        registry.register(self)

    def update(self, status: HubStatus) -> None:
        """Take the status a scrape reports; steps taken before the first scrape are history, not observations."""
        self.status = status
        if self.observed_step is not None:
            for point in status.history:
                if point.step > self.observed_step:
                    self.step_seconds.observe(point.t_train_s)
        self.observed_step = status.history[-1].step if status.history else 0

    def collect(self) -> Iterator[Metric]:
        if self.status is not None:
            yield from status_metrics(self.status)


def _count(values: list[str], known: tuple[str, ...] = ()) -> dict[str, float]:
    """How many of each value, every known one present (a 0 series keeps dashboards' queries defined)."""
    counts = dict.fromkeys(known, 0.0)
    for value in values:
        counts[value] = counts.get(value, 0.0) + 1
    return counts


def status_metrics(s: HubStatus) -> list[Metric]:
    """The echo2_ metrics of one status: gauges of the run, the capacity model and the fleet; counters of groups
    and cost (all-time, restored on restart)."""
    last_eval = s.evals[-1].reward if s.evals else None
    return [
        gauge("echo2_learner_step", "learner steps done", s.step),
        gauge("echo2_learner_steps_target", "learner steps to run (0: until interrupted)", s.steps_target),
        gauge("echo2_learner_version", "policy version the learner publishes", s.version),
        gauge("echo2_staleness", "S in force: the staleness budget (it moves under --staleness auto)", s.staleness),
        gauge("echo2_kappa", "kappa in force: steps between snapshots", s.kappa),
        gauge("echo2_rollout_reward", "mean rollout reward of the last step", s.reward_mean),
        gauge(
            "echo2_tool_calls_per_rollout",
            "rounds of tool calls per rollout (a tool-using run's, recent steps)",
            s.recent_tool_calls(),
        ),
        gauge("echo2_eval_reward", "mean reward of the last held-out evaluation", last_eval),
        gauge("echo2_bubble_ratio", "share of the last step the learner waited for rollouts", s.bubble),
        gauge("echo2_predicted_bubble_ratio", "the capacity model's predicted bubble", s.predicted_bubble),
        gauge("echo2_train_step_seconds", "mean learner step time (recent steps)", s.t_train_s),
        gauge("echo2_broadcast_seconds", "T_bcast: time for the last version to reach the fleet", s.t_bcast_s),
        gauge("echo2_mu_pool_rollouts_per_second", "mu_pool: rollout rate of the active pool", s.mu_pool),
        gauge("echo2_mu_min_rollouts_per_second", "mu_min: rollout rate the learner needs to never wait", s.mu_min),
        gauge("echo2_mu_target_rollouts_per_second", "mu_target: rollout rate the scheduler aims at", s.mu_target),
        gauge("echo2_usable_fraction", "share of accepted groups the learner trains on (recent window)", s.usable_fraction),
        gauge("echo2_snapshot_bytes", "bytes of the newest full snapshot", s.snapshot_bytes),
        gauge("echo2_delta_bytes", "bytes of the newest delta", s.delta_bytes),
        gauge("echo2_open_leases", "leases out now", s.open_leases),
        by_label(
            GaugeMetricFamily("echo2_nodes", "nodes listed, by state", labels=["state"]),
            _count([n.state for n in s.nodes], get_args(NodeState)),
        ),
        by_label(
            GaugeMetricFamily("echo2_nodes_by_reachability", "nodes listed, by reachability", labels=["reachability"]),
            _count([n.reachability for n in s.nodes], get_args(Reachability)),
        ),
        by_label(
            GaugeMetricFamily("echo2_nodes_by_link", "nodes listed, by how they get snapshots", labels=["link"]),
            _count([n.link or "none" for n in s.nodes]),
        ),
        by_label(
            CounterMetricFamily("echo2_groups", "groups received, by verdict", labels=["verdict"]),
            {v: getattr(s.totals, v) for v in GROUP_VERDICTS},
        ),
        by_label(
            CounterMetricFamily(
                "echo2_refused_groups",
                "groups refused, by reason: late is the late verdict, every other one a rejection (this hub process)",
                labels=["reason"],
            ),
            {**{r.value: 0.0 for r in GroupReason}, **{why: float(n) for why, n in s.reasons.items()}},
        ),
        CounterMetricFamily("echo2_refused_requests", "requests refused at the protocol level", value=s.totals.refused),
        CounterMetricFamily("echo2_dropped_stale_groups", "accepted groups dropped as too stale", value=s.dropped_stale),
        CounterMetricFamily("echo2_submissions", "submissions received from nodes (this hub process)", value=s.submissions),
        CounterMetricFamily("echo2_heartbeats", "heartbeats received from nodes (this hub process)", value=s.heartbeats),
        by_label(
            CounterMetricFamily("echo2_audits", "audits of submissions, by result (this hub process)", labels=["result"]),
            {"passed": s.audits_passed, "failed": s.audits_failed, "unverified": s.audits_unverified},
        ),
        *([] if s.tools is None else tool_metrics(s.tools)),
    ]


def tool_metrics(tools: ToolTotals) -> list[Metric]:
    """A tool-using run's tools (this hub process): calls, the tools' own errors, rollouts ended early by reason, the
    sandbox's time; every reason present (a 0 series keeps dashboards' queries defined)."""
    return [
        CounterMetricFamily("echo2_tool_calls", "tool calls the hub ran", value=tools.calls),
        gauge("echo2_tool_calls_per_second", "tool calls per second over the last minute", tools.calls_per_s),
        CounterMetricFamily(
            "echo2_tool_errors", "tool calls the tool refused (it raised; the model reads it)", value=tools.errors
        ),
        by_label(
            CounterMetricFamily("echo2_tool_rollout_ends", "tool-using rollouts ended early, by reason", labels=["reason"]),
            {**{r.value: 0.0 for r in RolloutEnd}, **{why: float(n) for why, n in tools.ends.items()}},
        ),
        CounterMetricFamily(
            "echo2_tool_environment_seconds",
            "wall seconds the sandbox spent on tool calls, environments' resets and rewards",
            value=tools.environment_s,
        ),
    ]


class PublicView:
    """The status board's last public build as the hub wrote it: the JSON /api/status serves, parsed once per build
    for /metrics (and only when scraped)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self._status: HubStatus | None = None

    def update(self, body: bytes) -> None:
        self.body, self._status = body, None

    def status(self) -> HubStatus:
        if self._status is None:
            self._status = HubStatus.model_validate_json(self.body)
        return self._status


def web_app(view: PublicView) -> ASGIApp:
    """The page, /api/status and /metrics over the public `view`."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StatusCollector(registry)

    async def page(_request: object) -> Response:
        return HTMLResponse(
            PAGE,
            headers={
                "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; img-src 'none'"
            },
        )

    async def api_status(_request: object) -> Response:
        return Response(view.body, media_type="application/json")

    last: list[tuple[bytes, bytes]] = []  # the view's body and its exposition: encoded once per build

    async def metrics(_request: object) -> Response:
        if not last or last[0][0] is not view.body:
            collector.update(view.status())
            last[:] = [(view.body, generate_latest(registry))]
        return Response(last[0][1], media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/", page), Route("/api/status", api_status), Route("/metrics", metrics)]
    return Starlette(routes=routes)


# -- the hub's side ------------------------------------------------------------------------------------------


async def serve_web(board: StatusBoard, bind: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the web view at `bind` (HOST:PORT) from a process of its own until cancelled (see the module docstring);
    reports the bound addresses once they listen. The process ending first is an error: the page is part of the run."""
    sockets = listening_sockets(bind)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "hub.service.web", bind, *(str(sock.fileno()) for sock in sockets)],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal is the hub's to handle; the process ends with the pipe
            pass_fds=[sock.fileno() for sock in sockets],
        )
        task_status.started(urls(sockets))
    finally:
        for sock in sockets:  # the process holds them now (or nobody does)
            sock.close()
    assert process.stdin is not None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_feed, board, process.stdin)
            code = await process.wait()
            nursery.cancel_scope.cancel()
        raise RuntimeError(f"the web server's process exited with code {code} (--http {bind})")
    finally:
        with trio.CancelScope(shield=True):
            await process.stdin.aclose()
            with trio.move_on_after(WEB_EXIT_S):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _feed(board: StatusBoard, pipe: trio.abc.SendStream) -> None:
    """Write the board's public view to the web process whenever the board built a new one."""
    from hub.service.status import STATUS_PERIOD_S

    sent = b""
    while True:
        body = await board.public_json()
        if body != sent:
            try:
                await pipe.send_all(len(body).to_bytes(VIEW_LENGTH_BYTES, "big") + body)
            except trio.BrokenResourceError:
                # The process died: serve_web says so with its exit code (process.wait), not with a broken pipe.
                await trio.sleep_forever()
            sent = body
        await trio.sleep(STATUS_PERIOD_S)


# -- the web process -------------------------------------------------------------------------------------------


async def _receive_exactly(pipe: trio.abc.ReceiveStream, size: int) -> bytes | None:
    """`size` bytes from the hub's pipe; None when the hub closed it."""
    data = bytearray()
    while len(data) < size:  # appended in place: a view of megabytes is not copied once per chunk
        chunk = await pipe.receive_some(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


async def _next_view(pipe: trio.abc.ReceiveStream) -> bytes | None:
    """The next view frame the hub wrote; None when the hub closed the pipe."""
    head = await _receive_exactly(pipe, VIEW_LENGTH_BYTES)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > HubStatus.MAX_BYTES:
        raise ValueError(f"a view frame of {size} bytes, past HubStatus.MAX_BYTES")
    return await _receive_exactly(pipe, size)


async def _serve_views(bind: str, sockets: list[socket.socket]) -> None:
    """Serve the views the hub writes on stdin, on `sockets`, until it closes the pipe."""
    pipe = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    first = await _next_view(pipe)
    if first is None:
        return
    view = PublicView(first)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve(web_app(view), bind, sockets=sockets))
        while (body := await _next_view(pipe)) is not None:
            view.update(body)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    """`python -m hub.service.web BIND FD...`: the web process `serve_web` starts, on the listening sockets FD."""
    parser = argparse.ArgumentParser(description="the hub's web server process (started by echo-hub start --http)")
    parser.add_argument("bind")
    parser.add_argument("fds", nargs="+", type=int)
    args = parser.parse_args(argv)
    os.nice(WEB_NICENESS)
    sockets = [socket.socket(fileno=fd) for fd in args.fds]
    trio.run(_serve_views, args.bind, sockets)


if __name__ == "__main__":
    main()
