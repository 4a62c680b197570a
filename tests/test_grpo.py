"""GRPO advantages and loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hub.method.grpo import group_advantages, grpo_loss, staleness_histogram

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


# --- advantages -------------------------------------------------------------------------


def test_group_scale_uses_sample_std():
    # group 1: mean 0.25, centered [.75, -.25, -.25, -.25], sample var = 0.75 / 3 = 0.25, std 0.5
    adv = group_advantages(t([1, 0, 0, 0, 2, 2, 2, 2]), group_size=4, scale="group", eps=0.0)
    torch.testing.assert_close(adv, t([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))


def test_group_scale_eps_added_to_std():
    adv = group_advantages(t([1, 0, 0, 0]), group_size=4, scale="group", eps=1e-4)
    torch.testing.assert_close(adv, t([0.75, -0.25, -0.25, -0.25]) / 0.5001)


def test_two_member_group_is_not_population_std():
    # sample std of [0, 1] is sqrt(0.5); a population std (0.5) would give +-1
    adv = group_advantages(t([0, 1]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, t([-math.sqrt(0.5), math.sqrt(0.5)]))


def test_batch_scale_divides_by_std_of_all_rewards():
    # centered per group: [.5, -.5, 1, -1]; all rewards [1, 0, 3, 1]: mean 1.25,
    # squared deviations .0625 + 1.5625 + 3.0625 + .0625 = 4.75, sample var 4.75 / 3
    adv = group_advantages(t([1, 0, 3, 1]), group_size=2, scale="batch", eps=0.0)
    torch.testing.assert_close(adv, t([0.5, -0.5, 1.0, -1.0]) / math.sqrt(4.75 / 3))


def test_none_scale_only_centers():
    adv = group_advantages(t([1, 0, 3, 1, 5, 5]), group_size=2, scale="none")
    torch.testing.assert_close(adv, t([0.5, -0.5, 1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exact_zeros(scale):
    # in float32 the mean of sixteen 0.1s is off by ~7e-9; dividing by (0 + eps) would make
    # that residue a spurious advantage of ~7e-5
    rewards = torch.cat([torch.full((16,), 0.1), torch.linspace(0.0, 1.0, 16)])
    adv = group_advantages(rewards, group_size=16, scale=scale)
    assert torch.equal(adv[:16], torch.zeros(16))
    assert torch.all(adv[16:] != 0)


def test_group_of_one_is_zero():
    assert torch.equal(group_advantages(t([1.0, 3.0]), group_size=1), t([0.0, 0.0]))


def test_integer_rewards_accepted():
    adv = group_advantages(torch.tensor([0, 1]), group_size=2, eps=0.0, scale="none")
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]))


def test_advantage_errors():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(t([1, 2, 3]), group_size=4)
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(t([1, 2]), group_size=2, scale="global")
    with pytest.raises(ValueError, match="flat"):
        group_advantages(t([[1, 2]]), group_size=2)


# --- loss -------------------------------------------------------------------------------


def one_token(ratio: float, advantage: float, **kwargs):
    lp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(lp, t([[0.0]]), t([advantage]), torch.ones(1, 1, dtype=torch.bool), **kwargs)
    loss.backward()
    return loss.item(), stats, lp.grad.item()


def test_positive_advantage_clipped_above_1_plus_eps_high():
    loss, stats, grad = one_token(1.5, 2.0)
    assert loss == pytest.approx(-1.28 * 2.0)
    assert stats["clip_frac"] == 1.0
    assert grad == 0.0


def test_positive_advantage_not_clipped_below_1_minus_eps_low():
    # min(0.5 * 2, 0.8 * 2) = 1.0: the unclipped branch, so the gradient flows: d(-r A)/dlp = -r A
    loss, stats, grad = one_token(0.5, 2.0)
    assert loss == pytest.approx(-1.0)
    assert stats["clip_frac"] == 0.0
    assert grad == pytest.approx(-1.0)


def test_negative_advantage_clipped_below_1_minus_eps_low():
    loss, stats, grad = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert stats["clip_frac"] == 1.0
    assert grad == 0.0


def test_negative_advantage_not_clipped_above_1_plus_eps_high():
    loss, stats, grad = one_token(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert stats["clip_frac"] == 0.0
    assert grad == pytest.approx(1.5)


def test_exactly_at_the_boundaries_is_not_clipped():
    # pick eps so that 1 + eps_high and 1 - eps_low are exactly the ratios exp() produces
    upper = torch.exp(t(0.25)).item()
    lower = torch.exp(t(-0.25)).item()
    kwargs = {"eps_high": upper - 1.0, "eps_low": 1.0 - lower}
    for log_ratio, advantage in ((0.25, 1.0), (-0.25, -1.0)):
        lp = torch.tensor([[log_ratio]], dtype=F64, requires_grad=True)
        loss, stats = grpo_loss(lp, t([[0.0]]), t([advantage]), torch.ones(1, 1), **kwargs)
        loss.backward()
        ratio = math.exp(log_ratio)
        assert loss.item() == pytest.approx(-ratio * advantage)
        assert stats["clip_frac"] == 0.0
        assert lp.grad.item() == pytest.approx(-ratio * advantage)


def test_padding_tokens_do_not_count():
    # row 0: 2 real tokens at r = 1 (A = 1) -> -1 each; row 1: 1 real token at r = 1.2 (A = -1) -> 1.2
    # padding holds -inf / garbage log-probs; mean over 3 real tokens = (-2 + 1.2) / 3
    lp = torch.tensor([[0.0, 0.0, -math.inf], [math.log(1.2), 7.0, -math.inf]], dtype=F64, requires_grad=True)
    behaviour = t([[0.0, 0.0, 0.0], [0.0, -math.inf, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, stats = grpo_loss(lp, behaviour, t([1.0, -1.0]), mask)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 + 1.2) / 3)
    assert stats["ratio_mean"] == pytest.approx(3.2 / 3)
    assert stats["ratio_max"] == pytest.approx(1.2)
    # the drift: |log r| is 0, 0 and log 1.2 on the real tokens, nothing from padding
    assert stats["abs_log_ratio"] == pytest.approx(math.log(1.2) / 3)
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 2] == 0 and lp.grad[1, 1] == 0 and lp.grad[1, 2] == 0
    torch.testing.assert_close(lp.grad[0, :2], t([-1 / 3, -1 / 3]))


def test_max_is_ratio_drops_tokens_from_loss_and_count():
    lp = torch.tensor([[0.0, math.log(3.0), math.log(1.1)]], dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(lp, t([[0.0, 0.0, 0.0]]), t([1.0]), torch.ones(1, 3), max_is_ratio=2.0)
    loss.backward()
    # tokens r = 1 and r = 1.1 remain: (-1 - 1.1) / 2
    assert loss.item() == pytest.approx(-1.05)
    assert stats["masked_by_is"] == 1.0
    assert stats["ratio_max"] == pytest.approx(3.0)
    assert lp.grad[0, 1] == 0.0


def test_k3_kl_term():
    # r = 1, A = 0 so the policy term is 0; ref - lp = [log 2, 0]:
    # k3 = [2 - log 2 - 1, 0] -> mean (1 - log 2) / 2
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = t([[math.log(2.0), 0.0]])
    loss, stats = grpo_loss(lp, t([[0.0, 0.0]]), t([0.0]), torch.ones(1, 2), ref_logprobs=ref, beta=0.5)
    loss.backward()
    kl = (1 - math.log(2.0)) / 2
    assert stats["kl"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 * kl)
    # d k3 / d lp = 1 - exp(ref - lp): -1 at the first token, 0 at the second; times beta / 2 tokens
    torch.testing.assert_close(lp.grad, t([[-0.25, 0.0]]))


def test_kl_reported_but_not_added_with_beta_zero():
    lp = torch.zeros(1, 1, dtype=F64)
    loss, stats = grpo_loss(lp, lp, t([0.0]), torch.ones(1, 1), ref_logprobs=t([[math.log(2.0)]]))
    assert loss.item() == 0.0
    assert stats["kl"] == pytest.approx(1 - math.log(2.0))


def test_gradient_flows_to_logprobs_only():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    behaviour = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    adv = t([1.0]).requires_grad_(True)
    ref = torch.ones(1, 2, dtype=F64, requires_grad=True)
    loss, _ = grpo_loss(lp, behaviour, adv, torch.ones(1, 2), ref_logprobs=ref, beta=0.1)
    loss.backward()
    assert lp.grad is not None
    assert behaviour.grad is None and adv.grad is None and ref.grad is None


def test_all_masked_batch_gives_zero_loss():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(lp, t([[0.0, 0.0]]), t([1.0]), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and stats["clip_frac"] == 0.0 and stats["ratio_max"] == 0.0


def test_loss_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask shape"):
        grpo_loss(lp, lp, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), beta=0.1)


def test_staleness_histogram():
    assert staleness_histogram(10, [10, 9, 9, 6]) == {0: 1, 1: 2, 4: 1}
    assert list(staleness_histogram(5, [2, 5, 4])) == [0, 1, 3]
    with pytest.raises(ValueError, match="newer"):
        staleness_histogram(3, [4])


def test_micro_batches_pack_rows_by_real_tokens():
    from hub.method.grpo import micro_batches

    # 5 rows of 5 tokens, budget 10: two rows (10) fit, three (15) do not.
    assert micro_batches([5] * 5, 10) == [range(0, 2), range(2, 4), range(4, 5)]
    # No padding counts: 5 + 4 fit in 10 beside a long row, which goes alone.
    assert micro_batches([5, 21, 4, 5], 10) == [range(0, 1), range(1, 2), range(2, 4)]
    assert micro_batches([8, 8], 16) == [range(0, 2)]
    assert micro_batches([8, 8], 15) == [range(0, 1), range(1, 2)]
    assert micro_batches([], 5) == []
    with pytest.raises(ValueError):
        micro_batches([2], 0)


def test_loss_types_add_tokens_up_as_trl_does():
    """Two rows of 1 and 3 taking-part tokens, per-token losses -r*A = -A (r = 1): A = 1 and 2 give token losses
    -1 and -2, -2, -2. dapo and bnpo: (-1 - 6) / 4; grpo: (-1/1 + -6/3) / 2; dr_grpo: -7 / (2 rows x 5)."""
    lp = torch.zeros(2, 3)
    mask = t([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = t([1.0, 2.0])
    expected = {"dapo": -7 / 4, "bnpo": -7 / 4, "grpo": -1.5, "dr_grpo": -7 / 10}
    for loss_type, value in expected.items():
        loss, _ = grpo_loss(lp, lp.clone(), advantages, mask, loss_type=loss_type, max_completion_length=5)
        assert float(loss) == pytest.approx(value), loss_type
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        grpo_loss(lp, lp.clone(), advantages, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="unknown loss type 'cispo'"):
        grpo_loss(lp, lp.clone(), advantages, mask, loss_type="cispo")


def test_the_kl_term_is_added_per_token_before_the_rows_are_averaged():
    """grpo with beta: each row's mean of (policy + beta * k3) tokens, as TRL adds the KL per token."""
    lp = torch.zeros(2, 2)
    ref = t([[math.log(2.0), 0.0], [0.0, 0.0]])  # k3 = 2 - log 2 - 1 at one token of row 0
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = grpo_loss(lp, lp.clone(), t([0.0, 0.0]), mask, ref_logprobs=ref, beta=0.5, loss_type="grpo")
    k3 = 1.0 - math.log(2.0)
    assert float(loss) == pytest.approx(0.5 * (0.5 * k3 / 2 + 0.0)) and stats["kl"] == pytest.approx(k3 / 3)
