"""The GRPO learner: the policy, its optimizer and (only when beta > 0) a frozen reference copy.

`Learner` is blocking torch: one step is this rank's rows, their gradients summed over micro-batches,
the reduce over the ranks and the optimizer's update. It gives a snapshot its weights, a checkpoint its
state and the run its final policy; hub/training/loop.py drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hub.config import LearnerConfig
from hub.method.corrections import CORRECTION_SUMS, Correction, correction_metrics
from hub.method.grpo import group_advantages, grpo_loss, micro_batches, row_weighted
from hub.training.checkpoint import CheckpointInfo
from hub.training.distributed import SOLO, Collective, full_state_dict, partition_rows, shard
from shared.adapters import LoraSpec, adapter_state, add_adapters, is_adapter_key, merged_state_dict, snapshot_metadata
from shared.logprobs import completion_logprobs, completion_logprobs_and_entropy
from shared.model_identity import ModelIdentity
from shared.model_io import load_into, tied_duplicates
from shared.precision import engine_dtype, resolve_device
from shared.rollout import Group, SamplingParams, scored_positions
from shared.snapshot import model_config_hash

log = logging.getLogger("echo2.hub.learner")


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    reward_mean: float
    reward_std: float
    tokens: int
    clip_frac: float
    ratio_mean: float
    ratio_max: float
    abs_log_ratio: float  # mean |log pi_behaviour - log pi_current| over valid tokens: off-policy drift
    kl: float
    masked_by_is: float
    grad_norm: float
    t_forward_s: float
    t_backward_s: float
    t_optim_s: float
    t_train_s: float
    lr: float  # the learning rate this step trained with (the schedule's, hub/method/schedule.py)
    entropy: float  # mean entropy (nats) of the sampling distribution at the completion tokens
    completion_length_mean: float
    completion_length_max: int
    clipped_ratio: float  # share of completions cut at max_new_tokens (finish_reason "length")
    corrections: dict[str, float]  # the off-policy corrections' is_* metrics (hub.method.corrections.correction_metrics)


@dataclass(frozen=True)
class CompletionLengths:
    """Completion lengths of a step's groups, in tokens, and the share cut at max_new_tokens."""

    mean: float
    max: int
    clipped_ratio: float


def completion_lengths(groups: Sequence[Group]) -> CompletionLengths:
    """Mean and max completion length, and the share that ended at max_new_tokens without EOS."""
    completions = [c for g in groups for c in g.completions]
    lengths = [len(c.token_ids) for c in completions]
    clipped = sum(c.finish_reason == "length" for c in completions)
    return CompletionLengths(sum(lengths) / len(lengths), max(lengths), clipped / len(completions))


# A CPU learner shares the machine's memory with the hub and its local nodes: a fixed budget, not the free RAM.
CPU_MICRO_BATCH_TOKENS = 16384
# Share of the GPU's free memory (after weights, gradients and optimizer state) that a micro-batch's activations
# may take: the estimate below leaves out the allocator's fragmentation and the attention kernels' workspace.
GPU_ACTIVATION_SHARE = 0.5
MICRO_BATCH_ROUNDING_TOKENS = 1024
MAX_AUTO_MICRO_BATCH_TOKENS = 1 << 20


def activation_bytes_per_token(layers: int, hidden: int, intermediate: int, bytes_per_value: int, checkpointing: bool) -> int:
    """Activation bytes one token keeps for backward, estimated for a Llama-shaped decoder: per layer the
    attention's inputs and outputs (~10 x hidden values) and the gated MLP's (~4 x intermediate); with
    checkpointing, each layer's input only plus one layer recomputed at a time."""
    per_layer = bytes_per_value * (10 * hidden + 4 * intermediate)
    if checkpointing:
        return layers * bytes_per_value * hidden + per_layer
    return layers * per_layer


def auto_micro_batch_tokens(free_bytes: int, per_token_bytes: int) -> int:
    """The micro-batch a GPU with `free_bytes` left for activations holds: GPU_ACTIVATION_SHARE of it, in whole
    MICRO_BATCH_ROUNDING_TOKENS, at least one such unit and at most MAX_AUTO_MICRO_BATCH_TOKENS."""
    tokens = int(GPU_ACTIVATION_SHARE * max(0, free_bytes) / max(1, per_token_bytes))
    tokens = tokens // MICRO_BATCH_ROUNDING_TOKENS * MICRO_BATCH_ROUNDING_TOKENS
    return min(MAX_AUTO_MICRO_BATCH_TOKENS, max(MICRO_BATCH_ROUNDING_TOKENS, tokens))


def build_optimizer(params: Sequence[torch.nn.Parameter], cfg: LearnerConfig, fused: bool) -> torch.optim.Optimizer:
    """cfg.optimizer over `params`. AdamW's fp32 moments take 8 bytes a parameter (64 GB at 8B parameters,
    which with fp32 weights and gradients leaves an H200 no room); torchao's AdamW8bit keeps them in 8-bit
    blocks of 256 values with a scale each, ~2 bytes a parameter."""
    if cfg.optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # fused: one kernel per tensor, no model-sized temporaries (the default foreach path allocates
    # some: +0.4 x the weights at the first step, measured on CPU). Not for sharded (DTensor) parameters.
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def _pad(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def _completions_per_group(groups: Sequence[Group]) -> int:
    """The step's group size: every group must hold as many completions and rewards as the first."""
    if not groups:
        raise ValueError("train_step needs at least one group")
    n = len(groups[0].completions)
    if any(len(g.completions) != n or len(g.rewards) != n for g in groups):
        raise ValueError("all groups of a step must hold the same number of completions and rewards")
    return n


@dataclass(frozen=True)
class _Rows:
    """The rows one rank trains on in a step (one per completion), and the whole step's rewards."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour: list[tuple[float, ...]]  # the nodes' log-probs of each completion token
    advantages: torch.Tensor
    rewards: torch.Tensor
    # Per row, the tokens trained on: a tool-using rollout's model tokens (its environment tokens are context, out of
    # the loss, its token count, entropy and clip figures); None, or a row's None: all (shared.rollout.scored_positions).
    scored: list[list[bool] | None] | None = None

    def scored_in(self, part: slice) -> list[list[bool] | None] | None:
        """`scored` of the rows in `part`."""
        return None if self.scored is None else self.scored[part]


@dataclass
class _Tally:
    """A step's sums over its micro-batches: the loss weighted by what its loss type averages over (tokens kept, or
    rows: `weight`), clip fraction and KL by tokens kept, the ratio by valid tokens; tokens dropped; the largest
    ratio; the corrections' CORRECTION_SUMS and largest weight; forward and backward time."""

    weight: float = 0.0
    loss: float = 0.0
    clip: float = 0.0
    ratio_sum: float = 0.0
    # |log-ratio| summed over valid tokens: the drift adaptive staleness guards (hub/control/staleness.py).
    drift_sum: float = 0.0
    kl: float = 0.0
    masked: float = 0.0
    entropy_sum: float = 0.0
    n_keep: int = 0
    n_valid: int = 0
    ratio_max: float = 0.0
    corrections: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CORRECTION_SUMS, 0.0))
    weight_max: float = 0.0
    t_forward: float = 0.0
    t_backward: float = 0.0

    def add(self, loss: float, stats: Mapping[str, float], n_valid: int, n_keep: int, entropy_sum: float, weight: float) -> None:
        """One micro-batch's share; `weight`: what its loss is a mean over (tokens kept, or rows)."""
        self.entropy_sum += entropy_sum
        self.n_keep += n_keep
        self.n_valid += n_valid
        self.weight += weight
        self.loss += loss * weight
        self.clip += stats["clip_frac"] * n_keep
        self.kl += stats["kl"] * n_keep
        self.ratio_sum += stats["ratio_mean"] * n_valid
        self.drift_sum += stats["abs_log_ratio"] * n_valid
        self.masked += stats["masked_by_is"]
        self.ratio_max = max(self.ratio_max, stats["ratio_max"])
        self.weight_max = max(self.weight_max, stats["is_weight_max"])
        for name in CORRECTION_SUMS:
            self.corrections[name] += stats[name]

    def across(self, collective: Collective) -> _Tally:
        """The sums over every rank (this tally itself when alone); the times stay this rank's."""
        weight, loss, clip, ratio_sum, drift_sum, kl, masked, entropy_sum, n_keep, n_valid, *corrections = collective.sum(
            [
                self.weight,
                self.loss,
                self.clip,
                self.ratio_sum,
                self.drift_sum,
                self.kl,
                self.masked,
                self.entropy_sum,
                self.n_keep,
                self.n_valid,
                *(self.corrections[name] for name in CORRECTION_SUMS),
            ]
        )
        return dataclasses.replace(
            self,
            weight=weight,
            loss=loss,
            clip=clip,
            ratio_sum=ratio_sum,
            drift_sum=drift_sum,
            kl=kl,
            masked=masked,
            entropy_sum=entropy_sum,
            n_keep=int(n_keep),
            n_valid=int(n_valid),
            ratio_max=collective.max(self.ratio_max),
            corrections=dict(zip(CORRECTION_SUMS, corrections)),
            weight_max=collective.max(self.weight_max),
        )


def _fqn_optimizer_state(model: torch.nn.Module, state: dict) -> dict:
    """A one-process optimizer state dict (parameters by position) keyed by parameter name instead, as
    torch.distributed.checkpoint's full-state API takes it."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def _zero_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # a config float on attention modules, not a submodule


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """torch.compile each decoder layer in place (regional compilation: one small graph compiled once and reused
    by every layer, instead of the whole model's), with dynamic shapes so that packed bins of any length reuse
    it. The layers are the classes the model names in `_no_split_modules`. Returns how many were compiled."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to compile; drop --compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


class Learner:
    """The policy, its optimizer and (only when beta > 0) a frozen reference copy; blocking."""

    def __init__(
        self,
        model_identity: ModelIdentity,
        cfg: LearnerConfig,
        sampling: SamplingParams,
        checkpoint: CheckpointInfo | None = None,
        collective: Collective = SOLO,
        device: str | None = None,
    ) -> None:
        """`model_identity`: the base model (its weights start the policy unless a checkpoint's do).
        `collective`: this process's learner rank (hub/training/distributed.py); with more than one, the model is
        sharded with FSDP2 and each step's rows are split across the ranks. `device`: this rank's own
        device (default cfg.device)."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.sampling = sampling
        self.collective = collective
        self.correction = Correction(
            mode=cfg.rollout_is_mode,
            level=cfg.rollout_is_level,
            upper=cfg.rollout_is_threshold,
            lower=cfg.rollout_is_threshold_lower,
            veto=cfg.rollout_is_veto_threshold,
            off_policy_mask=cfg.off_policy_mask_threshold,
        )
        self.device = torch.device(device or resolve_device(cfg.device, "--device"))
        # A LoRA run's base never changes: its checkpoints hold the adapters only; a sharded checkpoint's
        # weights are loaded into the sharded model below.
        policy_dir = (
            checkpoint.model_dir
            if checkpoint is not None and not cfg.lora_rank and not checkpoint.sharded
            else model_identity.model_dir
        )
        # Its own tokenizer: it tokenizes in a worker thread while the service decodes in others.
        self.tokenizer = model_identity.tokenizer_copy()
        # fp32 master weights whatever the snapshot dtype; bf16 runs forward and backward under autocast.
        self.model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32, attn_implementation=cfg.attention).to(
            self.device
        )
        self.lora: LoraSpec | None = None
        if cfg.lora_rank:
            self.lora = add_adapters(self.model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
            if checkpoint is not None:
                load_into(self.model, checkpoint.adapter_path, keys=is_adapter_key)
        self.snapshot_metadata = snapshot_metadata(self.lora)
        self.snapshot_dtype = engine_dtype(cfg.dtype, cfg.device)
        # Eval mode: no dropout, so the learner's log-probs are the ones the nodes sampled under.
        self.model.eval()
        if cfg.gradient_checkpointing:
            # transformers >= 5.2x renamed it (vLLM's pin keeps older versions in use too).
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # transformers recomputes activations only in train mode: with every dropout at 0 train
            # mode computes exactly what eval mode does.
            _zero_dropout(self.model)
            self.model.train()
        if cfg.compile:
            # After checkpointing wraps the layers and before FSDP2 shards them, as torchtitan orders it.
            log.info(
                "learner: torch.compile on %d decoder layers; the first step compiles them", compile_decoder_layers(self.model)
            )
        self._tied_duplicates = tied_duplicates(self.model)
        if collective.world > 1:
            shard(self.model, bf16=self.snapshot_dtype == torch.bfloat16)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trainable, cfg, fused=collective.world == 1)
        if checkpoint is not None and checkpoint.sharded:
            self.load_sharded(checkpoint.sharded_dir)
        elif checkpoint is not None:
            optimizer_state = torch.load(checkpoint.optimizer_path, map_location=self.device)
            if collective.world == 1:
                self.optimizer.load_state_dict(optimizer_state)
            else:  # a one-process checkpoint resumed across ranks: each takes its shard of the full state
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                full = _fqn_optimizer_state(self.model, optimizer_state)
                set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(full_state_dict=True))
        self.reference = None
        if cfg.beta > 0:
            # The KL anchor is the initial policy, also after a resume.
            reference = AutoModelForCausalLM.from_pretrained(
                model_identity.model_dir, dtype=torch.float32, attn_implementation=cfg.attention
            )
            self.reference = reference.to(self.device).eval().requires_grad_(False)
        self.config_hash = model_config_hash(self.model.config.to_dict())
        self.micro_batch_tokens = cfg.micro_batch_tokens or self._auto_micro_batch_tokens(trainable)
        log.info(
            "learner micro-batches of at most %d tokens%s",
            self.micro_batch_tokens,
            "" if cfg.micro_batch_tokens else f" (sized for {self.device})",
        )

    def _auto_micro_batch_tokens(self, trainable: Sequence[torch.nn.Parameter]) -> int:
        """CPU_MICRO_BATCH_TOKENS on a CPU; on a GPU, what its free memory holds once the gradients and AdamW's
        two moments (fp32, allocated at the first step) are taken out."""
        if self.device.type != "cuda":
            return CPU_MICRO_BATCH_TOKENS
        free, _ = torch.cuda.mem_get_info(self.device)
        pending = 3 * 4 * sum(p.numel() for p in trainable) // self.collective.world
        config = self.model.config
        per_token = activation_bytes_per_token(
            config.num_hidden_layers,
            config.hidden_size,
            getattr(config, "intermediate_size", 4 * config.hidden_size),
            2 if self.snapshot_dtype == torch.bfloat16 else 4,
            self.cfg.gradient_checkpointing,
        )
        return auto_micro_batch_tokens(free - pending, per_token)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a snapshot carries: the live weights (a LoRA run's adapters only), not a copy (a snapshot
        streams them to disk): read them only between steps. Sharded: every rank calls it, and rank 0 gets
        the full weights gathered a tensor at a time onto its CPU (one copy; tied duplicates left out)."""
        if self.collective.world > 1:
            names = [n for n in self.model.state_dict() if n not in self._tied_duplicates]
            return full_state_dict(self.model, keep=names)
        return adapter_state(self.model) if self.lora is not None else self.model.state_dict()

    def save_sharded(self, path: Path) -> None:
        """Every rank writes its shard of the weights and optimizer state (torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))

    def load_sharded(self, path: Path) -> None:
        """Load a sharded checkpoint written by any number of ranks (DCP reshards it to this group)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _autocast(self):
        # Sharded, FSDP2's mixed-precision policy casts instead.
        enabled = self.snapshot_dtype == torch.bfloat16 and self.collective.world == 1
        # Autocast's cache keeps the bf16 copy of every weight until the forward ends (2 bytes a parameter);
        # with checkpointing nothing else holds them, so each layer casts its weights as it runs, and again
        # in its recomputation (100M parameters: 187 MB less peak RSS, the same step time).
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=not self.cfg.gradient_checkpointing
        )

    def train_step(self, groups: Sequence[Group], step: int, lr: float | None = None) -> StepStats:
        """One GRPO update on `groups`: this rank's rows, their gradients summed over micro-batches, then the
        reduce over the ranks and the optimizer's update, at learning rate `lr` (None: the one it has)."""
        started = time.perf_counter()
        if lr is not None:
            for group in self.optimizer.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW8bit keeps it as a tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
        lengths = completion_lengths(groups)
        rows = self._rows(groups)
        tally = self._accumulate(rows)
        optim_started = time.perf_counter()
        total, grad_norm = self._reduce_and_update(tally)
        done = time.perf_counter()
        return StepStats(
            step=step,
            loss=total.loss / total.weight if total.weight else 0.0,
            reward_mean=float(rows.rewards.mean()),
            reward_std=float(rows.rewards.std(unbiased=False)),
            tokens=total.n_valid,
            clip_frac=total.clip / max(1, total.n_keep),
            ratio_mean=total.ratio_sum / max(1, total.n_valid),
            ratio_max=total.ratio_max,
            abs_log_ratio=total.drift_sum / max(1, total.n_valid),
            kl=total.kl / max(1, total.n_keep),
            masked_by_is=total.masked,
            grad_norm=grad_norm,
            t_forward_s=total.t_forward,
            t_backward_s=total.t_backward,
            t_optim_s=done - optim_started,
            t_train_s=done - started,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            entropy=total.entropy_sum / max(1, total.n_valid),
            completion_length_mean=lengths.mean,
            completion_length_max=lengths.max,
            clipped_ratio=lengths.clipped_ratio,
            corrections=correction_metrics(total.corrections, total.weight_max, total.n_valid),
        )

    def _rows(self, groups: Sequence[Group]) -> _Rows:
        """This rank's rows of the step: all of them, in order, when alone; else its share, balanced by token count.
        The nodes' completion token ids are used as-is."""
        n = _completions_per_group(groups)
        prompt_ids: list[list[int]] = []
        completion_ids: list[list[int]] = []
        behaviour: list[tuple[float, ...]] = []
        for group in groups:
            # Exactly the node engines' prompt tokenization (node/engine.py: tokenizer(text)["input_ids"]).
            ids = self.tokenizer(group.prompt_text)["input_ids"]
            for completion in group.completions:
                prompt_ids.append(ids)
                completion_ids.append(list(completion.token_ids))
                behaviour.append(completion.logprobs)
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        advantages = group_advantages(rewards, n, scale=self.cfg.advantage_scale).to(self.device)
        c = self.collective
        mine = partition_rows([len(p) + len(q) for p, q in zip(prompt_ids, completion_ids)], c.world)[c.rank]
        scored = scored_positions([completion for g in groups for completion in g.completions])
        return _Rows(
            prompt_ids=[prompt_ids[i] for i in mine],
            completion_ids=[completion_ids[i] for i in mine],
            behaviour=[behaviour[i] for i in mine],
            advantages=advantages[torch.tensor(mine, dtype=torch.long, device=self.device)],
            rewards=rewards,
            scored=None if scored is None else [scored[i] for i in mine],
        )

    def _accumulate(self, rows: _Rows) -> _Tally:
        """The step's gradient summed over micro-batches by token budget, and this rank's tally.

        The loss is a token mean over the whole step (grpo_loss), so each micro-batch's mean is weighted by its
        token count and the summed gradient divided by the step's count before clipping: exact, not an
        approximation."""
        c = self.collective
        sizes = [len(p) + len(q) for p, q in zip(rows.prompt_ids, rows.completion_ids)]
        # Zeroed in place, not freed: re-allocating model-sized gradients every step fragments the heap.
        self.optimizer.zero_grad(set_to_none=False)
        tally = _Tally()
        parts = micro_batches(sizes, self.micro_batch_tokens) if sizes else []
        # Sharded, every rank runs as many forward and backward passes as the busiest (FSDP gathers weights in
        # each), and gradients are reduced across ranks in the last one only.
        count = int(c.max(len(parts)))
        for index in range(count):
            if c.world > 1:
                self.model.set_requires_gradient_sync(index == count - 1)
            if index < len(parts):
                self._micro_step(rows, slice(parts[index].start, parts[index].stop), tally)
            else:
                self._idle_pass(self.tokenizer.pad_token_id)
        return tally

    def _micro_step(self, rows: _Rows, part: slice, tally: _Tally) -> None:
        """Forward, loss and backward of one micro-batch: its token-weighted loss's gradient adds to .grad."""
        started = time.perf_counter()
        with self._autocast():
            logprobs, mask, entropy = completion_logprobs_and_entropy(
                self.model,
                rows.prompt_ids[part],
                rows.completion_ids[part],
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                min_p=self.sampling.min_p,
                scored=rows.scored_in(part),
            )
            ref_logprobs = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = self._logprobs(self.reference, rows, part)
        if self.cfg.use_is_ratio:
            behaviour = _pad(rows.behaviour[part], logprobs.shape[1]).to(self.device)
        else:
            behaviour = logprobs.detach()
        n_valid = int(mask.sum())
        rows_here = part.stop - part.start
        if n_valid == 0:  # only empty completions: nothing to learn, but a sharded rank still takes part
            tally.weight += rows_here if row_weighted(self.cfg.loss_type) else 0  # grpo's mean counts them as zeros
            self._idle_pass(self.tokenizer.pad_token_id)
            return
        loss, stats = grpo_loss(
            logprobs,
            behaviour,
            rows.advantages[part],
            mask,
            eps_low=self.cfg.eps_low,
            eps_high=self.cfg.eps_high,
            max_is_ratio=self.cfg.max_is_ratio,
            ref_logprobs=ref_logprobs,
            beta=self.cfg.beta,
            loss_type=self.cfg.loss_type,
            max_completion_length=self.sampling.max_new_tokens,
            correction=self.correction,
            importance_sampling_level=self.cfg.importance_sampling_level,
        )
        n_keep = n_valid - int(stats["masked_by_is"])
        weight = rows_here if row_weighted(self.cfg.loss_type) else n_keep
        backward_started = time.perf_counter()
        (loss * weight).backward()
        tally.t_forward += backward_started - started
        tally.t_backward += time.perf_counter() - backward_started
        tally.add(float(loss.detach()), stats, n_valid, n_keep, float(entropy.sum()), weight)

    def _logprobs(self, model: torch.nn.Module, rows: _Rows, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """`model`'s log-probs of the micro-batch's completion tokens under the sampling's temperature and
        top-p, and their mask."""
        return completion_logprobs(
            model,
            rows.prompt_ids[part],
            rows.completion_ids[part],
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            min_p=self.sampling.min_p,
            scored=rows.scored_in(part),
        )

    def _reduce_and_update(self, tally: _Tally) -> tuple[_Tally, float]:
        """The tally summed over the ranks; the gradient scaled to the step's token mean, clipped, and the
        optimizer's update. Returns the summed tally and the gradient's norm before clipping."""
        c = self.collective
        total = tally.across(c)
        # Each rank's gradient is its micro-batches' weighted sum (by tokens kept, or rows: the loss type's); FSDP
        # averaged them over the ranks, so the step's mean is that times world / the weights' total.
        if c.world > 1 or total.weight > 1:
            divisor = total.weight / c.world if total.weight else 1.0 / c.world
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor when the gradients are sharded
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        return total, float(grad_norm)

    def _idle_pass(self, pad_id: int) -> None:
        """A forward and backward that adds nothing to any gradient: a rank with fewer micro-batches than
        another still takes part in every collective FSDP runs in them."""
        with self._autocast():
            logits = self.model(torch.tensor([[pad_id]], device=self.device)).logits
        (logits.float().sum() * 0.0).backward()

    def save_final(self, out_dir: Path) -> None:
        """save_pretrained (+ tokenizer) into out_dir, replacing it atomically (sharded: every rank calls it,
        rank 0 writes the gathered weights)."""
        if self.collective.world > 1:
            full = self.state_dict()
            if self.collective.rank == 0:
                self._save_pretrained(Path(out_dir), full)
            return
        self._save_pretrained(Path(out_dir), merged_state_dict(self.model) if self.lora is not None else None)

    def _save_pretrained(self, out_dir: Path, state_dict: dict[str, torch.Tensor] | None) -> None:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        # A LoRA run's final policy has its adapters merged in: a plain model from_pretrained loads.
        self.model.save_pretrained(tmp, state_dict=state_dict)
        self.tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.rename(out_dir, old / out_dir.name)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
