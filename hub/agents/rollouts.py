"""The hub's multi-turn rollouts by lease: opened when a lease is granted, answered turn by turn as its node sends
them (TURN_PROTOCOL), settled when its answer comes, and ended with the lease.

- Grant: each of the lease's prompts x group_size rollouts opens in the tool loop (hub/agents/loop.py), charged to
  the node. With an environment, each rollout's environment is made and reset with the prompt's row, and the
  observation reset() returns is appended to the prompt's last message, which is rendered again with the tools'
  schemas (TRL's GRPOTrainer does the same). A group is trained against one prompt, so a rollout whose reset()
  answered otherwise than its group's first is ended at once (RolloutEnd.OBSERVATION_DIFFERS).
- Turns: a request names the node's open lease and some of its rollouts (prompt id, completion index), each with
  the ids of its next model turn; anything else, a token id past the vocabulary or a turn past the rollout's token
  budget is the peer's fault. The turns of one request are answered concurrently, each through the loop.
- Settling: every completion of an answer must be a rollout the hub saw to its end. One that is not (never opened
  here: the hub restarted, say; or still unfinished) has its group rejected. A settled rollout's environment is
  asked for its reward (get_reward()) and ended; what the hub sent it (digests of its environment segments, which
  `sent_matches` holds a submission to: hub/trust/submissions.py refuses a cheat's) and its account are kept until
  the lease closes, for the same answer sent again.
- Ending: every rollout still open when its lease closes (answered, expired, given back) ends, its environment
  with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from hub.agents.loop import LoopFull, RolloutRecord, ToolLoop, TurnAnswer, segment_digest
from hub.agents.sandbox import SandboxFull
from hub.records.leases import LeaseRecord
from shared.messages import RejectCode, RolloutAnswer, Submission, ToolUse, TurnReply, TurnRequest, turns_per_request
from shared.tasks.base import Prompt
from shared.tasks.dataset import DatasetTask, Messages
from shared.tools import RolloutEnd, rollout_key
from shared.wire import PeerFault

# Why a completion's group is rejected when its rollout was not the hub's to settle.
# Whom the hub's own held-out rollouts are charged to in the tool loop's bounds (no node's peer id looks like it).
EVAL_OWNER = "held-out evaluation"
UNKNOWN_ROLLOUT = "a rollout this hub did not open (it restarted since the lease) or never answered to its end"


class AgentsBusy(Exception):
    """The tool loop or its sandbox holds all the rollouts or environments it may: no multi-turn lease now."""


@dataclass(frozen=True)
class Settled:
    """A rollout whose completion was submitted: the digests of what it exchanged with the hub (its model turns
    and the tool answers it got, in order), and its account."""

    digests: tuple[str, ...]
    record: RolloutRecord


@dataclass(frozen=True)
class SettledAnswer:
    """What a submission's rollouts came to: each one's account by (prompt id, index), and the prompts whose groups
    hold a rollout that was not the hub's to settle (their groups are rejected: what the hub sent them is unknown
    here, so they are no cheat's either)."""

    records: dict[tuple[str, int], RolloutRecord]
    unknown: frozenset[str]

    def environment_rewards(self, prompt_id: str, n: int) -> tuple[float | None, ...]:
        """The environment's get_reward() of each of a settled group's `n` rollouts (None: it ended early)."""
        return tuple(self.records[(prompt_id, i)].reward for i in range(n))


def with_observation(messages: Messages, observation: str) -> Messages:
    """The prompt's messages with an environment's reset() observation appended to the last one's text, as TRL
    appends it."""
    *head, last = messages
    return (*head, {**last, "content": last["content"] + observation})


class AgentRollouts:
    """The rollouts of every multi-turn lease; see the module docstring."""

    def __init__(
        self,
        loop: ToolLoop,
        task: DatasetTask,
        render: Callable[[Messages], str],
        group_size: int,
        vocab_size: int,
        max_new_tokens: int,
        environment_name: str | None,
    ) -> None:
        """`render`: messages -> prompt text, with the tools' schemas; `environment_name`: the reward column the
        environment's get_reward() goes under (TRL's: its class name; None: no environment reward)."""
        self.loop = loop
        self.task = task
        self.render = render
        self.group_size = group_size
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.environment_name = environment_name
        self.tool_use = ToolUse(max_tool_calls=loop.limits.max_tool_calls)
        self.keys: dict[str, set[str]] = {}  # open rollouts by lease
        self.settled: dict[str, dict[str, Settled]] = {}  # settled rollouts by lease, until it closes
        self.answering: set[str] = set()  # rollouts whose turn is being answered now
        self._closing_send, self._closing = trio.open_memory_channel[str](math.inf)

    # -- the sandbox's life -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the sandbox's workers (they import the operator's tools: SandboxBroken when they cannot)."""
        await self.loop.sandbox.start()

    def stop(self) -> None:
        self.loop.sandbox.stop()

    async def run(self) -> None:
        """End the rollouts of each lease that closes (a component of the hub's nursery), each lease apart: one
        node's calls still queued in the sandbox delay its own leases' ends, not every node's."""
        async with trio.open_nursery() as nursery:
            async for lease_id in self._closing:
                nursery.start_soon(self._end_lease, lease_id)

    # -- grant ---------------------------------------------------------------------------------

    async def open_lease(self, lease: LeaseRecord) -> tuple[Prompt, ...]:
        """Open every rollout of a lease just granted, charged to its node: the lease's prompts as its node is to
        read them (with an environment, rendered with their observations). AgentsBusy (nothing left open) when the
        loop or the sandbox is full."""
        return await self._open(lease.lease_id, lease.node_id, lease.prompts, self.group_size)

    async def _open(self, lease_id: str, owner: str, prompts: Sequence[Prompt], n: int) -> tuple[Prompt, ...]:
        """Open `n` rollouts of each of `prompts` (the task's) under `lease_id`, charged to `owner`."""
        keys = self.keys.setdefault(lease_id, set())
        try:
            return tuple([await self._open_group(lease_id, owner, prompt, keys, n) for prompt in prompts])
        except (LoopFull, SandboxFull) as exc:
            if self.keys.get(lease_id) is keys:
                del self.keys[lease_id]
            await self._end_keys(keys)
            raise AgentsBusy(str(exc)) from None

    async def _open_group(self, lease_id: str, owner: str, prompt: Prompt, keys: set[str], n: int) -> Prompt:
        row = self.task.row_of(prompt.id) if self.loop.sandbox.environment_spec is not None else {}
        observations: dict[str, str | None] = {}
        for index in range(n):
            key = rollout_key(lease_id, prompt.id, index)
            keys.add(key)
            observations[key] = await self.loop.begin(key, owner, dict(row))
            if self.keys.get(lease_id) is not keys:  # the lease closed meanwhile (its node left, say)
                raise LoopFull(f"lease {lease_id[:8]} closed while its rollouts were opened")
        live = [key for key in observations if not self.loop.done(key)]  # a reset past a limit ended its rollout
        first = observations[live[0]] if live else None
        for key in live[1:]:
            if observations[key] != first:
                self.loop.stop(key, RolloutEnd.OBSERVATION_DIFFERS)
        messages = self.task.messages_of(prompt.id)
        if first is None or messages is None:
            return prompt
        text = await trio.to_thread.run_sync(self.render, with_observation(messages, first))
        return dataclasses.replace(prompt, text=text)

    # -- turns ---------------------------------------------------------------------------------

    async def turns(self, lease: LeaseRecord, request: TurnRequest) -> TurnReply:
        """The answers to a node's turns under its open lease `lease` (PeerFault: a turn it may not send)."""
        keys = [self._checked_key(lease, turn.prompt_id, turn.index, turn.token_ids) for turn in request.turns]
        if len(keys) > turns_per_request(self.max_new_tokens):
            raise PeerFault(f"{len(keys)} turns in one request, more than {turns_per_request(self.max_new_tokens)}")
        answers: list[TurnAnswer | None] = [None] * len(keys)
        self.answering.update(keys)
        try:
            async with trio.open_nursery() as nursery:
                for i, (key, turn) in enumerate(zip(keys, request.turns)):
                    nursery.start_soon(self._answer, answers, i, key, turn.token_ids)
        finally:
            self.answering.difference_update(keys)
        return TurnReply(
            answers=tuple(
                RolloutAnswer(
                    prompt_id=turn.prompt_id,
                    index=turn.index,
                    env_ids=answer.env_ids,
                    done=answer.done,
                    end=answer.end.value if answer.end is not None else None,
                )
                for turn, answer in zip(request.turns, answers)
                if answer is not None
            )
        )

    def _checked_key(self, lease: LeaseRecord, prompt_id: str, index: int, token_ids: Sequence[int]) -> str:
        """The loop's key of a turn the node may send: a rollout of its lease, open, not being answered, the turn
        within the vocabulary and the rollout's token budget."""
        key = rollout_key(lease.lease_id, prompt_id, index)
        if index >= self.group_size or key not in self.keys.get(lease.lease_id, ()):
            raise PeerFault(f"lease {lease.lease_id[:8]} holds no rollout {index} of prompt {prompt_id[:40]!r}")
        if key not in self.loop.rollouts:
            raise PeerFault(f"rollout {index} of prompt {prompt_id[:40]!r} was submitted already", RejectCode.BAD_LEASE)
        if key in self.answering:
            raise PeerFault(f"rollout {index} of prompt {prompt_id[:40]!r} has a turn being answered already")
        if max(token_ids) >= self.vocab_size:
            raise PeerFault(f"a token id past the vocabulary ({self.vocab_size}) in a turn of prompt {prompt_id[:40]!r}")
        if self.loop.tokens_of(key) + len(token_ids) > self.max_new_tokens:
            raise PeerFault(f"a turn past the rollout's {self.max_new_tokens} tokens (prompt {prompt_id[:40]!r})")
        return key

    async def _answer(self, answers: list[TurnAnswer | None], i: int, key: str, token_ids: Sequence[int]) -> None:
        answers[i] = await self.loop.turn(key, token_ids)

    # -- an answer -----------------------------------------------------------------------------

    def holds(self, lease_id: str) -> bool:
        """Whether `lease_id` is a multi-turn lease of this hub (its rollouts opened here)."""
        return lease_id in self.keys or lease_id in self.settled

    async def settle(self, submission: Submission) -> SettledAnswer:
        """Each submitted completion's rollout settled: ended, its environment's reward asked; the answer's groups
        holding a rollout the hub did not see through are named."""
        records: dict[tuple[str, int], RolloutRecord] = {}
        unknown: set[str] = set()
        for group in submission.groups:
            for index in range(min(len(group.completions), self.group_size)):
                record = await self._settled(submission.lease_id, rollout_key(submission.lease_id, group.prompt_id, index))
                if record is None:
                    unknown.add(group.prompt_id)
                else:
                    records[(group.prompt_id, index)] = record
        return SettledAnswer(records, frozenset(unknown))

    async def _settled(self, lease_id: str, key: str) -> RolloutRecord | None:
        done = self.settled.get(lease_id, {}).get(key)
        if done is not None:  # the same answer sent again (its reply was lost, or the hub was busy)
            return done.record
        if key not in self.keys.get(lease_id, ()) or key not in self.loop.rollouts or not self.loop.done(key):
            return None
        self.keys[lease_id].discard(key)
        sent = self.loop.exchanged_digests(key)
        record = await self.loop.end(key)
        assert record is not None, "an open rollout's end gives its record"
        self.settled.setdefault(lease_id, {})[key] = Settled(sent, record)
        return record

    def sent_matches(self, key: str, segments: Sequence[Sequence[int]]) -> bool:
        """Whether a submitted rollout's environment segments are exactly, and all of, what the hub sent it (its
        rollout open or settled; False for one it does not know)."""
        lease_id = key.partition("/")[0]
        done = self.settled.get(lease_id, {}).get(key)
        if done is not None:
            return tuple(segment_digest(ids) for ids in segments) == done.digests
        return self.loop.sent_matches(key, segments)

    # -- held-out evaluation --------------------------------------------------------------------

    async def open_evaluation(self, name: str, prompts: Sequence[Prompt], n: int) -> tuple[Prompt, ...]:
        """Open `n` rollouts of each held-out prompt under `name` (a pseudo-lease of the hub's own, charged to
        EVAL_OWNER): the prompts as the model is to read them. AgentsBusy when the loop or the sandbox is full."""
        return await self._open(name, EVAL_OWNER, prompts, n)

    async def answer_evaluation(self, turns: Sequence[tuple[str, Sequence[int]]]) -> list[TurnAnswer]:
        """The answers to held-out rollouts' turns ((key, the turn's ids) each), run concurrently."""
        answers: list[TurnAnswer | None] = [None] * len(turns)
        async with trio.open_nursery() as nursery:
            for i, (key, token_ids) in enumerate(turns):
                nursery.start_soon(self._answer, answers, i, key, token_ids)
        return [a for a in answers if a is not None]

    async def close_evaluation(self, name: str) -> dict[str, float | None]:
        """End every rollout of `name`, each environment asked for its reward first (a rollout ended early gets
        none): the rewards by rollout key."""
        rewards: dict[str, float | None] = {}
        for key in sorted(self.keys.pop(name, set())):
            record = await self.loop.end(key)
            rewards[key] = record.reward if record is not None else None
        return rewards

    # -- a lease's end -------------------------------------------------------------------------

    def lease_closed(self, lease: LeaseRecord) -> None:
        """LeaseBook's hook: `lease` closed; its rollouts end (in `run`)."""
        if self.holds(lease.lease_id):
            self._closing_send.send_nowait(lease.lease_id)

    async def _end_lease(self, lease_id: str) -> None:
        await self._end_keys(self.keys.pop(lease_id, set()))
        self.settled.pop(lease_id, None)

    async def _end_keys(self, keys: set[str]) -> None:
        """End the rollouts `keys` names, unrewarded (their answer never came): drained, since a grant still opening
        them may add to the set meanwhile."""
        while keys:
            await self.loop.end(keys.pop(), reward=False)
