"""The hub's public web view: a status page, /api/status (the status protocol's redacted view as JSON) and /metrics
(Prometheus text), served by hypercorn's trio worker on the hub's own event loop. Read-only: no route changes state.

Every route reads the status board's last build (hub/service/status.py), so a scrape or a page costs at most one
encoding per board period, whoever asks; prices, costs and hardware of nodes never leave through here."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import files
from typing import get_args

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from hub.service.status import LEADERS_MAX, StatusBoard
from shared.messages import GROUP_VERDICTS, GroupReason, HubStatus, NodeState, Reachability
from shared.web import by_label, gauge, serve

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
    ]


def web_app(board: StatusBoard) -> ASGIApp:
    """The page, /api/status and /metrics over `board`."""
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
        return Response(await board.public_json(), media_type="application/json")

    last: list[tuple[HubStatus, bytes]] = []  # the board's last build and its exposition: encoded once per build

    async def metrics(_request: object) -> Response:
        status = await board.latest()
        if not last or last[0][0] is not status:
            collector.update(status)
            last[:] = [(status, generate_latest(registry))]
        return Response(last[0][1], media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/", page), Route("/api/status", api_status), Route("/metrics", metrics)]
    return Starlette(routes=routes)


async def serve_web(board: StatusBoard, bind: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the web view at `bind` (HOST:PORT) until cancelled; reports the bound addresses when listening."""
    await serve(web_app(board), bind, task_status=task_status)
