"""Command-line entry points of the dashboards, for hub/cli/main.py (`echo-hub dashboard`) and node/cli.py
(`echo-node join --dashboard`, `echo-node dashboard`). Textual and the sources load only when a
dashboard is built, so `--help` stays fast."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tui import DEFAULT_REFRESH_S

if TYPE_CHECKING:
    from tui.widgets import DashboardApp

SCREENSHOT_SIZE = (120, 40)


def add_dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hub", metavar="ADDR", help="multiaddr of a running hub, ending in /p2p/<hub peer id>")
    source.add_argument("--data-dir", metavar="DIR", type=Path, help="read DIR/status.json (hub) or DIR/node_status.json (node)")
    parser.add_argument(
        "--key",
        metavar="FILE",
        type=Path,
        default=None,
        help="with --hub: ask as this identity (the hub's DATA_DIR/hub.key sees nodes' prices and costs)",
    )
    add_view_arguments(parser)


def add_view_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--refresh-s",
        type=float,
        default=None,
        help=f"seconds between refreshes (default {DEFAULT_REFRESH_S:g}; with --hub, twice the hub's per-address status interval)",
    )
    parser.add_argument(
        "--screenshot",
        metavar="FILE.svg",
        type=Path,
        help=f"load once, render at {SCREENSHOT_SIZE[0]}x{SCREENSHOT_SIZE[1]}, save an SVG screenshot and exit",
    )


def build_dashboard(args: argparse.Namespace, kind: Literal["hub", "node"] = "hub") -> DashboardApp:
    from shared.checks import UserError
    from tui.hub_app import HubDashboard
    from tui.node_app import NodeDashboard
    from tui.sources import DataDirSource, HubSource

    if args.refresh_s is not None and args.refresh_s <= 0:
        raise UserError(f"--refresh-s must be positive, got {args.refresh_s}")
    refresh_s = args.refresh_s or DEFAULT_REFRESH_S
    if kind == "hub" and args.data_dir is not None and _holds_only_node_status(args.data_dir):
        kind = "node"  # a volunteer's data dir: show the volunteer's view, as --help says
    if kind == "node":
        if args.data_dir is None:
            raise UserError("the node dashboard reads the node's --data-dir; --hub is for the hub dashboard")
        return NodeDashboard(DataDirSource(args.data_dir, kind="node"), refresh_s)
    if args.hub is not None:
        from shared.checks import check_key_file, check_peer_addr
        from shared.crypto import Identity

        check_peer_addr(args.hub)
        if args.key is not None:
            check_key_file(args.key)
        source: HubSource | DataDirSource = HubSource(args.hub, identity=Identity.load(args.key) if args.key else None)
        refresh_s = args.refresh_s or hub_refresh_s()
    else:
        source = DataDirSource(args.data_dir, kind="hub")
    return HubDashboard(source, refresh_s)


def hub_refresh_s() -> float:
    """A remote dashboard shares the hub's per-address status limit with every other one on its address (an
    operator's key lifts it): polling at half that rate leaves room, so a healthy hub is not refused."""
    from shared.messages import STRANGER_STATUS_PER_S

    return 2.0 / STRANGER_STATUS_PER_S


def _holds_only_node_status(data_dir: Path) -> bool:
    from shared.layout import HUB_STATUS_FILE, NODE_STATUS_FILE

    return (data_dir / NODE_STATUS_FILE).exists() and not (data_dir / HUB_STATUS_FILE).exists()


def run_dashboard(args: argparse.Namespace, kind: Literal["hub", "node"] = "hub") -> int:
    """Run the dashboard in this terminal until `q`; with --screenshot, write the SVG and return at once."""
    # py-libp2p logs every failed dial at ERROR to stderr, which would scribble over the
    # screen; the dashboard's banner already shows why the hub is unreachable.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    app = build_dashboard(args, kind)
    if args.screenshot is not None:
        return save_screenshot(app, args.screenshot)
    app.run()
    return 0 if app.return_code is None else app.return_code


def save_screenshot(app: DashboardApp, path: Path) -> int:
    """Render `app` headless at SCREENSHOT_SIZE after its first load and write the SVG to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    async def shoot(pilot) -> None:
        await app.loaded.wait()
        await pilot.pause()
        app.save_screenshot(filename=path.name, path=str(path.parent))
        app.exit(0)

    app.run(headless=True, size=SCREENSHOT_SIZE, auto_pilot=shoot)
    if not path.exists():
        raise RuntimeError(f"the dashboard exited without writing {path}")
    return 0 if app.return_code is None else app.return_code


def run_node_dashboard(data_dir: Path | str, refresh_s: float = DEFAULT_REFRESH_S) -> DashboardApp:
    """The node's dashboard over DATA_DIR/node_status.json, not yet running: call `.run()` (main thread) or `await .run_async()`."""
    from tui.node_app import NodeDashboard
    from tui.sources import DataDirSource

    return NodeDashboard(DataDirSource(data_dir, kind="node"), refresh_s)
