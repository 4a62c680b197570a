"""The hub's configuration: one strict model, one section per component."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hub.capacity import default_kappa, validate_kappa
from shared.config import Section
from shared.rollout import SamplingParams

DEFAULT_HUB_PORT = 4077


class LearnerConfig(Section):
    """GRPO learner (DESIGN sections 2, 6)."""

    staleness: int = Field(4, ge=0, le=64, description="S: max versions a trajectory may lag the learner")
    kappa: int | None = Field(None, ge=1, le=64, description="publish a snapshot every kappa steps (default max(1, S-1))")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="groups consumed per learner step")
    group_size: int = Field(8, ge=2, le=256, description="n: completions per prompt")
    lr: float = Field(3e-4, gt=0.0, le=1.0, description="AdamW learning rate (the default suits the embedded model)")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="max global gradient norm")
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="lower PPO clip range")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="upper PPO clip range")
    use_is_ratio: bool = Field(True, description="importance-weight stale rollouts (off: treat them as on-policy)")
    max_is_ratio: float | None = Field(None, gt=1.0, description="mask tokens whose ratio exceeds this")
    beta: float = Field(0.0, ge=0.0, le=10.0, description="KL penalty weight to the initial policy")
    advantage_scale: Literal["group", "batch", "none"] = Field("group", description="advantage normalisation")
    skip_zero_variance: bool = Field(True, description="skip groups whose rewards are all equal")
    buffer_max_groups: int = Field(4096, ge=1, le=1_000_000, description="replay buffer capacity in groups")
    checkpoint_every: int = Field(10, ge=1, le=100_000, description="checkpoint model+optimizer every K steps")
    learner_price_per_hour: float = Field(3.06, ge=0.0, le=1000.0, description="learner GPU price, $/h")
    seed: int = Field(0, ge=0, description="seed for the learner and prompt sampling")
    device: str = Field("cpu", description="torch device for the learner")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads for the learner")

    @property
    def effective_kappa(self) -> int:
        return self.kappa if self.kappa is not None else default_kappa(self.staleness)

    @model_validator(mode="after")
    def _kappa_in_range(self) -> LearnerConfig:
        validate_kappa(self.effective_kappa, self.staleness)
        return self


class LeaseConfig(Section):
    """Work leases handed to nodes (DESIGN section 7)."""

    prompts_per_lease: int = Field(4, ge=1, le=1024, description="prompts in one lease")
    lease_timeout_s: float = Field(60.0, gt=0.0, le=86400.0, description="a lease not answered by then is re-leased")
    max_cost_per_lease_usd: float = Field(1.0, gt=0.0, description="cap on what one lease can be paid")
    max_inflight_steps: float = Field(2.0, gt=0.0, le=100.0, description="leased + buffered work cap, in learner steps")


class BroadcastConfig(Section):
    """Snapshot dissemination (DESIGN section 5)."""

    mode: Literal["chain", "star"] = Field("chain", description="forwarding chains or hub-to-every-node")
    chunk_kib: int = Field(1024, ge=4, le=16384, description="snapshot chunk size in KiB")
    hub_uplink_mbps: float | None = Field(None, gt=0.0, description="B0 in Mbit/s (None: unlimited/unknown)")
    link_mbps: float | None = Field(None, gt=0.0, description="emulated per-connection rate limit in Mbit/s")


class SchedulerConfig(Section):
    """Capacity model and cost-aware activation (DESIGN sections 3, 4)."""

    gamma: float = Field(1.1, ge=1.0, le=10.0, description="provisioning headroom over mu_min")
    control_period_s: float = Field(5.0, gt=0.0, le=3600.0, description="seconds between fleet decisions")
    release_margin: float = Field(0.2, ge=0.0, le=10.0, description="hysteresis before releasing a node")
    heartbeat_timeout_s: float = Field(15.0, gt=0.0, le=3600.0, description="a node silent this long is dropped")
    enabled: bool = Field(True, description="off: every node is active")


class HubConfig(Section):
    """Everything `echo-hub start` needs."""

    data_dir: Path = Field(Path("echo2-data"), description="store, snapshots, checkpoints, metrics, logs")
    model: Path | None = Field(None, description="local HF causal LM directory (None: the embedded default)")
    task: str = Field("reverse", description="builtin name, math:FILE.jsonl, or module:Class")
    listen: str = Field(f"/ip4/0.0.0.0/tcp/{DEFAULT_HUB_PORT}", description="libp2p listen multiaddr")
    key: Path | None = Field(None, description="hub identity key file (default DATA_DIR/hub.key)")
    steps: int = Field(150, ge=0, le=10_000_000, description="learner steps to run (0: until interrupted)")
    local_nodes: int = Field(3, ge=0, le=64, description="volunteer nodes to spawn on loopback")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of the data-dir log")
    learner: LearnerConfig = LearnerConfig()
    sampling: SamplingParams = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10)
    lease: LeaseConfig = LeaseConfig()
    broadcast: BroadcastConfig = BroadcastConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @property
    def key_path(self) -> Path:
        return self.key if self.key is not None else self.data_dir / "hub.key"
