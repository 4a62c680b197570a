"""`echo-hub`: the operator's entry point. Parses flags, then imports the heavy modules it needs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# flag name -> dotted HubConfig field; flags override the TOML file, which overrides defaults.
START_FLAGS: dict[str, tuple[str, type, str]] = {
    "data_dir": ("data_dir", Path, "store, snapshots, checkpoints, metrics and logs (default ./echo2-data)"),
    "model": ("model", Path, "local Hugging Face causal LM directory (default: the embedded default model)"),
    "task": ("task", str, "builtin task name, math:FILE.jsonl, or module:Class (default reverse)"),
    "listen": ("listen", str, "libp2p listen multiaddr (default /ip4/0.0.0.0/tcp/4077)"),
    "key": ("key", Path, "hub identity key file (default DATA_DIR/hub.key)"),
    "steps": ("steps", int, "learner steps to run; 0 runs until interrupted (default 300)"),
    "local_nodes": ("local_nodes", int, "volunteer nodes to spawn on loopback (default 3; 0: wait for remote nodes)"),
    "staleness": ("learner.staleness", int, "S: max versions a rollout may lag the learner (default 4)"),
    "kappa": ("learner.kappa", int, "publish a snapshot every kappa steps (default max(1, S-1))"),
    "prompts_per_step": ("learner.prompts_per_step", int, "prompt groups per learner step (default 16)"),
    "group_size": ("learner.group_size", int, "n: completions per prompt (default 8)"),
    "lr": ("learner.lr", float, "learning rate (default 3e-4)"),
    "seed": ("learner.seed", int, "seed (default 0)"),
    "max_new_tokens": ("sampling.max_new_tokens", int, "completion length cap in tokens"),
    "temperature": ("sampling.temperature", float, "sampling temperature (default 1.0)"),
    "top_p": ("sampling.top_p", float, "nucleus sampling mass (default 1.0)"),
    "broadcast": ("broadcast.mode", str, "snapshot broadcast: chain or star (default chain)"),
    "link_mbps": ("broadcast.link_mbps", float, "emulated per-connection link rate, Mbit/s (tests, benchmarks)"),
    "hub_mbps": ("broadcast.hub_uplink_mbps", float, "hub uplink B0 in Mbit/s, for chain planning"),
    "log_level": ("log_level", str, "log level of DATA_DIR/hub.log (default info)"),
}


def _start_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="run the hub (and, by default, local volunteer nodes)")
    p.add_argument("--config", type=Path, help="hub.toml with the same fields; flags override it")
    for flag, (_, kind, help_text) in START_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None, help=help_text)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live progress display")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="echo-hub",
        description="echo2 hub: central GRPO learner that signs policy snapshots and buys rollouts from volunteer nodes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _start_parser(sub)

    status = sub.add_parser("status", help="print nodes, leases, versions, throughput and cost of a hub")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--hub", help="multiaddr of a running hub (with /p2p/<id>)")
    where.add_argument("--data-dir", type=Path, default=None, help="read DATA_DIR/status.json (default ./echo2-data)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--key", type=Path, default=None,
                        help="with --hub: ask as this identity (the hub's DATA_DIR/hub.key, or a key listed in "
                             "trust.status_operators, sees nodes' prices and costs; others see them hidden)")

    from hub.plan import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="capacity planning for a fleet, without running anything"))

    from tui.cli import add_dashboard_arguments

    add_dashboard_arguments(sub.add_parser("dashboard", help="live terminal dashboard of a hub"))

    report = sub.add_parser("report", help="plot reward, staleness and bubble ratio from metrics.jsonl")
    report.add_argument("--data-dir", type=Path, default=Path("echo2-data"), help="the hub's data dir")
    report.add_argument("--out", type=Path, default=None, help="PNG path (default DATA_DIR/report.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":
        from hub.config import HubConfig
        from shared.config import ConfigError, load_config

        overrides = {dotted: getattr(args, flag) for flag, (dotted, _, _) in START_FLAGS.items()}
        try:
            config = load_config(HubConfig, args.config, overrides)
        except ConfigError as exc:
            print(f"echo-hub: {exc}", file=sys.stderr)
            return 2
        from hub.run import run_hub

        return run_hub(config, progress=not args.no_progress)
    if args.command == "status":
        from hub.status_cli import run_status

        return run_status(hub=args.hub, data_dir=args.data_dir, as_json=args.json, key=args.key)
    if args.command == "plan":
        from hub.plan import run_plan

        return run_plan(args)
    if args.command == "dashboard":
        from tui.cli import run_dashboard

        return run_dashboard(args)
    if args.command == "report":
        from hub.report import write_report

        out = write_report(args.data_dir, args.out)
        print(f"wrote {out}")
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
