"""Checks of one signed submission against the lease it answers; the hub's verdict per group.

Nothing a node says about its own work is believed: the completion text is re-decoded from
the token ids with the hub's tokenizer, the reward is recomputed from the task, and lengths,
versions and log-probs are bounded by the lease. A node may claim rewards; a claim that differs
from the hub's score is a lie, and that group is rejected (neither trained on nor paid), and so is a
group that repeats earlier work too exactly to be honest (hub/trust/copies.py finds those), and a group
whose reward ran past its CPU budget (shared/tasks/budget.py): the node chose the text the reward ran on.
A tool-using completion (environment segments between its model turns) is held to the same rules on its model
tokens; its environment tokens must be exactly what the hub sent (`refuse_tampered`), else it is a cheat's.
Here too: what a submission's verdicts add to the tallies and to the event log. The reward is the
operator's code: when it fails (shared.tasks.base.RewardError) no verdict is given, and the error
propagates (hub/trust/checkpool.py decides whose fault it was).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hub.config import TrustConfig
from hub.records.leases import LeaseRecord
from hub.records.schema import NewEvent
from hub.trust.copies import CopyDetector, CopyFlag, Disputed
from shared.messages import GROUP_VERDICTS, GroupReason, Submission, SubmittedGroup, Tallies
from shared.rollout import MAX_ENV_SEGMENTS, Completion, Group, SamplingParams
from shared.tasks.base import GroupContext, Prompt, Task, checked_scores
from shared.tasks.budget import OverBudget, cpu_budget
from shared.tools import rollout_key

CLAIMED_REWARD_TOLERANCE = 1e-6
# The most bytes a submission's JSON spends on each of its parts, for the frame cap of one lease's answer.
JSON_BYTES_PER_CHAR = 6  # a control character escaped ("\u001f"); others take at most 4 (raw UTF-8)
NUMBER_JSON_BYTES = 26  # a token id (<= 10 digits) or a float's shortest repr (<= 24 chars), with its comma
COMPLETION_JSON_BYTES = 256  # a completion's keys, brackets, finish_reason and version
SPAN_JSON_BYTES = 2 * NUMBER_JSON_BYTES + 2  # one environment segment's (start, length), bracketed
GROUP_JSON_BYTES = JSON_BYTES_PER_CHAR * 200 + 256  # a group's keys and its prompt id at its longest, escaped
SUBMISSION_JSON_BYTES = JSON_BYTES_PER_CHAR * (64 + 128) + 256  # keys, lease id and node id at their longest
REASON_CLAIMED_REWARD = "claimed rewards differ from the hub's scores"
REASON_OVER_BUDGET = "the reward ran past its budget on this work"
REASON_REWARD_FAILED = "the task's reward failed on this work"
REASON_ENVIRONMENT = "model turns or tool answers differ from those exchanged with the hub"

# Whether a rollout's submitted segments (Completion.segments: its model turns and tool answers, in order) are exactly
# what it exchanged with the hub (hub.agents.loop.ToolLoop's sent_matches), by the rollout's key (`rollout_key`).
SentMatches = Callable[[str, Sequence[Sequence[int]]], bool]


@dataclass(frozen=True)
class VersionWindow:
    """Versions the hub accepts right now: newest published, and the oldest still within S."""

    oldest: int
    newest: int


@dataclass(frozen=True)
class SubmissionRules:
    """What every submission is checked against; fixed for the hub's lifetime."""

    task: Task
    group_size: int
    sampling: SamplingParams
    stop_ids: frozenset[int]  # every EOS the model declares (shared.model_identity.ModelIdentity.stop_ids)
    vocab_size: int
    decode: Callable[[list[int]], str]
    token_text_bytes: int  # the most JSON bytes one token's decoded text takes (`token_text_bytes`)
    # CPU seconds the reward may spend per completion (TrustConfig.reward_budget_s).
    reward_budget_s: float = TrustConfig.model_fields["reward_budget_s"].default
    # Model and environment tokens one tool-using completion may hold, each model turn at most max_new_tokens
    # (hub.agents.loop.LoopLimits); None: single-turn, a completion is one model turn and holds no environment tokens.
    max_completion_tokens: int | None = None

    @property
    def completion_tokens(self) -> int:
        """The most tokens one completion may hold."""
        return self.sampling.max_new_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def env_segments_max(self) -> int:
        """The most environment segments one completion may hold: each sits after a model token and before another."""
        return 0 if self.max_completion_tokens is None else min(MAX_ENV_SEGMENTS, (self.max_completion_tokens - 1) // 2)

    def frame_cap(self, prompts: int) -> int:
        """`submission_frame_cap` of an answer to a lease of `prompts` prompts under these rules."""
        return submission_frame_cap(
            prompts, self.group_size, self.completion_tokens, self.token_text_bytes, self.env_segments_max
        )


def token_text_bytes(vocab: Iterable[str]) -> int:
    """The most JSON bytes one token's decoded text can take. A vocabulary entry (a byte-level BPE or
    SentencePiece piece) decodes to at most as many characters as it has, each at most
    JSON_BYTES_PER_CHAR bytes once escaped."""
    return JSON_BYTES_PER_CHAR * max(map(len, vocab))


def submission_frame_cap(
    prompts: int, group_size: int, completion_tokens: int, text_bytes_per_token: int, env_segments: int = 0
) -> int:
    """The most bytes an honest answer to a lease of `prompts` prompts takes (signature excluded): every
    completion at `completion_tokens` tokens of the longest text and `env_segments` environment segments, with a
    claimed reward each. The hub reads and reserves no more than this for a submission, however large the
    protocol's own cap."""
    token = 2 * NUMBER_JSON_BYTES + text_bytes_per_token
    completion = COMPLETION_JSON_BYTES + completion_tokens * token + env_segments * SPAN_JSON_BYTES + NUMBER_JSON_BYTES
    return SUBMISSION_JSON_BYTES + prompts * (GROUP_JSON_BYTES + group_size * completion)


@dataclass(frozen=True)
class GroupVerdict:
    prompt_id: str
    accepted: bool
    reason: str
    submitted: SubmittedGroup
    group: Group | None = None
    # Refused only because its version fell out of the staleness window while it was generated:
    # the normal cost of asynchrony for an honest node, kept apart from refusals for bad work.
    late: bool = False
    code: GroupReason | None = None  # why a rejected group was rejected (a late one's is LATE: `why`)

    def __post_init__(self) -> None:
        if self.accepted and self.late:
            raise ValueError("a group is either accepted or late, not both")
        if self.accepted != (self.group is not None):
            raise ValueError("an accepted group carries its parsed Group, a refused one none")
        if self.accepted and self.code is not None:
            raise ValueError("an accepted group has no reason code")
        if not self.accepted and not self.late and self.code in (None, GroupReason.LATE):
            raise ValueError("a rejected group carries the reason code it was rejected for (not LATE)")

    @property
    def why(self) -> GroupReason | None:
        """The reason it was refused under (None: accepted)."""
        return GroupReason.LATE if self.late else self.code

    @property
    def verdict(self) -> str:
        """How the store records it: accepted, late or rejected."""
        return "accepted" if self.accepted else "late" if self.late else "rejected"


def _check_completion(c: Completion, sampling: SamplingParams, stop_ids: frozenset[int]) -> str | None:
    n = len(c.token_ids)
    if n == 0 or n > sampling.max_new_tokens:
        return f"completion length {n} outside [1, {sampling.max_new_tokens}]"
    if len(c.logprobs) != n:
        return f"{len(c.logprobs)} log-probs for {n} tokens"
    if not all(math.isfinite(lp) and lp <= 1e-6 for lp in c.logprobs):
        return "log-probs must be finite and <= 0"
    if c.finish_reason == "stop" and c.token_ids[-1] not in stop_ids:
        return "finish_reason stop without EOS"
    if c.finish_reason == "length" and n != sampling.max_new_tokens:
        return "finish_reason length before max_new_tokens"
    if not stop_ids.isdisjoint(c.token_ids[:-1]):
        return "tokens after EOS"
    return None


def _check_turns(c: Completion, rules: SubmissionRules) -> str | None:
    """A tool-using completion: `_check_completion`'s rules on its model tokens, turn by turn (a stop id may end
    each model turn, and nothing else of it); its environment tokens never sampled (log-prob exactly 0.0).
    Whether they are what the hub sent is `refuse_tampered`'s question."""
    if rules.max_completion_tokens is None:
        return "environment segments in a run without tools"
    n, cap, turn_cap = len(c.token_ids), rules.max_completion_tokens, rules.sampling.max_new_tokens
    if n > cap:  # which bounds its segments too (Completion: each between two model tokens)
        return f"completion length {n} over {cap} tokens"
    if len(c.logprobs) != n:
        return f"{len(c.logprobs)} log-probs for {n} tokens"
    sampled = c.model_positions()
    if not all(math.isfinite(lp) and lp <= 1e-6 for lp, s in zip(c.logprobs, sampled) if s):
        return "log-probs must be finite and <= 0"
    if any(lp != 0.0 for lp, s in zip(c.logprobs, sampled) if not s):
        return "environment tokens' log-probs must be 0.0: they are not sampled"
    turns = c.model_turns()
    for start, stop in turns:
        if stop - start > turn_cap:
            return f"model turn length {stop - start} outside [1, {turn_cap}]"
        if not rules.stop_ids.isdisjoint(c.token_ids[start : stop - 1]):
            return "tokens after EOS within a model turn"
    last = turns[-1][1] - turns[-1][0]
    if c.finish_reason == "stop" and c.token_ids[-1] not in rules.stop_ids:
        return "finish_reason stop without EOS"
    if c.finish_reason == "length" and last != turn_cap and n != cap:
        return "finish_reason length before max_new_tokens or max_completion_tokens"
    return None


def _check_prompt(pid: str, prompts: Mapping[str, Prompt], record: LeaseRecord, seen: set[str]) -> str | None:
    """The group answers a prompt of the lease that neither the lease nor this submission answered before."""
    if pid not in prompts:
        return "prompt not in lease"
    if pid in record.answered or pid in seen:
        return "prompt already answered"
    seen.add(pid)
    return None


def _check_size(submitted: SubmittedGroup, rules: SubmissionRules) -> str | None:
    """As many completions as the lease asked for."""
    if len(submitted.completions) != rules.group_size:
        return f"{len(submitted.completions)} completions, lease asked for {rules.group_size}"
    return None


def _check_version(submitted: SubmittedGroup, record: LeaseRecord, window: VersionWindow) -> str | None:
    """One version for the whole group, published and not below the lease's minimum (staleness comes last)."""
    versions = {c.version for c in submitted.completions}
    if len(versions) != 1:
        return "completions of one group made with different versions"
    version = versions.pop()
    if version > window.newest:
        return f"version {version} was never published (newest {window.newest})"
    if version < record.min_version:
        # The lease was only issued to a node holding at least min_version: not lateness.
        return f"version {version} below the lease's minimum {record.min_version}"
    if version < record.held_version:
        # Its room was sized for that version's takes: older work would take it and then go stale, paid.
        return f"version {version} below v{record.held_version}, which the node held when it was leased"
    return None


def _check_tokens(submitted: SubmittedGroup, rules: SubmissionRules) -> str | None:
    """Every completion well-formed (`_check_completion`, or `_check_turns` for a tool-using one) and within the
    vocabulary."""
    for c in submitted.completions:
        problem = _check_turns(c, rules) if c.env_spans else _check_completion(c, rules.sampling, rules.stop_ids)
        if problem is None and any(not 0 <= t < rules.vocab_size for t in c.token_ids):
            problem = "token id outside the vocabulary"
        if problem is not None:
            return problem
    return None


def _claims_differ(claimed: Sequence[float] | None, rewards: Sequence[float]) -> bool:
    """Whether the node claimed rewards other than the hub's scores (claiming none is no lie)."""
    return claimed is not None and (
        len(claimed) != len(rewards) or any(not abs(a - b) <= CLAIMED_REWARD_TOLERANCE for a, b in zip(claimed, rewards))
    )


def _score(submitted: SubmittedGroup, prompt: Prompt, rules: SubmissionRules, node_id: str) -> GroupVerdict:
    """A valid group's completions re-decoded and scored by the task in one call: accepted, unless the node
    claimed other scores or the call ran past the group's CPU budget. A reward that fails raises RewardError."""
    pid = submitted.prompt_id
    completions = [c.model_copy(update={"text": rules.decode(list(c.token_ids))}) for c in submitted.completions]
    version = submitted.completions[0].version
    context = GroupContext(tuple(c.token_ids for c in completions), version, tuple(c.env_spans for c in completions))
    try:
        with cpu_budget(rules.reward_budget_s * len(completions)):
            scores = checked_scores(rules.task, prompt, [c.text for c in completions], context)
    except OverBudget:
        return GroupVerdict(pid, False, REASON_OVER_BUDGET, submitted, code=GroupReason.REWARD_BUDGET)
    if _claims_differ(submitted.claimed_rewards, scores.rewards):
        return GroupVerdict(pid, False, REASON_CLAIMED_REWARD, submitted, code=GroupReason.CLAIMED_REWARD)
    group = Group(
        prompt_id=pid,
        prompt_text=prompt.text,
        version=version,
        completions=tuple(completions),
        rewards=scores.rewards,
        node_id=node_id,
        reward_parts=scores.parts,
        logged_metrics=scores.metrics,
        logged_columns=scores.columns,
    )
    return GroupVerdict(pid, True, "", submitted, group)


def check_group(
    submitted: SubmittedGroup, record: LeaseRecord, seen: set[str], rules: SubmissionRules, window: VersionWindow, node_id: str
) -> GroupVerdict:
    """The hub's verdict on one group of a submission; `seen` holds the prompts it answered before this group."""
    pid = submitted.prompt_id
    prompts = {p.id: p for p in record.prompts}
    checks = (
        (GroupReason.LEASE, lambda: _check_prompt(pid, prompts, record, seen)),
        (GroupReason.LEASE, lambda: _check_size(submitted, rules)),
        (GroupReason.VERSION, lambda: _check_version(submitted, record, window)),
        (GroupReason.TOKENS, lambda: _check_tokens(submitted, rules)),
    )
    for code, check in checks:
        problem = check()
        if problem is not None:
            return GroupVerdict(pid, False, problem, submitted, code=code)
    version = submitted.completions[0].version
    # Checked last: only a group that is otherwise valid work is late rather than rejected.
    if version < window.oldest:
        reason = f"stale version {version} (oldest accepted {window.oldest})"
        return GroupVerdict(pid, False, reason, submitted, late=True)
    return _score(submitted, prompts[pid], rules, node_id)


def check_submission(
    submission: Submission, record: LeaseRecord, rules: SubmissionRules, window: VersionWindow
) -> list[GroupVerdict]:
    """Verdicts for every group of a submission whose lease and signer were already verified. Once a group ran the
    reward past its budget, the rest are rejected unscored: the node has shown what its text costs."""
    seen: set[str] = set()
    verdicts: list[GroupVerdict] = []
    for group in submission.groups:
        if verdicts and verdicts[-1].reason == REASON_OVER_BUDGET:
            verdicts.append(GroupVerdict(group.prompt_id, False, REASON_OVER_BUDGET, group, code=GroupReason.REWARD_BUDGET))
        else:
            verdicts.append(check_group(group, record, seen, rules, window, submission.node_id))
    return verdicts


# The reason code of each reason a whole submission is charged with (`charged_verdicts`).
CHARGED_CODES = {REASON_OVER_BUDGET: GroupReason.REWARD_BUDGET, REASON_REWARD_FAILED: GroupReason.REWARD_FAILED}


def charged_verdicts(submission: Submission, reason: str) -> list[GroupVerdict]:
    """Every group of a submission rejected for `reason` (a key of CHARGED_CODES): its checks as a whole ran past
    their budget, or the reward failed on it while it still passes the operator's probe (hub/trust/checkpool.py).
    Counted against the node as any rejected work is: neither paid nor trained on."""
    return [GroupVerdict(g.prompt_id, False, reason, g, code=CHARGED_CODES[reason]) for g in submission.groups]


def refuse_tampered(verdicts: Sequence[GroupVerdict], lease_id: str, sent_matches: SentMatches) -> list[GroupVerdict]:
    """Groups that are otherwise valid work (accepted or late) but hold a rollout whose model turns and tool answers
    are not exactly, and all of, those it exchanged with the hub are refused as a cheat's (GroupReason.ENVIRONMENT:
    the intake bans their node). The turns count too: a node that sent the hub turns its model never wrote (an
    oracle's tool call, earning the environment's reward) and submitted sampled ones around the answers would pass
    the audits. A completion's rollout is its lease's, prompt's and place's in the group (`rollout_key`)."""
    out: list[GroupVerdict] = []
    for v in verdicts:
        if (v.accepted or v.late) and not all(
            sent_matches(rollout_key(lease_id, v.prompt_id, i), c.segments()) for i, c in enumerate(v.submitted.completions)
        ):
            v = dataclasses.replace(
                v, accepted=False, late=False, reason=REASON_ENVIRONMENT, group=None, code=GroupReason.ENVIRONMENT
            )
        out.append(v)
    return out


async def reject_copies(
    verdicts: Sequence[GroupVerdict],
    copies: CopyDetector,
    node_id: str,
    lease_id: str,
    recompute: Callable[[Group], Awaitable[Sequence[float] | None]] | None = None,
) -> tuple[list[GroupVerdict], list[CopyFlag]]:
    """Groups that repeat earlier work too improbably to be honest are refused: neither trained on nor paid. A group
    whose verdict depends on whose log-probs are believed is settled on `recompute`'s (the hub's own: each
    completion's log-prob sum under the claimed version; None when it cannot), or on its own claims without one."""
    flags: list[CopyFlag] = []
    out: list[GroupVerdict] = []
    for verdict in verdicts:
        group = verdict.group
        flag = copies.check(group, node_id, lease_id) if group is not None else None
        if isinstance(flag, Disputed) and group is not None:
            trusted = await recompute(group) if recompute is not None else None
            flag = copies.settle(group, node_id, lease_id, trusted)
        if isinstance(flag, CopyFlag):
            flags.append(flag)
            verdict = dataclasses.replace(
                verdict, accepted=False, reason="copy of an earlier group", group=None, code=GroupReason.COPY
            )
        out.append(verdict)
    return out, flags


def verdict_tallies(verdicts: Sequence[GroupVerdict]) -> Tallies:
    """A submission's groups counted by verdict, as the node's tallies and the run's totals add them."""
    return Tallies(**{name: sum(v.verdict == name for v in verdicts) for name in GROUP_VERDICTS})


def verdict_reasons(verdicts: Sequence[GroupVerdict]) -> dict[str, int]:
    """A submission's refused groups counted by reason (GroupReason's values), in the order first met."""
    counts: dict[str, int] = {}
    for v in verdicts:
        if v.why is not None:
            counts[v.why.value] = counts.get(v.why.value, 0) + 1
    return counts


def submission_events(
    node_id: str, lease: LeaseRecord, verdicts: Sequence[GroupVerdict], copies: Sequence[CopyFlag], rate: float
) -> list[NewEvent]:
    """The events a submission's commit writes: copies found, rewards claimed falsely, a probe's throughput."""
    events: list[NewEvent] = [("copy_detected", node_id, flag.describe()) for flag in copies]
    mismatches = sum(v.reason == REASON_CLAIMED_REWARD for v in verdicts)
    if mismatches:
        events.append(("reward_claim_mismatch", node_id, f"{mismatches} groups claimed other rewards"))
    overruns = sum(v.reason in (REASON_OVER_BUDGET, REASON_REWARD_FAILED) for v in verdicts)
    if overruns:
        events.append(("reward_charged", node_id, f"{overruns} groups ran the reward past its budget or made it fail"))
    if lease.probe:
        events.append(("probed", node_id, f"{rate:.2f} rollouts/s"))
    return events
