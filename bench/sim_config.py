"""What bench/simulate.py draws, as one strict model: `--config sim.toml` sets any of it, the defaults are the
simulator's documented fleet (bench/simulate.py's docstring).

Every field is bounded; a mistake in sim.toml is one line (`load_sim_config` raises SimConfigError). The fleet
is either drawn from the GPU mix (`[[fleet.gpu]]`, at each size of `fleet.nodes`) or read from `echo-hub plan`'s
FLEET.toml (`fleet.file`, relative to sim.toml), whose nodes keep their names, prices and rates. `with_settings`
applies `--set KEY=VALUE` (bench/simulate.py, bench/sensitivity.py) on top of a file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from hub.config import LearnerConfig, SchedulerConfig
from hub.method.capacity import CapacityRule, validate_kappa
from shared.config import ConfigError, field_of, read_toml, set_dotted, validated

# The simulator's scenarios (bench/simulate.py's SCENARIOS).
ScenarioName = Literal["cost-aware", "all-on", "star", "sync"]


class SimConfigError(ConfigError):
    """sim.toml is unreadable or out of bounds: the message is the one line the user sees."""


class Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuClass(Part):
    """One class of the drawn fleet's GPU mix."""

    share: float = Field(gt=0.0, le=1.0, description="share of the fleet in this class")
    rollouts_per_s: float = Field(gt=0.0, le=1e6, description="median accepted-or-not rollouts per second")
    price_per_hour: float = Field(ge=0.0, le=1000.0, description="median declared price, $/h")


DEFAULT_GPU_MIX = (
    GpuClass(share=0.35, rollouts_per_s=6.0, price_per_hour=0.10),  # RTX 3060-class
    GpuClass(share=0.35, rollouts_per_s=20.0, price_per_hour=0.35),  # RTX 4090-class
    GpuClass(share=0.20, rollouts_per_s=35.0, price_per_hour=1.10),  # A100-class
    GpuClass(share=0.10, rollouts_per_s=60.0, price_per_hour=2.50),  # H100-class
)


class FleetPart(Part):
    """Who the volunteers are: fleet sizes or echo-hub plan's fleet file, the GPU mix, NAT."""

    nodes: tuple[int, ...] = Field(
        (10, 100, 1000, 10000), min_length=1, max_length=16, description="fleet sizes to simulate (drawn fleets)"
    )
    file: Path | None = Field(None, description="echo-hub plan's FLEET.toml instead of a drawn fleet (relative to sim.toml)")
    gpu: tuple[GpuClass, ...] = Field(DEFAULT_GPU_MIX, min_length=1, max_length=32, description="the drawn fleet's GPU mix")
    jitter_sigma: float = Field(
        0.25, ge=0.0, le=2.0, description="lognormal sigma of each node's rate and price around its class"
    )
    nat_share: float = Field(0.0, ge=0.0, le=1.0, description="share of nodes behind a NAT (dial out only)")
    holepunch_s: float = Field(2.0, ge=0.0, le=600.0, description="seconds a hole punch adds to a hop between two NATed nodes")

    @field_validator("nodes")
    @classmethod
    def _sizes(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 1 <= n <= 100_000 for n in sizes):
            raise ValueError(f"fleet sizes must be in [1, 100000], got {sizes}")
        return sizes

    @field_validator("gpu")
    @classmethod
    def _shares(cls, mix: tuple[GpuClass, ...]) -> tuple[GpuClass, ...]:
        if abs(sum(g.share for g in mix) - 1.0) > 1e-6:
            raise ValueError(f"the GPU mix's shares must sum to 1, got {sum(g.share for g in mix):g}")
        return mix


class LinksPart(Part):
    """Bandwidths the broadcast runs at: the volunteers' links and the hub's uplink."""

    median_mbps: float = Field(500.0, gt=0.0, le=1e6, description="median node link, Mbit/s (lognormal)")
    sigma: float = Field(0.5, ge=0.0, le=3.0, description="lognormal sigma of node links")
    min_mbps: float = Field(100.0, gt=0.0, le=1e6, description="node links are clipped to at least this")
    max_mbps: float = Field(2000.0, gt=0.0, le=1e6, description="node links are clipped to at most this")
    hub_uplink_mbps: float = Field(10_000.0, gt=0.0, le=1e7, description="the hub's uplink, Mbit/s")
    hop_latency_s: float = Field(0.05, ge=0.0, le=60.0, description="per-hop latency of a chain")
    fitted_nodes: tuple[int, int] | None = Field(
        None,
        description="[smallest, largest] fleet the links were fitted to: a run of another size is flagged (None: not fitted)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> LinksPart:
        if self.min_mbps > self.max_mbps:
            raise ValueError(f"links.min_mbps ({self.min_mbps:g}) is above links.max_mbps ({self.max_mbps:g})")
        if self.fitted_nodes is not None and not 1 <= self.fitted_nodes[0] <= self.fitted_nodes[1] <= 100_000:
            raise ValueError(f"links.fitted_nodes must be [smallest, largest] in [1, 100000], got {list(self.fitted_nodes)}")
        return self


class ChurnPart(Part):
    """How volunteers come and go."""

    session_mean_s: float = Field(
        7200.0, gt=0.0, le=1e12, description="mean online session (exponential; 1e9 or more: nobody leaves)"
    )
    offline_mean_s: float = Field(1800.0, gt=0.0, le=1e7, description="mean offline spell (exponential)")
    online_at_start: float = Field(0.8, ge=0.0, le=1.0, description="share of nodes online at the start")
    probe_s: float = Field(30.0, ge=0.0, le=3600.0, description="seconds a joining node's probe lease takes")


class LearnerPart(Part):
    """The learner: its step time, price, and the rollouts a step trains on."""

    t_train_s: float = Field(60.0, gt=0.0, le=1e6, description="mean seconds of one learner step")
    t_train_cv: float = Field(0.10, ge=0.0, le=1.0, description="coefficient of variation of T_train (normal)")
    price_per_hour: float = field_of(LearnerConfig, "learner_price_per_hour")
    usable_fraction: float = Field(0.7, gt=0.0, le=1.0, description="share of accepted rollouts the learner trains on")
    rollouts_per_step: float | None = Field(None, gt=0.0, le=1e9, description="R (None: sized by demand_share)")
    demand_share: float = Field(
        0.3, gt=0.0, le=10.0, description="without R: mu_min as this share of the fleet's expected online throughput"
    )
    rollouts_per_lease: int = Field(64, ge=1, le=1_000_000, description="prompts_per_lease * group_size")


class AgentsPart(Part):
    """A tool-using run's turns: every node's rate is what its turns' waits leave of its drawn (generation) rate,
    hub.method.capacity.turned_rollouts_per_s over learner.rollouts_per_lease rollouts in step."""

    turns: int = Field(1, ge=1, le=1025, description="model turns per rollout, at most (1: single-turn)")
    turn_wait_s: float = Field(
        0.0, ge=0.0, le=3600.0, description="seconds each turn waits for the hub's answer: the round trip and the tools' time"
    )


class SnapshotPart(Part):
    """What one published policy weighs."""

    bytes: float = Field(1.2e9, gt=0.0, le=1e13, description="bytes of one full snapshot")
    chunk_bytes: float = Field(float(1 << 20), gt=0.0, le=1e10, description="chunk size of the chained broadcast")


# An S as the hub takes it (its bounds), or auto; a value is checked as the one its type says it means.
StalenessSetting = Annotated[
    Annotated[int, *LearnerConfig.model_fields["staleness"].metadata, Tag("S")] | Annotated[Literal["auto"], Tag("auto")],
    Discriminator(lambda value: "auto" if isinstance(value, str) else "S"),
]


class RunPart(Part):
    """The hub's settings a run is simulated under: their defaults and bounds are the hub's own (hub/config.py)."""

    staleness: tuple[StalenessSetting, ...] = Field(
        (LearnerConfig().staleness,), min_length=1, max_length=16, description="S of each row set (an int, or auto)"
    )
    kappa: int | None = field_of(LearnerConfig, "kappa", description="publish period (None: default_kappa(S))")
    staleness_max: int = field_of(LearnerConfig, "staleness_max")
    drift_per_version: float = Field(
        0.01, ge=0.0, le=10.0, description="auto: mean |log-ratio| one version of age adds (an assumption: no model runs here)"
    )
    drift_max: float = field_of(LearnerConfig, "drift_max")
    gamma: float = field_of(SchedulerConfig, "gamma")
    steps: int | None = Field(None, ge=4, le=10_000_000, description="learner steps per run (None: default_steps(N))")
    seeds: int = Field(1, ge=1, le=1000, description="seeds per fleet size and scenario")
    fleet_seed: int | None = Field(None, ge=0, description="draw one fleet per size from this seed")
    scenarios: tuple[ScenarioName, ...] = Field(
        ("cost-aware", "all-on", "star", "sync"), min_length=1, description="scenarios to run"
    )
    capacity_rule: tuple[CapacityRule, ...] = Field(
        ("refined",), min_length=1, max_length=2, description="capacity rules, each running every row (paper, refined)"
    )


class PriceChange(Part):
    """At `at_s`, a share of the nodes (the same ones in every scenario of a seed) multiply their price."""

    at_s: float = Field(ge=0.0, le=1e9, description="simulated seconds from the start")
    share: float = Field(gt=0.0, le=1.0, description="share of the nodes whose price changes")
    factor: float = Field(gt=0.0, le=1000.0, description="their price is multiplied by this")


class FleetChange(Part):
    """At `at_s`, a share of the online nodes leave at once and come back after `away_s` (None: never)."""

    at_s: float = Field(ge=0.0, le=1e9, description="simulated seconds from the start")
    leave_share: float = Field(gt=0.0, le=1.0, description="share of the online nodes that leave")
    away_s: float | None = Field(None, gt=0.0, le=1e9, description="how long they stay away (None: the rest of the run)")


class PaperFigure(Part):
    """A $/step a paper reports for one scenario at one fleet size: the printed table shows it beside that row."""

    scenario: ScenarioName = Field(description="the simulator's scenario it is the paper's figure for")
    nodes: int = Field(ge=1, le=100_000, description="the fleet size it was reported at")
    cost_per_step: float = Field(gt=0.0, le=1e9, description="the reported $ per learner step")


class SimConfig(Part):
    """Everything the simulator draws and decides with."""

    fleet: FleetPart = FleetPart()
    links: LinksPart = LinksPart()
    churn: ChurnPart = ChurnPart()
    learner: LearnerPart = LearnerPart()
    agents: AgentsPart = AgentsPart()
    snapshot: SnapshotPart = SnapshotPart()
    run: RunPart = RunPart()
    price_change: tuple[PriceChange, ...] = Field((), max_length=1000)
    fleet_change: tuple[FleetChange, ...] = Field((), max_length=1000)
    paper_figure: tuple[PaperFigure, ...] = Field(
        (), max_length=1000, description="a paper's reported $/step, printed beside the simulated row it is for"
    )

    @model_validator(mode="after")
    def _kappa_fits(self) -> SimConfig:
        if self.run.kappa is not None:
            for s in self.run.staleness:
                validate_kappa(self.run.kappa, self.run.staleness_max if s == "auto" else s)
        return self


def load_sim_config(path: Path) -> SimConfig:
    """sim.toml as a SimConfig, `fleet.file` made relative to it; SimConfigError says what is wrong in one line."""
    try:
        config = validated(SimConfig, read_toml(path, "simulator config"), str(path))
    except ConfigError as exc:
        raise SimConfigError(str(exc)) from None
    if config.fleet.file is not None and not config.fleet.file.is_absolute():
        config = config.model_copy(update={"fleet": config.fleet.model_copy(update={"file": path.parent / config.fleet.file})})
    return config


def with_settings(base: SimConfig, settings: list[str]) -> SimConfig:
    """`base` with each KEY=VALUE (a dotted key, a TOML value) of --set applied; SimConfigError (one line) on a
    malformed setting, an unknown key or a value out of bounds."""
    tree = base.model_dump()
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise SimConfigError(f"--set {setting!r}: write KEY=VALUE, e.g. --set run.seeds=1")
        try:
            set_dotted(tree, key.strip(), tomllib.loads(f"value = {value.strip()}")["value"])
        except tomllib.TOMLDecodeError:
            raise SimConfigError(f"--set {setting!r}: {value.strip()!r} is not a TOML value (a string needs quotes)") from None
        except AttributeError:  # a dotted key through a value that is not a table
            raise SimConfigError(f"--set {setting!r}: {key.strip()!r} is not a key of sim.toml") from None
    try:
        return validated(SimConfig, tree, "--set")
    except ConfigError as exc:
        raise SimConfigError(str(exc)) from None
