"""`echo-node`: the volunteer's entry point. Parses flags, then runs the node (node/run.py imports torch and the
engine), in this process or as the child of its dashboard."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import threading
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING

from shared.checks import UserError
from shared.flags import EXAMPLE_FORMAT, FlagParser
from shared.logs import quiet_wheel_noise

if TYPE_CHECKING:
    from node.config import NodeConfig

NODE_ERR_FILE = "node.err"  # the stderr of a node run under its dashboard
STOP_TIMEOUT_S = 10.0
MIN_PRICE_PER_HOUR = 0.01  # a positive --price below it is read as a unit mistake (a price per rollout, per second)
SAID_BYTES = 16384  # the tail of a node's stderr its dashboard repeats when the node ended by itself, failing

# Before torch is imported here or in the node server local nodes are forked from (it imports this module first).
quiet_wheel_noise()

# flag name -> (NodeConfig field, type); each flag's help is its field's description and default (node/config.py).
JOIN_FLAGS: dict[str, tuple[str, type]] = {
    name: (name, kind)
    for name, kind in (
        ("hub", str),
        ("name", str),
        ("http", str),
        ("price", float),
        ("price_schedule", str),
        ("backend", str),
        ("device", str),
        ("dtype", str),
        ("data_dir", Path),
        ("key", Path),
        ("model", Path),
        ("listen", str),
        ("public_addr", str),
        ("bulk_port", int),
        ("max_rollouts_per_s", float),
        ("link_mbps", float),
        ("declared_link_mbps", float),
        ("threads", int),
        ("seed", int),
        ("gpu_memory_fraction", float),
        ("kv_cache_gib", int),
        ("cpu_cores", str),
        ("max_lora_rank", int),
        ("log_level", str),
        ("log_max_mb", float),
        ("log_backups", int),
    )
}
# flag name -> NodeConfig field of a switch, a flag that takes no value and turns its field on.
JOIN_SWITCHES: dict[str, str] = {"wait_next_run": "wait_next_run"}


# How a volunteer is paid (hub.method.prices, hub.control.policy; docs/volunteers.md "What is paid"), for `join --help`.
JOIN_DESCRIPTION = """\
Join a hub and do rollout work for it, at the price you declare (--price, $/h).

How the hub pays:
  ranking   it measures each node's throughput (rollouts/s) and activates the
            nodes cheapest per measured rollout/s (price / rate) until it has
            the throughput it needs; the others wait in standby (unpaid),
            told their measured rate.
  pay       each lease at the price in force when it was issued, for the time
            from issue to answer in the share of its groups accepted (at most
            the accepted tokens' time at its lease.paid_tokens_per_s_floor);
            the node's summary shows the seconds paid beside its own
            generating time.
  ceiling   a price above the hub's ceiling (its scheduler.max_price_per_hour)
            is refused before the engine is built.
  unpaid    time in standby; groups that arrive late (past the hub's staleness
            window) or are rejected; relaying snapshots to the next node in a
            chain. A node whose every group arrives late is not activated again
            until its measured rate changes (a restart measures it again)."""


def build_parser() -> argparse.ArgumentParser:
    from node.config import NodeConfig
    from shared.config import flag_help

    parser = FlagParser(prog="echo-node", description="echo2 volunteer node: generate rollouts for a hub.")
    parser.add_argument("--version", action="version", version=f"echo-node {package_version('echo2')}")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser(
        "join",
        help="join a hub and do rollout work for it",
        description=JOIN_DESCRIPTION,
        formatter_class=EXAMPLE_FORMAT,
        epilog="example:\n  echo-node join --hub /ip4/203.0.113.7/tcp/4077/p2p/<hub id> --price 0.35",
    )
    join.add_argument("--config", type=Path, help="node.toml with the same fields; flags override it")
    for flag, (field, kind) in JOIN_FLAGS.items():
        join.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None, help=flag_help(NodeConfig, field))
    for flag, field in JOIN_SWITCHES.items():
        join.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            action="store_const",
            const=True,
            default=None,
            help=flag_help(NodeConfig, field, switch=True),
        )
    join.add_argument("--dashboard", action="store_true", help="show the volunteer's live dashboard")
    view = sub.add_parser(
        "dashboard",
        help="watch a node started elsewhere (reads its data dir)",
        formatter_class=EXAMPLE_FORMAT,
        epilog="example:\n  echo-node dashboard --data-dir echo2-node",
    )
    view.add_argument("--data-dir", type=Path, default=Path("echo2-node"), help="the node's --data-dir (default ./echo2-node)")
    from tui.cli import add_view_arguments

    add_view_arguments(view)
    return parser


def config_to_args(config) -> list[str]:
    """Flags that reproduce `config` (used to start the node as a child of its dashboard)."""
    args: list[str] = []
    for flag, (field, _) in JOIN_FLAGS.items():
        value = getattr(config, field)
        if value is not None:
            args += ["--" + flag.replace("_", "-"), str(value)]
    return args + ["--" + flag.replace("_", "-") for flag, field in JOIN_SWITCHES.items() if getattr(config, field)]


def check_join(config) -> None:
    """Every mistake `echo-node join` can see before it starts: one line each (UserError), nothing written."""
    from shared.checks import (
        check_bulk_port,
        check_data_dir,
        check_http,
        check_key_file,
        check_listen,
        check_model_dir,
        check_peer_addr,
    )

    check_peer_addr(config.hub)
    check_data_dir(config.data_dir)
    if config.model is not None:
        check_model_dir(config.model)
    check_listen(config.listen)
    check_bulk_port(config.listen, config.bulk_port)
    check_http(config.http, config.listen)
    check_key_file(config.key_path, "--key" if config.key is not None else "the node key")
    if 0 < config.price < MIN_PRICE_PER_HOUR:
        raise UserError(
            f"--price {config.price:g}: prices are $ per hour of this node's GPU, and below ${MIN_PRICE_PER_HOUR}/h is "
            "most likely another unit; give 0 to volunteer for free, or a price per hour like 0.35"
        )
    check_engine(config)


def check_engine(config) -> None:
    """An engine this machine cannot run (--device cuda without CUDA, --backend vllm without vLLM): UserError.
    torch is imported only for those choices."""
    from node.backends import check_backend
    from shared.precision import check_device

    check_device(config.device, "--device")
    check_backend(config.backend, None if config.device == "auto" else config.device)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "dashboard":
        from tui.cli import run_dashboard

        return run_dashboard(args, kind="node")
    from shared.signals import CtrlCWatch, ctrl_c_handled

    with CtrlCWatch() as ctrl_c:
        try:
            return _join(args)
        except BaseException as exc:  # Ctrl-C before the node's own signal handling runs (checks, imports, the engine)
            if not ctrl_c.stopped(exc):
                raise
    ctrl_c_handled()
    print("echo-node: interrupted before it joined", file=sys.stderr)
    return 130


def join_config(args: argparse.Namespace) -> NodeConfig:
    """The config `echo-node join` runs with, from its parsed flags: defaults < --config < flags; ConfigError (one
    line) on a mistake."""
    from node.config import NodeConfig
    from shared.config import load_config

    overrides = {dotted: getattr(args, flag) for flag, (dotted, _) in JOIN_FLAGS.items()}
    overrides |= {field: getattr(args, flag) for flag, field in JOIN_SWITCHES.items()}
    return load_config(NodeConfig, args.config, overrides)


def _join(args: argparse.Namespace) -> int:
    """`echo-node join`: its config checked (a mistake is one line, exit 2), its data dir locked, then the node."""
    from shared.config import ConfigError
    from shared.layout import NODE_LOCK_FILE
    from shared.lock import lock_data_dir

    try:
        config = join_config(args)
        check_join(config)  # may import torch to ask for a GPU: Ctrl-C can land here
        # One node per data dir: two would be one identity, knocking each other off the hub.
        lock = lock_data_dir(config.data_dir, NODE_LOCK_FILE, "node")
    except (ConfigError, UserError) as exc:
        print(f"echo-node: {exc}", file=sys.stderr)
        return 2
    if args.dashboard:
        lock.close()  # the node under the dashboard takes it; a second node is refused here already
        return _run_with_dashboard(config)
    with lock:
        from node.run import run_node

        return run_node(config)


def _run_with_dashboard(config) -> int:
    """The dashboard is its own process (Textual runs on asyncio, libp2p on trio): run the node as a child. The
    dashboard closes with the node (Ctrl-C or q stop it; it may end by itself), then says how the node ended."""
    from shared.logs import RotatingFile
    from tui.cli import run_node_dashboard

    err = RotatingFile(config.data_dir / NODE_ERR_FILE, config.log_max_mb, config.log_backups)
    started = time.time()
    args = [sys.executable, "-m", "node.cli", "join", *config_to_args(config)]
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    said = bytearray()
    copier = threading.Thread(target=_copy_stderr, args=(child.stderr, err, said), daemon=True)
    copier.start()
    app = run_node_dashboard(config.data_dir)
    threading.Thread(target=_close_when_done, args=(child, app), daemon=True).start()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            app.run()
    finally:
        ended_itself = _stop(child)
        copier.join(STOP_TIMEOUT_S)
        err.close()
    if ended_itself and child.returncode != 0:
        # Its own words (a refusal, another peer at the hub's address), which also went to its stderr file.
        print(said.decode(errors="replace").strip(), file=sys.stderr)
        return child.returncode
    return _print_summary(config.data_dir, started, ended_itself)


def _copy_stderr(pipe, sink, said: bytearray) -> None:
    """The node's stderr into its rotated file, keeping the last SAID_BYTES of it for the one line said on its end."""
    while chunk := pipe.read1(65536):
        sink.write(chunk)
        said += chunk
        del said[:-SAID_BYTES]


def _close_when_done(child: subprocess.Popen, app) -> None:
    """Close the dashboard once the node under it has ended by itself."""
    child.wait()
    with contextlib.suppress(RuntimeError):  # the dashboard has closed already
        app.call_from_thread(app.exit)


def _stop(child: subprocess.Popen) -> bool:
    """Stop the node under the dashboard (SIGTERM: it writes its status once more); whether it had ended by itself."""
    if child.poll() is not None:
        return True
    child.terminate()
    try:
        child.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return False


def _print_summary(data_dir: Path, started: float, ended_itself: bool) -> int:
    """How the node under the dashboard ended and what it did, as a node without one says it (node/run.py), from the
    status it wrote on the way out: the end of the hub's run when that stopped it, else a stop."""
    from node.summary import run_over_text, stored_view, summary_text

    view = stored_view(data_dir, since=started)
    if view is None:
        print(f"echo-node: stopped before it ran (see {data_dir / NODE_ERR_FILE})", file=sys.stderr)
        return 0
    if ended_itself and view.run_over is not None:
        print(f"echo-node: {run_over_text(view.run_over)}", flush=True)
    else:
        print("echo-node: stopped", file=sys.stderr, flush=True)
    print(summary_text(view), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
