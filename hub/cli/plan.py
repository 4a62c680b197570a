"""`echo-hub plan`: size and price a fleet from the capacity model before running anything.

Reads a FLEET.toml of candidate nodes ([[node]] tables with name, price_per_hour and
rollouts_per_s), computes mu_min and the target, the cost-aware active set, the predicted
bubble and the cost per hour and per learner step, and prints them (rich table or JSON).
For a tool-using run (`--turns`, `--turn-wait`), each node's rate is what its turns' round trips
leave of it (hub.method.capacity.turned_rollouts_per_s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from rich.console import Console
from rich.table import Table

from hub.config import LearnerConfig, LeaseConfig, SchedulerConfig
from hub.method.capacity import (
    CAPACITY_RULES,
    CapacityRule,
    InfeasibleCapacity,
    NodeOffer,
    activate,
    cost_per_step,
    default_kappa,
    mu_min,
    predicted_bubble,
    predicted_step_s,
    rule_staleness,
    turned_rollouts_per_s,
    validate_kappa,
)
from shared.config import ConfigError, Section, field_of, read_toml, validated

EXIT_USAGE_ERROR = 2


class PlanError(ConfigError):
    """The fleet file or the plan's parameters are unusable."""


class FleetNode(Section):
    """One candidate node: a [[node]] table of FLEET.toml."""

    name: str = Field(min_length=1, max_length=256, description="the node's name, unique in the file")
    price_per_hour: float = Field(ge=0.0, le=1e6, strict=True, allow_inf_nan=False, description="its declared price, $/h")
    rollouts_per_s: float = Field(
        gt=0.0,
        le=1e9,
        strict=True,
        allow_inf_nan=False,
        description="its rollouts per second (a tool-using run's: generating every turn, not waiting for answers)",
    )


class Fleet(Section):
    """FLEET.toml: the candidate nodes."""

    node: tuple[FleetNode, ...] = Field(
        min_length=1, max_length=1_000_000, description="the candidate nodes, as [[node]] tables (at least one)"
    )

    @field_validator("node")
    @classmethod
    def _names_unique(cls, nodes: tuple[FleetNode, ...]) -> tuple[FleetNode, ...]:
        seen: set[str] = set()
        for node in nodes:
            if node.name in seen:
                raise ValueError(f"duplicate node name {node.name!r}")
            seen.add(node.name)
        return nodes


class PlanConfig(Section):
    """What `echo-hub plan` sizes a fleet for; the hub's own settings keep the hub's defaults and bounds."""

    rollouts_per_step: float = Field(
        128 * 16,
        gt=0.0,
        le=1e12,
        description="accepted rollouts needed per step (128 prompts x n = 16 by default, docs/DESIGN.md §1); to count the groups the learner skips, divide by the share it trains on (`echo-hub status`)",
    )
    t_train: float = Field(gt=0.0, le=1e7, description="seconds per learner step")
    t_bcast: float = Field(ge=0.0, le=1e7, description="seconds to broadcast a snapshot to the fleet")
    staleness: int = field_of(LearnerConfig, "staleness", description="staleness budget S in versions")
    kappa: int | None = field_of(LearnerConfig, "kappa", description="publish period in learner steps (default max(1, S - 1))")
    gamma: float = field_of(SchedulerConfig, "gamma")
    capacity_rule: CapacityRule = field_of(SchedulerConfig, "capacity_rule")
    learner_price: float = field_of(
        LearnerConfig, "learner_price_per_hour", description="learner $/h (an A100 80GB's by default)"
    )
    turns: int = Field(
        1, ge=1, le=1025, description="model turns per rollout, at most: 1 single-turn; a tool-using run's max tool calls + 1"
    )
    turn_wait: float = Field(
        0.0, ge=0.0, le=3600.0, description="seconds each turn waits for the hub's answer: the round trip and the tools' time"
    )
    lease_rollouts: int = Field(
        LeaseConfig().prompts_per_lease * LearnerConfig().group_size,
        ge=1,
        le=1_000_000,
        description="rollouts a node generates in step: prompts per lease x n",
    )

    def node_rate(self, rollouts_per_s: float) -> float:
        """A node's rollouts/s in this run: what its turns' waits leave of its generation rate."""
        return turned_rollouts_per_s(rollouts_per_s, self.lease_rollouts, self.turns, self.turn_wait)

    @property
    def round_trip_bound(self) -> float | None:
        """The most rollouts/s any one node makes, however fast (None: no wait, no bound)."""
        return self.lease_rollouts / (self.turns * self.turn_wait) if self.turn_wait > 0 else None

    @property
    def effective_kappa(self) -> int:
        return self.kappa if self.kappa is not None else default_kappa(self.staleness)

    @model_validator(mode="after")
    def _kappa_in_range(self) -> PlanConfig:
        validate_kappa(self.effective_kappa, self.staleness)
        return self


@dataclass(frozen=True)
class PlanResult:
    """Everything `echo-hub plan` reports."""

    kappa: int
    capacity_rule: CapacityRule
    mu_min: float
    mu_target: float
    active: tuple[NodeOffer, ...]
    mu_active: float
    shortfall: float
    predicted_bubble: float
    predicted_step_s: float
    cost_per_hour: float
    cost_per_step: float
    round_trip_bound: float | None

    def to_json_dict(self) -> dict[str, object]:
        return {
            "node_rollouts_per_s": {node.name: node.rollouts_per_s for node in self.active},
            "round_trip_bound": self.round_trip_bound,
            "capacity_rule": self.capacity_rule,
            "mu_min": self.mu_min,
            "mu_target": self.mu_target,
            "active": [node.name for node in self.active],
            "mu_active": self.mu_active,
            "shortfall": self.shortfall,
            "predicted_bubble": self.predicted_bubble,
            "cost_per_hour": self.cost_per_hour,
            "cost_per_step": self.cost_per_step,
        }


def load_fleet(path: Path) -> list[NodeOffer]:
    """FLEET.toml's nodes; every problem is a PlanError (one line) naming the key."""
    try:
        fleet = validated(Fleet, read_toml(path, "fleet file"), f"fleet file {path}")
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    return [NodeOffer(node.name, node.price_per_hour, node.rollouts_per_s) for node in fleet.node]


def compute_plan(fleet: list[NodeOffer], plan: PlanConfig) -> PlanResult:
    """The plan for a validated fleet; raises InfeasibleCapacity."""
    fleet = [NodeOffer(node.name, node.price_per_hour, plan.node_rate(node.rollouts_per_s)) for node in fleet]
    kappa, staleness = plan.effective_kappa, rule_staleness(plan.capacity_rule, plan.staleness)
    minimum = mu_min(kappa, plan.rollouts_per_step, plan.t_train, plan.t_bcast, staleness)
    target = plan.gamma * minimum
    chosen = activate(fleet, target)
    active_prices = [node.price_per_hour for node in chosen.active]
    period = (kappa, plan.rollouts_per_step, plan.t_train, plan.t_bcast, chosen.mu_active)
    return PlanResult(
        kappa=kappa,
        capacity_rule=plan.capacity_rule,
        mu_min=minimum,
        mu_target=target,
        active=chosen.active,
        mu_active=chosen.mu_active,
        shortfall=chosen.shortfall,
        predicted_bubble=predicted_bubble(*period, staleness),
        predicted_step_s=predicted_step_s(*period, staleness),
        cost_per_hour=plan.learner_price + math.fsum(active_prices),
        cost_per_step=cost_per_step(*period, plan.learner_price, active_prices, staleness),
        round_trip_bound=plan.round_trip_bound,
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `echo-hub plan`: each sets the PlanConfig field of its name (bounds and defaults there)."""
    fields = PlanConfig.model_fields
    parser.add_argument(
        "--fleet",
        type=Path,
        required=True,
        metavar="FLEET.toml",
        help="candidate nodes: [[node]] tables with name, price_per_hour, rollouts_per_s",
    )
    parser.add_argument("--t-train", type=float, required=True, metavar="T", help=fields["t_train"].description)
    parser.add_argument("--t-bcast", type=float, required=True, metavar="B", help=fields["t_bcast"].description)
    for name, metavar, kind in (
        ("rollouts_per_step", "R", float),
        ("staleness", "S", int),
        ("kappa", "K", int),
        ("gamma", "G", float),
        ("learner_price", "P", float),
        ("turns", "N", int),
        ("turn_wait", "W", float),
        ("lease_rollouts", "B", int),
    ):
        field = fields[name]
        default = "" if field.default is None else f" (default {field.default:g})"
        parser.add_argument(
            "--" + name.replace("_", "-"), type=kind, metavar=metavar, help=f"{field.description}{default}".replace("%", "%%")
        )
    rule = fields["capacity_rule"]
    parser.add_argument("--capacity-rule", choices=CAPACITY_RULES, help=f"{rule.description} (default {rule.default})")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_config(args: argparse.Namespace) -> PlanConfig:
    """The command line's PlanConfig; PlanError (one line) naming a value out of bounds."""
    given = {name: getattr(args, name) for name in PlanConfig.model_fields if getattr(args, name, None) is not None}
    try:
        return validated(PlanConfig, given, "echo-hub plan")
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _print_table(result: PlanResult, console: Console) -> None:
    nodes = Table(title="active nodes (activation order)")
    nodes.add_column("#", justify="right")
    nodes.add_column("node")
    nodes.add_column("$/h", justify="right")
    nodes.add_column(
        "rollouts/s (turns' waits counted)" if result.round_trip_bound is not None else "rollouts/s", justify="right"
    )
    nodes.add_column("rho ($/h per rollout/s)", justify="right")
    for position, node in enumerate(result.active, start=1):
        nodes.add_row(str(position), node.name, f"{node.price_per_hour:.4g}", f"{node.rollouts_per_s:.4g}", f"{node.rho:.4g}")
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
    if result.round_trip_bound is not None:
        summary.add_row("a node's most, however fast (rollouts/s)", f"{result.round_trip_bound:.4g}")
    console.print(nodes)
    console.print(summary)
    if result.shortfall > 0:
        console.print(f"[yellow]the whole fleet falls {result.shortfall:.4g} rollouts/s short of the target[/]")


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; a bad fleet or infeasible capacity prints 'error: ...' and returns 2."""
    try:
        plan = plan_config(args)
        result = compute_plan(load_fleet(args.fleet), plan)
    except (PlanError, InfeasibleCapacity) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    if args.json:
        print(json.dumps(result.to_json_dict()))
    else:
        _print_table(result, Console())
    return 0
