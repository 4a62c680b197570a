"""`echo-node`: the volunteer's entry point. Parses flags, then imports torch and the engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

JOIN_FLAGS: dict[str, tuple[str, type, str]] = {
    "hub": ("hub", str, "hub multiaddr with /p2p/<id>, as printed by `echo-hub start`"),
    "price": ("price", float, "declared price in $/h (default 0.35)"),
    "backend": ("backend", str, "rollout engine: auto, hf or vllm (default auto)"),
    "device": ("device", str, "cpu or cuda (default: cuda when present)"),
    "data_dir": ("data_dir", Path, "identity, logs and node_status.json (default ./echo2-node)"),
    "key": ("key", Path, "identity key file (default DATA_DIR/node.key)"),
    "model": ("model", Path, "local HF model dir matching the hub's (default: the embedded default model)"),
    "listen": ("listen", str, "libp2p listen multiaddr for chain relays (default /ip4/0.0.0.0/tcp/0)"),
    "max_rollouts_per_s": ("max_rollouts_per_s", float, "throttle generation to this many rollouts/s"),
    "link_mbps": ("link_mbps", float, "emulate an outbound link of this many Mbit/s"),
    "declared_link_mbps": ("declared_link_mbps", float, "link bandwidth to declare on join, Mbit/s"),
    "threads": ("threads", int, "torch threads for generation (default 1)"),
    "log_level": ("log_level", str, "log level (default info)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-node", description="echo2 volunteer node: generate rollouts for a hub.")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a hub and do rollout work for it")
    join.add_argument("--config", type=Path, help="node.toml with the same fields; flags override it")
    for flag, (_, kind, help_text) in JOIN_FLAGS.items():
        join.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None, help=help_text)
    join.add_argument("--dashboard", action="store_true", help="show the volunteer's live dashboard")
    view = sub.add_parser("dashboard", help="watch a node started elsewhere (reads its data dir)")
    view.add_argument("--data-dir", type=Path, default=Path("echo2-node"), help="the node's --data-dir (default ./echo2-node)")
    from tui.cli import add_view_arguments

    add_view_arguments(view)
    return parser


def config_to_args(config) -> list[str]:
    """Flags that reproduce `config` (used to start the node as a child of its dashboard)."""
    args: list[str] = []
    for flag, (field, _, _) in JOIN_FLAGS.items():
        value = getattr(config, field)
        if value is not None:
            args += ["--" + flag.replace("_", "-"), str(value)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "dashboard":
        from tui.cli import run_dashboard

        return run_dashboard(args, kind="node")
    from node.config import NodeConfig
    from shared.config import ConfigError, load_config

    overrides = {dotted: getattr(args, flag) for flag, (dotted, _, _) in JOIN_FLAGS.items()}
    try:
        config = load_config(NodeConfig, args.config, overrides)
    except ConfigError as exc:
        print(f"echo-node: {exc}", file=sys.stderr)
        return 2
    from node.run import run_node

    return run_node(config, dashboard=args.dashboard)


if __name__ == "__main__":
    sys.exit(main())
