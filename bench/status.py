"""What the status protocol costs the hub's event loop, at fleets of throwaway identities: prints JSON.

    python bench/status.py [--identities 300,23000] [--json]

The real hub service and status board in process (testbed/inproc.py), its fleet filled with `--identities`
records, half live and half gone two hours ago (as throwaway joins leave them). Side by side:
- `per_request_ms_rebuilt`: CPU of what a status request did before the board cached it (build the
  view from every node, redact, encode), on the event loop, per request;
- `per_request_ms_served`: CPU per request as served now from the frame of the board's last build
  (built at most once per second, each view encoded once), averaged over 200 requests: what one more
  request costs, builds left out;
- `cpu_ms_per_s_asked`: the hub process's CPU per second of wall time while a stranger asks for its view
  ASK_PER_S times a second for ASK_SPAN_S: the builds and encodes the fleet's size costs, included;
- `build_ms`: one build (once per second whoever asks), `encode_ms`: one view's encoding (in a worker
  thread), `frame_bytes` and `nodes_listed` of the stranger's view.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio

from hub.records.fleet import NodeRecord
from shared.messages import HubStatus
from shared.wire import HEADER, encode_message
from testbed.inproc import PERMISSIVE_CONFIG as CONFIG
from testbed.inproc import inproc_hub

ASK_PER_S = 100.0
ASK_SPAN_S = 3.0


async def measure(identities: int, work: Path) -> dict:
    from shared.default_model import ensure_default_model

    async with inproc_hub(work, ensure_default_model(progress=False), CONFIG) as hub:
        now = time.time()
        for i in range(identities):
            live = i % 2 == 1
            hub.state.fleet.put(
                NodeRecord(
                    peer_id=f"throwaway{i}".replace("0", "z"),  # base58, as peer ids are
                    price_per_hour=1.0,
                    link_bps=1e8,
                    backend="hf",
                    hardware="x" * 32,
                    listen_addrs=(),
                    remote_ip="10.0.0.1",
                    last_seen=now if live else now - 7200,
                    state="probing" if live else "gone",
                )
            )
        board = hub.service.status.__self__
        await board.encoded(False, 50)
        started = time.process_time()
        for _ in range(10):
            encode_message(board.snapshot(50).redact())
        rebuilt = (time.process_time() - started) / 10
        started = time.process_time()
        for _ in range(200):
            await board.encoded(False, 50)
        served = (time.process_time() - started) / 200
        started, started_cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < ASK_SPAN_S:
            await board.encoded(False, 50)
            await trio.sleep(1.0 / ASK_PER_S)
        asked = (time.process_time() - started_cpu) / (time.perf_counter() - started)
        started = time.process_time()
        await board._build()
        build = time.process_time() - started
        started = time.perf_counter()
        frame = await board.encoded(False, 50)
        encode = time.perf_counter() - started
        listed = len(HubStatus.model_validate_json(frame[HEADER.size :]).nodes)
    return {
        "identities": identities,
        "per_request_ms_rebuilt": round(rebuilt * 1e3, 3),
        "per_request_ms_served": round(served * 1e3, 3),
        "cpu_ms_per_s_asked": round(asked * 1e3, 1),
        "build_ms": round(build * 1e3, 1),
        "encode_ms": round(encode * 1e3, 1),
        "frame_bytes": len(frame),
        "nodes_listed": listed,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--identities", default="300,23000", help="comma-separated fleet sizes")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="echo2-status-") as scratch:
        for n in (int(x) for x in args.identities.split(",")):
            rows.append(trio.run(measure, n, Path(scratch) / str(n)))
            if not args.json:
                print(rows[-1], file=sys.stderr)
    out = {"rows": rows}
    print(json.dumps(out, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
