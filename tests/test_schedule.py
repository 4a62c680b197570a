"""Learning-rate schedules (hub/method/schedule.py): hand-computed values, and the same learning rates as
transformers' schedulers (what TRL's GRPOTrainer builds) give a dummy optimizer over the same steps."""

from __future__ import annotations

import math

import pytest
import torch

from hub.config import HubConfig, LearnerConfig
from hub.method.schedule import lr_multiplier, step_lr, warmup_steps


def test_hand_computed_multipliers() -> None:
    # 10 updates, 20% warm-up: 2 warm-up updates (0, 0.5), then the decay over the 8 left.
    assert warmup_steps(10, 0.2) == 2 and warmup_steps(10, 0.21) == 3 and warmup_steps(10, 0.0) == 0
    assert [lr_multiplier("cosine", u, 10, 0.2) for u in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert lr_multiplier("cosine", 6, 10, 0.2) == pytest.approx(0.5)  # half way through the cosine
    assert lr_multiplier("linear", 6, 10, 0.2) == pytest.approx(0.5)  # (10 - 6) / 8
    assert lr_multiplier("linear", 9, 10, 0.2) == pytest.approx(0.125)
    assert lr_multiplier("constant", 1, 10, 0.2) == 0.5 and lr_multiplier("constant", 9, 10, 0.2) == 1.0
    assert lr_multiplier("cosine", 4, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.4)))
    # Step t is update t - 1; a run until interrupted keeps the base rate.
    assert step_lr(1e-3, "cosine", 3, 10, 0.2) == pytest.approx(1e-3)
    assert step_lr(1e-3, "constant", 12345, 0, 0.0) == 1e-3


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("total, ratio", [(20, 0.1), (7, 0.3), (5, 0.0), (1, 0.5)])
def test_the_same_learning_rates_as_transformers_schedulers(kind: str, total: int, ratio: float) -> None:
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    base = 3e-4
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    warmup = math.ceil(total * ratio)  # transformers' TrainingArguments.get_warmup_steps for a ratio
    scheduler = {
        "constant": lambda: get_constant_schedule_with_warmup(optimizer, warmup),
        "linear": lambda: get_linear_schedule_with_warmup(optimizer, warmup, total),
        "cosine": lambda: get_cosine_schedule_with_warmup(optimizer, warmup, total),
    }[kind]()
    for step in range(1, total + 1):  # the Trainer's k-th optimizer step runs at the rate set before it
        assert step_lr(base, kind, step, total, ratio) == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-15), step
        optimizer.step()
        scheduler.step()


def test_a_decay_or_warm_up_needs_an_end() -> None:
    from shared.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs --steps N"):
        load_config(HubConfig, None, {"steps": 0, "learner.lr_scheduler": "cosine"})
    with pytest.raises(ConfigError, match="needs --steps N"):
        load_config(HubConfig, None, {"steps": 0, "learner.warmup_ratio": 0.1})
    assert load_config(HubConfig, None, {"steps": 0}).learner == LearnerConfig()


def test_transformers_name_constant_with_warmup_is_our_constant() -> None:
    from shared.config import load_config

    learner = load_config(
        HubConfig, None, {"steps": 10, "learner.lr_scheduler": "constant_with_warmup", "learner.warmup_ratio": 0.2}
    ).learner
    assert learner.lr_scheduler == "constant"
    assert [step_lr(1.0, learner.lr_scheduler, k, 10, 0.2) for k in (1, 2, 3)] == [0.0, 0.5, 1.0]  # 2 warm-up updates
