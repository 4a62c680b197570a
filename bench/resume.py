"""How long a hub restarted on a long history takes to serve again: prints JSON.

    python bench/resume.py [--steps 100000] [--leases 1000000] [--work-dir DIR] [--rebuild] [--json]

A real `echo-hub start --steps 1` makes a data dir (the run's record, keys, snapshots); testbed/large_store.py
then appends `--steps` learner steps and `--leases` answered leases of history through the store's own write
methods, retention included as the running hub does it. That data dir is kept under --work-dir and reused for
the same sizes (--rebuild builds it again). Each measurement copies it and starts a real `echo-hub start` on the
copy in an interpreter of its own (imports included); resume_s_large_store is the time from its start until it
answers the status protocol. Keys: resume_s_large_store, store_bytes, steps, leases, build_s (null when reused).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.cli.status import fetch_status
from shared.layout import HUB_STORE_FILE
from testbed.harness import ADDR_RE
from testbed.large_store import build_large_store

FIRST_RUN_TIMEOUT_S = 600.0
SERVE_TIMEOUT_S = 300.0
BUILT_FILE = "built.json"


def hub_argv(data_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hub.cli.main",
        "start",
        "--data-dir",
        str(data_dir),
        "--steps",
        str(steps),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--no-progress",
        *extra,
    ]


def built(base: Path, steps: int, leases: int, rebuild: bool, say) -> tuple[int, float | None]:
    """The data dir with the large history (built unless one of these sizes is there): its last step, build_s."""
    marker = base / BUILT_FILE
    if not rebuild and marker.exists():
        found = json.loads(marker.read_text())
        if (found["steps"], found["leases"]) == (steps, leases):
            return found["last_step"], None
    shutil.rmtree(base, ignore_errors=True)
    started = time.monotonic()
    say("a real one-step run makes the data dir")
    subprocess.run(hub_argv(base, 1), cwd=ROOT, check=True, capture_output=True, timeout=FIRST_RUN_TIMEOUT_S)
    say(f"appending {steps} steps and {leases} leases of history")
    large = build_large_store(base, steps, leases)
    marker.write_text(json.dumps({"steps": steps, "leases": leases, "last_step": large.steps}))
    return large.steps, time.monotonic() - started


def time_resume(base: Path, work: Path, last_step: int) -> float:
    """Seconds from `echo-hub start` on a copy of `base` until the hub answers a status request."""
    data = work / "resumed"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(base, data)
    log = work / "resumed-hub.out"
    with log.open("w") as out:
        started = time.monotonic()
        hub = subprocess.Popen(
            hub_argv(data, last_step + 1000, "--local-nodes", "0"), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        while (match := ADDR_RE.search(log.read_text(errors="replace"))) is None:
            if hub.poll() is not None or time.monotonic() - started > SERVE_TIMEOUT_S:
                raise RuntimeError(f"the hub did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        while True:
            try:
                fetch_status(match.group(1))
                return time.monotonic() - started
            except Exception:  # noqa: BLE001 -- not serving yet: ask again until the deadline
                if time.monotonic() - started > SERVE_TIMEOUT_S:
                    raise
                time.sleep(0.1)
    finally:
        hub.terminate()
        hub.wait(timeout=120)
        shutil.rmtree(data, ignore_errors=True)  # a copy of the large store: the output file says what happened


def base_dir(work_dir: Path, steps: int, leases: int) -> Path:
    """Where the large data dir of `steps` and `leases` is built, and found again by a later run."""
    return work_dir / f"base-{steps}-{leases}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="learner steps of history")
    parser.add_argument("--leases", type=int, default=1_000_000, help="answered leases of history")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "echo2-bench-resume",
        help="where the large data dir is kept between runs",
    )
    parser.add_argument("--rebuild", action="store_true", help="build the large data dir again")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args(argv)

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    base = base_dir(args.work_dir, args.steps, args.leases)
    last_step, build_s = built(base, args.steps, args.leases, args.rebuild, say)
    say("timing a real hub start on a copy")
    resume_s = time_resume(base, args.work_dir, last_step)
    print(
        json.dumps(
            {
                "resume_s_large_store": round(resume_s, 2),
                "store_bytes": (base / HUB_STORE_FILE).stat().st_size,
                "steps": last_step,
                "leases": args.leases,
                "build_s": None if build_s is None else round(build_s, 1),
            },
            indent=None if args.json else 2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
