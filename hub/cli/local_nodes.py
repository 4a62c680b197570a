"""Local volunteer nodes for the embedded default: real `echo-node join` processes on loopback.

They are forked from one server process (multiprocessing's forkserver) that imports the node's modules
once, started when the hub starts so that it imports while the hub builds its learner. Each node then
runs `echo-node join` exactly as the command line does, in its own session with its own output file.
Importing torch, transformers and libp2p costs a node many CPU-seconds before it can join; separate
interpreters would pay that once per node, on the cores the hub needs for its first steps.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path

from shared.crypto import Identity
from shared.layout import LOCAL_NODES_DIR, NODE_KEY_FILE
from shared.logs import LOG_BACKUPS, LOG_MAX_MB, capture_output
from shared.signals import children_ignore_ctrl_c

# Differing declared prices ($/h), so cost-aware activation has something to choose between.
LOCAL_NODE_PRICES = (0.35, 0.50, 0.80, 0.30, 0.65, 1.00, 0.45, 0.90)
STOP_TIMEOUT_S = 10.0
LOCAL_NODE_OUT_FILE = "node.out"  # a local node's stdout and stderr, in its data dir
# What a node imports before it can join (a module that fails to import is left to the node itself).
NODE_MODULES = ("node.cli", "node.run", "node.hf_engine", "libp2p", "transformers.models.qwen2.modeling_qwen2")
_FORKSERVER = multiprocessing.get_context("forkserver")


@dataclass
class LocalNode:
    index: int
    peer_id: str
    price: float
    data_dir: Path
    process: multiprocessing.process.BaseProcess


def start_node_server() -> None:
    """Start the process local nodes are forked from; it imports NODE_MODULES in the background."""
    _FORKSERVER.set_forkserver_preload(list(NODE_MODULES))
    with children_ignore_ctrl_c():  # a Ctrl-C during its imports would print their tracebacks
        forkserver.ensure_running()


def _stop_with_the_hub() -> None:
    """SIGINT this node once the hub that started it is gone, however it ended (the pipe it holds for the
    node closes): a local node never outlives its hub, even when the node server died before it."""
    parent = multiprocessing.parent_process()
    assert parent is not None
    parent.join()
    os.kill(os.getpid(), signal.SIGINT)


def _node_main(argv: list[str], out_path: str, log_max_mb: float, log_backups: int) -> None:
    """One forked local node: its own session (a Ctrl-C in the terminal reaches the hub, which then stops
    the nodes itself) and output file, rotated as its log is, then `echo-node` with `argv`."""
    os.setsid()
    # The node server ignores Ctrl-C, and its children inherit that: a node is stopped by SIGINT (by its hub, or
    # by `_stop_with_the_hub`), so it takes Python's own handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    capture_output(Path(out_path), log_max_mb, log_backups)
    threading.Thread(target=_stop_with_the_hub, name="hub-watch", daemon=True).start()
    from node.cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # a forked multiprocessing child leaves with os._exit, which skips them
    sys.exit(code)


def local_nodes_device(choice: str, learner_device: str) -> str:
    """The local nodes' device: auto runs them where the learner runs (a `--device cpu` hub leaves the GPU alone)."""
    return learner_device if choice == "auto" else choice


def join_argv(
    hub_addr: str,
    price: float,
    device: str,
    node_dir: Path,
    link_mbps: float | None,
    model: Path | None,
    extra_args: tuple[str, ...],
) -> list[str]:
    """The `echo-node join` command line of one local node."""
    from shared.default_model import default_model_dir

    return [
        "join",
        "--hub",
        hub_addr,
        "--price",
        str(price),
        "--backend",
        "hf",
        "--device",
        device,
        "--data-dir",
        str(node_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        *(["--link-mbps", str(link_mbps)] if link_mbps else []),
        # The hub's own directory: a node on the hub's machine need not fetch its config and tokenizer.
        "--model",
        str(Path(model or default_model_dir()).resolve()),
        *extra_args,
    ]


def spawn_local_nodes(
    count: int,
    hub_addr: str,
    data_dir: Path,
    link_mbps: float | None = None,
    model: Path | None = None,
    extra_args: tuple[str, ...] = (),
    device: str = "cpu",
    log: tuple[float, int] = (LOG_MAX_MB, LOG_BACKUPS),
) -> list[LocalNode]:
    """`count` nodes joining `hub_addr` on `device`, each with the hub's model (`model`; None: the embedded default);
    `log`: the size cap in MB and the backups of each node's log and output file (the hub's own)."""
    nodes = []
    for i in range(count):
        node_dir = Path(data_dir) / LOCAL_NODES_DIR / f"node-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        price = LOCAL_NODE_PRICES[i % len(LOCAL_NODE_PRICES)]
        # The hub makes the node's key, so it knows its own nodes apart from strangers on its address.
        peer_id = Identity.load_or_create(node_dir / NODE_KEY_FILE).peer_id
        argv = join_argv(
            hub_addr,
            price,
            device,
            node_dir,
            link_mbps,
            model,
            ("--log-max-mb", str(log[0]), "--log-backups", str(log[1]), *extra_args),
        )
        # daemon: a hub that exits without stopping its nodes (an error) takes them with it.
        process = _FORKSERVER.Process(
            target=_node_main, args=(argv, str(node_dir / LOCAL_NODE_OUT_FILE), *log), name=f"echo-node-{i}", daemon=True
        )
        process.start()
        nodes.append(LocalNode(i, peer_id, price, node_dir, process))
    return nodes


def stop_local_nodes(nodes: list[LocalNode]) -> None:
    for node in nodes:
        if node.process.is_alive() and node.process.pid is not None:
            os.kill(node.process.pid, signal.SIGINT)
    for node in nodes:
        node.process.join(STOP_TIMEOUT_S)
        if node.process.exitcode is None:
            node.process.kill()
            node.process.join()
