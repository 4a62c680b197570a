"""hub/trust/submissions.py against hand-built Completions: every rejection reason, and rewards recomputed from token ids."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from hub.records.leases import LeaseRecord
from hub.trust.submissions import (
    REASON_CLAIMED_REWARD,
    GroupVerdict,
    SubmissionRules,
    VersionWindow,
    check_group,
    check_submission,
    submission_frame_cap,
    token_text_bytes,
    verdict_reasons,
)
from shared.messages import GroupReason, Submission, SubmittedGroup
from shared.rollout import Completion, SamplingParams
from shared.tasks.base import Prompt, RewardError
from shared.tasks.reverse import ReverseTask

MAX_NEW_TOKENS = 6
GROUP_SIZE = 2
NODE = "12D3KooWnode"
WINDOW = VersionWindow(oldest=3, newest=5)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def rules(tokenizer) -> SubmissionRules:
    return SubmissionRules(
        task=ReverseTask(),
        group_size=GROUP_SIZE,
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
        stop_ids=frozenset({tokenizer.eos_token_id}),
        vocab_size=len(tokenizer),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        token_text_bytes=token_text_bytes(tokenizer.get_vocab()),
    )


PROMPTS = (Prompt("p-abc", "abc>", "cba"), Prompt("p-xyz", "xyz>", "zyx"))


def lease(min_version: int = 0, answered: tuple[str, ...] = (), held_version: int = 0) -> LeaseRecord:
    return LeaseRecord(
        lease_id="l" * 24,
        node_id=NODE,
        prompts=PROMPTS,
        min_version=min_version,
        issued_at=0.0,
        deadline=60.0,
        price_per_hour=0.5,
        answered=set(answered),
        held_version=held_version,
    )


def completion(tokenizer, text: str, version: int = 4, claimed_text: str | None = None, **overrides) -> Completion:
    ids = tuple(tokenizer.encode(text)) + (tokenizer.eos_token_id,)
    fields = dict(
        token_ids=ids,
        logprobs=tuple(-0.5 for _ in ids),
        finish_reason="stop",
        version=version,
        text=text if claimed_text is None else claimed_text,
    )
    fields.update(overrides)
    return Completion(**fields)


def group(tokenizer, prompt_id: str = "p-abc", texts: tuple[str, ...] = ("cba", "abc"), **kw) -> SubmittedGroup:
    return SubmittedGroup(prompt_id=prompt_id, completions=tuple(completion(tokenizer, t, **kw) for t in texts))


def verdict(rules, submitted: SubmittedGroup, record: LeaseRecord | None = None, window: VersionWindow = WINDOW):
    return check_group(submitted, record or lease(), set(), rules, window, NODE)


def test_valid_group_is_accepted_and_scored_by_the_hub(rules, tokenizer):
    v = verdict(rules, group(tokenizer))
    assert v.accepted and v.reason == ""
    assert v.group.rewards == (1.0, 0.0)
    assert v.group.version == 4 and v.group.node_id == NODE and v.group.prompt_text == "abc>"
    assert [c.text for c in v.group.completions] == ["cba", "abc"]


def test_reward_comes_from_token_ids_not_from_the_nodes_text(rules, tokenizer):
    # Wrong tokens dressed up with the right text: the hub decodes the tokens and scores them.
    liar = SubmittedGroup(
        prompt_id="p-abc",
        completions=(completion(tokenizer, "xxx", claimed_text="cba"), completion(tokenizer, "cba", claimed_text="no")),
    )
    v = verdict(rules, liar)
    assert v.accepted and v.group.rewards == (0.0, 1.0)
    assert [c.text for c in v.group.completions] == ["xxx", "cba"]


@pytest.mark.parametrize("claimed", [(1.0, 1.0), (1.0,), (1.0, float("nan")), (1.0, 1e-5)])
def test_a_claimed_reward_the_hub_does_not_score_is_a_lie(rules, tokenizer, claimed):
    honest = group(tokenizer).model_copy(update={"claimed_rewards": (1.0, 0.0)})
    v = verdict(rules, honest)
    assert v.accepted and v.group.rewards == (1.0, 0.0)
    v = verdict(rules, group(tokenizer).model_copy(update={"claimed_rewards": claimed}))
    assert not v.accepted and not v.late and v.reason == REASON_CLAIMED_REWARD and v.group is None


def test_finish_reason_length_at_the_cap_is_accepted(rules, tokenizer):
    ids = tuple(tokenizer.encode("abcabc"))
    assert len(ids) == MAX_NEW_TOKENS
    c = Completion(token_ids=ids, logprobs=(-0.1,) * len(ids), finish_reason="length", version=3, text="")
    v = verdict(rules, SubmittedGroup(prompt_id="p-xyz", completions=(c, c)))
    assert v.accepted and v.group.rewards == (0.0, 0.0)


def reasons(rules, tokenizer) -> dict[str, tuple[SubmittedGroup, LeaseRecord, str]]:
    eos = tokenizer.eos_token_id
    a = tokenizer.encode("a")[0]
    good = completion(tokenizer, "cba")

    def with_completion(c: Completion) -> SubmittedGroup:
        return SubmittedGroup(prompt_id="p-abc", completions=(good, c))

    return {
        "not in lease": (group(tokenizer, prompt_id="p-other"), lease(), "prompt not in lease"),
        "answered before": (group(tokenizer), lease(answered=("p-abc",)), "prompt already answered"),
        "too few": (group(tokenizer, texts=("cba",)), lease(), "1 completions, lease asked for 2"),
        "too many": (group(tokenizer, texts=("cba",) * 3), lease(), "3 completions, lease asked for 2"),
        "mixed versions": (
            SubmittedGroup(prompt_id="p-abc", completions=(good, completion(tokenizer, "abc", version=5))),
            lease(),
            "different versions",
        ),
        "unpublished": (group(tokenizer, version=6), lease(), "version 6 was never published"),
        "stale for window": (group(tokenizer, version=2), lease(), "stale version 2 (oldest accepted 3)"),
        "below lease minimum": (group(tokenizer, version=4), lease(min_version=5), "version 4 below the lease's minimum 5"),
        # Issue 65: leased the room of v5, it answers with v4 groups, which would go stale first and still be paid.
        "below the version held": (
            group(tokenizer, version=4),
            lease(min_version=3, held_version=5),
            "version 4 below v5, which the node held when it was leased",
        ),
        "empty": (with_completion(good.model_copy(update={"token_ids": (), "logprobs": ()})), lease(), "length 0"),
        "too long": (
            with_completion(good.model_copy(update={"token_ids": (a,) * 7 + (eos,), "logprobs": (-0.1,) * 8})),
            lease(),
            "length 8 outside [1, 6]",
        ),
        "logprob count": (with_completion(good.model_copy(update={"logprobs": (-0.1,)})), lease(), "1 log-probs for 4"),
        "positive logprob": (with_completion(good.model_copy(update={"logprobs": (-0.1, 0.5, -0.1, -0.1)})), lease(), "<= 0"),
        "nan logprob": (with_completion(good.model_copy(update={"logprobs": (-0.1, math.nan, -0.1, -0.1)})), lease(), "finite"),
        "stop without eos": (with_completion(good.model_copy(update={"token_ids": (a, a, a, a)})), lease(), "stop without EOS"),
        "length too early": (
            with_completion(good.model_copy(update={"token_ids": (a, a, a, a), "finish_reason": "length"})),
            lease(),
            "length before max_new_tokens",
        ),
        "tokens after eos": (
            with_completion(good.model_copy(update={"token_ids": (a, eos, a, eos)})),
            lease(),
            "tokens after EOS",
        ),
        "token outside vocab": (
            with_completion(good.model_copy(update={"token_ids": (a, len(tokenizer) + 7, a, eos)})),
            lease(),
            "outside the vocabulary",
        ),
        "negative token": (
            with_completion(good.model_copy(update={"token_ids": (a, -1, a, eos)})),
            lease(),
            "outside the vocabulary",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "not in lease",
        "answered before",
        "too few",
        "too many",
        "mixed versions",
        "unpublished",
        "stale for window",
        "below lease minimum",
        "empty",
        "too long",
        "logprob count",
        "positive logprob",
        "nan logprob",
        "stop without eos",
        "length too early",
        "tokens after eos",
        "token outside vocab",
        "negative token",
    ],
)
def test_every_rejection_reason(rules, tokenizer, case):
    submitted, record, expected = reasons(rules, tokenizer)[case]
    v = verdict(rules, submitted, record)
    assert not v.accepted and v.group is None
    assert expected in v.reason, v.reason
    assert v.prompt_id == submitted.prompt_id and v.submitted is submitted
    # Only a version that fell out of the window is lateness; everything else is bad work.
    assert v.late == case.startswith("stale")
    assert v.verdict == ("late" if v.late else "rejected")
    assert v.why == REASON_CODES[case]  # the word its refusal is counted under


# The reason code each rejection is counted under (shared.messages.GroupReason).
REASON_CODES = {
    "not in lease": GroupReason.LEASE,
    "answered before": GroupReason.LEASE,
    "too few": GroupReason.LEASE,
    "too many": GroupReason.LEASE,
    "mixed versions": GroupReason.VERSION,
    "unpublished": GroupReason.VERSION,
    "stale for window": GroupReason.LATE,
    "below lease minimum": GroupReason.VERSION,
    **dict.fromkeys(
        ("empty", "too long", "logprob count", "positive logprob", "nan logprob", "stop without eos", "length too early"),
        GroupReason.TOKENS,
    ),
    **dict.fromkeys(("tokens after eos", "token outside vocab", "negative token"), GroupReason.TOKENS),
}


def test_bad_work_is_rejected_even_when_it_is_also_stale(rules, tokenizer):
    a, eos = tokenizer.encode("a")[0], tokenizer.eos_token_id
    stale = completion(tokenizer, "cba", version=2)
    broken = stale.model_copy(update={"token_ids": (eos, a, eos), "logprobs": (-0.1,) * 3})
    v = verdict(rules, SubmittedGroup(prompt_id="p-abc", completions=(stale, broken)))
    assert (v.accepted, v.late, v.verdict) == (False, False, "rejected") and v.reason == "tokens after EOS"
    honest_but_late = verdict(rules, SubmittedGroup(prompt_id="p-abc", completions=(stale, stale)))
    assert honest_but_late.verdict == "late" and honest_but_late.reason == "stale version 2 (oldest accepted 3)"
    with pytest.raises(ValueError, match="accepted or late"):
        GroupVerdict("p", True, "", honest_but_late.submitted, late=True)
    with pytest.raises(ValueError, match="reason code"):
        GroupVerdict("p", False, "no code given", honest_but_late.submitted)
    assert verdict_reasons([v, honest_but_late, v]) == {"tokens": 2, "late": 1}


def test_duplicate_prompt_in_one_submission_is_answered_once(rules, tokenizer):
    submission = Submission(
        lease_id="l" * 24,
        node_id=NODE,
        groups=(
            group(tokenizer),
            group(tokenizer, texts=("abc", "cba")),
            group(tokenizer, prompt_id="p-xyz", texts=("zyx", "zzz")),
        ),
    )
    verdicts = check_submission(submission, lease(), rules, WINDOW)
    assert [(v.prompt_id, v.accepted) for v in verdicts] == [("p-abc", True), ("p-abc", False), ("p-xyz", True)]
    assert verdicts[1].reason == "prompt already answered"
    assert verdicts[2].group.rewards == (1.0, 0.0)


class BrokenReward(ReverseTask):
    """An operator's reward that raises on some text, or returns NaN: the operator's fault, not the node's."""

    def rewards(self, prompt, completions):
        if any(c.startswith("c") for c in completions):
            raise RuntimeError("regex blew up")
        return [float("nan")] * len(completions)


def test_a_reward_that_raises_or_is_not_finite_is_no_verdict_on_the_node(rules, tokenizer):
    from dataclasses import replace

    broken = replace(rules, task=BrokenReward())
    with pytest.raises(RewardError, match=f"reward {__name__}:BrokenReward.rewards raised RuntimeError"):
        verdict(broken, group(tokenizer, texts=("cba", "abc")))
    with pytest.raises(RewardError, match="returned nan for completion 1 of 2"):
        verdict(broken, group(tokenizer, texts=("xba", "abc")))


def test_submission_frame_cap_by_hand():
    # 6*(64+128)+256 for the submission, 6*200+256 per group, 256 + 1 token of 2*26+6 + 26 per completion.
    assert submission_frame_cap(1, 1, 1, 6) == 1408 + 1456 + (256 + 58 + 26)
    assert submission_frame_cap(2, 3, 4, 12) == 1408 + 2 * (1456 + 3 * (256 + 4 * 64 + 26))
    assert token_text_bytes(["a", "abcd", "ab"]) == 24


def test_the_largest_honest_answer_fits_the_lease_cap(tokenizer):
    """Every completion at max_new_tokens of the longest token, the longest floats, the longest ids: it
    fits the cap the hub reads a lease's answer with, so no honest node is ever refused by it."""
    from shared.crypto import SIGNATURE_BYTES, Identity
    from shared.rollout import MAX_VERSION
    from shared.wire import HEADER_BYTES, encode_signed

    vocab = tokenizer.get_vocab()
    longest = max(vocab, key=len)
    ids = (vocab[longest],) * MAX_NEW_TOKENS
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    worst_float = -2.2250738585072014e-308
    identity = Identity.generate()
    for text in (text, "\x1f" * len(longest) * MAX_NEW_TOKENS):  # as decoded, and every char escaped
        completion = Completion(
            token_ids=ids, logprobs=(worst_float,) * MAX_NEW_TOKENS, finish_reason="length", version=MAX_VERSION, text=text
        )
        groups = tuple(
            SubmittedGroup(
                prompt_id="\x1f" * 200, completions=(completion,) * GROUP_SIZE, claimed_rewards=(worst_float,) * GROUP_SIZE
            )
            for _ in range(3)
        )
        frame = encode_signed(Submission(lease_id="\x1f" * 64, node_id="\x1f" * 128, groups=groups), identity)
        cap = submission_frame_cap(3, GROUP_SIZE, MAX_NEW_TOKENS, token_text_bytes(vocab))
        assert len(frame) - HEADER_BYTES <= cap + SIGNATURE_BYTES


# --- tool-using (multi-turn) completions ------------------------------------------------------------------------------

MAX_COMPLETION_TOKENS = 16


@pytest.fixture(scope="module")
def tool_rules(rules) -> SubmissionRules:
    from dataclasses import replace

    return replace(rules, max_completion_tokens=MAX_COMPLETION_TOKENS)


def turns(tokenizer, *parts: str, env_eos: bool = True, **overrides) -> Completion:
    """A completion of model turns (odd parts: text, each ending with EOS) and environment segments between them (even
    parts: a tool answer, holding an EOS of its own as a chat template renders one, log-prob 0.0)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    for i, text in enumerate(parts):
        if i % 2:
            segment = [eos, *tokenizer.encode(text)] if env_eos else tokenizer.encode(text)
            spans.append((len(ids), len(segment)))
            ids += segment
            logprobs += [0.0] * len(segment)
        else:
            ids += [*tokenizer.encode(text), eos]
            logprobs += [-0.5] * (len(ids) - len(logprobs))
    fields = dict(
        token_ids=tuple(ids), logprobs=tuple(logprobs), finish_reason="stop", version=4, text="", env_spans=tuple(spans)
    )
    fields.update(overrides)
    return Completion(**fields)


def tool_group(*completions: Completion) -> SubmittedGroup:
    return SubmittedGroup(prompt_id="p-abc", completions=completions)


def test_a_stop_id_may_end_each_model_turn_and_environment_tokens_are_context(tool_rules, tokenizer):
    # Model "a<eos>", the tool's "zz" after an EOS of the template's, model "cba<eos>": every turn ends with a stop id.
    c = turns(tokenizer, "a", "zz", "cba")
    assert c.model_turns() == [(0, 2), (5, 9)] and c.model_token_ids() == (*tokenizer.encode("a"), 1, *tokenizer.encode("cba"), 1)
    v = verdict(tool_rules, tool_group(c, turns(tokenizer, "abc")))
    assert v.accepted, v.reason
    assert v.group.completions[0].env_spans == c.env_spans  # kept as sent: the learner masks them
    # Longer than max_new_tokens in all, each turn within it: only the whole is bounded by max_completion_tokens.
    long = turns(tokenizer, "abcde", "zz", "abcde")
    assert len(long.token_ids) > MAX_NEW_TOKENS
    assert verdict(tool_rules, tool_group(long, long)).accepted


def tool_reasons(tokenizer) -> dict[str, tuple[Completion, str]]:
    eos, a = tokenizer.eos_token_id, tokenizer.encode("a")[0]
    good = turns(tokenizer, "a", "zz", "cba")
    logprobs = list(good.logprobs)
    nonzero_env = logprobs[:3] + [-0.2] + logprobs[4:]
    positive_model = [0.5] + logprobs[1:]
    return {
        "env logprob": (good.model_copy(update={"logprobs": tuple(nonzero_env)}), "log-probs must be 0.0"),
        "model logprob": (good.model_copy(update={"logprobs": tuple(positive_model)}), "finite and <= 0"),
        "logprob count": (good.model_copy(update={"logprobs": good.logprobs[:-1]}), "8 log-probs for 9 tokens"),
        "eos inside a turn": (
            turns(tokenizer, "a", "zz", "cba").model_copy(update={"token_ids": (eos, eos, *good.token_ids[2:])}),
            "tokens after EOS within a model turn",
        ),
        "turn too long": (turns(tokenizer, "abcdefg", "zz", "a"), "model turn length 8 outside [1, 6]"),
        "too long in all": (turns(tokenizer, "abcde", "zz", "abcde", "z", "a"), "over 16 tokens"),
        "stop without eos": (good.model_copy(update={"token_ids": (*good.token_ids[:-1], a)}), "finish_reason stop without EOS"),
        "length too early": (good.model_copy(update={"finish_reason": "length"}), "length before max_new_tokens"),
        "outside vocab": (
            good.model_copy(update={"token_ids": (*good.token_ids[:4], len(tokenizer), *good.token_ids[5:])}),
            "outside the vocabulary",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "env logprob",
        "model logprob",
        "logprob count",
        "eos inside a turn",
        "turn too long",
        "too long in all",
        "stop without eos",
        "length too early",
        "outside vocab",
    ],
)
def test_every_rejection_reason_of_a_tool_using_completion(tool_rules, tokenizer, case):
    bad, expected = tool_reasons(tokenizer)[case]
    v = verdict(tool_rules, tool_group(turns(tokenizer, "abc"), bad))
    assert not v.accepted and v.why == GroupReason.TOKENS
    assert expected in v.reason, v.reason


def test_length_ends_a_tool_using_completion_at_a_turn_cap_or_the_whole_cap(tool_rules, tokenizer):
    a = tokenizer.encode("a")[0]
    at_turn_cap = turns(tokenizer, "a", "zz", "abcde").model_copy(update={"finish_reason": "length"})
    cut = at_turn_cap.model_copy(update={"token_ids": (*at_turn_cap.token_ids[:-1], a)})  # six sampled, no EOS
    assert verdict(tool_rules, tool_group(cut, cut)).accepted
    # The last turn cut short by max_completion_tokens: 16 tokens in all.
    whole = turns(tokenizer, "abcde", "z", "abc", "z", "a")
    assert len(whole.token_ids) == MAX_COMPLETION_TOKENS
    cut = whole.model_copy(update={"finish_reason": "length", "token_ids": (*whole.token_ids[:-1], a)})
    assert verdict(tool_rules, tool_group(cut, cut)).accepted


def test_environment_segments_in_a_run_without_tools_are_refused(rules, tokenizer):
    v = verdict(rules, tool_group(turns(tokenizer, "a", "zz", "cba"), turns(tokenizer, "abc")))
    assert not v.accepted and v.why == GroupReason.TOKENS and v.reason == "environment segments in a run without tools"


def test_a_tampered_environment_segment_is_refused_as_a_cheats(tool_rules, tokenizer):
    """The hub's record of what it sent (here a dict of digests, as hub.agents.loop.ToolLoop keeps them): a group whose
    segments differ, or drop one, or add one, is refused with the ENVIRONMENT reason; honest ones pass; only otherwise
    valid work is compared."""
    from hub.agents.loop import segment_digest
    from hub.trust.submissions import refuse_tampered
    from shared.tools import rollout_key

    honest = [turns(tokenizer, "a", "zz", "cba"), turns(tokenizer, "abc")]
    lease_id = lease().lease_id
    sent = {rollout_key(lease_id, "p-abc", i): [segment_digest(s) for s in c.segments()] for i, c in enumerate(honest)}

    def sent_matches(key, segments):
        return key in sent and [segment_digest(s) for s in segments] == sent[key]

    z = tokenizer.encode("z")[0]
    edited = honest[0].model_copy(update={"token_ids": (*honest[0].token_ids[:4], z + 1, *honest[0].token_ids[5:])})
    dropped = turns(tokenizer, "acba")  # no segment: the model "answered" without the tool
    added = turns(tokenizer, "a", "zz", "abc")  # a segment the hub never sent rollout 1
    swapped = turns(tokenizer, "b", "zz", "cba")  # a first turn other than the one the hub answered
    cases = {
        "honest": tool_group(*honest),
        "edited": tool_group(edited, honest[1]),
        "dropped": tool_group(dropped, honest[1]),
        "added": tool_group(honest[0], added),
        "swapped": tool_group(swapped, honest[1]),
    }
    verdicts = [verdict(tool_rules, g) for g in cases.values()]
    assert all(v.accepted for v in verdicts)  # each is well-formed: only the hub's record tells them apart
    out = dict(zip(cases, refuse_tampered(verdicts, lease_id, sent_matches)))
    assert out["honest"].accepted and out["honest"].group is not None
    for name in ("edited", "dropped", "added", "swapped"):
        v = out[name]
        assert (v.accepted, v.late, v.group, v.why) == (False, False, None, GroupReason.ENVIRONMENT), name
        assert v.reason == "model turns or tool answers differ from those exchanged with the hub"
    # Another lease's rollouts are not this one's: the same work answering it is refused.
    assert refuse_tampered([verdicts[0]], "m" * 24, sent_matches)[0].why == GroupReason.ENVIRONMENT
    # Work refused for another reason is not compared (its rollouts need not be the lease's).
    refused = verdict(tool_rules, tool_group(edited, honest[1]).model_copy(update={"prompt_id": "p-other"}))
    assert refuse_tampered([refused], lease_id, sent_matches)[0].why == GroupReason.LEASE


def test_the_largest_honest_tool_using_answer_fits_the_lease_cap(tool_rules, tokenizer):
    """Every completion at max_completion_tokens of the longest token, as many environment segments as fit, the
    longest floats, ids and spans: within the cap the hub reads a lease's answer with."""
    from shared.crypto import SIGNATURE_BYTES, Identity
    from shared.rollout import MAX_VERSION
    from shared.wire import HEADER_BYTES, encode_signed

    vocab = tokenizer.get_vocab()
    ids = (vocab[max(vocab, key=len)],) * MAX_COMPLETION_TOKENS
    segments = tool_rules.env_segments_max
    assert segments == (MAX_COMPLETION_TOKENS - 1) // 2
    spans = tuple((1 + 2 * i, 1) for i in range(segments))
    logprobs = tuple(0.0 if any(s == i for s, _ in spans) else -2.2250738585072014e-308 for i in range(len(ids)))
    completion = Completion(
        token_ids=ids,
        logprobs=logprobs,
        finish_reason="length",
        version=MAX_VERSION,
        text="\x1f" * len(max(vocab, key=len)) * MAX_COMPLETION_TOKENS,
        env_spans=spans,
    )
    groups = tuple(
        SubmittedGroup(prompt_id="\x1f" * 200, completions=(completion,) * GROUP_SIZE, claimed_rewards=(-1e-308,) * GROUP_SIZE)
        for _ in range(3)
    )
    frame = encode_signed(Submission(lease_id="\x1f" * 64, node_id="\x1f" * 128, groups=groups), Identity.generate())
    assert len(frame) - HEADER_BYTES <= tool_rules.frame_cap(3) + SIGNATURE_BYTES
    # A run without tools: the cap of today, max_new_tokens per completion and no segment.
    rules_cap = submission_frame_cap(3, GROUP_SIZE, MAX_NEW_TOKENS, tool_rules.token_text_bytes)
    from dataclasses import replace

    assert replace(tool_rules, max_completion_tokens=None).frame_cap(3) == rules_cap < tool_rules.frame_cap(3)
