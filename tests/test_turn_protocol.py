"""A multi-turn lease's turns (TURN_PROTOCOL): the messages' bounds, and a real hub service on loopback (its real
state, store, tool sandbox and a model whose chat template renders tools) answering an honest volunteer's turns,
refusing the turns it may not send, settling its answer with the environment's reward, and banning a volunteer
that altered the environment's tokens. The volunteer is a hand-driven client speaking the protocol directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from pydantic import ValidationError

from hub.config import AgentsConfig, DatasetConfig, HubConfig, LearnerConfig, LeaseConfig
from node.client import HubClient
from shared.crypto import Identity
from shared.messages import (
    MAX_TOKEN_ID,
    TOKEN_ID_JSON_BYTES,
    TURN_JSON_BYTES,
    JoinReply,
    JoinRequest,
    Lease,
    LeaseReply,
    Reject,
    RejectCode,
    RolloutAnswer,
    RolloutTurn,
    Submission,
    SubmitReply,
    SubmittedGroup,
    ToolUse,
    TurnReply,
    TurnRequest,
    turns_per_request,
)
from shared.net import running_host
from shared.rollout import Completion, SamplingParams
from testbed.inproc import PERMISSIVE_TRUST, inproc_hub, wait_state
from testbed.tool_chat import random_tool_model, tool_chat_tokenizer

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
MAX_NEW_TOKENS = 200
CALL = '<tool_call>\n{"name": "bump", "arguments": {"by": 3}}\n</tool_call><|im_end|>'
DONE = "done<|im_end|>"


# -- the messages ----------------------------------------------------------------------------------


def test_turn_messages_bound_every_number_before_the_hub_reads_a_key():
    turn = {"prompt_id": "p", "index": 0, "token_ids": (1, 2)}
    TurnRequest(lease_id="l", turns=(RolloutTurn(**turn), RolloutTurn(**{**turn, "index": 1})))
    bad = [
        {"turns": (RolloutTurn(**turn), RolloutTurn(**turn))},  # two turns of one rollout
        {"turns": ()},
    ]
    for fields in bad:
        with pytest.raises(ValidationError):
            TurnRequest(lease_id="l", **fields)
    for fields in ({"token_ids": ()}, {"token_ids": (MAX_TOKEN_ID,)}, {"token_ids": (-1,)}, {"index": 256}):
        with pytest.raises(ValidationError):
            RolloutTurn(**{**turn, **fields})
    RolloutAnswer(prompt_id="p", index=0, env_ids=(5,))
    RolloutAnswer(prompt_id="p", index=0, done=True, end="tool_cpu")
    for fields in ({"done": True, "env_ids": (5,)}, {}, {"done": True, "end": "Not a reason"}):
        with pytest.raises(ValidationError):
            RolloutAnswer(prompt_id="p", index=0, **fields)
    for calls in (0, 257):
        with pytest.raises(ValidationError):
            ToolUse(max_tool_calls=calls)


def test_a_request_of_turns_per_request_turns_gets_a_reply_within_its_frame():
    """The reply's bytes grow as TURN_JSON_BYTES + TOKEN_ID_JSON_BYTES a token per answer at most (the widest ids, the
    longest prompt id), so the answers turns_per_request allows, each at the whole budget, fit TurnReply.MAX_BYTES."""
    tokens = 1000
    answer = RolloutAnswer(prompt_id="p" * 200, index=255, env_ids=(MAX_TOKEN_ID - 1,) * tokens)
    one = len(TurnReply(answers=(answer,)).model_dump_json())
    assert one <= TURN_JSON_BYTES + tokens * TOKEN_ID_JSON_BYTES
    for budget in (1, 512, 65536):
        n = turns_per_request(budget)
        assert n >= 1 and n * (TURN_JSON_BYTES + budget * TOKEN_ID_JSON_BYTES) <= TurnReply.MAX_BYTES
    assert turns_per_request(65536) < turns_per_request(512) == 1024


# -- a real hub ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The hub's model: its turns are written by hand here, so a random one over the tool-chat tokenizer."""
    return random_tool_model(tmp_path_factory.mktemp("tool-model"))


def config(tmp_path: Path) -> HubConfig:
    task = tmp_path / "bump.jsonl"
    task.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Bump to 3 ({i})."}]}) + "\n" for i in range(4)))
    return HubConfig(
        task=str(task),
        learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=2),
        lease=LeaseConfig(prompts_per_lease=2),
        trust=PERMISSIVE_TRUST,
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
        dataset=DatasetConfig(reward="testbed.agent_tools:said_done"),
        agents=AgentsConfig(tools=("testbed.agent_tools:add",), environment="testbed.agent_tools:Counter", tool_procs=1),
    )


class Volunteer(HubClient):
    """Joins, takes leases, sends turns and answers by hand."""

    def __init__(self, host, identity, hub) -> None:
        super().__init__(host, identity, hub.addr, timeout_s=20.0)
        self.hub = hub
        self.tokenizer = tool_chat_tokenizer()

    async def join_hub(self, backend: str = "hf") -> JoinReply | Reject:
        return await self.join(
            JoinRequest(
                price_per_hour=0.5,
                hardware="test",
                link_bps=1e8,
                backend=backend,
                dtype="float32",
                model_config_hash=self.hub.config_hash,
                version_held=0,
            )
        )

    async def take_lease(self) -> Lease:
        reply = await self.lease(0)
        assert isinstance(reply, LeaseReply) and reply.lease is not None, reply
        return reply.lease

    def ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    async def send(self, lease_id: str, *turns: tuple[str, int, tuple[int, ...]]) -> TurnReply | Reject:
        request = TurnRequest(lease_id=lease_id, turns=tuple(RolloutTurn(prompt_id=p, index=i, token_ids=t) for p, i, t in turns))
        return await self.turns(request, timeout_s=20.0)

    async def honest_group(self, lease: Lease, prompt_id: str) -> tuple[Completion, Completion]:
        """Rollout 0 calls bump(3) then says done; rollout 1 says done at once: both as the hub answers them."""
        first = await self.send(lease.lease_id, (prompt_id, 0, self.ids(CALL)), (prompt_id, 1, self.ids(DONE)))
        assert isinstance(first, TurnReply), first
        called, finished = first.answers
        assert not called.done and finished.done and finished.end is None
        assert "<tool_response>\n3\n</tool_response>" in self.tokenizer.decode(list(called.env_ids))
        last = await self.send(lease.lease_id, (prompt_id, 0, self.ids(DONE)))
        assert isinstance(last, TurnReply) and last.answers[0].done, last
        return self.completion([self.ids(CALL), called.env_ids, self.ids(DONE)]), self.completion([self.ids(DONE)])

    def completion(self, segments: list[tuple[int, ...]]) -> Completion:
        """Model turns and environment segments alternating, the first a model turn."""
        ids, logprobs, spans = [], [], []
        for i, segment in enumerate(segments):
            if i % 2:
                spans.append((len(ids), len(segment)))
            ids += segment
            logprobs += [0.0 if i % 2 else -0.5] * len(segment)
        return Completion(
            token_ids=tuple(ids), logprobs=tuple(logprobs), finish_reason="stop", version=0, text="", env_spans=tuple(spans)
        )

    async def answer(self, lease: Lease, groups: dict[str, tuple[Completion, Completion]]) -> SubmitReply:
        submission = Submission(
            lease_id=lease.lease_id,
            node_id=self.peer_id,
            groups=tuple(SubmittedGroup(prompt_id=pid, completions=group) for pid, group in groups.items()),
        )
        reply = await self.submit(submission)
        assert isinstance(reply, SubmitReply), reply
        return reply


def refused(reply: TurnReply | Reject, code: RejectCode, words: str) -> None:
    assert isinstance(reply, Reject) and reply.code == code and words in reply.reason, reply


def test_a_hub_answers_honest_turns_refuses_the_rest_and_bans_an_altered_environment(tmp_path, tool_model):
    async def main():
        mine, theirs = Identity.generate(), Identity.generate()
        async with inproc_hub(tmp_path / "hub", tool_model, config(tmp_path)) as hub:
            async with running_host(mine, [LOOPBACK]) as (host, _), running_host(theirs, [LOOPBACK]) as (other, _):
                await node_flow(hub, Volunteer(host, mine, hub), Volunteer(other, theirs, hub))

    trio.run(main)


async def node_flow(hub, node: Volunteer, stranger: Volunteer) -> None:
    await node.connect()
    assert isinstance(await node.join_hub(), JoinReply)
    probe = await node.take_lease()
    assert probe.tools == ToolUse(max_tool_calls=8)
    (prompt,) = probe.prompts
    # The environment's reset() observation, appended to the prompt as TRL appends it; the tools in the prompt.
    assert "counter at 0<|im_end|>" in prompt.text and '"name": "bump"' in prompt.text and '"name": "add"' in prompt.text
    pid, ok = prompt.prompt_id, node.ids(DONE)
    refused(await node.send("f" * 24, (pid, 0, ok)), RejectCode.BAD_LEASE, "no open lease")
    refused(await node.send(probe.lease_id, ("row-99", 0, ok)), RejectCode.BAD_REQUEST, "holds no rollout")
    refused(await node.send(probe.lease_id, (pid, 2, ok)), RejectCode.BAD_REQUEST, "holds no rollout")
    refused(await node.send(probe.lease_id, (pid, 0, (5000,))), RejectCode.BAD_REQUEST, "past the vocabulary")
    refused(await node.send(probe.lease_id, (pid, 0, (5,) * (MAX_NEW_TOKENS + 1))), RejectCode.BAD_REQUEST, "past the")
    await stranger.connect()
    refused(await stranger.send(probe.lease_id, (pid, 0, ok)), RejectCode.UNKNOWN_NODE, "")
    # A vLLM node runs tool-using rollouts as a transformers one does (node/vllm_engine.py): its join is taken.
    assert isinstance(await stranger.join_hub(backend="vllm"), JoinReply)

    group = await node.honest_group(probe, pid)
    reply = await node.answer(probe, {pid: group})
    assert reply.accepted == 1 and not reply.rejected, reply
    ((_, kept),) = hub.state.store.groups.unconsumed_groups()
    # TRL's reward column of the environment (Counter.get_reward: its count is 3), added with weight 1.
    assert dict(kept.reward_parts)["Counter"] == (1.0, 0.0)
    assert kept.rewards == (2.0, 1.0) and kept.completions[0].env_spans == group[0].env_spans
    refused(await node.send(probe.lease_id, (pid, 0, ok)), RejectCode.BAD_LEASE, "no open lease")
    assert not hub.state.agents.loop.rollouts  # every rollout of the answered lease ended, its environment too

    await wait_state(hub, node.peer_id, "active")
    # An answer whose rollouts the hub never saw end (no turn sent): rejected, and no cheat's (its node stays).
    unturned = await node.take_lease()
    made_up = {p.prompt_id: (node.completion([node.ids(DONE)]),) * 2 for p in unturned.prompts}
    reply = await node.answer(unturned, made_up)
    assert reply.accepted == 0 and reply.reasons == {"lease": 2}, reply
    assert hub.state.fleet.get(node.peer_id).state == "active"
    lease = await node.take_lease()
    groups = {p.prompt_id: await node.honest_group(lease, p.prompt_id) for p in lease.prompts}
    altered, done = next(iter(groups.values()))
    ids = list(altered.token_ids)
    start = altered.env_spans[0][0]
    ids[start] = (ids[start] + 1) % 200
    groups[next(iter(groups))] = (altered.model_copy(update={"token_ids": tuple(ids)}), done)
    reply = await node.answer(lease, groups)
    assert reply.reasons.get("environment") == 1, reply  # (the other group, made by hand, repeats the probe's: a copy)
    await wait_state(hub, node.peer_id, "banned")
