"""The off-policy corrections (hub/method/corrections.py) and the loss they shape, against hand-computed values.

One small batch throughout: two rows whose tokens' ratios p_learner / p_node are [2, 1, 0.25] and [4, 0.5] (the second
row's third position is padding), advantages [1, -0.5]. Products of the rows' ratios: 0.5 and 2; geometric means:
0.5^(1/3) and sqrt(2). With a correction the PPO ratio is the learner's own (1 in value, the clip never acts), so a
token's loss is -A * w: the weight decides it all.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
import torch

from hub.config import LearnerConfig
from hub.method.corrections import (
    CORRECTION_SUMS,
    Correction,
    correction_metrics,
    effective_sample_size,
    level_log_weights,
    off_policy_rows,
    token_weights,
    vetoed_rows,
)
from hub.method.grpo import grpo_loss
from hub.training.metrics import read_metrics
from shared.config import ConfigError, validated
from shared.layout import FINAL_DIR, METRICS_FILE, RUN_CONFIG_FILE

F64 = torch.float64
RATIOS = [[2.0, 1.0, 0.25], [4.0, 0.5, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
ADVANTAGES = torch.tensor([1.0, -0.5], dtype=F64)
GEO0, GEO1 = 0.5 ** (1 / 3), math.sqrt(2.0)
SHARES = ("is_tokens_masked", "is_tokens_truncated", "is_seqs_masked", "is_seqs_truncated", "is_seqs_vetoed")


def batch(advantages: torch.Tensor = ADVANTAGES):
    """(logprobs with a gradient, the nodes' log-probs, advantages, mask) of the batch: behaviour -1 per token."""
    behaviour = torch.full((2, 3), -1.0, dtype=F64)
    logprobs = (behaviour + torch.log(torch.tensor(RATIOS, dtype=F64))).requires_grad_(True)
    return logprobs, behaviour, advantages, MASK


def loss_and_stats(correction: Correction, advantages: torch.Tensor = ADVANTAGES, **kwargs):
    logprobs, behaviour, adv, mask = batch(advantages)
    loss, stats = grpo_loss(logprobs, behaviour, adv, mask, correction=correction, **kwargs)
    return logprobs, loss, stats


def metrics(stats: dict[str, float]) -> dict[str, float]:
    return correction_metrics({name: stats[name] for name in CORRECTION_SUMS}, stats["is_weight_max"], 5)


# --- one test per mode: the loss and the shares the step logs ----------------------------------------------------


def test_token_truncate_caps_each_tokens_weight_from_above():
    # weights [2, 1, 0.25] and [3 (4 capped), 0.5]: -(1 * 3.25 - 0.5 * 3.5) / 5
    _, loss, stats = loss_and_stats(Correction(mode="truncate", level="token", upper=3.0))
    assert float(loss.detach()) == pytest.approx(-0.3)
    m = metrics(stats)
    assert (m["is_tokens_truncated"], m["is_seqs_truncated"], m["is_tokens_masked"]) == (0.2, 0.5, 0.0)
    assert m["is_weight_mean"] == pytest.approx(7.75 / 5) and m["is_weight_max"] == 4.0
    # ESS of the weights trained with: 6.75^2 / (5 x 14.3125)
    assert m["is_ess"] == pytest.approx(6.75**2 / (5 * 14.3125))


def test_token_truncate_with_a_lower_cap_raises_small_weights():
    # weights [2, 1, 0.45 (0.25 raised)] and [3, 0.5]: -(3.45 - 0.5 * 3.5) / 5
    _, loss, stats = loss_and_stats(Correction(mode="truncate", level="token", upper=3.0, lower=0.45))
    assert float(loss.detach()) == pytest.approx(-0.34)
    m = metrics(stats)
    assert (m["is_tokens_truncated"], m["is_seqs_truncated"]) == (0.4, 1.0)


def test_token_mask_drops_tokens_outside_the_caps_from_loss_and_count():
    # kept: 2 and 1 of the first row, 0.5 of the second (0.25 < 0.45 and 4 > 3 dropped): -(3 - 0.5 * 0.5) / 3
    _, loss, stats = loss_and_stats(Correction(mode="mask", level="token", upper=3.0, lower=0.45))
    assert float(loss.detach()) == pytest.approx(-2.75 / 3)
    assert stats["masked_by_is"] == 2.0
    m = metrics(stats)
    assert (m["is_tokens_masked"], m["is_seqs_masked"], m["is_tokens_truncated"]) == (0.4, 1.0, 0.0)
    # trained-with weights [2, 1, 0, 0, 0.5]: 3.5^2 / (5 x 5.25)
    assert m["is_ess"] == pytest.approx(3.5**2 / (5 * 5.25))


def test_sequence_truncate_weighs_every_token_by_its_rows_capped_product():
    # row weights 0.5 and 2 -> 1.8: -(3 x 0.5 - 0.5 x 2 x 1.8) / 5
    _, loss, stats = loss_and_stats(Correction(mode="truncate", level="sequence", upper=1.8))
    assert float(loss.detach()) == pytest.approx(0.06)
    m = metrics(stats)
    assert (m["is_tokens_truncated"], m["is_seqs_truncated"]) == (0.4, 0.5)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_weight_mean"] == pytest.approx((3 * 0.5 + 2 * 2) / 5)


def test_sequence_mask_drops_whole_rows():
    # the second row's product 2 > 1.8: only the first row, weight 0.5, trains: -(3 x 0.5) / 3
    _, loss, stats = loss_and_stats(Correction(mode="mask", level="sequence", upper=1.8))
    assert float(loss.detach()) == pytest.approx(-0.5)
    m = metrics(stats)
    assert (m["is_tokens_masked"], m["is_seqs_masked"]) == (0.4, 0.5)


def test_geometric_truncate_uses_the_rows_geometric_means():
    # row weights 0.7937 and 1.4142 -> 1.2: -(3 x 0.7937 - 0.5 x 2 x 1.2) / 5
    _, loss, stats = loss_and_stats(Correction(mode="truncate", level="geometric", upper=1.2))
    assert float(loss.detach()) == pytest.approx(-(3 * GEO0 - 1.2) / 5)
    assert metrics(stats)["is_weight_max"] == pytest.approx(GEO1)


def test_geometric_mask_keeps_rows_within_both_caps():
    # 0.7937 is within [0.75, 1.2], 1.4142 is not: -(3 x 0.7937) / 3
    _, loss, stats = loss_and_stats(Correction(mode="mask", level="geometric", upper=1.2, lower=0.75))
    assert float(loss.detach()) == pytest.approx(-GEO0)
    _, _, tighter = loss_and_stats(Correction(mode="mask", level="geometric", upper=1.2, lower=0.8))
    assert metrics(tighter)["is_seqs_masked"] == 1.0 and tighter["masked_by_is"] == 5.0


def test_the_veto_drops_a_row_with_one_catastrophic_token_in_any_mode():
    # 0.25 < 0.3 vetoes the first row. Truncate: the second row's weights [3, 0.5]: 0.5 x 3.5 / 2
    _, loss, stats = loss_and_stats(Correction(mode="truncate", upper=3.0, veto=0.3))
    assert float(loss.detach()) == pytest.approx(0.875)
    m = metrics(stats)
    assert (m["is_seqs_vetoed"], m["is_tokens_masked"], m["is_seqs_masked"]) == (0.5, 0.6, 0.5)
    # Without a weight: the PPO-clipped ratio to the nodes' log-probs, A = -0.5: -min(4A, 1.28A) = 2 and
    # -min(0.5A, 0.8A) = 0.4, their mean 1.2
    _, loss, _ = loss_and_stats(Correction(veto=0.3))
    assert float(loss.detach()) == pytest.approx(1.2)


def test_off_policy_mask_drops_negative_advantage_rows_far_from_the_learner():
    # the first row's mean log(p_node / p_learner) = -(ln 2 + ln 0.25) / 3 = 0.231; its advantage -0.5 < 0
    advantages = torch.tensor([-0.5, 1.0], dtype=F64)
    _, loss, stats = loss_and_stats(Correction(off_policy_mask=0.2), advantages)
    # the second row alone, A = 1: -min(4, 1.28) and -min(0.5, 0.8), mean -0.89
    assert float(loss.detach()) == pytest.approx(-0.89)
    assert metrics(stats)["is_seqs_masked"] == 0.5
    _, _, kept = loss_and_stats(Correction(off_policy_mask=0.25), advantages)
    assert kept["masked_by_is"] == 0.0


def test_gspo_clips_each_rows_geometric_mean_ratio_and_spreads_its_gradient():
    # rows' ratios 0.7937 (clipped up to 0.8 is larger: the unclipped branch counts, A = 1) and 1.4142 (A = -0.5:
    # -min(-0.7071, -0.64) = 0.7071); dapo: (-3 x 0.7937 + 2 x 0.7071) / 5
    logprobs, loss, _ = loss_and_stats(Correction(), importance_sampling_level="sequence")
    assert float(loss.detach()) == pytest.approx((-3 * GEO0 + 2 * GEO1 / 2) / 5)
    loss.backward()
    # d/d lp_t of the row's 3 (or 2) equal terms, through the mean: -A r / 5 on each of its tokens
    expected = torch.tensor([[-GEO0 / 5] * 3, [0.5 * GEO1 / 5] * 2 + [0.0]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected)
    _, grpo, _ = loss_and_stats(Correction(), importance_sampling_level="sequence", loss_type="grpo")
    assert float(grpo.detach()) == pytest.approx((-GEO0 + GEO1 / 2) / 2)


def test_a_correction_weighs_the_gradient_and_leaves_the_ratio_unclipped():
    # the ratio to the learner's own log-probs is 1: d/d lp_t = -A w_t / 5 with w = [2, 1, 0.25], [3, 0.5]
    logprobs, loss, stats = loss_and_stats(Correction(mode="truncate", upper=3.0))
    loss.backward()
    expected = torch.tensor([[-2.0, -1.0, -0.25], [1.5, 0.25, 0.0]], dtype=F64) / 5
    torch.testing.assert_close(logprobs.grad, expected)
    assert stats["clip_frac"] == 0.0
    assert stats["ratio_max"] == pytest.approx(4.0)  # the ratio to the nodes' log-probs, still logged


def test_without_a_correction_the_ess_is_the_ratios_own():
    # weights are the ratios themselves: 7.75^2 / (5 x 21.3125)
    _, _, stats = loss_and_stats(Correction())
    m = metrics(stats)
    assert m["is_ess"] == pytest.approx(7.75**2 / (5 * 21.3125))
    assert (m["is_tokens_masked"], m["is_tokens_truncated"], m["is_seqs_vetoed"]) == (0.0, 0.0, 0.0)


# --- the pieces -----------------------------------------------------------------------------------------------


def test_level_log_weights_sum_or_average_each_rows_valid_tokens():
    log_ratio = torch.log(torch.tensor(RATIOS, dtype=F64)) * MASK
    valid = MASK.bool()
    torch.testing.assert_close(level_log_weights(log_ratio, valid, "token"), log_ratio)
    seq = level_log_weights(log_ratio, valid, "sequence")
    torch.testing.assert_close(seq.exp() * MASK, torch.tensor([[0.5] * 3, [2.0, 2.0, 0.0]], dtype=F64))
    geo = level_log_weights(log_ratio, valid, "geometric")
    torch.testing.assert_close(geo.exp() * MASK, torch.tensor([[GEO0] * 3, [GEO1, GEO1, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="unknown importance sampling level"):
        level_log_weights(log_ratio, valid, "batch")


def test_veto_and_off_policy_rows():
    log_ratio = torch.log(torch.tensor(RATIOS, dtype=F64)) * MASK
    valid = MASK.bool()
    assert vetoed_rows(log_ratio, valid, 0.3).tolist() == [True, False]
    assert vetoed_rows(log_ratio, valid, 0.25).tolist() == [False, False]  # strictly below
    # padding never vetoes: a ratio of 1e-9 where the mask is 0
    padded = log_ratio.clone()
    padded[1, 2] = math.log(1e-9)
    assert vetoed_rows(padded, valid, 0.3).tolist() == [True, False]
    negative = torch.tensor([-1.0, -1.0], dtype=F64)
    assert off_policy_rows(log_ratio, valid, negative, 0.2).tolist() == [True, False]  # KL 0.231 and -0.347
    assert off_policy_rows(log_ratio, valid, -negative, 0.2).tolist() == [False, False]


def test_sequence_weights_are_bounded_before_exp():
    # a row of 100 tokens at ratio e: its product e^100 would be inf in float32; the bound keeps it e^20
    log_ratio = torch.ones(1, 100)
    corrected = token_weights(
        log_ratio, torch.ones(1, 100, dtype=torch.bool), torch.ones(1), Correction(mode="truncate", level="sequence")
    )
    assert torch.isfinite(corrected.raw).all() and float(corrected.raw[0, 0]) == pytest.approx(math.exp(20), rel=1e-5)


def test_effective_sample_size_is_verls():
    assert effective_sample_size(4.0, 4.0, 4) == 1.0  # four weights of 1
    assert effective_sample_size(1.0, 1.0, 4) == 0.25  # one weight of 1, three of 0
    assert effective_sample_size(0.0, 0.0, 4) == 0.0 and effective_sample_size(1.0, 1.0, 0) == 0.0


# --- the config, under verl's and TRL's names ---------------------------------------------------------------------


def learner(**values) -> LearnerConfig:
    return validated(LearnerConfig, values)


def test_trls_mode_names_set_level_and_mode():
    cfg = learner(rollout_is_mode="sequence_mask", rollout_is_threshold=2.0)
    assert (cfg.rollout_is_mode, cfg.rollout_is_level, cfg.rollout_is_threshold) == ("mask", "sequence", 2.0)
    assert learner(rollout_is_mode="token_truncate", rollout_is_level="token").rollout_is_level == "token"
    with pytest.raises(
        ConfigError, match="rollout_is_mode sequence_mask .* is level sequence, but rollout_is_level is geometric"
    ):
        learner(rollout_is_mode="sequence_mask", rollout_is_level="geometric")


def test_a_correction_setting_that_would_do_nothing_is_refused():
    with pytest.raises(
        ConfigError,
        match="rollout_is_level geometric: it acts only with rollout_is_mode truncate or mask, and rollout_is_mode is off",
    ):
        learner(rollout_is_level="geometric")
    with pytest.raises(ConfigError, match="rollout_is_threshold 2.0: it acts only"):
        learner(rollout_is_threshold=2.0)
    with pytest.raises(ConfigError, match="use_is_ratio = false .* nothing to weigh"):
        learner(use_is_ratio=False, rollout_is_mode="truncate")
    with pytest.raises(ConfigError, match="use_is_ratio = false"):
        learner(use_is_ratio=False, off_policy_mask_threshold=0.5)
    with pytest.raises(ConfigError, match="rollout_is_threshold_lower"):
        learner(rollout_is_mode="mask", rollout_is_threshold_lower=1.5)  # a lower cap must be below 1
    assert learner(rollout_is_veto_threshold=1e-4).rollout_is_mode == "off"  # the veto acts without a weight too


# --- a real run ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_real_run_trains_under_trls_sequence_mask_and_logs_the_corrections(tmp_path: Path) -> None:
    """`echo-hub start` with TRL's flag spellings (its default correction, sequence_mask at cap 3) and verl's veto:
    the run ends its steps, the policy it saves was trained under them, and every step's row has the is_* metrics."""
    from testbed.harness import start_hub

    data = tmp_path / "data"
    hub = start_hub(
        data,
        *("--max-steps", "3", "--local-nodes", "1", "--num-generations", "4", "--prompts-per-step", "4"),
        *("--vllm-importance-sampling-mode", "sequence_mask", "--vllm-importance-sampling-clip-max", "3"),
        *("--rollout-is-veto-threshold", "1e-4", "--save-steps", "100"),
    )
    try:
        assert hub.process.wait(timeout=150) == 0, hub.output()[-3000:]
    finally:
        hub.kill()
    saved = tomllib.loads((data / FINAL_DIR / RUN_CONFIG_FILE).read_text())["learner"]
    assert (saved["rollout_is_mode"], saved["rollout_is_level"], saved["rollout_is_threshold"]) == ("mask", "sequence", 3.0)
    assert saved["rollout_is_veto_threshold"] == 1e-4
    rows = read_metrics(data / METRICS_FILE)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        shares = [row[key] for key in SHARES]
        assert all(0.0 <= share <= 1.0 for share in shares), row
        assert row["is_tokens_truncated"] == row["is_seqs_truncated"] == 0.0  # a mask mode truncates nothing
        assert 0.0 < row["is_ess"] <= 1.0 and 0.0 < row["is_weight_mean"] <= row["is_weight_max"]
        # it trained: tokens kept, a gradient, a finite loss
        assert row["tokens"] > 0 and row["is_tokens_masked"] < 1.0 and row["grad_norm"] > 0.0 and math.isfinite(row["loss"])
