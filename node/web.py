"""A volunteer's own page, /api/status (its NodeView, what it writes to node_status.json) and /metrics, on the node's
event loop (`echo-node join --http HOST:PORT`; off by default: it shows the node's price and earnings)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from shared.messages import GROUP_VERDICTS, GroupReason, NodeView
from shared.web import by_label, gauge, serve

# The view as a key/value table, refreshed every two seconds; every value is set as text.
PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>echo2 node</title>
<style>body{font:14px system-ui,sans-serif;margin:1.5em}td{padding:.15em .8em;border-bottom:1px solid #ddd}</style></head>
<body><h1>echo2 node</h1><table id="view"><tbody></tbody></table><script>
"use strict";
async function poll() {
  const v = await (await fetch("/api/status", {cache: "no-store"})).json();
  const body = document.querySelector("#view tbody");
  body.replaceChildren();
  for (const [k, x] of Object.entries(v)) {
    if (k === "events") continue;
    const tr = document.createElement("tr");
    for (const text of [k, typeof x === "object" && x !== null ? JSON.stringify(x) : String(x)]) {
      const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}
poll(); setInterval(poll, 2000);
</script></body></html>"""


def view_metrics(v: NodeView) -> list[Metric]:
    """The echo2_node_ metrics of one view (counters since this node process started, or as the hub replied)."""
    return [
        gauge("echo2_node_connected", "1 while joined to the hub", float(v.connected)),
        gauge("echo2_node_version_held", "newest verified snapshot held (-1: none)", v.version_held),
        gauge("echo2_node_rollouts_per_second", "measured generation rate", v.rollouts_per_s),
        gauge("echo2_node_tokens_per_second", "measured generation rate in tokens", v.tokens_per_s),
        CounterMetricFamily("echo2_node_leases", "leases done", value=v.leases_done),
        by_label(
            CounterMetricFamily("echo2_node_groups", "groups the hub decided about, by verdict", labels=["verdict"]),
            {name: getattr(v.tallies, name) for name in GROUP_VERDICTS},
        ),
        by_label(
            CounterMetricFamily(
                "echo2_node_refused_groups", "groups the hub refused, by reason (as it replied)", labels=["reason"]
            ),
            {**{r.value: 0.0 for r in GroupReason}, **{why: float(n) for why, n in v.reasons.items()}},
        ),
        CounterMetricFamily("echo2_node_earnings_usd", "booked by the hub for this node's leases", value=v.earnings_usd),
        CounterMetricFamily("echo2_node_relayed_bytes", "snapshot bytes served to successors", value=v.relayed_bytes),
        CounterMetricFamily("echo2_node_busy_seconds", "time spent generating", value=v.busy_s),
        CounterMetricFamily("echo2_node_paid_seconds", "lease seconds the hub booked pay for (as it replied)", value=v.paid_s),
    ]


class ViewCollector:
    """prometheus_client collector over the node's view now."""

    def __init__(self, view: Callable[[], NodeView]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        yield from view_metrics(self.view())


def node_app(view: Callable[[], NodeView]) -> ASGIApp:
    """The node's page, /api/status and /metrics over `view` (built on the event loop, as the status file is)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(view))

    async def page(_request: object) -> Response:
        return HTMLResponse(PAGE)

    async def api_status(_request: object) -> Response:
        return Response(view().model_dump_json(), media_type="application/json")

    async def metrics(_request: object) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/", page), Route("/api/status", api_status), Route("/metrics", metrics)])


async def serve_node_web(view: Callable[[], NodeView], bind: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the node's page at `bind` (HOST:PORT) until cancelled."""
    await serve(node_app(view), bind, task_status=task_status)
