"""`echo-node`: the volunteer's entry point. Parses flags, then runs the node (node/run.py imports torch and the
engine), in this process or as the child of its dashboard."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version as package_version
from pathlib import Path

from shared.checks import UserError

# flag name -> (NodeConfig field, type); each flag's help is its field's description and default (node/config.py).
JOIN_FLAGS: dict[str, tuple[str, type]] = {
    name: (name, kind) for name, kind in (
        ("hub", str), ("price", float), ("backend", str), ("device", str), ("dtype", str), ("data_dir", Path), ("key", Path),
        ("model", Path), ("listen", str), ("public_addr", str), ("bulk_port", int), ("max_rollouts_per_s", float), ("link_mbps", float),
        ("declared_link_mbps", float), ("threads", int), ("seed", int), ("gpu_memory_fraction", float),
        ("kv_cache_gib", int), ("cpu_cores", str),
        ("max_lora_rank", int), ("log_level", str),
    )
}


def build_parser() -> argparse.ArgumentParser:
    from node.config import NodeConfig
    from shared.config import flag_help

    parser = argparse.ArgumentParser(prog="echo-node", description="echo2 volunteer node: generate rollouts for a hub.")
    parser.add_argument("--version", action="version", version=f"echo-node {package_version('echo2')}")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a hub and do rollout work for it")
    join.add_argument("--config", type=Path, help="node.toml with the same fields; flags override it")
    for flag, (field, kind) in JOIN_FLAGS.items():
        join.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None,
                          help=flag_help(NodeConfig, field))
    join.add_argument("--dashboard", action="store_true", help="show the volunteer's live dashboard")
    view = sub.add_parser("dashboard", help="watch a node started elsewhere (reads its data dir)")
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
    return args


def check_join(config) -> None:
    """Every mistake `echo-node join` can see before it starts: one line each (UserError), nothing written."""
    from shared.checks import (
        check_bulk_port,
        check_data_dir,
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
    check_key_file(config.key_path, "--key" if config.key is not None else "the node key")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "dashboard":
        from tui.cli import run_dashboard

        return run_dashboard(args, kind="node")
    from node.config import NodeConfig
    from shared.config import ConfigError, load_config

    overrides = {dotted: getattr(args, flag) for flag, (dotted, _) in JOIN_FLAGS.items()}
    try:
        config = load_config(NodeConfig, args.config, overrides)
        check_join(config)
    except (ConfigError, UserError) as exc:
        print(f"echo-node: {exc}", file=sys.stderr)
        return 2
    if args.dashboard:
        return _run_with_dashboard(config)
    from node.run import run_node

    return run_node(config)


def _run_with_dashboard(config) -> int:
    """The dashboard is its own process (Textual runs on asyncio, libp2p on trio): run the node as a child."""
    from tui.cli import run_node_dashboard

    config.data_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "node.cli", "join", *config_to_args(config)]
    with open(config.data_dir / "node.err", "ab") as err:
        child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
    try:
        run_node_dashboard(config.data_dir).run()
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
