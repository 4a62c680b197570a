"""Real processes on loopback for integration tests: a hub (`echo-hub start`) and nodes (`echo-node join`),
forked from a server that imported them once (tests/forked.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.layout import HUB_STATUS_FILE, HUB_STORE_FILE
from shared.messages import HubStatus
from tests import forked

ADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)\s*$", re.M)
START_TIMEOUT_S = 120.0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class Proc:
    process: subprocess.Popen | forked.Forked
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class HubProc(Proc):
    addr: str
    data_dir: Path

    def status(self) -> HubStatus | None:
        path = self.data_dir / HUB_STATUS_FILE
        try:
            return HubStatus.model_validate_json(path.read_text())
        except (OSError, ValueError):
            return None


def free_port() -> int:
    """A loopback TCP port free right now (for a hub that must keep its address across a restart)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(data_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Read a hub's store, read-only (WAL: a running hub's writer is never blocked)."""
    db = sqlite3.connect(f"file:{data_dir / HUB_STORE_FILE}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def start_hub(data_dir: Path, *args: str, port: int = 0, wait: bool = True) -> HubProc:
    """`echo-hub start` on 127.0.0.1 with `args` (e.g. --local-nodes 0 --steps 5); returns once it printed its address."""
    data_dir.mkdir(parents=True, exist_ok=True)
    # Beside the data dir, not in it: `--fresh` moves the data dir away while the hub writes its output.
    log = data_dir.parent / f"{data_dir.name}-hub-{time.time_ns()}.out"
    argv = ["start", "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--no-progress", *args]
    process = forked.spawn("hub.cli", argv, str(log), _env())
    hub = HubProc(process, log, "", data_dir)
    if wait:
        def printed() -> str | None:
            if process.poll() is not None:
                raise RuntimeError(f"hub exited with {process.returncode}:\n{hub.output()[-3000:]}")
            match = ADDR_RE.search(hub.output())
            return match.group(1) if match else None

        hub.addr = wait_until(printed, START_TIMEOUT_S, "the hub to print its address")
    return hub


def start_node(hub_addr: str, data_dir: Path, *args: str, price: float = 0.35, nice: int = 0) -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / f"node-{time.time_ns()}.out"
    argv = ["join", "--hub", hub_addr, "--price", str(price), "--backend", "hf",
            "--device", "cpu", "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0", *args]
    process = forked.spawn("node.cli", argv, str(log), _env(), nice=nice)
    return Proc(process, log)


def node_peer_id(node: Proc, timeout_s: float = 60.0) -> str:
    """The node's peer id, from the line it prints on start."""
    pattern = re.compile(r"echo-node (\w+) joining")
    return wait_until(lambda: (m := pattern.search(node.output())) and m.group(1), timeout_s, "the node to start")
