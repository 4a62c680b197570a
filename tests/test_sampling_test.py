"""The sampling test (hub/trust/sampling.py): its e-values against hand-computed ones, their expectation under
honest sampling, and the sequential statistic's bound, reset and memory."""

from __future__ import annotations

import math

import pytest
import torch

from hub.trust.sampling import (
    SAMPLING_ORDERS,
    GroupEvidence,
    SamplingTest,
    condemn_threshold_nats,
    cusum,
    group_evidence,
    token_log_evalues,
)
from shared.logprobs import sampling_logprobs


def power_sums(log_q: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.logsumexp(a * log_q, dim=-1) for a in SAMPLING_ORDERS], dim=-1)


def test_evalues_by_hand():
    q = torch.tensor([0.5, 0.25, 0.25])
    log_q = q.log()
    # a = 2: q(x) / sum q^2 = 0.5 / 0.375 at the mode; a = 1/2: q(x)^-1/2 / sum q^1/2.
    sum_sqrt = math.sqrt(0.5) + 2 * 0.5
    got = token_log_evalues(log_q[0], power_sums(log_q))
    assert got.tolist() == pytest.approx([math.log(0.5 / 0.375), math.log(0.5**-0.5 / sum_sqrt)], rel=1e-5)
    got = token_log_evalues(log_q[1], power_sums(log_q))
    assert got.tolist() == pytest.approx([math.log(0.25 / 0.375), math.log(0.25**-0.5 / sum_sqrt)], rel=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.95), (1.3, 0.8)])
def test_each_order_has_expectation_one_under_the_sampling_distribution(temperature, top_p):
    """The martingale property the false-alarm bound rests on, on the same filtered distribution audits use."""
    torch.manual_seed(0)
    logits = torch.randn(64, 200) * 3
    log_q = sampling_logprobs(logits, temperature, top_p)
    sums = power_sums(log_q)
    inside = torch.isfinite(log_q)
    e = token_log_evalues(log_q.masked_fill(~inside, 0.0), sums[:, None, :].expand(-1, 200, -1)).exp()
    expectation = (log_q.exp()[..., None] * e * inside[..., None]).sum(dim=1)
    assert torch.allclose(expectation, torch.ones_like(expectation), atol=1e-4)


def test_group_evidence_leaves_out_padding_and_tokens_outside_the_nucleus_and_charges_the_slack():
    log_q = torch.tensor([[0.5, 0.5, 0.0]]).log().expand(2, 3, 3)  # [B=2, T=3, vocab]
    sums = power_sums(log_q)
    logprobs = torch.tensor([[math.log(0.5), float("-inf"), 0.0], [math.log(0.5), math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    evidence = group_evidence(logprobs, sums, mask, slack_nats=0.1)
    # A flat two-way choice: every e-value is exactly 1; three tokens scored, each charged 0.1.
    assert evidence.tokens == 3
    assert evidence.log_e == pytest.approx((-0.3, -0.3), abs=1e-6)


def test_threshold_and_cusum_by_hand():
    assert condemn_threshold_nats(1e-6) == pytest.approx(math.log(2 * 10**9 / 1e-6))
    assert cusum((-5.0, 3.0), GroupEvidence((1.0, -1.0), 4)) == (1.0, 2.0)
    with pytest.raises(ValueError):
        condemn_threshold_nats(0.0)


def test_a_node_is_condemned_at_the_threshold_and_honest_history_buys_no_credit():
    test = SamplingTest(false_alarm=1e-6)
    bar = test.threshold_nats
    for _ in range(1000):  # a long honest past: strongly negative evidence, which must not offset what follows
        assert test.add("n", GroupEvidence((-5.0, -5.0), 100)) is None
    assert len(test) == 0  # at 0 it holds nothing
    assert test.add("n", GroupEvidence((bar / 2, -1.0), 10)) is None
    assert test.statistic("n") == pytest.approx(bar / 2)
    condemned = test.add("n", GroupEvidence((bar / 2 + 0.1, -1.0), 10))
    assert condemned is not None and condemned.order == SAMPLING_ORDERS[0]
    assert (condemned.groups, condemned.tokens) == (2, 20)
    assert "likelier" in condemned.describe() and f"{bar:.1f}" in condemned.describe()


def test_the_table_is_bounded_and_drops_the_least_evidence():
    test = SamplingTest(false_alarm=1e-6, max_nodes=3)
    for i, nats in enumerate([5.0, 1.0, 3.0, 4.0]):
        test.add(f"n{i}", GroupEvidence((nats, 0.0), 1))
    assert len(test) == 3 and test.statistic("n1") == 0.0 and test.statistic("n3") == 4.0
    test.forget("n3")
    assert test.statistic("n3") == 0.0


def test_the_heads_power_sums_are_those_of_the_full_sampling_distribution(default_model_dir):
    """completion_logprobs_and_power_sums (the audit's pass, a chunk of the head at a time) against the full logits."""
    from transformers import AutoModelForCausalLM

    from shared.logprobs import completion_logprobs_and_power_sums

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt, completions = [5, 6, 7], [[8, 9, 10], [11, 12]]
    with torch.inference_mode():
        logprobs, mask, sums = completion_logprobs_and_power_sums(
            model, [prompt] * 2, completions, SAMPLING_ORDERS, temperature=0.7, top_p=0.9
        )
        for row, completion in enumerate(completions):
            logits = model(torch.tensor([prompt + completion[:-1]])).logits[0, len(prompt) - 1 :]
            log_q = sampling_logprobs(logits, 0.7, 0.9)
            assert torch.allclose(sums[row, : len(completion)], power_sums(log_q), atol=1e-4)
            expected = log_q.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            assert torch.allclose(logprobs[row, : len(completion)], expected, atol=1e-4)
    assert mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
