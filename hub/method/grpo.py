"""GRPO math for the learner (docs/DESIGN.md §4): group advantages and the clipped, token-level loss, shaped by the
off-policy corrections of hub/method/corrections.py.

Pure torch functions with no model, optimizer or I/O, so every formula is tested against
hand-computed values.

Standard deviation: the sample (unbiased, Bessel-corrected, n - 1) estimator, i.e. torch.std's
default. It is what the reference GRPO/DAPO implementations compute (TRL's GRPOTrainer and
verl call `torch.std` on the grouped rewards), so our advantages match theirs for the same
rewards, and for the small groups GRPO uses (n = 4..16) it does not understate the spread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from hub.method.corrections import CORRECTION_SUMS, Correction, correction_sums, level_log_weights, token_weights

ADVANTAGE_SCALES = ("group", "batch", "none")
# TRL's loss_type values the loss below implements: how the per-token losses of a batch add up to one number.
# dapo and bnpo: their mean over the batch's tokens (TRL's bnpo takes it per device batch; a step here is one
# batch, accumulated exactly, so the two agree); grpo: each completion's token mean, then their mean; dr_grpo:
# their sum over (completions x max_completion_length), a constant.
LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
# TRL's importance_sampling_level: the PPO ratio per token, or per sequence as GSPO's geometric mean of its tokens'.
RATIO_LEVELS = ("token", "sequence")
NO_CORRECTION = Correction()


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Advantages of flat rewards [G * n], grouped consecutively (n = group_size).

    A = r - mean(group), divided by (std(group) + eps) for scale="group", by
    (std(all rewards) + eps) for "batch", and left undivided for "none". std is the sample
    std (see the module docstring). A group whose rewards are all equal carries no signal and
    gets exact zeros, whatever rounding the mean picks up; a group of one is such a group.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {ADVANTAGE_SCALES}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be flat [G * n], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} (remainder {rewards.numel() % group_size})"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.numel() == 0 or group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.detach().view(-1, group_size)
    flat_group = grouped.max(dim=1, keepdim=True).values == grouped.min(dim=1, keepdim=True).values
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.detach().std() + eps)
    return torch.where(flat_group, torch.zeros_like(centered), centered).reshape(-1)


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    max_is_ratio: float | None = None,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    correction: Correction = NO_CORRECTION,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss, its tokens added up as `loss_type` says (LOSS_TYPES); gradient flows to `logprobs` only.

    logprobs, behaviour_logprobs, mask (and ref_logprobs): [B, T]; advantages: [B].
    Without a correction (correction.mode "off"): r = exp(logprobs - behaviour_logprobs), the ratio to the nodes'
    log-probs; per token -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A). With one (hub/method/corrections.py): r is the
    ratio to the learner's own detached log-probs (1 in value: each group trains once, so the PPO clip never acts),
    and each token's term is multiplied by the correction's weight w of the nodes' log-probs (verl's and TRL's
    decoupled form). importance_sampling_level "sequence" (GSPO): r is each row's geometric mean of its tokens' ratios,
    on every token of the row. Plus beta * the k3 KL exp(ref - lp) - (ref - lp) - 1 per token (TRL adds it too).
    A token takes part when mask is set, the correction keeps it and, if max_is_ratio is given, its ratio to the
    nodes' log-probs is <= max_is_ratio.
    dapo and bnpo: the sum over taking-part tokens divided by their count (0 with no such token); grpo: each
    row's sum over its taking-part tokens divided by their count (0 without), averaged over the B rows; dr_grpo:
    the sum divided by B * max_completion_length.

    stats: clip_frac (share of taking-part tokens where the clipped branch is strictly
    smaller, so it carries no gradient), ratio_mean and ratio_max (the token ratio to the nodes' log-probs over all
    mask tokens, before any token is dropped, so the drop's effect stays visible), abs_log_ratio (mean |log r| over the
    same tokens: the off-policy drift adaptive staleness guards), kl (k3 mean, 0.0
    without ref_logprobs), masked_by_is (mask tokens dropped), the correction's CORRECTION_SUMS and is_weight_max (the
    largest weight before its caps).
    """
    _check_loss_inputs(logprobs, behaviour_logprobs, advantages, mask, ref_logprobs, loss_type, max_completion_length)
    # The user-facing bounds are LearnerConfig's (hub/config.py); these are what the math needs of them.
    assert 0.0 <= eps_low < 1.0 and eps_high >= 0.0 and beta >= 0.0, (eps_low, eps_high, beta)
    assert max_is_ratio is None or max_is_ratio > 0.0, max_is_ratio
    if beta > 0.0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    if importance_sampling_level not in RATIO_LEVELS:
        raise ValueError(f"unknown importance sampling level {importance_sampling_level!r}; expected one of {RATIO_LEVELS}")

    valid = mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Padding positions may hold -inf or garbage log-probs: zero their log-ratio before exp so
    # neither the forward nor the backward pass ever sees inf * 0.
    log_ratio = torch.where(valid, logprobs - behaviour_logprobs.detach(), zeros)
    token_log_ratio = log_ratio.detach()
    corrected = token_weights(token_log_ratio, valid, advantages.detach(), correction, max_is_ratio)
    keep = corrected.keep
    n_keep = keep.sum()

    if correction.mode != "off":
        log_ratio = torch.where(valid, logprobs - logprobs.detach(), zeros)
    if importance_sampling_level == "sequence":
        log_ratio = level_log_weights(log_ratio, valid, "geometric")
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if corrected.weights is not None:
        per_token = per_token * corrected.weights.to(per_token.dtype)

    kl_sum = n_keep.new_zeros((), dtype=torch.float64)
    if ref_logprobs is not None:
        ref_diff = torch.where(keep, ref_logprobs.detach() - logprobs, zeros)
        k3 = torch.exp(ref_diff) - ref_diff - 1.0
        kl_sum = k3.detach().sum().double()
        if beta > 0.0:
            per_token = per_token + beta * k3
    loss = _aggregate(torch.where(keep, per_token, zeros), keep, loss_type, max_completion_length)

    token_ratio = torch.exp(token_log_ratio)
    sums = [
        valid.sum().double(),
        n_keep.double(),
        ((clipped < unclipped).detach() & keep).sum().double(),
        token_ratio[valid].sum().double(),
        torch.where(valid, token_ratio, zeros).max().double() if valid.numel() else kl_sum * 0.0,
        token_log_ratio[valid].abs().sum().double(),
        kl_sum,
        torch.where(valid, corrected.raw, zeros).max().double() if valid.numel() else kl_sum * 0.0,
        *correction_sums(valid, corrected),
    ]
    n_valid, kept, clip, ratio_sum, ratio_max, drift_sum, kl_total, weight_max, *rest = torch.stack(sums).tolist()
    stats = {
        "clip_frac": clip / max(1.0, kept),
        "ratio_mean": ratio_sum / n_valid if n_valid else 0.0,
        "ratio_max": ratio_max,
        "abs_log_ratio": drift_sum / n_valid if n_valid else 0.0,
        "kl": kl_total / max(1.0, kept),
        "masked_by_is": n_valid - kept,
        "is_weight_max": weight_max,
        **dict(zip(CORRECTION_SUMS, rest)),
    }
    return loss, stats


def _check_loss_inputs(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    loss_type: str,
    max_completion_length: int | None,
) -> None:
    """ValueError naming the first input grpo_loss cannot take."""
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    for name, other in (("behaviour_logprobs", behaviour_logprobs), ("mask", mask)):
        if other.shape != shape:
            raise ValueError(f"{name} shape {tuple(other.shape)} != logprobs shape {tuple(shape)}")
    if ref_logprobs is not None and ref_logprobs.shape != shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(shape)}")
    if advantages.shape != (shape[0],):
        raise ValueError(f"advantages must be [B] = [{shape[0]}], got shape {tuple(advantages.shape)}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss type dr_grpo needs max_completion_length")


def _aggregate(per_token: Tensor, keep: Tensor, loss_type: str, max_completion_length: int | None) -> Tensor:
    """A batch's per-token losses (zero where a token takes no part) as one number, by `loss_type`."""
    if loss_type == "grpo":
        per_row = keep.sum(dim=1).clamp(min=1).to(per_token.dtype)
        return (per_token.sum(dim=1) / per_row).mean()
    if loss_type == "dr_grpo":
        assert max_completion_length is not None
        return per_token.sum() / (per_token.shape[0] * max_completion_length)
    return per_token.sum() / keep.sum().clamp(min=1).to(per_token.dtype)


def row_weighted(loss_type: str) -> bool:
    """Whether a batch's loss under `loss_type` is a mean over its rows (grpo, dr_grpo), not over its tokens: what
    a micro-batch's share of a step is weighted by, so that micro-batches add up to the whole batch's loss exactly."""
    return loss_type in ("grpo", "dr_grpo")


def micro_batches(row_tokens: Sequence[int], budget_tokens: int) -> list[range]:
    """Consecutive ranges of rows whose tokens (prompt and completion: rows are packed, not padded, see
    shared/logprobs.py) add up to at most `budget_tokens`.

    A row over the budget alone gets a micro-batch of its own (a row cannot be split). Order is
    kept, so per-row tensors (advantages, behaviour log-probs) slice the same way.
    """
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    out: list[range] = []
    start, total = 0, 0
    for i, tokens in enumerate(row_tokens):
        if i > start and total + tokens > budget_tokens:
            out.append(range(start, i))
            start, total = i, 0
        total += tokens
    if start < len(row_tokens):
        out.append(range(start, len(row_tokens)))
    return out


def staleness_histogram(step: int, versions: Iterable[int]) -> dict[int, int]:
    """Count of trajectories per age (step - version), ages ascending."""
    ages: Counter[int] = Counter()
    for version in versions:
        if version > step:
            raise ValueError(f"version {version} is newer than learner step {step}")
        ages[step - version] += 1
    return dict(sorted(ages.items()))
