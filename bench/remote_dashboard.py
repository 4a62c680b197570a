"""A remote dashboard against a real hub for a while (issue 67 item 5): prints JSON.

    python bench/remote_dashboard.py [--seconds 600] [--json]

A real `echo-hub start` (its own interpreter, as a user starts it; `--local-nodes 0 --steps 0`: the stranger rules
need no training) and the remote dashboard's own client (tui/sources.py HubSource, over libp2p) polling at the
remote dashboard's pace (tui/cli.py `hub_refresh_s`) for `--seconds`, with the hub's default limits (a stranger's
connection 15 s idle, 120 s however busy; hub/trust/watchers.py). Reports the answers by kind (`status`,
`throttled`, `unreachable`) and the hub.log lines that name the dashboard's peer id (a closed connection is logged
at least once per 10 s: none means none was closed). Before status watchers, past 120 s the hub closed the
dashboard's connection at every poll: 60 "closing the long-held connection" lines in 2 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.layout import HUB_LOG_FILE
from shared.messages import HubStatus
from testbed.harness import start_hub
from tui.cli import hub_refresh_s
from tui.sources import HubSource, Throttled, Unreachable


async def poll(source: HubSource, seconds: float, period_s: float) -> Counter[str]:
    """The dashboard's fetch every `period_s` for `seconds`, its answers counted by kind."""
    kinds: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        result = await source.fetch()
        if isinstance(result, HubStatus):
            kinds["status"] += 1
        elif isinstance(result, Throttled):
            kinds["throttled"] += 1
        else:
            assert isinstance(result, Unreachable)
            kinds["unreachable"] += 1
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))
    return kinds


def measure(seconds: float, work: Path) -> dict:
    data = work / "hub"
    hub = start_hub(data, "--local-nodes", "0", "--steps", "0", command_line=True)
    source = HubSource(hub.addr)
    try:
        period_s = hub_refresh_s()
        kinds = asyncio.run(poll(source, seconds, period_s))
        peer = source.identity.peer_id
    finally:
        source.close()
        code = hub.stop()
    log = (data / HUB_LOG_FILE).read_text(errors="replace").splitlines()
    return {
        "seconds": seconds,
        "poll_period_s": period_s,
        "answers": dict(kinds),
        "hub_log_lines_naming_the_dashboard": len([line for line in log if peer in line]),
        "hub_log_closing_lines": len([line for line in log if "closing the" in line]),
        "hub_exit_code": code,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the dashboard polls (default 600)")
    parser.add_argument("--json", action="store_true", help="one JSON object (else indented)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        figures = measure(args.seconds, Path(work))
    print(json.dumps(figures) if args.json else json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
