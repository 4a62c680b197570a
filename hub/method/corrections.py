"""Off-policy corrections of the learner's loss (docs/DESIGN.md §4), under verl's and TRL's names: importance weights
of the nodes' sampled tokens at token, sequence or geometric-mean level, truncated (TIS) or masked (MIS) at a lower
and an upper cap, verl's sequence veto, DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold),
and what a step logs of them.

What they weigh: rollouts sampled up to S versions behind the learner, by engines whose numerics differ from the
learner's (vLLM in bf16), both at once. The audits (hub/trust/audit.py) answer another question, whether a node's
log-probs are those of the version it claims, within a tolerance; the corrections take audited log-probs as they are
and weigh the gap between them and the learner's current policy.

Pure torch functions on [B, T] tensors of per-token log-ratios log(p_learner / p_node) (0 on padding) and their mask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

# verl's rollout_is_level: one weight per token, per sequence (the product of its tokens' ratios), or per sequence as
# their geometric mean.
IS_LEVELS = ("token", "sequence", "geometric")
# verl's rollout_is_mode (TIS or MIS); off: the PPO ratio to the nodes' log-probs is the only correction (echo2's own).
IS_MODES = ("off", "truncate", "mask")
# exp of a sequence's summed log-ratio overflows float32 past ~88: weights are computed from log-ratios bounded here
# (verl's SAFETY_BOUND; e^20 ~ 4.9e8, past any cap that makes sense).
LOG_WEIGHT_BOUND = 20.0
# What a micro-batch adds up for the step's correction metrics (summed over micro-batches and ranks, then divided once):
# sequences with a valid token; valid tokens dropped (by the mask mode, the veto, the off-policy mask or max_is_ratio);
# valid tokens whose weight truncation changed; sequences with at least one such token of each kind; sequences vetoed;
# the sum and sum of squares of the weights tokens train with (0 if dropped; the ratio itself without a correction);
# the sum of the weights before their caps.
CORRECTION_SUMS = (
    "seqs",
    "tokens_masked",
    "tokens_truncated",
    "seqs_masked",
    "seqs_truncated",
    "seqs_vetoed",
    "weight_sum",
    "weight_sq_sum",
    "raw_sum",
)


@dataclass(frozen=True)
class Correction:
    """The learner's corrections, as LearnerConfig's rollout_is_* and off_policy_mask_threshold set them."""

    mode: str = "off"
    level: str = "token"
    upper: float = 3.0
    lower: float | None = None
    veto: float | None = None
    off_policy_mask: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in IS_MODES:
            raise ValueError(f"unknown importance sampling mode {self.mode!r}; expected one of {IS_MODES}")
        if self.level not in IS_LEVELS:
            raise ValueError(f"unknown importance sampling level {self.level!r}; expected one of {IS_LEVELS}")
        # The user-facing bounds are LearnerConfig's (hub/config.py); these are what the math needs of them.
        assert self.upper > 0.0 and (self.lower is None or 0.0 < self.lower < self.upper), (self.lower, self.upper)
        assert self.veto is None or self.veto > 0.0, self.veto
        assert self.off_policy_mask is None or self.off_policy_mask > 0.0, self.off_policy_mask


@dataclass(frozen=True)
class TokenWeights:
    """What the corrections make of a batch, all detached: `weights` multiply each token's loss (None: no correction
    weight, the PPO ratio to the nodes' log-probs is it); `raw` are the weights before their caps (the plain token
    ratio without a correction); `keep` the valid tokens that take part; `truncated` the tokens whose weight a cap
    changed; `vetoed` the rows the veto dropped."""

    weights: Tensor | None
    raw: Tensor
    keep: Tensor
    truncated: Tensor | None
    vetoed: Tensor | None


def level_log_weights(log_ratio: Tensor, valid: Tensor, level: str) -> Tensor:
    """Each valid token's log importance weight at `level` (0 on padding): its own log-ratio (token), its row's sum
    (sequence: the log of the product of the row's ratios) or the row's mean (geometric, and GSPO's sequence ratio).
    Differentiable, so GSPO's ratio passes its gradient to every token of the row."""
    if level == "token":
        return log_ratio
    total = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(dim=1, keepdim=True).clamp(min=1).to(total.dtype)
    elif level != "sequence":
        raise ValueError(f"unknown importance sampling level {level!r}; expected one of {IS_LEVELS}")
    return torch.where(valid, total.expand_as(log_ratio), torch.zeros_like(log_ratio))


def vetoed_rows(log_ratio: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """[B] rows with a valid token whose ratio is below `threshold` (verl's rollout_is_veto_threshold): one such token
    says the node's policy gave it far more weight than the learner's, and the whole sequence is dropped."""
    return ((log_ratio < math.log(threshold)) & valid).any(dim=1)


def off_policy_rows(log_ratio: Tensor, valid: Tensor, advantages: Tensor, threshold: float) -> Tensor:
    """[B] rows DeepSeek-V3.2's off-policy sequence mask drops (TRL's get_off_policy_mask): a negative advantage and a
    mean log(p_node / p_learner) over the row's valid tokens (a KL estimate) above `threshold`."""
    kl = -torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1) / valid.sum(dim=1).clamp(min=1)
    return (advantages < 0) & (kl > threshold)


def token_weights(
    log_ratio: Tensor, valid: Tensor, advantages: Tensor, correction: Correction, max_is_ratio: float | None = None
) -> TokenWeights:
    """The corrections of a batch from its detached log-ratios [B, T] (0 on padding), `valid` mask and advantages [B].

    truncate: weights clamp(w, lower, upper), every valid token kept; mask: weights w where lower <= w <= upper, the
    other tokens (at sequence or geometric level, the whole row) dropped from the loss and its token count, as verl
    rejects them (TRL zeroes their weight but keeps them in the count). Then, in any mode, a vetoed row, a row the
    off-policy mask drops and a token whose own ratio exceeds `max_is_ratio` are dropped too."""
    raw = torch.exp(level_log_weights(log_ratio, valid, correction.level).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    keep = valid
    weights: Tensor | None = None
    truncated: Tensor | None = None
    if correction.mode == "truncate":
        weights = raw.clamp(min=correction.lower, max=correction.upper)
        truncated = valid & (weights != raw)
    elif correction.mode == "mask":
        weights = raw
        keep = keep & (raw <= correction.upper)
        if correction.lower is not None:
            keep = keep & (raw >= correction.lower)
    vetoed = vetoed_rows(log_ratio, valid, correction.veto) if correction.veto is not None else None
    dropped = vetoed
    if correction.off_policy_mask is not None:
        off_policy = off_policy_rows(log_ratio, valid, advantages, correction.off_policy_mask)
        dropped = off_policy if dropped is None else dropped | off_policy
    if dropped is not None:
        keep = keep & ~dropped.unsqueeze(1)
    if max_is_ratio is not None:
        keep = keep & (torch.exp(log_ratio) <= max_is_ratio)
    return TokenWeights(weights, raw, keep, truncated, vetoed)


def correction_sums(valid: Tensor, corrected: TokenWeights) -> list[Tensor]:
    """A micro-batch's CORRECTION_SUMS, as 0-d tensors in that order (stacked by the caller: one device sync)."""
    zero = valid.new_zeros((), dtype=torch.float64)
    dropped = valid & ~corrected.keep
    applied = corrected.raw if corrected.weights is None else corrected.weights
    applied = torch.where(corrected.keep, applied, torch.zeros_like(applied)).double()
    truncated = corrected.truncated
    return [
        valid.any(dim=1).sum().double(),
        dropped.sum().double(),
        truncated.sum().double() if truncated is not None else zero,
        dropped.any(dim=1).sum().double(),
        truncated.any(dim=1).sum().double() if truncated is not None else zero,
        corrected.vetoed.sum().double() if corrected.vetoed is not None else zero,
        applied.sum(),
        applied.square().sum(),
        torch.where(valid, corrected.raw, torch.zeros_like(corrected.raw)).double().sum(),
    ]


def effective_sample_size(weight_sum: float, weight_sq_sum: float, count: int) -> float:
    """verl's effective sample size, (sum w)^2 / sum w^2 over `count` tokens, divided by `count`: 1 when every token
    weighs the same, towards 1/count as one token outweighs the rest, 0 when none trains (or no tokens)."""
    if count == 0 or weight_sq_sum <= 0.0:
        return 0.0
    return weight_sum * weight_sum / weight_sq_sum / count


def correction_metrics(sums: Mapping[str, float], raw_max: float, tokens: int) -> dict[str, float]:
    """A step's correction metrics from its CORRECTION_SUMS over every micro-batch and rank, its largest weight
    before the caps and its valid token count: the metrics row's `is_*` keys (docs/operations.md)."""
    seqs = max(1.0, sums["seqs"])
    return {
        "is_tokens_masked": sums["tokens_masked"] / max(1, tokens),
        "is_tokens_truncated": sums["tokens_truncated"] / max(1, tokens),
        "is_seqs_masked": sums["seqs_masked"] / seqs,
        "is_seqs_truncated": sums["seqs_truncated"] / seqs,
        "is_seqs_vetoed": sums["seqs_vetoed"] / seqs,
        "is_weight_mean": sums["raw_sum"] / max(1, tokens),
        "is_weight_max": raw_max,
        "is_ess": effective_sample_size(sums["weight_sum"], sums["weight_sq_sum"], tokens),
    }
