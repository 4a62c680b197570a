"""Learning-rate schedules: the multiplier of the base learning rate at each learner step, as TRL's are.

TRL (transformers' Trainer) builds `get_{constant,linear,cosine}_schedule_with_warmup`: a linear warm-up from 0
over ceil(warmup_ratio x total) updates, then constant, a linear decay to 0 at the last update, or a half cosine
to 0. The k-th update (k = 0, 1, ...) runs with the multiplier at k; echo2's step t is update t - 1. The
multiplier is a pure function of the step, so a resumed run continues the schedule from its step number.
"""

from __future__ import annotations

import math


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Updates of the linear warm-up: ceil(warmup_ratio x total_steps), as transformers counts them."""
    return math.ceil(total_steps * warmup_ratio)


def lr_multiplier(kind: str, update: int, total_steps: int, warmup_ratio: float) -> float:
    """The factor on the base learning rate at update `update` (0-based) of `total_steps`, after a warm-up of
    warmup_ratio x total_steps updates; `kind` is constant, linear or cosine."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    if update < warmup:
        return update / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (total_steps - update) / max(1, total_steps - warmup))
    if kind == "cosine":
        progress = (update - warmup) / max(1, total_steps - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown learning-rate schedule {kind!r}")


def step_lr(base_lr: float, kind: str, step: int, total_steps: int, warmup_ratio: float) -> float:
    """The learning rate learner step `step` (1-based) trains with; total_steps 0 (until interrupted) keeps
    base_lr, which the config allows only for a constant schedule without warm-up."""
    if total_steps == 0:
        return base_lr
    return base_lr * lr_multiplier(kind, step - 1, total_steps, warmup_ratio)
