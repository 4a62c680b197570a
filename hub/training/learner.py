"""The learning plane: GRPO steps on buffered groups, snapshot publishing, checkpoints and resume.

`Learner` is the blocking torch object (one step = forward, backward, optimizer).
`LearnerComponent` is the trio side: it waits for usable groups (that wait is T_idle), runs
the step in a worker thread, commits it to the store, appends metrics, checkpoints, and
publishes a signed snapshot every kappa steps on a memory channel.

Versions and staleness: the policy after step t is version t. Step t updates the policy of
version t-1, so a group made with version x has age (t-1) - x at step t: the number of
updates between the policy that sampled it and the policy being updated. S = 0 is then
fully on-policy.

GIL caveat: torch releases the GIL inside its kernels, but the Python around a forward and
backward pass (module calls, autograd bookkeeping) holds it in short bursts. The step runs
in a worker thread, so trio keeps scheduling between those bursts; test_learner measures the
lateness of a 10 ms trio ticker during steps. A model whose Python overhead dominates would
need the step in a separate process.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

from hub.config import LearnerConfig
from hub.method.grpo import group_advantages, grpo_loss, micro_batches
from hub.records.store import StepRecord
from hub.service.state import HubState
from hub.training.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from hub.training.distributed import (
    SOLO,
    Collective,
    Command,
    RankGroup,
    RankWatch,
    broadcast,
    full_state_dict,
    partition_rows,
    shard,
)
from hub.training.evaluation import EvalRunner
from hub.training.metrics import MetricsWriter, bubble_ratio
from hub.training.trackers import Trackers
from shared.adapters import LoraSpec, adapter_state, add_adapters, is_adapter_key, merged_state_dict, snapshot_metadata
from shared.crypto import Identity
from shared.delta import build_delta_snapshot
from shared.layout import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, SNAPSHOTS_DIR
from shared.logprobs import completion_logprobs
from shared.precision import engine_dtype
from shared.probe import InstallProbe
from shared.rollout import Group, SamplingParams
from shared.snapshot import (
    Snapshot,
    build_snapshot,
    load_into,
    model_config_hash,
    read_snapshot_files,
    tied_duplicates,
)

log = logging.getLogger("echo2.hub.learner")


@dataclass(frozen=True)
class SnapshotPublished:
    """A snapshot whose files and store row exist; sent to the broadcaster and local rollouts."""

    version: int
    snapshot: Snapshot
    delta: Snapshot | None = None  # the version as a delta against the one published before it


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
    kl: float
    masked_by_is: float
    grad_norm: float
    t_forward_s: float
    t_backward_s: float
    t_optim_s: float
    t_train_s: float


def _pad(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


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
            module.attention_dropout = 0.0


class Learner:
    """The policy, its optimizer and (only when beta > 0) a frozen reference copy; blocking."""

    def __init__(
        self,
        base_model_dir: Path,
        cfg: LearnerConfig,
        sampling: SamplingParams,
        checkpoint: CheckpointInfo | None = None,
        collective: Collective = SOLO,
        device: str | None = None,
    ) -> None:
        """`collective`: this process's learner rank (hub/training/distributed.py); with more than one, the model is
        sharded with FSDP2 and each step's rows are split across the ranks. `device`: this rank's own
        device (default cfg.device)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.sampling = sampling
        self.collective = collective
        self.device = torch.device(device or cfg.device)
        # A LoRA run's base never changes: its checkpoints hold the adapters only; a sharded checkpoint's
        # weights are loaded into the sharded model below.
        policy_dir = (checkpoint.model_dir if checkpoint is not None and not cfg.lora_rank and not checkpoint.sharded
                      else Path(base_model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        # fp32 master weights whatever the snapshot dtype; bf16 runs forward and backward under autocast.
        self.model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).to(self.device)
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
        self._tied_duplicates = tied_duplicates(self.model)
        if collective.world > 1:
            shard(self.model, bf16=self.snapshot_dtype == torch.bfloat16)
        # fused: one kernel per tensor, no model-sized temporaries (the default foreach path allocates
        # some: +0.4 x the weights at the first step, measured on CPU). Not for sharded (DTensor) parameters.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=collective.world == 1)
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
            reference = AutoModelForCausalLM.from_pretrained(Path(base_model_dir), dtype=torch.float32)
            self.reference = reference.to(self.device).eval().requires_grad_(False)
        self.config_hash = model_config_hash(self.model.config.to_dict())

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
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _autocast(self):
        # Sharded, FSDP2's mixed-precision policy casts instead.
        enabled = self.snapshot_dtype == torch.bfloat16 and self.collective.world == 1
        # Autocast's cache keeps the bf16 copy of every weight until the forward ends (2 bytes a parameter);
        # with checkpointing nothing else holds them, so each layer casts its weights as it runs, and again
        # in its recomputation (100M parameters: 187 MB less peak RSS, the same step time).
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled,
                              cache_enabled=not self.cfg.gradient_checkpointing)

    def train_step(self, groups: Sequence[Group], step: int) -> StepStats:
        """One GRPO update on `groups`; the nodes' completion token ids are used as-is."""
        if not groups:
            raise ValueError("train_step needs at least one group")
        n = len(groups[0].completions)
        if any(len(g.completions) != n or len(g.rewards) != n for g in groups):
            raise ValueError("all groups of a step must hold the same number of completions and rewards")
        started = time.perf_counter()
        prompt_ids: list[list[int]] = []
        completion_ids: list[list[int]] = []
        behaviour_rows: list[tuple[float, ...]] = []
        for group in groups:
            # Exactly the node engines' prompt tokenization (node/engine.py: tokenizer(text)["input_ids"]).
            ids = self.tokenizer(group.prompt_text)["input_ids"]
            for completion in group.completions:
                prompt_ids.append(ids)
                completion_ids.append(list(completion.token_ids))
                behaviour_rows.append(completion.logprobs)
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        advantages = group_advantages(rewards, n, scale=self.cfg.advantage_scale).to(self.device)
        # This rank's rows (all of them, in order, when alone): the step's rows balanced by token count.
        c = self.collective
        mine = partition_rows([len(p) + len(q) for p, q in zip(prompt_ids, completion_ids)], c.world)[c.rank]
        prompt_ids = [prompt_ids[i] for i in mine]
        completion_ids = [completion_ids[i] for i in mine]
        behaviour_rows = [behaviour_rows[i] for i in mine]
        advantages = advantages[torch.tensor(mine, dtype=torch.long, device=self.device)]

        # Micro-batches by token budget, gradients summed over them: the loss is a token mean over
        # the whole step (grpo_loss), so each micro-batch's mean is weighted by its token count and
        # the summed gradient divided by the step's count before clipping: exact, not an approximation.
        pad_id = self.tokenizer.pad_token_id
        rows = [(len(p), len(c)) for p, c in zip(prompt_ids, completion_ids)]
        # Zeroed in place, not freed: re-allocating model-sized gradients every step fragments the heap.
        self.optimizer.zero_grad(set_to_none=False)
        totals = {"loss": 0.0, "clip": 0.0, "ratio_sum": 0.0, "kl": 0.0, "masked": 0.0}
        n_keep_total, n_valid_total, ratio_max, tokens = 0, 0, 0.0, 0
        t_forward = t_backward = 0.0
        parts = micro_batches(rows, self.cfg.micro_batch_tokens) if rows else []
        # Sharded, every rank runs as many forward and backward passes as the busiest (FSDP gathers weights in
        # each), and gradients are reduced across ranks in the last one only.
        count = int(c.max(len(parts)))
        for index in range(count):
            if c.world > 1:
                self.model.set_requires_gradient_sync(index == count - 1)
            if index >= len(parts):
                self._idle_pass(pad_id)
                continue
            part = parts[index]
            part_started = time.perf_counter()
            sl = slice(part.start, part.stop)
            with self._autocast():
                logprobs, mask = completion_logprobs(
                    self.model, prompt_ids[sl], completion_ids[sl], pad_id,
                    temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                )
                ref_logprobs = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref_logprobs, _ = completion_logprobs(
                            self.reference, prompt_ids[sl], completion_ids[sl], pad_id,
                            temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                        )
            if self.cfg.use_is_ratio:
                behaviour = _pad(behaviour_rows[sl], logprobs.shape[1]).to(self.device)
            else:
                behaviour = logprobs.detach()
            loss, stats = grpo_loss(
                logprobs, behaviour, advantages[sl], mask,
                eps_low=self.cfg.eps_low, eps_high=self.cfg.eps_high, max_is_ratio=self.cfg.max_is_ratio,
                ref_logprobs=ref_logprobs, beta=self.cfg.beta,
            )
            n_valid = int(mask.sum())
            n_keep = n_valid - int(stats["masked_by_is"])
            backward_started = time.perf_counter()
            (loss * n_keep).backward()
            t_forward += backward_started - part_started
            t_backward += time.perf_counter() - backward_started
            n_keep_total += n_keep
            n_valid_total += n_valid
            tokens += n_valid
            totals["loss"] += float(loss.detach()) * n_keep
            totals["clip"] += stats["clip_frac"] * n_keep
            totals["kl"] += stats["kl"] * n_keep
            totals["ratio_sum"] += stats["ratio_mean"] * n_valid
            totals["masked"] += stats["masked_by_is"]
            ratio_max = max(ratio_max, stats["ratio_max"])
        optim_started = time.perf_counter()
        (totals["loss"], totals["clip"], totals["ratio_sum"], totals["kl"], totals["masked"], n_keep_total,
         n_valid_total, tokens) = c.sum([totals["loss"], totals["clip"], totals["ratio_sum"], totals["kl"],
                                         totals["masked"], n_keep_total, n_valid_total, tokens])
        n_keep_total, n_valid_total, tokens = int(n_keep_total), int(n_valid_total), int(tokens)
        ratio_max = c.max(ratio_max)
        # Each rank's gradient is its rows' token-weighted sum; FSDP averaged them over the ranks, so the
        # step's token mean is that times world / tokens kept.
        if c.world > 1 or n_keep_total > 1:
            divisor = n_keep_total / c.world if n_keep_total else 1.0 / c.world
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor when the gradients are sharded
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        done = time.perf_counter()
        return StepStats(
            step=step,
            loss=totals["loss"] / max(1, n_keep_total),
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            tokens=tokens,
            clip_frac=totals["clip"] / max(1, n_keep_total),
            ratio_mean=totals["ratio_sum"] / max(1, n_valid_total),
            ratio_max=ratio_max,
            kl=totals["kl"] / max(1, n_keep_total),
            masked_by_is=totals["masked"],
            grad_norm=float(grad_norm),
            t_forward_s=t_forward,
            t_backward_s=t_backward,
            t_optim_s=done - optim_started,
            t_train_s=done - started,
        )

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


class LearnerComponent:
    """Trio driver of the Learner over a data dir; resumes from the newest checkpoint there.

    Construction blocks (loads the model, reads the store): build it before trio starts or in
    trio.to_thread.run_sync. It takes groups from the hub state's buffer (refilled from the store
    when the state opened) and commits its steps through the state.
    `run` trains until the step number reaches `steps` (0: forever), then saves DATA_DIR/final.
    Per step: wait for prompts_per_step usable groups (T_idle), train in a worker thread,
    commit step row + consumed and stale-dropped row ids in one transaction, append
    metrics.jsonl (and the trackers), hand the weights to a due evaluation, checkpoint every
    checkpoint_every steps, publish every kappa steps.
    """

    def __init__(
        self,
        cfg: LearnerConfig,
        sampling: SamplingParams,
        base_model_dir: Path,
        data_dir: Path,
        state: HubState,
        identity: Identity,
        snapshot_send: trio.MemorySendChannel[SnapshotPublished],
        steps: int,
        chunk_size_bytes: int,
        delta_max_ratio: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        extra_metrics: Callable[[int], Mapping[str, float | None]] = lambda step: {},
        trackers: Trackers | None = None,
        evaluation: EvalRunner | None = None,
        ranks: tuple[Collective, str, RankWatch | None] | None = None,
        probe: Callable[[Path, str], InstallProbe] | None = None,
    ) -> None:
        """`ranks`: (this process's rank, its device, the spawned ranks) of a learner sharded across processes
        (hub/training/distributed.py); the learner is then driven through a RankGroup. `probe(weights path, whole hash)`:
        the install probe signed into each snapshot's manifest (shared/probe.py)."""
        self.probe = probe
        self.cfg = cfg
        self.data_dir = Path(data_dir)
        self.state = state
        self.store = state.store
        self.buffer = state.buffer
        self.signal = state.signal
        self.identity = identity
        self.snapshot_send = snapshot_send
        self.steps = steps
        self.chunk_size_bytes = chunk_size_bytes
        self.delta_max_ratio = delta_max_ratio
        self._last_published: Snapshot | None = None  # the base of the next delta
        self.kappa = cfg.effective_kappa
        self.clock = clock
        self.extra_metrics = extra_metrics
        self._offered_seen = (0, 0.0)
        self.snapshots_dir = self.data_dir / SNAPSHOTS_DIR
        self.checkpoints_dir = self.data_dir / CHECKPOINTS_DIR
        remove_stale_temporaries(self.checkpoints_dir)
        checkpoint = latest_checkpoint(self.checkpoints_dir)
        self.sharded = ranks is not None
        if ranks is None:
            self.learner = Learner(base_model_dir, cfg, sampling, checkpoint)
        else:
            collective, device, watch = ranks
            broadcast(Command("init", checkpoint=checkpoint))  # every rank resumes what rank 0 resumes
            self.learner = RankGroup(Learner(base_model_dir, cfg, sampling, checkpoint, collective, device), watch)
        self.metrics = MetricsWriter(self.data_dir / METRICS_FILE, trackers)
        self.evaluation = evaluation
        # Numbering continues after the newest committed step even when the checkpoint is older:
        # steps after the checkpoint are lost as weights but stay in the record, so versions
        # never repeat.
        latest_step = self.store.latest_step() or 0
        self.step = max(latest_step, checkpoint.step if checkpoint is not None else 0)
        self.training = False
        self.snapshot_seconds: list[float] = []
        self._pending_stale: list[int] = []
        if self.step > 0 or checkpoint is not None:
            lost = self.step - (checkpoint.step if checkpoint is not None else 0)
            state.record_event(
                "learner_resume", None,
                f"step {self.step}, checkpoint {checkpoint.step if checkpoint else 'none'}, steps lost as weights: {lost}",
            )

    @property
    def version(self) -> int:
        """Version of the policy the learner holds now."""
        return self.step

    def min_useful_version(self) -> int:
        """Oldest version whose fresh rollouts the next take can still use (for leases and local rollouts)."""
        next_take_version = self.step + 1 if self.training else self.step
        return max(0, next_take_version - self.cfg.staleness)

    async def run(self) -> None:
        await self._publish_initial()
        k = self.cfg.prompts_per_step
        while self.steps == 0 or self.step < self.steps:
            current = self.step
            t = current + 1
            idle_started = self.clock()
            while True:
                dropped = self.buffer.prune(current)
                if dropped:
                    self._pending_stale.extend(dropped)
                    self.signal.notify()
                if self.buffer.ready(current, k):
                    break
                await self.signal.wait()
            t_idle = self.clock() - idle_started
            taken = self.buffer.take(current, k)
            self._pending_stale.extend(taken.dropped_row_ids)
            self.training = True
            self.signal.notify()
            try:
                # Sharded, a step waits on other processes: when one dies the hub stops without waiting for it.
                stats = await trio.to_thread.run_sync(self.learner.train_step, taken.groups, t,
                                                      abandon_on_cancel=self.sharded)
            finally:
                self.training = False
            staleness = taken.staleness
            record = StepRecord(
                step=t,
                version=t,
                reward_mean=stats.reward_mean,
                reward_std=stats.reward_std,
                staleness_mean=sum(staleness) / len(staleness),
                staleness_max=max(staleness),
                dropped_stale=len(self._pending_stale),
                t_train_s=stats.t_train_s,
                t_idle_s=t_idle,
                bubble=bubble_ratio(t_idle, stats.t_train_s),
                tokens=stats.tokens,
                clip_frac=stats.clip_frac,
                extra={
                    "loss": stats.loss,
                    "ratio_mean": stats.ratio_mean,
                    "ratio_max": stats.ratio_max,
                    "kl": stats.kl,
                    "masked_by_is": stats.masked_by_is,
                    "grad_norm": stats.grad_norm,
                    "t_forward_s": stats.t_forward_s,
                    "t_backward_s": stats.t_backward_s,
                    "t_optim_s": stats.t_optim_s,
                    **self._rollout_reward_since_last_step(),
                    **self.extra_metrics(t),
                },
            )
            stale_ids = list(self._pending_stale)
            await self.state.commit_step(record, taken.row_ids, stale_ids)
            self._pending_stale.clear()
            self.step = t
            await trio.to_thread.run_sync(self.metrics.append, record)
            if self.evaluation is not None and self.evaluation.due(t):
                await self.evaluation.start(t, self.learner.state_dict)
            if t % self.cfg.checkpoint_every == 0:
                await trio.to_thread.run_sync(self._checkpoint, t)
            if t % self.kappa == 0:
                await self._publish(t)
            self.signal.notify()
        await trio.to_thread.run_sync(self.learner.save_final, self.data_dir / FINAL_DIR)

    def _rollout_reward_since_last_step(self) -> dict[str, float]:
        """Mean reward of every group offered since the previous step, zero-variance ones included.

        The step's own reward_mean covers only the groups it trained on, which skipping
        zero-variance groups biases towards 0.5; this one tracks what the policy scores.
        """
        count, total = self.buffer.offered, self.buffer.offered_reward_sum
        seen_count, seen_total = self._offered_seen
        self._offered_seen = (count, total)
        if count == seen_count:
            return {}
        return {"rollout_reward_mean": (total - seen_total) / (count - seen_count)}

    def save_state(self) -> None:
        """Checkpoint and save the final policy now (on Ctrl-C): blocking, call outside trio."""
        latest = self.store.latest_checkpoint()
        if self.step > 0 and (latest is None or latest.step < self.step):  # a periodic one may have just been taken
            self._checkpoint(self.step)
        self.learner.save_final(self.data_dir / FINAL_DIR)

    def _checkpoint(self, step: int) -> None:
        learner = self.learner
        info = save_checkpoint(
            self.checkpoints_dir, step, step, learner.model, learner.tokenizer, learner.optimizer,
            keep=self.cfg.checkpoints_kept, adapter=learner.state_dict() if learner.lora is not None else None,
            adapter_metadata=learner.snapshot_metadata,
            sharded=learner.save_sharded if learner.collective.world > 1 else None,
        )
        self.state.record_checkpoint(step, info.path, step)

    async def _publish_initial(self) -> None:
        """Snapshot of the policy held at start: v0 when fresh; on resume, a new version or the last one again."""
        latest = await trio.to_thread.run_sync(self.store.latest_version)
        if latest is None or latest < self.step:
            await self._publish(self.step)
            return
        snapshot = await trio.to_thread.run_sync(
            read_snapshot_files, self.snapshots_dir, latest, self.identity.peer_id
        )
        self._last_published = snapshot
        await self.snapshot_send.send(SnapshotPublished(version=latest, snapshot=snapshot))

    def _build_and_write(self, version: int) -> tuple[Snapshot, Snapshot | None]:
        started, started_at = time.perf_counter(), time.time()
        snapshot = build_snapshot(
            self.learner.state_dict(), version, self.identity, self.learner.config_hash, self.snapshots_dir,
            dtype=self.learner.snapshot_dtype, chunk_size=self.chunk_size_bytes, metadata=self.learner.snapshot_metadata,
            probe=self.probe,
        )
        manifest = snapshot.manifest
        delta = None
        base = self._last_published
        if self.delta_max_ratio > 0 and base is not None and base.manifest.config_hash == manifest.config_hash:
            try:
                built = build_delta_snapshot(base, snapshot, self.identity, self.snapshots_dir, self.delta_max_ratio)
            except OSError as exc:  # a full disk, say: the full snapshot is written, receivers pull that
                log.warning("v%d goes without a delta: %s", version, exc)
                built = None
            if built is not None:
                delta = built[0]
        self.state.record_snapshot(version, str(snapshot.path), manifest.whole_hash, manifest.total_bytes, started_at)
        self.snapshot_seconds.append(time.perf_counter() - started)
        self._last_published = snapshot
        return snapshot, delta

    async def _publish(self, version: int) -> None:
        snapshot, delta = await trio.to_thread.run_sync(self._build_and_write, version)
        await self.snapshot_send.send(SnapshotPublished(version=version, snapshot=snapshot, delta=delta))
