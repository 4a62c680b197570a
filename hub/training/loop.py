"""The training loop: it takes usable groups from the hub's buffer, steps the Learner on them, commits
each step, and publishes a signed snapshot every kappa steps.

`LearnerComponent` waits for usable groups (that wait is T_idle), runs the step in a worker thread,
commits it through its host, appends metrics, checkpoints (every checkpoint_every steps, and once
checkpoint_every_s seconds passed: hub/training/checkpoint.py), and sends each snapshot on a memory channel. A resume
that lost steps as weights (a crash after their checkpoint) says so for the operator and marks the gap in metrics.
It knows the hub only as a `LearnerHost`: the buffer and its signal, the record's latest step, version
and checkpoint, and the learner's writes (HubState is one; hub/cli/run.py wires it in).

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
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from hub.config import LearnerConfig
from hub.method.capacity import default_kappa
from hub.method.drift import DriftMeter
from hub.method.schedule import step_lr
from hub.records.buffer import BufferSignal, ReplayBuffer
from hub.records.measurements import (
    Measurements,
    grace_after_lowering,
    grace_staleness,
    next_take,
    oldest_useful_version,
    resumed_staleness,
    takes_served,
)
from hub.records.schema import StepRecord
from hub.records.shelf_table import ShelfTable
from hub.records.training_table import TrainingTable
from hub.training.checkpoint import (
    CheckpointInfo,
    checkpoint_due,
    latest_checkpoint,
    lost_steps,
    remove_stale_temporaries,
    save_checkpoint,
    write_text_files,
)
from hub.training.distributed import Collective, Command, RankGroup, RankWatch, broadcast
from hub.training.evaluation import EvalRunner
from hub.training.learner import Learner, StepStats
from hub.training.metrics import (
    MetricsWriter,
    bubble_ratio,
    cut_completions_warning,
    logged_metric_means,
    lost_text,
    read_lost,
    reward_means,
    sample_completions,
)
from hub.training.trackers import Trackers
from shared.crypto import Identity
from shared.delta import build_delta_snapshot
from shared.layout import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, SNAPSHOTS_DIR
from shared.logs import for_operator
from shared.memory import release_free_memory
from shared.model_identity import ModelIdentity
from shared.model_io import build_snapshot
from shared.probe import InstallProbe
from shared.rollout import Group, SamplingParams
from shared.snapshot import Snapshot, read_snapshot_files
from shared.staleness import StalenessMove
from shared.tools import TOOL_CALLS_METRIC

if TYPE_CHECKING:  # pyarrow is imported only by a hub that saves rollouts
    from hub.training.rollout_export import RolloutExport

log = logging.getLogger("echo2.hub.learner")

SNAPSHOT_TIMES_KEPT = 100


@dataclass(frozen=True)
class SnapshotPublished:
    """A snapshot whose files and store row exist; sent to the broadcaster and local rollouts."""

    version: int
    snapshot: Snapshot
    delta: Snapshot | None = None  # the version as a delta against the one published before it


class RecordReads(Protocol):
    """The tables of the hub's record the loop reads when it starts and when it saves on Ctrl-C."""

    @property
    def training(self) -> TrainingTable: ...

    @property
    def shelf(self) -> ShelfTable: ...


class LearnerHost(Protocol):
    """The hub as the loop sees it. The loop takes groups from `buffer` on the trio thread, waits on `signal`
    and notifies it after each take and step; `commit_step` writes a step with its consumed and stale-dropped
    groups in one transaction; the `record_*` writes go through the hub's one store writer and may run in a worker
    thread (they wait for its commit there). `measurements.learner` is the loop's window (step, S, kappa) as the
    hub's Leasing and status board read it: the loop sets it after every change."""

    @property
    def store(self) -> RecordReads: ...

    @property
    def buffer(self) -> ReplayBuffer: ...

    @property
    def signal(self) -> BufferSignal: ...

    @property
    def measurements(self) -> Measurements: ...

    async def commit_step(self, record: StepRecord, consumed_ids: Sequence[int], dropped_stale_ids: Sequence[int]) -> None: ...

    def record_snapshot(self, version: int, path: str, manifest_hash: str, total_bytes: int, started_at: float) -> None: ...

    def record_checkpoint(self, step: int, path: Path, version: int) -> None: ...

    def record_event(self, kind: str, node_id: str | None, detail: str) -> None: ...


class LearnerComponent:
    """Trio driver of the Learner over a data dir; resumes from the newest checkpoint there.

    Construction blocks (loads the model, reads the store): build it before trio starts or in
    trio.to_thread.run_sync. It takes groups from its host's buffer (refilled from the store
    when the host opened) and commits its steps through the host.
    `run` trains until the step number reaches `steps` (0: forever), then evaluates the final policy (when
    evaluation is on), checkpoints it and saves it as DATA_DIR/final, each with its run card.
    Per step: wait for prompts_per_step usable groups (T_idle), train in a worker thread,
    commit step row + consumed and stale-dropped row ids in one transaction, append
    metrics.jsonl (and the trackers), hand the weights to a due evaluation, checkpoint when due
    (hub.training.checkpoint.checkpoint_due), publish every kappa steps.
    """

    def __init__(
        self,
        cfg: LearnerConfig,
        sampling: SamplingParams,
        model_identity: ModelIdentity,
        data_dir: Path,
        host: LearnerHost,
        identity: Identity,
        snapshot_send: trio.MemorySendChannel[SnapshotPublished],
        steps: int,
        chunk_size_bytes: int,
        delta_max_ratio: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        extra_metrics: Callable[[int], Mapping[str, float | None]] = lambda step: {},
        trackers: Trackers | None = None,
        evaluation: EvalRunner | None = None,
        log_completions: int = 0,
        ranks: tuple[Collective, str, RankWatch | None] | None = None,
        probe: Callable[[Path, str], InstallProbe] | None = None,
        card: Callable[[int], Mapping[str, str]] | None = None,
        rollouts: RolloutExport | None = None,
        staleness_control: Callable[[int, float | None, float | None, float | None], StalenessMove | None] | None = None,
        metrics: MetricsWriter | None = None,
        uses_tools: bool = False,
    ) -> None:
        """`ranks`: (this process's rank, its device, the spawned ranks) of a learner sharded across processes
        (hub/training/distributed.py); the learner is then driven through a RankGroup. `probe(weights path, whole hash)`:
        the install probe signed into each snapshot's manifest (shared/probe.py). `card(step)`: the text files saved
        beside the policy of that step, in each checkpoint and in DATA_DIR/final (name -> text). `rollouts`: where each
        step's groups are saved as data (--save-rollouts). `staleness_control(version, drift, drift_per_version,
        age)`: under --staleness auto, after each publish, the S and kappa of the next period (None: they stay), given
        the period's drift, the drift per version of age and the mean age, as hub/method/drift.py reads them from the
        steps (each None when not measured yet). `uses_tools`: a tool-using run, whose metrics give its rollouts' rounds
        of tool calls (TRL's tools/call_frequency)."""
        self.probe = probe
        self.card = card or (lambda step: {})
        self.rollouts = rollouts  # --save-rollouts: each step's groups as a Parquet shard
        self.cfg = cfg
        self.data_dir = Path(data_dir)
        self.host = host
        self.store = host.store
        self.buffer = host.buffer
        self.signal = host.signal
        self.identity = identity
        self.snapshot_send = snapshot_send
        self.steps = steps
        self.chunk_size_bytes = chunk_size_bytes
        self.delta_max_ratio = delta_max_ratio
        self._last_published: Snapshot | None = None  # the base of the next delta
        self.kappa = cfg.effective_kappa
        # The S in force; a lowered S leaves the window at the old one until a step (see _adapt_staleness).
        self.staleness = cfg.staleness
        self.staleness_control = staleness_control
        self._grace = (cfg.staleness, 0)
        self._drift = DriftMeter()  # what staleness_control decides on
        self.clock = clock
        self.extra_metrics = extra_metrics
        self.log_completions = log_completions  # sample completions logged per step (--log-completions)
        self.max_new_tokens = sampling.max_new_tokens
        self._warned_cut = False  # the cut-completions warning is said once a run
        self._groups_trained = 0  # since this start, against the buffer's count of groups offered
        self._offered_seen = (0, 0.0, 0, 0.0)
        self.uses_tools = uses_tools
        self.snapshots_dir = self.data_dir / SNAPSHOTS_DIR
        self.checkpoints_dir = self.data_dir / CHECKPOINTS_DIR
        remove_stale_temporaries(self.checkpoints_dir)
        checkpoint = latest_checkpoint(self.checkpoints_dir)
        self.sharded = ranks is not None
        # RankGroup answers the Learner's own interface (each call run on every rank), and stop().
        self.learner: Learner | RankGroup
        if ranks is None:
            self.learner = Learner(model_identity, cfg, sampling, checkpoint)
        else:
            collective, device, watch = ranks
            broadcast(Command("init", checkpoint=checkpoint))  # every rank resumes what rank 0 resumes
            self.learner = RankGroup(Learner(model_identity, cfg, sampling, checkpoint, collective, device), watch)
        # metrics.jsonl: the hub's writer, which its evaluations write to too (None: one of the loop's own).
        self.metrics = metrics if metrics is not None else MetricsWriter(self.data_dir / METRICS_FILE, trackers)
        self.evaluation = evaluation
        # Numbering continues after the newest committed step even when the checkpoint is older:
        # steps after the checkpoint are lost as weights but stay in the record, so versions
        # never repeat.
        latest_step = self.store.training.latest_step() or 0
        self.step = max(latest_step, checkpoint.step if checkpoint is not None else 0)
        if cfg.staleness_auto:
            self._resume_staleness()
        self.training = False
        self._measured()
        self.snapshot_seconds: deque[float] = deque(maxlen=SNAPSHOT_TIMES_KEPT)  # the latest, for benchmarks
        self._pending_stale: list[int] = []
        # When the last checkpoint was taken (this start counts as one: it resumes one, or the starting model) and
        # how long it took: what a checkpoint due by time is measured from (checkpoint_due).
        self._checkpointed_at, self._checkpoint_took_s = self.clock(), 0.0
        if self.step > 0 or checkpoint is not None:
            self._resumed(checkpoint)

    def _resumed(self, checkpoint: CheckpointInfo | None) -> None:
        """A resume, as an event; the steps it lost as weights (a crash after their checkpoint), if any, as a warning
        for the operator and a gap in metrics.jsonl."""
        at = checkpoint.step if checkpoint is not None else 0
        lost = lost_steps(self.step, at, read_lost(self.metrics.path))
        detail = f"step {self.step}, checkpoint {checkpoint.step if checkpoint else 'none'}, steps lost as weights: "
        if lost is None:
            self.host.record_event("learner_resume", None, f"{detail}0")
            return
        first, last = lost
        self.host.record_event("learner_resume", None, f"{detail}{last - first + 1} ({lost_text(lost)})")
        policy = f"the checkpoint of step {at}" if checkpoint is not None else "the starting model (no checkpoint yet)"
        log.warning(
            "%s lost in a crash: their updates died with the hub before a checkpoint held them; the learner resumes "
            "from %s, and its next step is %d (their groups are not trained on again)",
            lost_text(lost),
            policy,
            last + 1,
            extra=for_operator("steps_lost"),
        )
        self.metrics.append_lost(first, last, at)

    @property
    def version(self) -> int:
        """Version of the policy the learner holds now."""
        return self.step

    def min_useful_version(self) -> int:
        """Oldest version whose fresh rollouts the next take can still use (for leases and local rollouts)."""
        return oldest_useful_version(self.step, self.training, self.window_staleness())

    def takes_served(self, held: int) -> int:
        """How many takes from the next still use version `held` (hub.records.measurements.takes_served)."""
        return takes_served(held, next_take(self.step, self.training), self.staleness, self._grace)

    def _resume_staleness(self) -> None:
        """--staleness auto: go on at the S (kappa following) the newest committed step trained under, within
        [1, staleness_max], rather than at the start's; a move decided after that step is decided again at the next
        publish."""
        resumed = resumed_staleness(self.store.training.latest_step_record(), self.cfg.staleness_max)
        if resumed is None:
            return
        self.staleness = resumed
        self.kappa = default_kappa(self.staleness)
        self._grace = (self.staleness, 0)

    def _measured(self) -> None:
        """The learner's window as the hub's measurements hold it (Leasing's version floor, the status board's step):
        set after every change of the step, of a step under way, or of S."""
        window = self.host.measurements.learner
        window.step, window.training = self.step, self.training
        window.staleness, window.window_staleness, window.kappa = self.staleness, self.window_staleness(), self.kappa
        window.grace = self._grace

    def window_staleness(self) -> int:
        """The S the buffer and the leases' window use: the S in force, or a larger one it replaced, for its grace."""
        return grace_staleness(self.staleness, self._grace, self.step)

    async def run(self) -> None:
        await self._publish_initial()
        k = self.cfg.prompts_per_step
        while self.steps == 0 or self.step < self.steps:
            current = self.step
            t = current + 1
            self.buffer.staleness = self.window_staleness()
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
            self._measured()
            self.signal.notify()
            try:
                # Sharded, a step waits on other processes: when one dies the hub stops without waiting for it.
                stats = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                    self.learner.train_step, taken.groups, t, self._lr(t), abandon_on_cancel=self.sharded
                )
            finally:
                self.training = False
                self._measured()
            staleness = taken.staleness
            self._groups_trained += len(taken.groups)
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
                staleness_budget=self.staleness,
                extra={
                    **logged_metric_means(taken.groups),  # the reward functions' own: ours win a shared name
                    "loss": stats.loss,
                    "ratio_mean": stats.ratio_mean,
                    "ratio_max": stats.ratio_max,
                    "abs_log_ratio": stats.abs_log_ratio,
                    "kappa": float(self.kappa),
                    "kl": stats.kl,
                    "masked_by_is": stats.masked_by_is,
                    **stats.corrections,
                    "grad_norm": stats.grad_norm,
                    "t_forward_s": stats.t_forward_s,
                    "t_backward_s": stats.t_backward_s,
                    "t_optim_s": stats.t_optim_s,
                    **self._trl_metrics(stats),
                    **reward_means(taken.groups),
                    **self._rollout_reward_since_last_step(),
                    **self.extra_metrics(t),
                },
            )
            stale_ids = list(self._pending_stale)
            # A committed step gets its metrics line even when the hub is stopping (Ctrl-C between the two would
            # leave a hole in metrics.jsonl that a resume never fills).
            with trio.CancelScope(shield=True):
                await self.host.commit_step(record, taken.row_ids, stale_ids)
                self._pending_stale.clear()
                self.step = t
                self._measured()
                await trio.to_thread.run_sync(self._log_step, record, taken.groups)
                # A step frees its activations and the groups it trained on: hand the pages back, not one arena's worth.
                await trio.to_thread.run_sync(release_free_memory)
            if self.rollouts is not None:
                await trio.to_thread.run_sync(self.rollouts.save, taken.groups, t, staleness)
            if self.evaluation is not None and self.evaluation.due(t):
                await self.evaluation.start(t, self.learner.state_dict)
            if checkpoint_due(
                t,
                self.cfg.checkpoint_every,
                self.clock() - self._checkpointed_at,
                self.cfg.checkpoint_every_s,
                self._checkpoint_took_s,
            ):
                await trio.to_thread.run_sync(self._checkpoint, t)
            await self._warn_if_cut(t, stats.clipped_ratio)
            self._drift.add(stats.abs_log_ratio, record.staleness_mean)
            # After kappa changes the next multiple of it comes within kappa steps: the lease rule (kappa <= S - 1) holds.
            if t % self.kappa == 0:
                await self._publish(t)
                await self._adapt_staleness(t)
            self.signal.notify()
        if self.evaluation is not None:  # the final policy's evaluation belongs to the run, and to its card
            await self.evaluation.finish(self.step, self.learner.state_dict)
        await trio.to_thread.run_sync(self.save_state)

    def _lr(self, step: int) -> float:
        """The learning rate of `step` under the configured schedule (--lr-scheduler, --warmup-ratio)."""
        return step_lr(self.cfg.lr, self.cfg.lr_scheduler, step, self.steps, self.cfg.warmup_ratio)

    async def _warn_if_cut(self, step: int, clipped_ratio: float) -> None:
        """Say once (log, event, terminal) that most of a step's completions hit --max-new-tokens."""
        line = None if self._warned_cut else cut_completions_warning(step, clipped_ratio, self.max_new_tokens)
        if line is None:
            return
        self._warned_cut = True
        log.warning(line, extra=for_operator("completions_cut"))
        await trio.to_thread.run_sync(self.host.record_event, "completions_cut", None, line)

    def _trl_metrics(self, stats: StepStats) -> dict[str, float]:
        """The step's metrics under TRL's meaning: lr, entropy, completion lengths, and the share of the groups
        offered since this start (bought or local) that were trained on."""
        return {
            "lr": stats.lr,
            "entropy": stats.entropy,
            "completion_length_mean": stats.completion_length_mean,
            "completion_length_max": stats.completion_length_max,
            "clipped_ratio": stats.clipped_ratio,
            # The same under TRL's names, so TRL users' dashboards and scripts read them.
            "completions/mean_length": stats.completion_length_mean,
            "completions/max_length": stats.completion_length_max,
            "completions/clipped_ratio": stats.clipped_ratio,
            "trained_share": self._groups_trained / max(1, self.buffer.offered),
        }

    def _log_step(self, record: StepRecord, groups: Sequence[Group]) -> None:
        """The step's metrics row, then its sample completions (--log-completions). Blocking."""
        self.metrics.append(record)
        if self.log_completions:
            self.metrics.append_completions(record.step, sample_completions(groups, self.log_completions))

    def _rollout_reward_since_last_step(self) -> dict[str, float]:
        """Mean reward of every group offered since the previous step, zero-variance ones included, and the share of
        those groups whose completions all scored the same (TRL's frac_reward_zero_std, over what was sampled).

        The step's own reward_mean covers only the groups it trained on, which skipping
        zero-variance groups biases towards 0.5; this one tracks what the policy scores.
        """
        buffer = self.buffer
        count, total, zero_std, rounds = (
            buffer.offered,
            buffer.offered_reward_sum,
            buffer.offered_zero_std,
            buffer.offered_tool_rounds,
        )
        seen_count, seen_total, seen_zero_std, seen_rounds = self._offered_seen
        self._offered_seen = (count, total, zero_std, rounds)
        if count == seen_count:
            return {}
        offered = count - seen_count
        tools = {TOOL_CALLS_METRIC: (rounds - seen_rounds) / offered} if self.uses_tools else {}
        return {
            "rollout_reward_mean": (total - seen_total) / offered,
            "frac_reward_zero_std": (zero_std - seen_zero_std) / offered,
            **tools,
        }

    def save_state(self) -> None:
        """Checkpoint and save the final policy, with its card, now (at the end of the run, on Ctrl-C): a later
        start resumes this policy. Nothing before the first step. Blocking: call outside trio or in a worker thread."""
        latest = self.store.training.latest_checkpoint()
        if self.step == 0:
            return  # nothing trained yet: the starting model is no final policy, and the next start begins afresh
        if latest is None or latest.step < self.step:  # a periodic one may have just been taken
            self._checkpoint(self.step)
        final = self.data_dir / FINAL_DIR
        self.learner.save_final(final)
        write_text_files(final, self.card(self.step))

    def _checkpoint(self, step: int) -> None:
        """Checkpoint the policy after `step`, timed (hub.log says how long: what checkpoint_every_s costs). Blocking."""
        learner = self.learner
        started = time.perf_counter()
        info = save_checkpoint(
            self.checkpoints_dir,
            step,
            step,
            learner.model,
            learner.tokenizer,
            learner.optimizer,
            keep=self.cfg.checkpoints_kept,
            adapter=learner.state_dict() if learner.lora is not None else None,
            adapter_metadata=learner.snapshot_metadata,
            sharded=learner.save_sharded if learner.collective.world > 1 else None,
            files=self.card(step),
        )
        self.host.record_checkpoint(step, info.path, step)
        self._checkpointed_at, self._checkpoint_took_s = self.clock(), time.perf_counter() - started
        log.info("checkpoint of step %d in %.3fs", step, self._checkpoint_took_s)

    async def _publish_initial(self) -> None:
        """Snapshot of the policy held at start: v0 when fresh; on resume, a new version or the last one again."""
        latest = await trio.to_thread.run_sync(self.store.shelf.latest_version)
        if latest is None or latest < self.step:
            await self._publish(self.step)
            return
        snapshot = await trio.to_thread.run_sync(read_snapshot_files, self.snapshots_dir, latest, self.identity.peer_id)
        self._last_published = snapshot
        await self.snapshot_send.send(SnapshotPublished(version=latest, snapshot=snapshot))

    def _build_and_write(self, version: int) -> tuple[Snapshot, Snapshot | None]:
        started, started_at = time.perf_counter(), time.time()
        snapshot = build_snapshot(
            self.learner.state_dict(),
            version,
            self.identity,
            self.learner.config_hash,
            self.snapshots_dir,
            dtype=self.learner.snapshot_dtype,
            chunk_size=self.chunk_size_bytes,
            metadata=self.learner.snapshot_metadata,
            probe=self.probe,
        )
        manifest = snapshot.manifest
        delta = None
        base = self._last_published
        if self.delta_max_ratio > 0 and base is not None and base.manifest.config_hash == manifest.config_hash:
            try:
                built = build_delta_snapshot(base, snapshot, self.identity, self.snapshots_dir, self.delta_max_ratio)
            except OSError as exc:  # a full disk, say: the full snapshot is written, receivers pull that
                log.warning("v%d goes without a delta: %s", version, exc, extra=for_operator("no_delta"))
                built = None
            if built is not None:
                delta = built[0]
        self.host.record_snapshot(version, str(snapshot.path), manifest.whole_hash, manifest.total_bytes, started_at)
        self.snapshot_seconds.append(time.perf_counter() - started)
        self._last_published = snapshot
        return snapshot, delta

    async def _adapt_staleness(self, version: int) -> None:
        """Put the S its control chooses in force. A lowered S keeps the old window for S_old steps: a group made with
        a version up to this one was usable under the old S until at most this step + S_old, so no group made or leased
        before the change is dropped for it; the drift guard lowers S early enough (LOWER_AT) for that delay."""
        if self.staleness_control is None:
            return
        move = self.staleness_control(version, *self._drift.read())
        if move is None:
            return
        self._drift.moved()
        if move.staleness < self.staleness:
            self._grace = grace_after_lowering(self._grace, self.window_staleness(), version, self.staleness)
        before = (self.staleness, self.kappa)
        self.staleness, self.kappa = move.staleness, move.kappa
        self._measured()
        detail = f"S {before[0]} -> {move.staleness}, kappa {before[1]} -> {move.kappa}: {move.reason.value} ({move.detail})"
        await trio.to_thread.run_sync(self.host.record_event, "staleness", None, detail)

    async def _publish(self, version: int) -> None:
        snapshot, delta = await trio.to_thread.run_sync(self._build_and_write, version)
        await self.snapshot_send.send(SnapshotPublished(version=version, snapshot=snapshot, delta=delta))
