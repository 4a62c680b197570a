"""A foreign libp2p stranger against the real hub on loopback: how long the hub lets its bad streams and its
connection live (untrusted peers, round four, item 8), printed as JSON.

The hub is the real service, state and store in process (testbed/inproc.py) with the default trust limits
(a stranger's connection ends after trust.idle_connection_s idle, and NON_MEMBER_LIFETIME_S however busy). The
stranger opens every /echo2/ protocol on one connection, sends a frame header claiming a 4 GiB body and
--garbage-bytes of garbage on each (js: in 64 KiB pieces as back-pressure allows, or with --pattern one-write in
one `send`, as a js-libp2p peer did in issue 65), half-closes, and reports when each stream and the connection ended:
- js: js-libp2p (TCP, Noise, Yamux) from bench/foreign/ (`npm ci` there once; node >= 20);
- py: a raw py-libp2p host sending the same bytes (testbed/strangers.py), which the suite also runs.

With --busy-every-s the stranger opens one more bad status stream that often while it waits, so it is never idle
and only the lifetime ends its connection (--lifetime-s shortens the hub's, NON_MEMBER_LIFETIME_S by default).

Usage: python bench/foreign_peer.py [--impl js,py] [--give-up-s 150] [--garbage-bytes 1048576]
           [--busy-every-s 1] [--lifetime-s 120] [--pattern pieces|one-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import trio

from hub.config import HubConfig, LearnerConfig, LeaseConfig, TrustConfig
from hub.service.handlers import NON_MEMBER_LIFETIME_S
from shared.crypto import Identity
from shared.default_model import ensure_default_model
from shared.messages import STATUS_PROTOCOL
from shared.net import running_host
from testbed.inproc import LOOPBACK, inproc_hub
from testbed.strangers import bad_frame_header, echo2_protocols, raw_probe

FOREIGN_DIR = REPO_ROOT / "bench" / "foreign"
# Checks in a hub thread (no check workers to spawn); every limit a stranger meets is the default one.
CONFIG = HubConfig(
    learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=2),
    lease=LeaseConfig(prompts_per_lease=2),
    trust=TrustConfig(check_procs=0),
)


def summary(report: dict, lifetime_s: float) -> dict:
    """The figures the issue asks for: the longest a stream stayed open, the streams' seconds in all, and when the
    connection went, against the hub's cap."""
    ended = [s["ended_s"] if s["ended_s"] is not None else report["give_up_s"] for s in report["streams"] if s["opened_s"]]
    opened = [s["opened_s"] for s in report["streams"] if s["opened_s"]]
    return {
        "streams_opened": len(opened),
        "streams_ended_by_hub": sum(1 for s in report["streams"] if s["opened_s"] and s["ended_s"] is not None),
        "longest_stream_open_s": max((e - o for e, o in zip(ended, opened, strict=True)), default=None),
        "stream_seconds_in_all": sum(e - o for e, o in zip(ended, opened, strict=True)),
        "connection_closed_s": report["connection_closed_s"],
        "busy_streams": report["busy_streams"],
        "hub_cap_s": {"idle": CONFIG.trust.idle_connection_s, "lifetime": lifetime_s},
    }


async def js_probe(
    hub_addr: str, protocols: list[str], garbage_bytes: int, give_up_s: float, busy_every_s: float | None, pattern: str
) -> dict:
    node = shutil.which("node")
    if node is None:
        raise SystemExit("bench/foreign_peer.py --impl js needs node (>= 20): apt-get install -y nodejs npm")
    if not (FOREIGN_DIR / "node_modules").is_dir():
        raise SystemExit(f"js-libp2p is not installed: cd {FOREIGN_DIR} && npm ci")
    args = {
        "hub": hub_addr,
        "give_up_s": give_up_s,
        "garbage_bytes": garbage_bytes,
        "pattern": pattern,
        "protocols": [{"protocol": p, "header_hex": bad_frame_header(p).hex()} for p in protocols],
        "busy": None
        if busy_every_s is None
        else {"protocol": STATUS_PROTOCOL, "header_hex": bad_frame_header(STATUS_PROTOCOL).hex(), "every_s": busy_every_s},
    }
    done = await trio.run_process([node, "probe.mjs", json.dumps(args)], cwd=FOREIGN_DIR, capture_stdout=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


async def run(impl: str, args: argparse.Namespace, work: Path, model_dir: Path) -> dict:
    garbage_bytes, give_up_s, busy_every_s, lifetime_s = args.garbage_bytes, args.give_up_s, args.busy_every_s, args.lifetime_s
    protocols = echo2_protocols()
    async with inproc_hub(work, model_dir, CONFIG) as hub, AsyncExitStack() as stack:
        hub.service.stranger_lifetime_s = lifetime_s
        if impl == "js":
            report = await js_probe(hub.addr, protocols, garbage_bytes, give_up_s, busy_every_s, args.pattern)
        else:
            host, _ = await stack.enter_async_context(running_host(Identity.generate(), [LOOPBACK]))
            probe = await raw_probe(host, hub.addr, protocols, garbage_bytes, give_up_s, busy_every_s)
            report = dataclasses.asdict(probe)
            for stream in report["streams"]:  # as the js probe reports it
                reply = stream.pop("reply")
                stream["reply_bytes"], stream["reply_head"] = len(reply), reply[:200].decode("latin-1")
    return {"summary": summary(report, lifetime_s), **report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="js,py", help="comma-separated: js (js-libp2p), py (raw py-libp2p)")
    parser.add_argument("--give-up-s", type=float, default=NON_MEMBER_LIFETIME_S + 30.0)
    parser.add_argument("--garbage-bytes", type=int, default=1 << 20)
    parser.add_argument("--busy-every-s", type=float, default=None, help="open a bad status stream this often meanwhile")
    parser.add_argument(
        "--pattern",
        choices=("pieces", "one-write"),
        default="pieces",
        help="js: send the frame in 64 KiB pieces as back-pressure allows, or in one send",
    )
    parser.add_argument("--lifetime-s", type=float, default=NON_MEMBER_LIFETIME_S, help="the hub's stranger lifetime")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = ensure_default_model(progress=False)
    results = {}
    for impl in args.impl.split(","):
        with tempfile.TemporaryDirectory() as work:
            results[impl] = trio.run(run, impl, args, Path(work), model_dir)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
