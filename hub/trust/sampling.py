"""Sampling plausibility: a sequential test, per node, of whether its tokens were sampled from the policy it claims.

Audits (hub/trust/audit.py) check that a node's log-probs are the claimed version's on its tokens; they cannot tell
sampled tokens from chosen ones. A node that sells the right answer beside seven strings of random letters, each with
its true log-probs, passes them, and so does one that submits greedy picks, or edits honest samples. This test asks
the other question, on the hub's own recomputation of the sampling distribution q_t (temperature, top-k, min-p,
top-p) at every token the hub re-scores.

The evidence: for an order a, the token x_t's e-value is E_a(x_t) = q_t(x_t)^(a-1) / sum_y q_t(y)^a. If x_t was drawn
from q_t, its expectation is exactly 1 (sum_x q(x) q(x)^(a-1) = sum_y q(y)^a), whatever q_t is, so the product over a
node's tokens is a nonnegative martingale: by Ville's inequality it ever reaches c with probability at most 1/c.
- a = 2 grows on picks likelier than sampling gives (greedy or high-reward choices): E = q(x) / sum q^2 > 1 at the
  mode of any distribution that is not flat.
- a = 1/2 grows on picks less likely than sampling gives (invented or edited text): E = q(x)^-1/2 / sum q^1/2.
Tokens the hub puts outside the nucleus (q = 0) are left out: a bf16 engine samples some at its boundary honestly
(~1 in 900), and the audit bounds their share (`audit_max_outside_frac`). So are a tool-using completion's environment
tokens, which nobody sampled (the audit's mask holds model tokens only).

The node's engine samples from its own q'_t, a few hundredths of a nat away from the hub's at bf16. Then
E_q'[E_a] <= e^d, with d the largest log-prob gap; so each token's evidence is charged `slack_nats` (the audit's
mean-gap tolerance by default), which keeps an honest node's product a supermartingale that drifts down.

Sequential, per node (CUSUM): after each re-scored group the statistic is S = max(0, S) + sum of the group's
log E_a - slack over its tokens, one per order. S >= log c means some run of its groups, from some start, multiplied
to c. Each start is one supermartingale: over at most SAMPLING_GROUPS_MAX starts and the orders, a node is condemned
with probability at most `false_alarm` per hub run if honest, when c = orders x SAMPLING_GROUPS_MAX / false_alarm
(condemn_threshold_nats). Unlike a plain product, an honest history earns no credit to spend later: S never goes
below 0.

What stays possible: choosing among honest samples (submit the best of k draws per prompt) moves few tokens far from
what sampling gives; how much reward it buys before the test fires is measured by bench/sampling.py and stated in
docs/trust-model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The orders a of the per-token e-values (module doc): picks likelier than sampling gives, and less likely.
SAMPLING_ORDERS = (2.0, 0.5)
# Starts of a CUSUM run a node's statistic is the best of: a bound on the groups one node has re-scored in a hub run
# (a billion: years of a node at 30 groups a second).
SAMPLING_GROUPS_MAX = 10**9
# Nodes with evidence held at once: a node at S = 0 holds nothing, so this bounds what scattered bad luck keeps.
SAMPLING_NODES_MAX = 100_000


def condemn_threshold_nats(
    false_alarm: float, orders: int = len(SAMPLING_ORDERS), groups_max: int = SAMPLING_GROUPS_MAX
) -> float:
    """log c (module doc): the statistic at which an honest node has had at most `false_alarm` chance per run."""
    if not 0.0 < false_alarm < 1.0:
        raise ValueError(f"false_alarm must be in (0, 1), got {false_alarm}")
    return math.log(orders * groups_max / false_alarm)


def token_log_evalues(
    logprobs: torch.Tensor, power_sums: torch.Tensor, orders: tuple[float, ...] = SAMPLING_ORDERS
) -> torch.Tensor:
    """log E_a per token and order [..., len(orders)]: (a - 1) log q(x) - log sum_y q(y)^a, from the tokens' log-probs
    [...] and the log power sums [..., len(orders)] of their sampling distributions."""
    a = torch.tensor(orders, dtype=power_sums.dtype, device=power_sums.device)
    return (a - 1.0) * logprobs.unsqueeze(-1) - power_sums


@dataclass(frozen=True)
class GroupEvidence:
    """One re-scored group's evidence: per order, the sum over its scored tokens of log E_a - slack; and how many
    tokens were scored (inside the nucleus)."""

    log_e: tuple[float, ...]
    tokens: int


def group_evidence(logprobs: torch.Tensor, power_sums: torch.Tensor, mask: torch.Tensor, slack_nats: float) -> GroupEvidence:
    """The evidence of a group's tokens: `logprobs` and `mask` [B, T] and `power_sums` [B, T, orders] as
    shared.logprobs.completion_logprobs_and_power_sums gives them; tokens outside the nucleus (-inf) left out."""
    scored = (mask > 0) & torch.isfinite(logprobs)
    per_token = token_log_evalues(logprobs.masked_fill(~scored, 0.0), power_sums)[scored]
    tokens = int(scored.sum())
    return GroupEvidence(tuple(float(x) - slack_nats * tokens for x in per_token.double().sum(dim=0)), tokens)


def cusum(statistics: tuple[float, ...], evidence: GroupEvidence) -> tuple[float, ...]:
    """The statistics after one more group: S = max(0, S) + its evidence, per order."""
    return tuple(max(0.0, s) + e for s, e in zip(statistics, evidence.log_e, strict=True))


@dataclass(frozen=True)
class Condemned:
    """A node whose sampling the test rejected: by which order, its statistic and the threshold, over how many groups
    and tokens re-scored since its statistic last stood at 0."""

    order: float
    statistic_nats: float
    threshold_nats: float
    groups: int
    tokens: int

    def describe(self) -> str:
        kind = "likelier" if self.order > 1 else "less likely"
        return (
            f"sampling test: its tokens were {kind} than sampling the claimed policy gives "
            f"(evidence {self.statistic_nats:.1f} nats over {self.groups} groups, {self.tokens} tokens; an honest "
            f"node reaches {self.threshold_nats:.1f} with odds below e^-{self.threshold_nats:.0f}): a node must submit "
            "every completion as its engine drew it, at the hub's temperature and top-p, unchosen and unedited"
        )


@dataclass
class _Run:
    statistics: tuple[float, ...]
    groups: int
    tokens: int


class SamplingTest:
    """Each node's CUSUM statistics; `add` one re-scored group's evidence and learn whether the node is condemned.

    Bounded: a node at 0 on every order is not held, and past `max_nodes` the node with the least evidence is
    dropped (its statistics reset to 0: a delay for it, never a false alarm)."""

    def __init__(self, false_alarm: float, max_nodes: int = SAMPLING_NODES_MAX) -> None:
        self.threshold_nats = condemn_threshold_nats(false_alarm)
        self.max_nodes = max_nodes
        self._runs: dict[str, _Run] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def statistic(self, node_id: str) -> float:
        """The node's largest statistic, nats (0: no evidence against it)."""
        run = self._runs.get(node_id)
        return 0.0 if run is None else max(0.0, *run.statistics)

    def add(self, node_id: str, evidence: GroupEvidence) -> Condemned | None:
        """Fold one group's evidence into the node's statistics; Condemned once one reaches the threshold."""
        run = self._runs.pop(node_id, None) or _Run((0.0,) * len(evidence.log_e), 0, 0)
        statistics = cusum(run.statistics, evidence)
        if max(statistics) <= 0.0:
            return None
        # The run counts the groups since a statistic last stood at 0: what the evidence was gathered over.
        run = _Run(statistics, run.groups + 1, run.tokens + evidence.tokens)
        best = max(range(len(statistics)), key=statistics.__getitem__)
        if statistics[best] >= self.threshold_nats:
            return Condemned(SAMPLING_ORDERS[best], statistics[best], self.threshold_nats, run.groups, run.tokens)
        self._runs[node_id] = run
        if len(self._runs) > self.max_nodes:
            del self._runs[min(self._runs, key=self.statistic)]
        return None

    def forget(self, node_id: str) -> None:
        self._runs.pop(node_id, None)
