"""Local volunteer nodes for the embedded default: real `echo-node join` processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.crypto import Identity
from shared.layout import LOCAL_NODES_DIR, NODE_KEY_FILE

# Differing declared prices ($/h), so cost-aware activation has something to choose between.
LOCAL_NODE_PRICES = (0.35, 0.50, 0.80, 0.30, 0.65, 1.00, 0.45, 0.90)
STOP_TIMEOUT_S = 10.0


@dataclass
class LocalNode:
    index: int
    peer_id: str
    price: float
    data_dir: Path
    process: subprocess.Popen


def spawn_local_nodes(
    count: int, hub_addr: str, data_dir: Path, link_mbps: float | None = None, model: Path | None = None,
    extra_args: tuple[str, ...] = (),
) -> list[LocalNode]:
    """`count` nodes joining `hub_addr`, each with the hub's model (`model`; None: the embedded default)."""
    nodes = []
    for i in range(count):
        node_dir = Path(data_dir) / LOCAL_NODES_DIR / f"node-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        price = LOCAL_NODE_PRICES[i % len(LOCAL_NODE_PRICES)]
        # The hub makes the node's key, so it knows its own nodes apart from strangers on its address.
        peer_id = Identity.load_or_create(node_dir / NODE_KEY_FILE).peer_id
        args = [
            sys.executable, "-m", "node.cli", "join", "--hub", hub_addr, "--price", str(price),
            "--backend", "hf", "--device", "cpu", "--data-dir", str(node_dir), "--listen", "/ip4/127.0.0.1/tcp/0",
            *(["--link-mbps", str(link_mbps)] if link_mbps else []),
            *(["--model", str(Path(model).resolve())] if model else []), *extra_args,
        ]
        with open(node_dir / "node.out", "ab") as out:
            # Own process group: a Ctrl-C in the terminal reaches the hub, which then stops the nodes itself.
            process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        nodes.append(LocalNode(i, peer_id, price, node_dir, process))
    return nodes


def stop_local_nodes(nodes: list[LocalNode]) -> None:
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGINT)
    for node in nodes:
        try:
            node.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()
