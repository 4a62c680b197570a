"""Probation and audit sampling: which work is audited, the groups held for their audit, and the
audits' verdict on one submission.

A node is on probation until it passed `audit_first_n` audits: every group it submits is committed held,
all of them audited after the reply, and released to the buffer only by the transaction that records the
passed audit. At most `audit_queue_groups` groups are held at once; more new work waits. After probation,
`audit_rate` of a node's submissions get one group sampled for a later audit. A passed audit vouches for
the node's pay up to the audited submission; a failed one bans it and voids its pay booked since. Every audit's
re-scoring is also evidence for the node's sampling test (hub/trust/sampling.py): an audit that passes on its
log-probs fails when that evidence condemns the node, and vouches for pay only while there is none against it.

This decides and counts; it writes nothing. What follows a verdict (the release, the discard, the ban and
the voided pay) is the intake's (hub/service/intake.py), the owner of probation and audits.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hub.config import TrustConfig
from hub.records.fleet import NodeRecord
from hub.trust.audit import AuditJob, AuditQueue, AuditResult
from hub.trust.sampling import SamplingTest
from shared.rollout import Group


@dataclass(frozen=True)
class AuditVerdict:
    """The audits of one submission: all passed; or one failed (`failure`: why the node is banned); or one
    could not run (neither: the work is unverified). A pass `vouches` for the node's pay only while its sampling test
    holds no evidence against it: evidence still gathering may yet condemn what the pass covers."""

    passed: bool
    failure: str | None = None
    vouches: bool = False


AUDIT_RESULTS = ("passed", "failed", "unverified")


def audit_result(verdict: AuditVerdict) -> str:
    """What an audit came to, as /metrics counts it: one of AUDIT_RESULTS."""
    return "passed" if verdict.passed else "failed" if verdict.failure is not None else "unverified"


class Probation:
    """The audit queue, its draws, and the count of groups held for audit."""

    def __init__(self, trust: TrustConfig, audits: AuditQueue | None) -> None:
        self.trust = trust
        self.audits = audits
        # The OS's CSPRNG: no node can replay the draws to cheat only when it will not be checked.
        self.rng = secrets.SystemRandom()
        # Groups of nodes on probation committed (or being committed) held, waiting for their audit.
        self.held = 0
        self.sampling = SamplingTest(trust.sampling_false_alarm)

    def on_probation(self, record: NodeRecord) -> bool:
        """A node whose every submission is still audited: its work waits for the verdict."""
        return record.audits_passed < self.trust.audit_first_n

    def backed_up(self, groups: int) -> bool:
        """Whether holding `groups` more would pass `audit_queue_groups`: new work waits, it does not pile up."""
        return self.held + groups > self.trust.audit_queue_groups

    @contextmanager
    def holding(self, groups: int) -> Iterator[None]:
        """Count `groups` as held while the block commits them; uncounted at once if the commit fails,
        else by `release` once their audit is through."""
        self.held += groups
        try:
            yield
        except BaseException:
            self.held -= groups
            raise

    def release(self, groups: int) -> None:
        """Held groups whose audit is through (released to the buffer or discarded)."""
        self.held -= groups

    def sample(self, node_id: str, lease_id: str, kept: Sequence[tuple[Group, int]], answered_at: float) -> None:
        """Decide, now that a submission is in, whether to audit it later; if so queue one of its groups."""
        if self.rng.random() >= self.trust.audit_rate:
            return
        group, row_id = kept[self.rng.randrange(len(kept))]
        assert self.audits is not None, "a hub without an auditor draws no audits"
        self.audits.offer(AuditJob(node_id, lease_id, row_id, group, answered_at))

    async def recompute(self, group: Group) -> list[float] | None:
        """The audit model's log-prob sums of `group`'s completions (the copy detector's disputes); None without
        audits or when its version left the shelf."""
        return None if self.audits is None else await self.audits.recompute(group)

    async def judge(self, jobs: Sequence[AuditJob]) -> AuditVerdict:
        """Audit the groups of one submission in turn, up to the first that fails or cannot be audited."""
        assert self.audits is not None, "a hub without an auditor holds nothing for audit"
        for job in jobs:
            result = await self.audits.judge(job)
            if result is None:
                return AuditVerdict(passed=False)
            failure = self._failure(job, result)
            if failure is not None:
                return AuditVerdict(False, f"audit failed: v{job.group.version} group {job.group.prompt_id}: {failure}")
        return AuditVerdict(passed=True, vouches=self.sampling.statistic(jobs[0].node_id) == 0.0)

    def _failure(self, job: AuditJob, result: AuditResult) -> str | None:
        """Why one audited group fails: its log-probs, else the sampling test its evidence tipped; None: it passed."""
        if not result.passed:
            return result.reason
        condemned = None if result.evidence is None else self.sampling.add(job.node_id, result.evidence)
        return None if condemned is None else condemned.describe()

    @staticmethod
    def unvouched_since(record: NodeRecord) -> float:
        """Pay booked after this is what a failed audit voids: the last passed audit vouched for the rest."""
        return record.vouched_at or 0.0
