"""Fault injection against the real system: misbehaving nodes, hub crashes, node churn (measured and printed).

The scenarios live in testbed/fault_scenarios.py, shared with tests/test_faults.py (one test per cheat
class); see that module for what each does and counts. This script runs the ones asked for against
real hub processes and prints the figures.

Usage: python bench/faults.py [--json] [--quick] [--only bad_signature,replay,...,framed_relay,crash,churn] [--kills N]

A scenario that fails is a row of its own with its `error` (crash and churn: an `error` in place of their
figures); the others still run, and the JSON always prints.

Relay scenarios (framed_relay, forged_manifest, stalling_relay, serving_strangers) run in process
against the real Broadcaster and keepers (testbed/relay_scenarios.py).

`--only crash --kills 200` is the crash mode: 200 SIGKILLs of the hub at random moments (mid learner
step, mid submission), each followed by a restart, then the books are checked (JSON adds wall_s).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import trio

from node.hub_link import describe_failure
from testbed.fault_scenarios import (
    AUDIT_CHEATS,
    PROTOCOL_CHEATS,
    ScenarioResult,
    run_cheat,
    run_churn,
    run_crash,
    run_row,
    start_audit_hub,
    start_protocol_hub,
)
from testbed.relay_scenarios import RELAY_SCENARIOS


def run_cheats(work: Path, names: list[str], quick: bool, say) -> list[dict]:
    results = []
    for group, start in ((PROTOCOL_CHEATS, start_protocol_hub), (AUDIT_CHEATS, start_audit_hub)):
        wanted = [n for n in group if n in names]
        if not wanted:
            continue
        try:
            hub = start(work)
        except Exception as exc:  # noqa: BLE001 - its scenarios are rows that say so; the rest still run
            results += [asdict(ScenarioResult(n, error=f"hub did not start: {describe_failure(exc)}")) for n in wanted]
            continue
        try:
            for name in wanted:
                say(name)
                results.append(asdict(run_row(name, partial(run_cheat, name, hub, quick))))
        finally:
            hub.stop()
    return results


def run_figures(name: str, run: Callable[[], dict]) -> dict:
    """The crash or churn figures; when the scenario fails, its error in their place (the JSON still prints)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a failed scenario is a finding of the bench, not its end
        logging.getLogger("echo2.bench.faults").warning("%s failed", name, exc_info=exc)
        return {"error": describe_failure(exc)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of progress lines")
    parser.add_argument("--quick", action="store_true", help="fewer attempts, kills and nodes")
    parser.add_argument("--only", default="", help="comma-separated scenario names (plus crash, churn)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep hub data dirs here (default: a temp dir)")
    parser.add_argument("--kills", type=int, default=None, help="hub SIGKILLs in the crash scenario (default 6; 2 with --quick)")
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the scenarios load engines; keep stderr for progress
    from rich.console import Console

    console = Console(stderr=True)
    say = (lambda _: None) if args.json else (lambda msg: console.log(msg))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="echo2-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    unknown = only - set(PROTOCOL_CHEATS + AUDIT_CHEATS) - set(RELAY_SCENARIOS) - {"crash", "churn"}
    if unknown:
        parser.error(
            f"unknown scenario(s) {sorted(unknown)}: choose from "
            f"{', '.join([*PROTOCOL_CHEATS, *AUDIT_CHEATS, *RELAY_SCENARIOS])}, crash, churn"
        )
    names = [n for n in PROTOCOL_CHEATS + AUDIT_CHEATS if not only or n in only]
    out: dict = {"scenarios": run_cheats(work, names, args.quick, say)}
    for name, scenario in RELAY_SCENARIOS.items():  # in process: real Broadcaster, real keepers
        if not only or name in only:
            say(name)
            out["scenarios"].append(asdict(run_row(name, partial(trio.run, scenario))))
    if args.kills is not None and args.kills < 1:
        parser.error(f"--kills must be >= 1, got {args.kills}")
    if not only or "crash" in only:
        started = time.monotonic()
        out["crash"] = run_figures("crash", partial(run_crash, work, args.kills or (2 if args.quick else 6), say))
        out["crash"]["wall_s"] = round(time.monotonic() - started, 1)
    if not only or "churn" in only:
        out["churn"] = run_figures("churn", partial(run_churn, work, 4 if args.quick else 7, say))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        console.print_json(json.dumps(out))


if __name__ == "__main__":
    main()
