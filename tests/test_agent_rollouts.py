"""The hub's book of multi-turn rollouts (hub/agents/rollouts.py) over a real tool loop, sandbox workers and a
tokenizer whose template renders tools: what opens with a lease, what a group whose environments disagree on their
prompt does, and that every rollout ends with its lease."""

from __future__ import annotations

import json
import re

import trio

from hub.agents.loop import LoopLimits, ToolLoop
from hub.agents.rollouts import AgentRollouts
from hub.agents.sandbox import SandboxLimits, open_sandbox
from hub.agents.toolset import load_toolset
from hub.records.leases import LeaseRecord
from shared.messages import RolloutTurn, Submission, SubmittedGroup, TurnRequest
from shared.rollout import Completion
from shared.tasks.dataset import DatasetOptions, DatasetTask, chat_renderer
from shared.tools import RolloutEnd
from testbed.tool_chat import tool_chat_tokenizer

SANDBOX = SandboxLimits(wall_s=5.0, cpu_s=1.0, memory_bytes=256 * 1024**2)


def rollouts_over(tmp_path, environment: str, body):
    """Run `body(agents, lease)` on the rollouts of a run with `environment`, a lease of one prompt x 2."""
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Roll."}]}) + "\n")
    tokenizer = tool_chat_tokenizer()
    schemas = load_toolset([], environment).schemas
    render = chat_renderer(tokenizer, "test", schemas)
    task = DatasetTask(path, DatasetOptions(reward="testbed.agent_tools:said_done", keep_rows=True), lambda: render)
    lease = LeaseRecord("l" * 24, "node", tuple(task.prompts()), 0, 0.0, 1e9, 0.0)

    async def main():
        async with open_sandbox([], environment, SANDBOX, procs=1) as sandbox:
            loop = ToolLoop(sandbox, tokenizer, LoopLimits(max_tool_calls=2, max_completion_tokens=100))
            agents = AgentRollouts(loop, task, render, 2, len(tokenizer), 100, None)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agents.run)
                out = await body(agents, lease)
                nursery.cancel_scope.cancel()
            return out

    return trio.run(main)


def test_a_rollout_whose_environment_answers_its_reset_otherwise_than_its_group_ends_at_once(tmp_path):
    async def body(agents, lease):
        (prompt,) = await agents.open_lease(lease)
        eos = tuple(agents.loop.tokenizer.encode("ok<|im_end|>"))
        turns = (RolloutTurn(prompt_id=prompt.id, index=i, token_ids=eos) for i in range(2))
        reply = await agents.turns(lease, TurnRequest(lease_id=lease.lease_id, turns=tuple(turns)))
        return prompt.text, reply

    text, reply = rollouts_over(tmp_path, "testbed.agent_tools:Dice", body)
    # The group's prompt carries its first rollout's observation; the second's differed, so it was ended at once.
    assert re.search(r"Roll\.you rolled \d+<\|im_end\|>\n<\|im_start\|>assistant\n$", text), text
    assert [(a.done, a.end) for a in reply.answers] == [(True, None), (True, RolloutEnd.OBSERVATION_DIFFERS.value)]


def test_a_rollout_never_turned_is_unsettled_and_every_rollout_ends_with_its_lease(tmp_path):
    async def body(agents, lease):
        (prompt,) = await agents.open_lease(lease)
        opened = len(agents.loop.rollouts)
        completion = Completion(token_ids=(5,), logprobs=(-1.0,), finish_reason="stop", version=0, text="")
        group = SubmittedGroup(prompt_id=prompt.id, completions=(completion,) * 2)
        # No turn was sent: the hub never saw these rollouts end, so it cannot say what they were sent.
        settled = await agents.settle(Submission(lease_id=lease.lease_id, node_id="node", groups=(group,)))
        agents.lease_closed(lease)
        with trio.fail_after(10):
            while agents.loop.rollouts or agents.loop.sandbox.pinned:
                await trio.sleep(0.01)
        return opened, settled

    opened, settled = rollouts_over(tmp_path, "testbed.agent_tools:Counter", body)
    assert opened == 2 and settled.unknown == {"row-1"} and not settled.records


def test_a_lease_that_closes_while_its_environments_open_ends_them_all_and_the_hub_goes_on(tmp_path):
    """Its node left (or was banned) while the grant still opened its rollouts: the grant is refused, every rollout
    it opened ends and its environment goes, and the book's own task keeps running (it once died of a set changed
    while iterated, taking the hub with it)."""
    from hub.agents.rollouts import AgentsBusy

    async def body(agents, lease):
        begin = agents.loop.begin

        async def close_after_first(key, owner, row):
            observation = await begin(key, owner, row)
            agents.lease_closed(lease)
            await trio.sleep(0.05)  # the book's task ends the lease now, mid-grant
            return observation

        agents.loop.begin = close_after_first
        try:
            await agents.open_lease(lease)
        except AgentsBusy as exc:
            refused = str(exc)
        agents.loop.begin = begin
        with trio.fail_after(10):
            while agents.loop.rollouts or agents.loop.sandbox.pinned:
                await trio.sleep(0.01)
        other = LeaseRecord("m" * 24, "node", lease.prompts, 0, 0.0, 1e9, 0.0)
        (prompt,) = await agents.open_lease(other)  # the book still serves
        return refused, len(agents.loop.rollouts), agents.keys.keys()

    refused, opened, leases = rollouts_over(tmp_path, "testbed.agent_tools:Counter", body)
    assert "closed while its rollouts were opened" in refused
    assert opened == 2 and set(leases) == {"m" * 24}
