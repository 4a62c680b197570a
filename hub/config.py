"""The hub's configuration: one strict model, one section per component."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from hub.method.capacity import CapacityRule, default_kappa, validate_kappa
from shared.config import HttpBind, Section
from shared.layout import HUB_KEY_FILE
from shared.logs import LOG_BACKUPS, LOG_MAX_MB
from shared.messages import LEASE_SECONDS_MAX
from shared.rollout import MAX_ENV_SEGMENTS, SamplingParams
from shared.tasks.dataset import DatasetOptions

DEFAULT_HUB_PORT = 4077
# TRL's default cap of the importance weights (vllm_importance_sampling_clip_max); verl recommends 2 at token level.
IS_THRESHOLD_DEFAULT = 3.0
# TRL's vllm_importance_sampling_mode values: level and mode (learner.rollout_is_level, learner.rollout_is_mode) in one.
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# A torch device as the flags and TOML take it: auto picks cuda when torch sees a GPU.
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]{1,2})?)$"
# The status page's documented port (`--http 0.0.0.0:4078`); off unless asked: see HubConfig.http.
DEFAULT_HTTP_PORT = 4078


class LearnerConfig(Section):
    """GRPO learner (docs/DESIGN.md §2-4)."""

    staleness: int = Field(
        4, ge=0, le=64, description='S: max versions a trajectory may lag the learner ("auto": adapt it, see staleness_auto)'
    )
    staleness_auto: bool = Field(
        False,
        description='set by staleness = "auto": the hub picks S in [1, staleness_max] each publish period, starting at 1, on resume at the S of the last step (kappa follows S)',
    )
    staleness_max: int = Field(8, ge=1, le=64, description='largest S that staleness = "auto" may choose')
    drift_max: float = Field(
        0.2,
        gt=0.0,
        le=10.0,
        description="auto staleness: bound on the mean |log-ratio| of the tokens trained on (0.2: eps_low's clip range); S falls at 0.8 x this",
    )
    kappa: int | None = Field(None, ge=1, le=64, description="publish a snapshot every kappa steps (default max(1, S-1))")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="groups consumed per learner step")
    group_size: int = Field(8, ge=2, le=256, description="n: completions per prompt")
    lr: float = Field(
        3e-4,
        gt=0.0,
        le=1.0,
        description="AdamW learning rate (the default suits the embedded model; a --model of your own: TRL's 1e-6)",
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="learning-rate schedule over --steps, after the warm-up (linear and cosine decay to 0 at the last step, as TRL's)",
    )
    warmup_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of --steps over which the learning rate rises linearly from 0 (TRL's warmup_ratio)",
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="max global gradient norm")
    eps_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="lower PPO clip range (below 1: the clip keeps ratios above 1 - eps_low > 0)"
    )
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="upper PPO clip range")
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = Field(
        "dapo",
        description="how a step's token losses add up (TRL's loss_type): dapo the mean over its tokens (bnpo the same: a step is one exactly accumulated batch), grpo each completion's mean then their mean, dr_grpo their sum over completions x max_new_tokens",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=1,
        description="TRL's num_iterations (mu), which must stay 1: each group trains once, and --staleness S bounds how stale it may be instead",
    )
    use_is_ratio: bool = Field(True, description="importance-weight stale rollouts (off: treat them as on-policy)")
    max_is_ratio: float | None = Field(None, gt=1.0, description="mask tokens whose ratio exceeds this")
    rollout_is_mode: Literal["off", "truncate", "mask"] = Field(
        "off",
        description="off-policy correction (verl's rollout_is_mode; TRL's vllm_importance_sampling_mode token_truncate, token_mask, sequence_truncate or sequence_mask sets the level too): off, the PPO ratio to the nodes' log-probs is the correction (today's default, until a sweep of S x mode picks one); truncate (TIS) multiplies each token's loss by its importance weight capped to [rollout_is_threshold_lower, rollout_is_threshold]; mask (MIS) drops the tokens, or sequences, whose weight lies outside",
    )
    rollout_is_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="what one importance weight covers (verl's rollout_is_level): a token's ratio, the product of its sequence's, or their geometric mean",
    )
    rollout_is_threshold: float = Field(
        IS_THRESHOLD_DEFAULT,
        gt=1.0,
        le=1e8,
        description="upper cap of the importance weights, with rollout_is_mode truncate or mask (verl's rollout_is_threshold, TRL's vllm_importance_sampling_clip_max)",
    )
    rollout_is_threshold_lower: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="lower cap of the importance weights (TRL's vllm_importance_sampling_clip_min; unset: none, where verl's unset is 1 / rollout_is_threshold)",
    )
    rollout_is_veto_threshold: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="drop every sequence with a token whose ratio to the nodes' log-probs is below this, in any mode (verl's veto, e.g. 1e-4)",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="the PPO ratio per token, or per sequence as the geometric mean of its tokens' (GSPO, which pairs it with loss_type grpo and eps ~ 4e-4; TRL's importance_sampling_level)",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0.0,
        le=100.0,
        description="drop sequences with a negative advantage whose mean log(p_node / p_learner) exceeds this (DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold, e.g. 0.5)",
    )
    beta: float = Field(0.0, ge=0.0, le=10.0, description="KL penalty weight to the initial policy")
    advantage_scale: Literal["group", "batch", "none"] = Field("group", description="advantage normalisation")
    skip_zero_variance: bool = Field(True, description="skip groups whose rewards are all equal")
    buffer_max_groups: int = Field(4096, ge=1, le=1_000_000, description="replay buffer capacity in groups")
    checkpoint_every: int = Field(10, ge=1, le=100_000, description="checkpoint model+optimizer every K steps")
    checkpoint_every_s: float = Field(
        60.0,
        ge=1.0,
        le=86_400.0,
        description="also checkpoint after a step once this many seconds passed since the last checkpoint (and 20x its time): what a crash loses at most",
    )
    checkpoints_kept: int = Field(2, ge=1, le=1000, description="newest checkpoints kept on disk; older ones are deleted")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="snapshot and engine precision (auto: bfloat16 on a CUDA GPU that has it, else float32); master weights stay fp32",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=64,
        le=10_000_000,
        description="tokens (prompts and completions, packed) per forward/backward micro-batch; gradients accumulate over them (None: from the GPU's free memory, 16384 on a CPU)",
    )
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw",
        description='AdamW with fp32 moments (8 bytes a trained parameter), or adamw8bit: torchao\'s blockwise 8-bit moments (2 bytes; pip install -e ".[lowbit]"), one learner process',
    )
    attention: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "sdpa",
        description="the learner's attention kernel: sdpa and eager pack rows into sequences as long as the longest row; flex_attention (CUDA) and flash_attention_2 (the flash-attn package) attend within each row, a micro-batch in one sequence",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory for long completions, ~30% slower"
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (dynamic shapes, so one compile serves every length): the first step pays the compile, tens of seconds; a CPU needs a C++ compiler",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        le=1024,
        description="train LoRA adapters of this rank only, and ship only them in snapshots (0: full fine-tuning)",
    )
    lora_alpha: float = Field(
        16.0, gt=0.0, le=1e4, description="LoRA scale numerator: the update is lora_alpha / lora_rank x B A"
    )
    lora_targets: tuple[str, ...] = Field(
        (), max_length=64, description="Linear modules to adapt, e.g. q_proj,v_proj (empty: peft's default for the architecture)"
    )
    learner_price_per_hour: float = Field(3.06, ge=0.0, le=1000.0, description="learner GPU price, $/h")
    seed: int = Field(0, ge=0, description="seed for the learner and prompt sampling")
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="torch device of the learner: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N",
    )
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads for the learner")
    procs: int = Field(
        1,
        ge=1,
        le=64,
        description="learner processes on this machine, sharded with FSDP2 (gloo on CPU, NCCL on GPUs: one GPU each); under torchrun WORLD_SIZE decides",
    )
    stall_warning_s: float = Field(120.0, gt=0.0, le=86400.0, description="warn when no step for this long while groups arrive")

    @property
    def effective_kappa(self) -> int:
        return self.kappa if self.kappa is not None else default_kappa(self.staleness)

    @property
    def staleness_bound(self) -> int:
        """The largest S this run may put in force: what snapshots are kept for and nodes are told."""
        return self.staleness_max if self.staleness_auto else self.staleness

    @field_validator("lr_scheduler", mode="before")
    @classmethod
    def _transformers_name(cls, value: object) -> object:
        """transformers' `constant_with_warmup` (TRL users' value) is our constant, which warms up as asked."""
        return "constant" if value == "constant_with_warmup" else value

    @field_validator("num_iterations", mode="before")
    @classmethod
    def _one_iteration(cls, value: object) -> object:
        """mu > 1 refused in words: what it does, and the setting that does the same here."""
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ValueError(
                f"{value} (TRL's mu) would train each batch of rollouts {value} times, the later passes on rollouts up "
                f"to {value - 1} version{'s' if value > 2 else ''} stale; echo2 trains each group once and lets it be up "
                f"to S versions stale instead: leave it at 1 and set --staleness S >= {value - 1} for as much reuse of "
                "off-policy rollouts"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _staleness_auto(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("staleness") == "auto":
            return {**data, "staleness": 1, "staleness_auto": True}
        return data

    @model_validator(mode="before")
    @classmethod
    def _trl_importance_sampling_mode(cls, data: object) -> object:
        """TRL's vllm_importance_sampling_mode (token_mask...) names the level and the mode in one value."""
        if not isinstance(data, dict) or data.get("rollout_is_mode") not in TRL_IS_MODES:
            return data
        level, mode = str(data["rollout_is_mode"]).split("_")
        if data.get("rollout_is_level", level) != level:
            raise ValueError(
                f"rollout_is_mode {data['rollout_is_mode']} (TRL's vllm_importance_sampling_mode) is level {level}, "
                f"but rollout_is_level is {data['rollout_is_level']}: give one of them"
            )
        return {**data, "rollout_is_mode": mode, "rollout_is_level": level}

    @model_validator(mode="after")
    def _corrections_apply(self) -> LearnerConfig:
        """A correction setting that would do nothing is refused, not ignored."""
        if self.rollout_is_mode == "off":
            unused = [
                f"{name} {value}"
                for name, value, default in (
                    ("rollout_is_level", self.rollout_is_level, "token"),
                    ("rollout_is_threshold", self.rollout_is_threshold, IS_THRESHOLD_DEFAULT),
                    ("rollout_is_threshold_lower", self.rollout_is_threshold_lower, None),
                )
                if value != default
            ]
            if unused:
                they = "it acts" if len(unused) == 1 else "they act"
                raise ValueError(
                    f"{', '.join(unused)}: {they} only with rollout_is_mode truncate or mask, and rollout_is_mode is off: set one"
                )
        needs_ratio = self.rollout_is_mode != "off" or self.rollout_is_veto_threshold or self.off_policy_mask_threshold
        if needs_ratio and not self.use_is_ratio:
            raise ValueError(
                "use_is_ratio = false trains as if every rollout were on-policy, leaving the off-policy corrections "
                "nothing to weigh: set use_is_ratio = true or drop rollout_is_mode, rollout_is_veto_threshold and "
                "off_policy_mask_threshold"
            )
        return self

    @model_validator(mode="after")
    def _kappa_in_range(self) -> LearnerConfig:
        if self.staleness_auto and self.kappa is not None:
            raise ValueError('kappa follows S under staleness = "auto": leave kappa unset')
        validate_kappa(self.effective_kappa, self.staleness)
        if self.staleness_auto and not 1 <= self.staleness <= self.staleness_max:
            raise ValueError(f'staleness = "auto" starts S in [1, staleness_max = {self.staleness_max}], got {self.staleness}')
        return self


class LeaseConfig(Section):
    """Work leases handed to nodes (docs/DESIGN.md §9)."""

    prompts_per_lease: int = Field(4, ge=1, le=1024, description="prompts in one lease")
    lease_timeout_s: float = Field(60.0, gt=0.0, le=LEASE_SECONDS_MAX, description="a lease not answered by then is re-leased")
    max_cost_per_lease_usd: float = Field(1.0, gt=0.0, le=1e6, description="cap on what one lease can be paid")
    paid_tokens_per_s_floor: float = Field(
        100.0,
        gt=0.0,
        le=1e9,
        description="slowest generation paid in full: a lease is paid for at most (accepted tokens / this) seconds",
    )
    max_inflight_steps: float = Field(
        2.0, gt=0.0, le=100.0, description="leased + buffered cap, in learner steps of groups trained on"
    )


class BroadcastConfig(Section):
    """Snapshot dissemination (docs/DESIGN.md §7-8)."""

    mode: Literal["chain", "star"] = Field("chain", description="forwarding chains or hub-to-every-node")
    chunk_kib: int = Field(1024, ge=4, le=16384, description="snapshot chunk size in KiB")
    hub_uplink_mbps: float | None = Field(None, gt=0.0, le=1e6, description="B0 in Mbit/s (None: unlimited/unknown)")
    link_mbps: float | None = Field(None, gt=0.0, le=1e6, description="emulated per-connection rate limit in Mbit/s")
    bulk_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="TCP port of the bulk channel snapshot transfers take (shared/bulk.py; 0: any free port, -1: off, transfers go over libp2p)",
    )
    delta_max_ratio: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="also publish each version as a delta against the previous one if at most this share of its bytes (0: never)",
    )


class SchedulerConfig(Section):
    """Capacity model and cost-aware activation (docs/DESIGN.md §5-6)."""

    gamma: float = Field(1.1, ge=1.0, le=10.0, description="provisioning headroom over mu_min")
    control_period_s: float = Field(5.0, gt=0.0, le=3600.0, description="seconds between fleet decisions")
    release_margin: float = Field(
        0.2, ge=0.0, le=10.0, description="hysteresis: nodes are released only while the pool keeps target * (1 + this)"
    )
    max_price_per_hour: float = Field(10.0, ge=0.0, le=1000.0, description="nodes declaring a higher $/h are refused at join")
    price_change_interval_s: float = Field(
        600.0,
        ge=0.0,
        le=86400.0,
        description="a joined node may re-declare its price once per this many seconds (sooner is refused and counted against it)",
    )
    price_band: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="hysteresis: the scheduler re-ranks a node only once its price moved more than this share",
    )
    heartbeat_period_s: float = Field(
        2.0, gt=0.0, le=600.0, description="how often nodes heartbeat while the fleet is small (told on join and each beat)"
    )
    heartbeat_timeout_s: float = Field(
        15.0, gt=0.0, le=3600.0, description="a node silent this long is dropped (stretched as its period is)"
    )
    heartbeats_per_s: float = Field(
        25.0, gt=0.0, le=1e6, description="most heartbeats/s asked of the whole fleet: past that, every node beats less often"
    )
    enabled: bool = Field(True, description="off: every node is active")
    capacity_rule: CapacityRule = Field(
        "refined",
        description="how mu_min charges the broadcast: paper = the whole T_bcast, refined = only past (S - kappa) T_train",
    )

    @model_validator(mode="after")
    def _timeout_covers_beats(self) -> SchedulerConfig:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_period_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice heartbeat_period_s "
                f"({self.heartbeat_period_s:g}): one late beat must not drop a node"
            )
        return self


# Config of the hub's trust defences (docs/DESIGN.md §10): log-prob audits, copy detection, Sybil and peer limits.
#
# Defaults and why (measured on the embedded default model, 20 prompts x 8 completions x <= 10 tokens):
# - honest fp32 CPU node vs the hub's fp32 CPU recomputation: mean |dlogp| ~3e-7, max ~7e-6;
# - honest bf16 node vs the same fp32 recomputation: mean ~0.008, worst group mean ~0.016, max token
#   ~0.16, and ~1 token in 900 outside the hub's top-p nucleus (top_p 0.9);
# - a node generating with another model (the base model while claiming a snapshot three Adam steps
#   at lr 1e-4 away): mean ~0.3, every group above 0.05.
# Engines load snapshots in the hub's dtype exactly (a node of another dtype is refused at join),
# and the hub recomputes in fp32 from those weights, so the tolerance follows the snapshot dtype:
# fp32 snapshots admit 0.01 nats (GPU kernels differ from the hub's CPU ones by far less than
# that), bf16 ones 0.05 nats, three times the worst honest bf16 group seen.
AUDIT_GAP_BY_DTYPE = {"float32": 0.01, "bfloat16": 0.05}


class TrustConfig(Section):
    """Audits, copy detection and per-peer limits of the hub (docs/DESIGN.md §10)."""

    audit_rate: float = Field(0.05, ge=0.0, le=1.0, description="fraction of a trusted node's submissions re-scored")
    audit_first_n: int = Field(10, ge=0, le=10_000, description="a node is audited on every submission until it passed this many")
    audit_mean_abs_gap: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="max mean |reported - recomputed| log-prob per group, nats (None: 0.01 for float32 snapshots, 0.05 for bfloat16)",
    )
    audit_max_outside_frac: float = Field(
        0.05, ge=0.0, le=1.0, description="max fraction of tokens outside the hub's top-p nucleus"
    )
    audit_queue_groups: int = Field(
        256,
        ge=1,
        le=100_000,
        description="groups waiting for an audit: sampled ones beyond it are skipped, probation ones told to retry",
    )
    copy_cache_groups: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="recent group fingerprints kept for copy detection (LRU; ~0.2 KB + 44 B per completion each)",
    )
    copy_false_alarm: float = Field(
        1e-6,
        ge=1e-300,
        le=0.01,
        description="chance that any honest group of a hub run is called a copy (the repeat threshold is this run-wide rate's)",
    )
    sampling_false_alarm: float = Field(
        1e-6, ge=1e-300, le=0.01, description="chance per hub run that the sampling test condemns an honest node"
    )
    sampling_slack_nats: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="nats charged per token re-scored for the sampling test: the engine's own gap (default: the audit tolerance)",
    )
    lease_new_node_prompts: int = Field(
        1, ge=1, le=1024, description="prompts per lease until a node passed trusted_after_audits audits"
    )
    trusted_after_audits: int = Field(3, ge=0, le=10_000, description="audits a node must pass before full-size leases")
    max_open_leases_per_peer: int = Field(2, ge=1, le=1024, description="open leases one identity may hold")
    max_open_leases_per_ip: int = Field(
        8, ge=1, le=100_000, description="open leases all identities behind one address (IPv6: /64) may hold"
    )
    max_streams_per_peer: int = Field(16, ge=1, le=4096, description="concurrent inbound streams one peer may hold")
    requests_per_s: float = Field(
        50.0, gt=0.0, le=1e6, description="sustained inbound streams per second per peer (token bucket rate)"
    )
    request_burst: int = Field(
        100, ge=1, le=1_000_000, description="token bucket depth: streams a peer may open at once after a quiet spell"
    )
    max_buffered_bytes_per_peer: int = Field(
        96 << 20, ge=1 << 20, le=1 << 40, description="frame bytes one peer may have in hub memory at once"
    )
    max_buffered_bytes_total: int = Field(
        2 << 30, ge=1 << 20, le=1 << 44, description="frame bytes all peers together may have in hub memory at once"
    )
    violations_to_disconnect: int = Field(
        20, ge=1, le=1_000_000, description="refusals within violation_window_s that get a peer disconnected"
    )
    violation_window_s: float = Field(10.0, gt=0.0, le=86400.0, description="sliding window over which refusals are counted")
    disconnect_cooldown_s: float = Field(
        60.0, ge=0.0, le=86400.0, description="a disconnected peer is refused outright this long"
    )
    max_connections_per_ip: int = Field(
        32, ge=1, le=100_000, description="live inbound connections one address may hold (loopback too)"
    )
    idle_connection_s: float = Field(
        15.0, gt=0.0, le=86400.0, description="a connection of a peer that is not a joined node is closed after this long idle"
    )
    check_procs: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="processes that check submissions (decode, lengths, rewards recomputed); 0: a thread of the hub's process; None: cores - 1, at least 1 (0 for a task with a light reward, as reverse)",
    )
    check_timeout_s: float = Field(
        20.0,
        gt=0.0,
        le=25.0,
        description="the longest (wall clock) one submission's checks may take: past it its groups are rejected, counted against its node, and the reward is probed",
    )
    reward_budget_s: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="CPU seconds the reward may spend per completion (a group gets this times its size): past it the group is rejected, counted against its node",
    )
    status_operators: tuple[str, ...] = Field(
        (),
        max_length=64,
        description="peer ids that see nodes' prices and costs in the status protocol (the hub's own key always does)",
    )

    def mean_abs_gap(self, snapshot_dtype: str) -> float:
        """The audit tolerance in nats: the configured one, else the snapshot dtype's."""
        return self.audit_mean_abs_gap if self.audit_mean_abs_gap is not None else AUDIT_GAP_BY_DTYPE[snapshot_dtype]

    def sampling_slack(self, snapshot_dtype: str) -> float:
        """The sampling test's charge per token, nats: the configured one, else the audit tolerance."""
        return self.sampling_slack_nats if self.sampling_slack_nats is not None else self.mean_abs_gap(snapshot_dtype)


class DatasetConfig(Section):
    """How a dataset task (--task FILE.jsonl, FILE.parquet or a save_to_disk DIR) is read and scored."""

    prompt_column: str = Field(
        "prompt", min_length=1, max_length=256, description="column holding the prompt (a string or chat messages)"
    )
    answer_column: str = Field(
        "answer",
        min_length=1,
        max_length=256,
        description="column holding the gold answer (a.b: key b of column a, e.g. verl's reward_model.ground_truth)",
    )
    reward: str = Field(
        "math",
        min_length=1,
        max_length=4096,
        description="math (math-verify on the answer), exact (exact match) or module:function (TRL's or verl's signature); several comma-separated add up",
    )
    reward_weights: tuple[Annotated[float, Field(ge=-1e6, le=1e6, allow_inf_nan=False)], ...] = Field(
        (), max_length=64, description="one weight per --reward function, comma-separated (empty: 1.0 each)"
    )
    reward_style: Literal["auto", "trl", "verl"] = Field(
        "auto",
        description="how module:function rewards are called: trl, verl (compute_score) or auto (verl when it takes solution_str)",
    )
    split: str = Field("train", min_length=1, max_length=256, description="split of a save_to_disk DatasetDict to read")
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="longest prompt in tokens: a longer one is refused at start, naming the count and the longest (verl's truncation='error'; nothing is cut), for --task and --eval-task (None: the model's context is the bound)",
    )
    chat: bool = Field(
        False,
        description="render string prompts as one user message with the tokenizer's chat template (message lists always are)",
    )
    allow_lossy_prompts: bool = Field(
        False, description="start even when the tokenizer drops characters of some prompts (warned once; by default refused)"
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _one_list(cls, value: object) -> object:
        """`--reward a --reward b` and hub.toml's `reward = ["a", "b"]` as `a,b`."""
        return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value

    def options(self, id_prefix: str = "row") -> DatasetOptions:
        return DatasetOptions(
            self.prompt_column,
            self.answer_column,
            self.reward,
            self.split,
            self.chat,
            id_prefix,
            self.reward_weights,
            self.reward_style,
        )


class EvalConfig(Section):
    """Held-out evaluation of the policy while it trains."""

    every: int = Field(0, ge=0, le=10_000_000, description="evaluate every N learner steps (0: never)")
    task: str | None = Field(
        None,
        max_length=4096,
        description="task to evaluate on, as --task takes it (None: the held-out split of the training task)",
    )
    split: float = Field(
        0.05,
        gt=0.0,
        lt=1.0,
        description="fraction of the training task held out for evaluation, by a hash of each prompt's text (when no eval task is given)",
    )
    prompts: int = Field(64, ge=1, le=100_000, description="held-out prompts per evaluation, the same ones every time")
    samples: int = Field(1, ge=1, le=256, description="k: completions per prompt, for pass@1 and pass@k")
    temperature: float | None = Field(
        None, ge=0.0, le=10.0, description="sampling temperature of evaluation (0: greedy; None: the training temperature)"
    )
    success_reward: float = Field(1.0, description="a completion with at least this reward counts as solved for pass@k")

    @model_validator(mode="after")
    def _greedy_needs_one_sample(self) -> EvalConfig:
        if self.temperature == 0.0 and self.samples > 1:
            raise ValueError(
                f"greedy evaluation (temperature 0) gives one completion per prompt; samples {self.samples} "
                "needs a temperature above 0"
            )
        return self


class AgentsConfig(Section):
    """Multi-turn, tool-using rollouts, as TRL's GRPOTrainer takes them (docs/agents.md). A rollout's model and tool
    tokens together are capped by --max-new-tokens (TRL's max_completion_length); the tools run on the hub, in a
    sandbox whose limits are below, never on the volunteers."""

    tools: tuple[Annotated[str, Field(min_length=3, max_length=4096)], ...] = Field(
        (), max_length=64, description="module:function specs of the tools the model may call (TRL's tools), comma-separated"
    )
    environment: str | None = Field(
        None,
        min_length=3,
        max_length=4096,
        description="module:Class making one environment per rollout: its reset method, its public methods as tools, an optional get_reward method (TRL's environment_factory)",
    )
    max_tool_calls: int = Field(
        8,
        ge=1,
        le=MAX_ENV_SEGMENTS,
        description="rounds of tool calls a rollout may run before it ends (TRL's max_tool_calling_iterations, unbounded there)",
    )
    tool_wall_s: float = Field(
        10.0, gt=0.0, le=600.0, description="wall-clock seconds one tool call may take: past it its sandbox worker is killed"
    )
    tool_cpu_s: float = Field(5.0, gt=0.0, le=600.0, description="CPU seconds one tool call may spend")
    tool_memory_mb: int = Field(
        512, ge=16, le=1 << 20, description="MB a tool call may allocate beyond what its worker held after loading the tools"
    )
    tool_procs: int = Field(2, ge=1, le=256, description="sandbox worker processes running tool calls and environments")
    environments_per_worker: int = Field(
        256, ge=1, le=1_000_000, description="environments one sandbox worker holds at once (with an environment)"
    )
    rollouts_per_node: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="multi-turn rollouts one node may hold open at once (its leases' prompts x group size)",
    )

    @property
    def enabled(self) -> bool:
        """Whether rollouts call tools (tools or an environment given)."""
        return bool(self.tools) or self.environment is not None

    @field_validator("tools", mode="before")
    @classmethod
    def _one_list(cls, value: object) -> object:
        """`--tools a,b --tools c` and hub.toml's `tools = "a,b"` as one tuple."""
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value


class TrackingConfig(Section):
    """Experiment trackers that receive the run config, every metrics row and every evaluation."""

    report_to: tuple[Literal["none", "tensorboard", "wandb", "trackio"], ...] = Field(
        ("none",), max_length=4, description="trackers to log to (TRL's convention; several allowed; each runs offline)"
    )
    project: str = Field("echo2", min_length=1, max_length=128, description="project name in wandb and trackio")
    run_name: str | None = Field(None, max_length=128, description="run name in the trackers (None: the data dir's name)")
    dir: Path | None = Field(None, description="where local trackers write (None: DATA_DIR/<tracker>)")
    log_completions: int = Field(
        0,
        ge=0,
        le=256,
        description="sample completions (prompt, completion, reward, version) logged per step to metrics.jsonl and the trackers (0: none)",
    )


class HubConfig(Section):
    """Everything `echo-hub start` needs."""

    data_dir: Path = Field(Path("echo2-data"), description="store, snapshots, checkpoints, metrics, logs")
    model: Path | None = Field(None, description="local HF causal LM directory (None: the embedded default)")
    task: str = Field(
        "reverse",
        max_length=4096,
        description="builtin name, a dataset (FILE.jsonl, FILE.parquet, save_to_disk DIR), math:FILE.jsonl, or module:Class",
    )
    listen: str = Field(f"/ip4/0.0.0.0/tcp/{DEFAULT_HUB_PORT}", description="libp2p listen multiaddr")
    key: Path | None = Field(None, description="hub identity key file (default DATA_DIR/hub.key)")
    steps: int = Field(300, ge=0, le=10_000_000, description="learner steps to run (0: until interrupted)")
    http: HttpBind = Field(
        "off", description=f"public status page, /api/status and /metrics at HOST:PORT (e.g. 0.0.0.0:{DEFAULT_HTTP_PORT}), or off"
    )
    local_nodes: int = Field(3, ge=0, le=64, description="volunteer nodes to spawn on loopback")
    local_device: str = Field(
        "auto", pattern=DEVICE_PATTERN, description="torch device of the local nodes: auto (the learner's), cpu, cuda or cuda:N"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of the data-dir log")
    log_max_mb: float = Field(
        LOG_MAX_MB, ge=0.01, le=1e6, description="hub.log is rotated past this size, in MB (the local nodes' logs too)"
    )
    log_backups: int = Field(LOG_BACKUPS, ge=1, le=1000, description="rotated logs kept (hub.log.1 ...); older ones are deleted")
    save_rollouts: Path | None = Field(
        None, description="write each learner step's groups as a Parquet shard into this directory (None: off)"
    )
    save_rollouts_max_gb: float = Field(
        10.0, gt=0.0, le=1e6, description="--save-rollouts keeps at most this many GB: the oldest shards are deleted"
    )
    repetition_penalty: float = Field(
        1.0,
        ge=1.0,
        le=1.0,
        description="TRL's repetition_penalty, which must stay 1.0: it would make each token's distribution depend on the completion's earlier tokens, which the hub's exact log-prob recompute (audits, the learner's importance ratios) does not model",
    )
    learner: LearnerConfig = LearnerConfig()
    # The section's own defaults, so that a flag setting one field of it (--top-p) leaves the others at theirs.
    sampling: SamplingParams = SamplingParams()
    lease: LeaseConfig = LeaseConfig()
    broadcast: BroadcastConfig = BroadcastConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    trust: TrustConfig = TrustConfig()
    dataset: DatasetConfig = DatasetConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    agents: AgentsConfig = AgentsConfig()

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _no_repetition_penalty(cls, value: object) -> object:
        """A penalty refused in words: why it cannot be audited, and what to use instead."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1.0:
            raise ValueError(
                f"{value:g} would penalise tokens the prompt and the completion already hold, so a token's "
                "probability would depend on the completion's own earlier tokens; the hub recomputes every audited "
                "log-prob and the learner's importance ratios from the model's distribution alone (temperature, "
                "top-p, top-k, min-p), so a penalty would fail honest nodes' audits: leave it at 1.0, and shape "
                "repetition through the reward"
            )
        return value

    @property
    def key_path(self) -> Path:
        return self.key if self.key is not None else self.data_dir / HUB_KEY_FILE

    @model_validator(mode="after")
    def _schedule_needs_an_end(self) -> HubConfig:
        # A decay or a warm-up is a share of the run's steps: a run until interrupted has no length to share.
        lc = self.learner
        if self.steps == 0 and (lc.lr_scheduler != "constant" or lc.warmup_ratio > 0):
            raise ValueError(
                f"--lr-scheduler {lc.lr_scheduler} with --warmup-ratio {lc.warmup_ratio:g} needs --steps N "
                "(0 runs until interrupted: only a constant learning rate without warm-up fits it)"
            )
        return self


# TRL's GRPOConfig defaults (trl 1.16: max_completion_length 512, learning_rate 1e-6, num_generations 8). A user's own
# model starts from these, not from the embedded toy's (10 tokens suit its reversal task; lr 3e-4 its 2 layers).
USER_MODEL_DEFAULTS: dict[str, int | float] = {"sampling.max_new_tokens": 512, "learner.lr": 1e-6, "learner.group_size": 8}
# The embedded tool task's: a call (10 tokens), the tool's answer (17) and the product (3), with room to spare; the
# embedded tool model's learning rate (its 4 layers learn the calls in ~50 steps at it).
CALC_MAX_NEW_TOKENS = 40
CALC_LR = 3e-4
CALC_STEPS = 100  # its reward near 0.7, in about four minutes on two cores (300 would take twelve)
# Each of them as the flag that sets it, for the line that says which ones a start took.
_DEFAULT_FLAGS = {"sampling.max_new_tokens": "--max-new-tokens", "learner.lr": "--lr", "learner.group_size": "--group-size"}


def _was_set(config: BaseModel, dotted: str) -> bool:
    """Whether the TOML file or a flag gave `dotted` (every section on its path, then the field, was given)."""
    head, _, rest = dotted.partition(".")
    if head not in config.model_fields_set:
        return False
    return not rest or _was_set(getattr(config, head), rest)


def _defaulted(config: HubConfig, defaults: Mapping[str, object]) -> tuple[HubConfig, dict[str, object]]:
    """`config` with each of `defaults` ("section.field": value, within its field's bounds) that neither the TOML file
    nor a flag set, and those it took."""
    taken = {dotted: value for dotted, value in defaults.items() if not _was_set(config, dotted)}
    update: dict[str, object] = {dotted: value for dotted, value in taken.items() if "." not in dotted}
    sections: dict[str, dict[str, object]] = {}
    for dotted, value in taken.items():
        if "." in dotted:
            section, field = dotted.split(".")
            sections.setdefault(section, {})[field] = value
    update |= {name: getattr(config, name).model_copy(update=fields) for name, fields in sections.items()}
    return config.model_copy(update=update), taken


def with_task_defaults(config: HubConfig) -> HubConfig:
    """`config` with the embedded tool task's own settings (shared/tasks/calc.py) where it is the task and neither the
    TOML file nor a flag set them: its length, its tool and reward, one tool call a rollout, room for the call, the
    tool's answer and the product, and the embedded tool model's learning rate."""
    from shared.tasks.calc import CALC_REWARD, CALC_TASK, CALC_TOOL

    if config.task.strip() != CALC_TASK:
        return config
    defaults = {
        "steps": CALC_STEPS,
        "agents.tools": (CALC_TOOL,),
        "agents.max_tool_calls": 1,
        "dataset.reward": CALC_REWARD,
        "sampling.max_new_tokens": CALC_MAX_NEW_TOKENS,
        "learner.lr": CALC_LR,
    }
    return _defaulted(config, defaults)[0]


def with_user_model_defaults(
    config: HubConfig, own_model: bool, fields: Collection[str] = tuple(USER_MODEL_DEFAULTS)
) -> tuple[HubConfig, str | None]:
    """`config` with TRL's defaults for max-new-tokens, lr and group size (those of them in `fields`) where
    `own_model` (not the embedded default) and neither the TOML file nor a flag set them, and the one line that says
    which it used (None: none)."""
    if not own_model:
        return config, None
    config, taken = _defaulted(config, {dotted: value for dotted, value in USER_MODEL_DEFAULTS.items() if dotted in fields})
    if not taken:
        return config, None
    used = ", ".join(f"{_DEFAULT_FLAGS[dotted]} {value:g}" for dotted, value in taken.items())
    toy = "the embedded toy's are for its 2-layer model; a hub.toml line or a flag overrides one"
    return config, f"your own model: TRL's defaults {used} ({toy})"
