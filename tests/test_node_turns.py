"""A node's side of a multi-turn lease (node/turns.py) on the real transformers engine: turns generated within each
rollout's budget, the hub's tokens appended unsampled, and a hub whose answers cannot be followed costing the lease.
The hub here is a script (its real side: tests/test_turn_protocol.py and the end-to-end test)."""

from __future__ import annotations

import pytest
import trio

from node.hf_engine import HFEngine
from node.turns import TurnsBroken, multi_turn_groups
from shared.messages import Lease, LeasePrompt, Reject, RejectCode, RolloutAnswer, ToolUse, TurnReply, TurnRequest
from shared.rollout import SamplingParams
from testbed.tool_chat import random_tool_model

BUDGET = 24
ENV = (70, 71, 72)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(random_tool_model(tmp_path_factory.mktemp("tool-model")), seed=3)


@pytest.fixture
def one_token_turns(engine):
    """Every id a stop id: each turn of the random model is one token, ended on a stop."""
    engine.use_stop_ids(range(engine.vocab_size))
    return engine


def test_each_turn_stays_within_its_rollouts_budget(engine):
    engine.use_stop_ids([0])  # (the pad id, which nothing samples here): the budgets are what end the turns
    turns = engine.generate_turns([[5, 6, 7], [8]], [1, 5], SamplingParams(max_new_tokens=1, seed=0))
    assert [len(t.token_ids) for t in turns] == [1, 5] and {t.finish_reason for t in turns} == {"length"}


def lease(calls: int = 2) -> Lease:
    return Lease(
        lease_id="l" * 24,
        prompts=(LeasePrompt(prompt_id="p", text="hello"),),
        group_size=2,
        sampling=SamplingParams(max_new_tokens=BUDGET, seed=1),
        min_version=0,
        deadline_s=60.0,
        tools=ToolUse(max_tool_calls=calls),
    )


def script(*rounds):
    """A hub answering round i with rounds[i](turn) for each turn it is sent; what it was sent, kept."""
    sent: list[TurnRequest] = []

    async def send(request: TurnRequest) -> TurnReply | Reject:
        answer = rounds[len(sent)]
        sent.append(request)
        return answer(request)

    return send, sent


def env_then_done(request: TurnRequest) -> TurnReply:
    return TurnReply(answers=tuple(RolloutAnswer(prompt_id=t.prompt_id, index=t.index, env_ids=ENV) for t in request.turns))


def done(request: TurnRequest) -> TurnReply:
    return TurnReply(answers=tuple(RolloutAnswer(prompt_id=t.prompt_id, index=t.index, done=True) for t in request.turns))


def sampling(turn: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=BUDGET, seed=turn)


def test_turns_take_the_hubs_tokens_unsampled_and_the_last_turn_is_sent_too(one_token_turns):
    send, sent = script(env_then_done, done)
    ((a, b),) = trio.run(lambda: multi_turn_groups(lease(), lease().prompts, one_token_turns, send, sampling))
    for c in (a, b):
        assert len(c.token_ids) == 5 and c.env_spans == ((1, len(ENV)),) and c.token_ids[1:4] == ENV
        assert c.logprobs[1:4] == (0.0,) * len(ENV) and c.logprobs[0] < 0.0 and c.logprobs[4] < 0.0
        assert c.finish_reason == "stop"
    assert [[t.token_ids for t in r.turns] for r in sent] == [
        [a.token_ids[:1], b.token_ids[:1]],
        [a.token_ids[4:], b.token_ids[4:]],
    ]


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (lambda r: Reject(code=RejectCode.BAD_LEASE, reason="no such lease"), "refused the turns: no such lease"),
        (lambda r: TurnReply(answers=()), "answered other rollouts"),
        (
            lambda r: TurnReply(
                answers=tuple(RolloutAnswer(prompt_id="p", index=t.index, env_ids=(1,) * BUDGET) for t in r.turns)
            ),
            "no room",
        ),
        (  # within the message's bound, past this model's embedding: it would crash the engine, not the lease
            lambda r: TurnReply(answers=tuple(RolloutAnswer(prompt_id="p", index=t.index, env_ids=(10**6,)) for t in r.turns)),
            "past this model's",
        ),
        (env_then_done, "did not end the rollouts"),
    ],
)
def test_a_hub_whose_answers_cannot_be_followed_costs_the_lease(one_token_turns, answer, words):
    send, _ = script(*[answer] * 3)
    with pytest.raises(TurnsBroken, match=words):
        trio.run(lambda: multi_turn_groups(lease(calls=1), lease().prompts, one_token_turns, send, sampling))
