"""Log-prob audits: re-score a random sample of accepted groups with the policy version they claim.

Nodes report the sampling log-prob of every token they generated, and the learner uses those
numbers as pi_behaviour. The hub recomputes them for a random sample of submissions with its
own copy of the model holding the claimed version's weights (shared.logprobs.completion_logprobs,
the learner's own function) and compares. Which submissions are audited is decided after they
arrived, with the hub's own RNG, so a node cannot know which of its answers will be checked:
every submission of a new node until it passed `audit_first_n` audits, `audit_rate` of them after.

What an audit proves: the reported log-probs are, within tolerance, those of the claimed
version on these tokens. It catches invented log-probs and generation with another model (the
untrained base, an old or foreign checkpoint) as soon as that model's log-probs differ from the
claimed version's by more than the tolerance. It cannot tell apart two versions closer than the
tolerance: such a lie is no worse than the staleness the learner already tolerates. Tolerance
figures and their reasons are next to TrustConfig in hub/config.py.

A tool-using completion's environment tokens (tool answers the hub sent) are never sampled: the recomputation runs
over the whole sequence, with them as context, and compares and scores its model tokens only.

Tokens the hub's recomputation puts outside the top-p nucleus (log-prob -inf) happen to honest
low-precision engines at nucleus boundaries (~1 in 900 tokens for bf16, top_p 0.9): they are
left out of the mean and limited by `audit_max_outside_frac` instead.

Each audit also re-scores the whole sampling distribution at every token, which is the evidence of the sampling
test (hub/trust/sampling.py): AuditResult.evidence.

What follows a verdict is the intake's (hub/service/intake.py): a pass vouches for the node's pay up to the
audited submission; a failure bans the node, drops its groups still in the replay buffer and
voids its pay booked after its last passed audit. Groups the learner already trained on stay
trained on: audits are spot checks, not a gate.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import trio

from hub.config import TrustConfig
from hub.records.snapshots import SnapshotShelf
from hub.trust.sampling import SAMPLING_ORDERS, GroupEvidence, group_evidence
from shared.adapters import install_snapshot, prepare_for, snapshot_spec
from shared.logprobs import completion_logprobs, completion_logprobs_and_power_sums
from shared.model_identity import ModelIdentity
from shared.probe import InstallProbe, TokenRow
from shared.rollout import Group, SamplingParams, scored_positions

log = logging.getLogger("echo2.hub.audit")


class VersionUnavailable(LookupError):
    """The claimed version is no longer (or was never) on the hub's shelf: the group cannot be audited."""


@dataclass(frozen=True)
class AuditResult:
    passed: bool
    mean_abs_gap: float
    max_abs_gap: float
    tokens: int
    outside_nucleus: int = 0
    reason: str = ""
    evidence: GroupEvidence | None = None  # for the sampling test: the group's tokens re-scored as sampled


@dataclass(frozen=True)
class GapStats:
    """|reported - recomputed| over the real tokens of a group; tokens the hub puts at -inf counted apart."""

    mean_abs_gap: float
    max_abs_gap: float
    tokens: int
    outside_nucleus: int


def gap_stats(reported: torch.Tensor, recomputed: torch.Tensor, mask: torch.Tensor) -> GapStats:
    """Gaps of [B, T] reported vs recomputed log-probs over the tokens where mask is 1."""
    real = mask > 0
    outside = real & ~torch.isfinite(recomputed)
    scored = real & ~outside
    gaps = (reported - recomputed).abs().masked_fill(~scored, 0.0)
    n = int(scored.sum())
    return GapStats(
        mean_abs_gap=float(gaps.sum()) / n if n else 0.0,
        max_abs_gap=float(gaps.max()) if n else 0.0,
        tokens=int(real.sum()),
        outside_nucleus=int(outside.sum()),
    )


def judge(stats: GapStats, mean_abs_gap_tolerance: float, max_outside_frac: float) -> AuditResult:
    """Pass or fail one group's gap statistics against the tolerances."""
    reason = ""
    if stats.tokens == 0:
        reason = "no tokens to audit"
    elif stats.outside_nucleus > max_outside_frac * stats.tokens:
        reason = f"{stats.outside_nucleus}/{stats.tokens} tokens outside the top-p nucleus of the claimed version"
    elif not stats.mean_abs_gap <= mean_abs_gap_tolerance:
        reason = f"mean |log-prob gap| {stats.mean_abs_gap:.4g} > {mean_abs_gap_tolerance:g}"
    return AuditResult(
        passed=not reason,
        mean_abs_gap=stats.mean_abs_gap,
        max_abs_gap=stats.max_abs_gap,
        tokens=stats.tokens,
        outside_nucleus=stats.outside_nucleus,
        reason=reason,
    )


def bare_model(model_identity: ModelIdentity, dtype: torch.dtype) -> torch.nn.Module:
    """The architecture of the model in `dtype` with uninitialised weights, for a snapshot to fill:
    the model dir's own weights are never read (from_pretrained would map the whole fp32 file)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers before 5.2x (vLLM's pin): initialising is only slower, not different
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(model_identity.config_copy(), dtype=dtype)
    model.tie_weights()  # skipped under no_init_weights; the snapshot carries only the first of tied names
    return model.eval().requires_grad_(False)


class Auditor:
    """The hub's audit model: a CPU copy of the policy in the snapshot dtype, loaded with whichever shelf
    version an audit needs.

    Built at the first audit (a hub nobody joins holds no second model) and filled from the snapshot
    file on the shelf, one tensor at a time: one snapshot's worth of RAM at most. In the snapshot
    dtype rather than upcast, so that a bf16 run holds half, not all, of an fp32 copy; the bf16
    tolerance (hub/config.py AUDIT_GAP_BY_DTYPE) covers two bf16 computations.
    Blocking and used by one thread at a time (the AuditQueue runs audits one after another).
    """

    def __init__(
        self,
        model_identity: ModelIdentity,
        shelf: SnapshotShelf,
        sampling: SamplingParams,
        config: TrustConfig,
        snapshot_dtype: str,
    ) -> None:
        self.model_identity = model_identity
        self.shelf = shelf
        self.sampling = sampling
        self.config = config
        self.mean_abs_gap = config.mean_abs_gap(snapshot_dtype)
        self.sampling_slack_nats = config.sampling_slack(snapshot_dtype)
        self.dtype = getattr(torch, snapshot_dtype)
        # Its own tokenizer: it audits in a worker thread while the service decodes in others.
        self.tokenizer = model_identity.tokenizer_copy()
        self.model: torch.nn.Module | None = None
        # The whole hash of the snapshot the model holds; None: the weights are the model dir's, no snapshot's.
        self.loaded_hash: str | None = None
        self._lock = threading.Lock()

    def _base(self, snapshot_path: Path) -> torch.nn.Module:
        """The model a snapshot goes into: uninitialised for a full snapshot, the base weights for adapters."""
        spec = snapshot_spec(snapshot_path)
        if spec is None:
            return bare_model(self.model_identity, self.dtype)
        from transformers import AutoModelForCausalLM

        with torch.inference_mode(False):  # the adapters are parameters, made outside the audit's inference mode
            model = AutoModelForCausalLM.from_pretrained(self.model_identity.model_dir, dtype=self.dtype).eval()
            prepare_for(model, spec)
        return model.requires_grad_(False)

    def _load(self, version: int) -> None:
        snapshot = self.shelf.get(version)
        if snapshot is None:
            raise VersionUnavailable(f"snapshot v{version} is not on the shelf")
        try:
            self._load_file(snapshot.path, snapshot.manifest.whole_hash)
        except FileNotFoundError as exc:  # it left the shelf (and the disk) between get and load
            raise VersionUnavailable(f"snapshot v{version} was deleted") from exc

    def _load_file(self, path: Path, whole_hash: str) -> None:
        """The snapshot weights at `path` (whole hash `whole_hash`) into the model, unless it holds them already."""
        if whole_hash != self.loaded_hash:
            self.loaded_hash = None  # a load that fails half way leaves no known weights
            model = self.model = self.model if self.model is not None else self._base(path)
            install_snapshot(model, path)
            self.loaded_hash = whole_hash

    def install_probe(self, path: Path, whole_hash: str, rows: tuple[tuple[TokenRow, ...], tuple[TokenRow, ...]]) -> InstallProbe:
        """The install probe of the snapshot weights at `path` (not yet on the shelf): the audit's own model and
        computation, at temperature 1 without top-p, on the snapshot's weights in the snapshot's dtype."""
        prompts, completions = rows
        with self._lock, torch.inference_mode():
            self._load_file(path, whole_hash)  # an audit of this version soon after needs no second load
            logprobs, _ = completion_logprobs(self.model, list(prompts), list(completions))
        return InstallProbe(
            prompt_ids=prompts,
            completion_ids=completions,
            max_mean_abs_gap=self.mean_abs_gap,
            logprobs=tuple(tuple(float(x) for x in row[: len(c)]) for row, c in zip(logprobs.tolist(), completions)),
        )

    def logprob_sums(self, group: Group) -> list[float]:
        """Each completion's log-prob sum under its claimed version, as sampled (temperature, top-p): the likelihood
        the copy detector trusts when claims disagree (hub/trust/copies.py). -inf for a completion holding a token
        outside the nucleus. VersionUnavailable if the version left the shelf."""
        version = group.completions[0].version
        if any(c.version != version for c in group.completions):
            raise ValueError(f"group {group.prompt_id} mixes policy versions")
        recomputed, mask, _ = self._recompute(group, version)
        return recomputed.masked_fill(mask == 0, 0.0).sum(dim=-1).tolist()

    def _recompute(self, group: Group, version: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs and mask [B, T] of the group's completions under `version`, as sampled, and the log power sums
        [B, T, orders] of the sampling distribution at each token (the sampling test's evidence). A tool-using
        completion is run whole, its environment tokens as context: the mask holds its model tokens only."""
        prompt = self.tokenizer(group.prompt_text)["input_ids"]
        completions = [list(c.token_ids) for c in group.completions]
        with self._lock, torch.inference_mode():
            self._load(version)
            return completion_logprobs_and_power_sums(
                self.model,
                [prompt] * len(completions),
                completions,
                SAMPLING_ORDERS,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                min_p=self.sampling.min_p,
                scored=scored_positions(group.completions),
            )

    def audit(self, group: Group, version: int) -> AuditResult:
        """Re-score `group`'s completions with `version`'s weights; VersionUnavailable if it left the shelf."""
        if any(c.version != version for c in group.completions):
            raise ValueError(f"group {group.prompt_id} holds completions of versions other than v{version}")
        recomputed, mask, power_sums = self._recompute(group, version)
        reported = torch.zeros_like(recomputed)
        for row, c in enumerate(group.completions):
            reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
        stats = gap_stats(reported, recomputed, mask)
        result = judge(stats, self.mean_abs_gap, self.config.audit_max_outside_frac)
        return replace(result, evidence=group_evidence(recomputed, power_sums, mask, self.sampling_slack_nats))


@dataclass(frozen=True)
class AuditJob:
    """One accepted group picked for audit, with where it came from."""

    node_id: str
    lease_id: str
    row_id: int
    group: Group
    answered_at: float  # when the hub committed the submission: what a pass vouches for


class AuditQueue:
    """Audits groups off the trio thread, one at a time.

    The intake `offer`s sampled groups of trusted nodes (a full queue skips new jobs rather than
    hold up submissions; logged), takes them back with `next_job` in its audit loop, and calls
    `judge` for those and, right away, for the groups of nodes on probation.
    """

    def __init__(self, auditor: Auditor, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.auditor = auditor
        self.capacity = capacity
        self._jobs: deque[AuditJob] = deque()
        self._wake = trio.Event()
        # One audit at a time, on a thread of its own: waiting audits queue here, never on trio's shared
        # worker threads (which every store write needs).
        self._limiter = trio.CapacityLimiter(1)
        # Recomputes for the copy detector wait on the model's lock, not behind queued audits.
        self._recompute_limiter = trio.CapacityLimiter(1)

    def __len__(self) -> int:
        return len(self._jobs)

    def offer(self, job: AuditJob) -> bool:
        """Queue a job (never blocks); False when the queue is full."""
        if len(self._jobs) >= self.capacity:
            log.warning("audit queue full (%d): skipped a group of %s", self.capacity, job.node_id)
            return False
        self._jobs.append(job)
        self._wake.set()
        return True

    async def next_job(self) -> AuditJob:
        while not self._jobs:
            self._wake = trio.Event()
            await self._wake.wait()
        return self._jobs.popleft()

    async def recompute(self, group: Group) -> list[float] | None:
        """Auditor.logprob_sums in a worker thread (one model, so one at a time with the audits); None when the
        version left the shelf (logged)."""
        try:
            return await trio.to_thread.run_sync(self.auditor.logprob_sums, group, limiter=self._recompute_limiter)
        except VersionUnavailable as exc:
            log.warning("recomputing log-probs of group %s for copy detection skipped: %s", group.prompt_id, exc)
            return None

    async def judge(self, job: AuditJob) -> AuditResult | None:
        """Re-score the job's group in a worker thread; None when its version left the shelf (logged)."""
        try:
            return await trio.to_thread.run_sync(self.auditor.audit, job.group, job.group.version, limiter=self._limiter)
        except VersionUnavailable as exc:
            log.warning("audit of %s's group %s skipped: %s", job.node_id, job.group.prompt_id, exc)
            return None
