"""`echo-hub plan`: size and price a fleet from the capacity model before running anything.

Reads a FLEET.toml of candidate nodes ([[node]] tables with name, price_per_hour and
rollouts_per_s), computes mu_min and the target, the cost-aware active set, the predicted
bubble and the cost per hour and per learner step, and prints them (rich table or JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hub.method.capacity import (
    InfeasibleCapacity,
    NodeOffer,
    activate,
    cost_per_step,
    default_kappa,
    mu_min,
    predicted_bubble,
    predicted_step_s,
    validate_kappa,
)

DEFAULT_STALENESS = 4
DEFAULT_GAMMA = 1.1
DEFAULT_LEARNER_PRICE_PER_HOUR = 3.06  # A100 80GB rental, docs/DESIGN.md §1
DEFAULT_ROLLOUTS_PER_STEP = 128 * 16  # 128 prompts x n = 16, docs/DESIGN.md §1
FLEET_NODE_KEYS = frozenset({"name", "price_per_hour", "rollouts_per_s"})
EXIT_USAGE_ERROR = 2


class PlanError(ValueError):
    """The fleet file or the plan's parameters are unusable."""


@dataclass(frozen=True)
class PlanResult:
    """Everything `echo-hub plan` reports."""

    kappa: int
    mu_min: float
    mu_target: float
    active: tuple[NodeOffer, ...]
    mu_active: float
    shortfall: float
    predicted_bubble: float
    predicted_step_s: float
    cost_per_hour: float
    cost_per_step: float

    def to_json_dict(self) -> dict[str, object]:
        return {
            "mu_min": self.mu_min,
            "mu_target": self.mu_target,
            "active": [node.name for node in self.active],
            "mu_active": self.mu_active,
            "shortfall": self.shortfall,
            "predicted_bubble": self.predicted_bubble,
            "cost_per_hour": self.cost_per_hour,
            "cost_per_step": self.cost_per_step,
        }


def _number(node_label: str, key: str, value: object) -> float:
    # bool is an int subclass; `price_per_hour = true` is a typo, not a price.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{node_label}: {key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise PlanError(f"{node_label}: {key} must be finite, got {value!r}")
    return float(value)


def load_fleet(path: Path) -> list[NodeOffer]:
    """Parse and validate FLEET.toml; every problem is a PlanError naming the node and key."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise PlanError(f"cannot read fleet file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"fleet file {path} is not valid TOML: {exc}") from exc
    unknown_top = sorted(set(document) - {"node"})
    if unknown_top:
        raise PlanError(f"fleet file {path}: unknown top-level keys {unknown_top}; expected [[node]] tables")
    tables = document.get("node", [])
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise PlanError(f"fleet file {path}: 'node' must be an array of tables ([[node]])")
    if not tables:
        raise PlanError(f"fleet file {path} declares no nodes; add [[node]] tables")
    fleet: list[NodeOffer] = []
    seen: set[str] = set()
    for index, table in enumerate(tables):
        label = f"node #{index + 1}"
        missing = sorted(FLEET_NODE_KEYS - set(table))
        if missing:
            raise PlanError(f"{label}: missing keys {missing}")
        unknown = sorted(set(table) - FLEET_NODE_KEYS)
        if unknown:
            raise PlanError(f"{label}: unknown keys {unknown}; allowed: {sorted(FLEET_NODE_KEYS)}")
        name = table["name"]
        if not isinstance(name, str) or not name:
            raise PlanError(f"{label}: name must be a non-empty string, got {name!r}")
        label = f"node {name!r}"
        if name in seen:
            raise PlanError(f"{label}: duplicate name")
        seen.add(name)
        price = _number(label, "price_per_hour", table["price_per_hour"])
        throughput = _number(label, "rollouts_per_s", table["rollouts_per_s"])
        if price < 0:
            raise PlanError(f"{label}: price_per_hour must be >= 0, got {price:g}")
        if throughput <= 0:
            raise PlanError(f"{label}: rollouts_per_s must be > 0, got {throughput:g}")
        fleet.append(NodeOffer(name, price, throughput))
    return fleet


def compute_plan(
    fleet: list[NodeOffer],
    rollouts_per_step: float,
    t_train_s: float,
    t_bcast_s: float,
    kappa: int,
    gamma: float,
    learner_price: float,
    staleness: int | None = None,
) -> PlanResult:
    """The plan for a validated fleet; raises InfeasibleCapacity or PlanError."""
    if rollouts_per_step <= 0:
        raise PlanError(f"--rollouts-per-step must be > 0, got {rollouts_per_step:g}")
    if t_train_s <= 0:
        raise PlanError(f"--t-train must be > 0 seconds, got {t_train_s:g}")
    if t_bcast_s < 0:
        raise PlanError(f"--t-bcast must be >= 0 seconds, got {t_bcast_s:g}")
    if kappa < 1:
        raise PlanError(f"--kappa must be >= 1, got {kappa}")
    if gamma < 1:
        raise PlanError(f"--gamma is headroom over mu_min and must be >= 1, got {gamma:g}")
    if learner_price < 0:
        raise PlanError(f"--learner-price must be >= 0, got {learner_price:g}")
    minimum = mu_min(kappa, rollouts_per_step, t_train_s, t_bcast_s, staleness)
    target = gamma * minimum
    chosen = activate(fleet, target)
    active_prices = [node.price_per_hour for node in chosen.active]
    period = (kappa, rollouts_per_step, t_train_s, t_bcast_s, chosen.mu_active)
    return PlanResult(
        kappa=kappa,
        mu_min=minimum,
        mu_target=target,
        active=chosen.active,
        mu_active=chosen.mu_active,
        shortfall=chosen.shortfall,
        predicted_bubble=predicted_bubble(*period, staleness),
        predicted_step_s=predicted_step_s(*period, staleness),
        cost_per_hour=learner_price + math.fsum(active_prices),
        cost_per_step=cost_per_step(*period, learner_price, active_prices, staleness),
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `echo-hub plan`."""
    parser.add_argument("--fleet", type=Path, required=True, metavar="FLEET.toml",
                        help="candidate nodes: [[node]] tables with name, price_per_hour, rollouts_per_s")
    parser.add_argument("--rollouts-per-step", type=float, default=DEFAULT_ROLLOUTS_PER_STEP, metavar="R",
                        help=f"accepted rollouts needed per step (default {DEFAULT_ROLLOUTS_PER_STEP}); to count the "
                             "groups the learner skips, divide by the share it trains on (`echo-hub status`)")
    parser.add_argument("--t-train", type=float, required=True, metavar="T",
                        help="seconds per learner step")
    parser.add_argument("--t-bcast", type=float, required=True, metavar="B",
                        help="seconds to broadcast a snapshot to the fleet")
    parser.add_argument("--staleness", type=int, default=DEFAULT_STALENESS, metavar="S",
                        help=f"staleness budget in versions (default {DEFAULT_STALENESS})")
    parser.add_argument("--kappa", type=int, default=None, metavar="K",
                        help="publish period in learner steps (default max(1, S - 1))")
    parser.add_argument("--gamma", type=float, default=DEFAULT_GAMMA, metavar="G",
                        help=f"provisioning headroom over mu_min (default {DEFAULT_GAMMA})")
    parser.add_argument("--learner-price", type=float, default=DEFAULT_LEARNER_PRICE_PER_HOUR, metavar="P",
                        help=f"learner $/h (default {DEFAULT_LEARNER_PRICE_PER_HOUR}, an A100 80GB)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _print_table(result: PlanResult, console: Console) -> None:
    nodes = Table(title="active nodes (activation order)")
    nodes.add_column("#", justify="right")
    nodes.add_column("node")
    nodes.add_column("$/h", justify="right")
    nodes.add_column("rollouts/s", justify="right")
    nodes.add_column("rho ($/h per rollout/s)", justify="right")
    for position, node in enumerate(result.active, start=1):
        nodes.add_row(str(position), node.name, f"{node.price_per_hour:.4g}",
                      f"{node.rollouts_per_s:.4g}", f"{node.rho:.4g}")
    summary = Table(title=f"plan (kappa = {result.kappa})", show_header=False)
    summary.add_column("quantity")
    summary.add_column("value", justify="right")
    summary.add_row("mu_min (rollouts/s)", f"{result.mu_min:.4g}")
    summary.add_row("mu_target (rollouts/s)", f"{result.mu_target:.4g}")
    summary.add_row("mu_active (rollouts/s)", f"{result.mu_active:.4g}")
    summary.add_row("shortfall (rollouts/s)", f"{result.shortfall:.4g}")
    summary.add_row("predicted bubble", f"{result.predicted_bubble:.2%}")
    summary.add_row("predicted step (s)", f"{result.predicted_step_s:.4g}")
    summary.add_row("cost per hour ($)", f"{result.cost_per_hour:.4f}")
    summary.add_row("cost per learner step ($)", f"{result.cost_per_step:.6f}")
    console.print(nodes)
    console.print(summary)
    if result.shortfall > 0:
        console.print(f"[yellow]the whole fleet falls {result.shortfall:.4g} rollouts/s short of the target[/]")


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; a bad fleet or infeasible capacity prints 'error: ...' and returns 2."""
    try:
        try:
            kappa = default_kappa(args.staleness) if args.kappa is None else args.kappa
            validate_kappa(kappa, args.staleness)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        fleet = load_fleet(args.fleet)
        result = compute_plan(fleet, args.rollouts_per_step, args.t_train, args.t_bcast,
                              kappa, args.gamma, args.learner_price, args.staleness)
    except (PlanError, InfeasibleCapacity) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    if args.json:
        print(json.dumps(result.to_json_dict()))
    else:
        _print_table(result, Console())
    return 0
