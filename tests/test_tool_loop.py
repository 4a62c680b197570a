"""The hub's side of a multi-turn rollout (hub/agents/loop.py): real sandbox workers running TRL-style tools and
an environment, a real tokenizer whose chat template renders tools, and the model's turns as a node sends
them (token ids, EOS included)."""

from __future__ import annotations

import pytest
import trio

from hub.agents.loop import LoopFull, LoopLimits, ToolLoop, segment_digest
from hub.agents.sandbox import SandboxLimits, open_sandbox
from shared.chat import tool_suffix_ids
from shared.tools import RolloutEnd
from testbed.tool_chat import tool_chat_tokenizer

TOOLS = ["testbed.agent_tools:add", "testbed.agent_tools:nap"]
ENVIRONMENT = "testbed.agent_tools:Counter"
SANDBOX = SandboxLimits(wall_s=3.0, cpu_s=0.5, memory_bytes=256 * 1024**2)


@pytest.fixture(scope="module")
def tokenizer():
    return tool_chat_tokenizer()


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turn_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text + "<|im_end|>")


def run(tokenizer, body, limits=LoopLimits(), environment=ENVIRONMENT):
    async def main():
        async with open_sandbox(TOOLS, environment, SANDBOX, procs=1) as sandbox:
            return await body(ToolLoop(sandbox, tokenizer, limits))

    return trio.run(main)


def test_a_rollout_runs_its_calls_reads_the_answers_and_ends_when_a_turn_holds_none(tokenizer):
    async def body(loop):
        observation = await loop.begin("r", "node", {"start": 1})
        calls = turn_ids(tokenizer, "Adding." + call("add", a=3, b=4) + call("bump", by=2))
        first = await loop.turn("r", calls)
        answer = turn_ids(tokenizer, "The count is 3.")
        last = await loop.turn("r", answer)
        matches = loop.sent_matches("r", [calls, first.env_ids, answer])
        tampered = loop.sent_matches("r", [calls, first.env_ids[:-1] + (first.env_ids[-1] + 1,), answer])
        missing = loop.sent_matches("r", [calls, answer])
        return observation, first, last, matches, tampered, missing, await loop.end("r"), loop.rollouts, loop.tally

    observation, first, last, matches, tampered, missing, record, left, tally = run(tokenizer, body)
    assert observation == "counter at 1"
    assert tokenizer.decode(list(first.env_ids)) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert not first.done and last.done and last.end is None
    assert matches and not tampered and not missing
    assert (record.tool_calls, record.tool_failures, record.rounds, record.reward) == (2, 0, 1, 1.0)
    assert left == {}
    # What the status page and /metrics show: two calls, no error, none ended early, the sandbox's time (reset, calls,
    # reward, close).
    assert (tally.calls, tally.errors, dict(tally.ends)) == (2, 0, {}) and tally.environment_s > 0


def test_rounds_and_tokens_are_capped_as_trl_caps_them(tokenizer):
    turn = turn_ids(tokenizer, call("add", a=1, b=1))
    suffix = len(tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "2"}]))

    async def body(loop):
        await loop.begin("r", "node", {})
        answers = [await loop.turn("r", turn) for _ in range(3)]
        return answers, await loop.end("r")

    answers, record = run(tokenizer, body, LoopLimits(max_tool_calls=2))
    assert [a.done for a in answers] == [False, False, True] and answers[2].env_ids == ()
    assert record.rounds == 2 and record.tool_calls == 2

    async def long(loop):
        await loop.begin("r", "node", {})
        return [await loop.turn("r", turn) for _ in range(2)]

    fits, over = run(tokenizer, long, LoopLimits(max_completion_tokens=len(turn) + suffix + 1))
    assert not fits.done and len(fits.env_ids) == suffix  # turn and answer, and room for one model token
    assert over.done and over.env_ids == () and over.end is None  # no room after it: dropped, the sample ends

    async def full(loop):
        await loop.begin("r", "node", {})
        return await loop.turn("r", turn)

    at_cap = run(tokenizer, full, LoopLimits(max_completion_tokens=len(turn) + suffix))
    assert at_cap.done and at_cap.env_ids == ()  # an answer filling the cap leaves the model no token: dropped


def test_a_call_past_a_limit_ends_its_rollout_with_the_reason_and_no_reward(tokenizer):
    async def body(loop):
        await loop.begin("r", "node", {"start": 3})
        refused = await loop.turn("r", turn_ids(tokenizer, call("add", a=1)))  # the tool raises: the model reads it
        ended = await loop.turn("r", turn_ids(tokenizer, call("nap", seconds=3600)))
        again = await loop.turn("r", turn_ids(tokenizer, call("add", a=1, b=1)))
        return refused, ended, again, await loop.end("r"), loop.tally

    refused, ended, again, record, tally = run(tokenizer, body)
    assert not refused.done and "error" in tokenizer.decode(list(refused.env_ids))
    assert ended.done and ended.end is RolloutEnd.TOOL_WALL_TIME
    assert again.done and again.end is RolloutEnd.TOOL_WALL_TIME
    assert record.end is RolloutEnd.TOOL_WALL_TIME and record.reward is None
    # Counted once, however many turns it is answered done; the call never run is not counted.
    assert (tally.calls, tally.errors, dict(tally.ends)) == (2, 1, {"tool_wall_time": 1})
    assert tally.environment_s >= SANDBOX.wall_s


def test_open_rollouts_are_bounded_per_owner_and_in_all(tokenizer):
    async def body(loop):
        for i in range(2):
            await loop.begin(f"a{i}", "a", {})
        with pytest.raises(LoopFull):
            await loop.begin("a2", "a", {})
        await loop.begin("b0", "b", {})
        with pytest.raises(LoopFull):
            await loop.begin("c0", "c", {})
        await loop.end("a0")
        await loop.begin("c0", "c", {})
        return dict(loop.per_owner)

    per_owner = run(tokenizer, body, LoopLimits(rollouts_per_owner=2, rollouts_total=3), environment=None)
    assert per_owner == {"a": 1, "b": 1, "c": 1}


def test_segment_digests_are_of_the_exact_ids():
    assert segment_digest([1, 2]) != segment_digest([2, 1]) != segment_digest([1, 2, 0])
    assert segment_digest([70000]) != segment_digest([70000 % 65536])


def test_the_tool_call_rate_is_over_the_last_minute_of_totals():
    from hub.service.status import RecentRate

    rate = RecentRate(window_s=60.0, samples=4)
    assert rate.add(0.0, 0) is None  # one sample: no span yet
    assert rate.add(10.0, 50) == 5.0
    assert rate.add(30.0, 250) == 250 / 30
    # 70 s: the sample at 0 s is past the window; from 10 s (50) to 70 s (350)
    assert rate.add(70.0, 350) == 300 / 60
    # the bound on samples keeps the newest: 4 of them (30, 70, 80, 90)
    rate.add(80.0, 350)
    assert rate.add(90.0, 350) == (350 - 250) / 60
