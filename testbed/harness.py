"""Real processes on loopback for integration tests: a hub (`echo-hub start`) and nodes (`echo-node join`),
forked from a server that imported them once (testbed/forked.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.layout import HUB_STATUS_FILE, HUB_STORE_FILE
from shared.messages import HubStatus
from shared.snapshot import SIGNATURE_BYTES, Manifest, blake3_hex, snapshot_paths
from testbed import forked

ADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)\s*$", re.M)
START_TIMEOUT_S = 120.0
ABORT_WAIT_S = 5.0  # for a hung process's stack dump, before SIGKILL


def _env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a process started from the command line dumps its stacks on SIGABRT too (wait_or_kill).
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


@dataclass
class Proc:
    process: subprocess.Popen | forked.Forked
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait_or_kill(timeout_s)

    def wait_or_kill(self, timeout_s: float) -> int:
        """Its exit status, once it exits or, after timeout_s, is killed: first by SIGABRT, on which faulthandler
        writes every thread's stack to its output (where a hung stop waited), then by SIGKILL."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)
            try:
                self.process.wait(timeout=ABORT_WAIT_S)
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


def start_hub(data_dir: Path, *args: str, port: int = 0, wait: bool = True, command_line: bool = False) -> HubProc:
    """`echo-hub start` on 127.0.0.1 with `args` (e.g. --local-nodes 0 --steps 5); returns once it printed its address.
    command_line: in an interpreter of its own, started as a user starts it (what a benchmark of the hub's memory
    measures), not forked from the server."""
    data_dir.mkdir(parents=True, exist_ok=True)
    # Beside the data dir, not in it: `--fresh` moves the data dir away while the hub writes its output.
    log = data_dir.parent / f"{data_dir.name}-hub-{time.time_ns()}.out"
    argv = ["start", "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--no-progress", *args]
    if command_line:
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "hub.cli.main", *argv], stdout=out, stderr=subprocess.STDOUT, env=_env()
            )
    else:
        process = forked.spawn("hub.cli.main", argv, str(log), _env())
    hub = HubProc(process, log, "", data_dir)
    if wait:

        def printed() -> str | None:
            if process.poll() is not None:
                raise RuntimeError(f"hub exited with {process.returncode}:\n{hub.output()[-3000:]}")
            match = ADDR_RE.search(hub.output())
            return match.group(1) if match else None

        hub.addr = wait_until(printed, START_TIMEOUT_S, "the hub to print its address")
    return hub


def with_model(args: tuple[str, ...]) -> tuple[str, ...]:
    """A test node's flags with `--model` the embedded default unless given: test hubs train it, and a node
    fetching the hub's files (tests/test_model_files.py) is not what most tests test. `--no-model`: fetch them."""
    if "--no-model" in args:
        return tuple(a for a in args if a != "--no-model")
    if "--model" in args:
        return args
    from shared.default_model import ensure_default_model

    return ("--model", str(ensure_default_model(progress=False)), *args)


def start_node(hub_addr: str, data_dir: Path, *args: str, price: float = 0.35, nice: int = 0) -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / f"node-{time.time_ns()}.out"
    argv = [
        "join",
        "--hub",
        hub_addr,
        "--price",
        str(price),
        "--backend",
        "hf",
        "--device",
        "cpu",
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        *with_model(args),
    ]
    process = forked.spawn("node.cli", argv, str(log), _env(), nice=nice)
    return Proc(process, log)


def node_peer_id(node: Proc, timeout_s: float = 60.0) -> str:
    """The node's peer id, from the line it prints on start."""
    pattern = re.compile(r"echo-node (\w+) joining")
    return wait_until(lambda: (m := pattern.search(node.output())) and m.group(1), timeout_s, "the node to start")


# -- a hub and nodes for broadcast runs ---------------------------------------------------------

LINK_MBPS = 2.0  # 250 kB/s per link: the ~3.5 MB default-model snapshot takes ~14 s per hop
HUB_TOML = """
[scheduler]
heartbeat_period_s = 0.5
heartbeat_timeout_s = 3.0
control_period_s = 1.0
[broadcast]
chunk_kib = 128
"""
# Nodes barely generate (a lease's rollouts take 1 / 0.05 s each): the CPU goes to the transfers.
QUIET_NODE = ("--max-rollouts-per-s", "0.05")


def start_test_node(hub_addr: str, data_dir: Path, *args: str, module: str = "testbed.recording_node") -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "node.out"
    argv = [
        "join",
        "--hub",
        hub_addr,
        "--price",
        "0.35",
        "--backend",
        "hf",
        "--device",
        "cpu",
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        *with_model(args),
    ]
    return Proc(forked.spawn(module, argv, str(log), _env()), log)


def start_test_hub(data_dir: Path, *args: str):
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "hub.toml").write_text(HUB_TOML)
    return start_hub(data_dir, "--local-nodes", "0", "--steps", "0", "--config", str(data_dir / "hub.toml"), *args)


def hub_manifest(hub_dir: Path, version: int) -> Manifest:
    raw = snapshot_paths(hub_dir / "snapshots", version)[1].read_bytes()
    return Manifest.model_validate_json(raw[SIGNATURE_BYTES:])


def assert_installed_bit_exact(node_dir: Path, hub_dir: Path, version: int) -> None:
    """What the node put into its engine, and the engine's weights read back, are the hub's file byte for byte."""
    from safetensors.torch import load as safetensors_load

    from testbed.recording_node import weights_digest

    hub_file = snapshot_paths(hub_dir / "snapshots", version)[0].read_bytes()
    tensors = safetensors_load(hub_file)  # the safetensors library reads our streamed files
    record = json.loads((node_dir / "installed" / f"v{version}.json").read_text())
    installed = {key: record[key] for key in ("version", "bytes_blake3", "model_digest")}  # beside them: its source
    assert installed == {
        "version": version,
        "bytes_blake3": blake3_hex(hub_file),
        "model_digest": weights_digest(tensors, tensors),
    }


def node_states(hub) -> dict[str, object]:
    status = hub.status()
    return {} if status is None else {n.peer_id: n for n in status.nodes}


def stop_all(procs: list[Proc]) -> None:
    """Ctrl-C to each at once, then each waited for (killed after 15 s). One signal each: a second Ctrl-C ends a
    process at once, skipping its clean stop (a node's leave, say)."""
    for proc in procs:
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait_or_kill(15)
