"""The run's totals: all-time figures of the run (every session of this data dir) as the status shows them. Each
owner adds what its own commands commit (Membership: heartbeats and refusals; Intake: submissions, groups, pay and
audits; HubState: stale drops), after the commit, on the trio thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from hub.trust.probation import AUDIT_RESULTS
from shared.messages import Tallies


@dataclass
class RunTotals:
    """All-time figures of the run (every session of this data dir), as the status shows them."""

    groups: Tallies  # groups received by verdict (local rollouts included) and protocol refusals of nodes
    dropped_stale: int
    paid_usd: dict[str, float]  # per node, booked and not voided
    learner_s_before: float  # learner time of earlier sessions
    session_started: float
    session_id: int = 0
    # Messages received in this session only (what /metrics counts; a Prometheus counter restarts with the process).
    submissions: int = 0
    heartbeats: int = 0
    # Refused groups of every node by reason (shared.messages.GroupReason), this session.
    reasons: dict[str, int] = field(default_factory=dict)
    # Audits of submissions by result (`audit_result`), this session.
    audits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(AUDIT_RESULTS, 0))

    def learner_s(self, now: float) -> float:
        return self.learner_s_before + max(0.0, now - self.session_started)
