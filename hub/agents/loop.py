"""The tool-calling loop of a multi-turn rollout, on the hub's side, as TRL's GRPOTrainer runs it.

A node generates a model turn and sends its token ids; the hub reads the turn's tool calls, runs them in the
sandbox (hub/agents/sandbox.py), and answers with the ids of the tool messages the model reads next, cut
from the chat template (hub/agents/turns.py). The node appends them and generates the next turn. A rollout is
done when a turn holds no call, after `max_tool_calls` rounds (TRL's max_tool_calling_iterations), or when a
tool answer would leave it no room for a model token within `max_completion_tokens` (TRL drops an answer that
would take it past, and ends the sample as it is; here a rollout also ends on a token the model sampled).
A call that breaks a sandbox limit ends the rollout with its reason. Decoding a turn and rendering an answer run
in a worker thread, one at a time (the loop's tokenizer is its own, and not for two threads at once).

The hub keeps a digest of every environment segment it sent, so a submitted trajectory whose environment
tokens differ from what the hub sent is a cheat's (`sent_matches`). Rollouts are bounded per owner (a node)
and in all; a rollout's environment goes with `end`, which the lease's end calls for every rollout left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import blake3
import trio

from hub.agents.sandbox import ToolSandbox
from hub.agents.turns import parse_turn
from shared.chat import tool_suffix_ids
from shared.tools import RolloutEnd


@dataclass(frozen=True)
class LoopLimits:
    """A rollout's bounds (TRL's names in the comments) and how many the hub holds open."""

    max_tool_calls: int = 8  # rounds of tool calls a rollout may run (max_tool_calling_iterations)
    max_completion_tokens: int = 1024  # model and tool tokens after the prompt (max_completion_length)
    rollouts_per_owner: int = 4096
    rollouts_total: int = 65536


@dataclass(frozen=True)
class TurnAnswer:
    """What the node does next: append `env_ids` and generate again, or stop (`done`), ended early if `end`."""

    env_ids: tuple[int, ...] = ()
    done: bool = False
    end: RolloutEnd | None = None


@dataclass
class _Rollout:
    owner: str
    tokens: int = 0
    rounds: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    exchanged: list[str] = field(default_factory=list)  # digests of each model turn received and tool answer sent
    done: bool = False
    end: RolloutEnd | None = None


@dataclass(frozen=True)
class RolloutRecord:
    """A finished rollout's account: what it cost and the environment's reward, if it has one."""

    tool_calls: int
    tool_failures: int
    rounds: int
    end: RolloutEnd | None
    reward: float | None


@dataclass
class ToolTally:
    """What the loop ran since the hub started (shared.messages.ToolTotals shows it)."""

    calls: int = 0
    errors: int = 0
    ends: Counter[str] = field(default_factory=Counter)
    environment_s: float = 0.0


_T = TypeVar("_T")


class LoopFull(Exception):
    """The owner, or the hub, holds its bound of open rollouts."""


def segment_digest(ids: Sequence[int]) -> str:
    """blake3 of a segment's ids (a model turn or a tool answer): what the hub keeps of what was exchanged."""
    return blake3.blake3(b"".join(int(token).to_bytes(4, "little") for token in ids)).hexdigest()


class ToolLoop:
    """Open rollouts by key: each turn answered, each environment segment remembered."""

    def __init__(self, sandbox: ToolSandbox, tokenizer: Any, limits: LoopLimits) -> None:
        self.sandbox = sandbox
        self.tokenizer = tokenizer
        self.limits = limits
        self.rollouts: dict[str, _Rollout] = {}
        self.per_owner: dict[str, int] = {}
        self.tally = ToolTally()
        self._tokenizing = trio.CapacityLimiter(1)

    async def begin(self, key: str, owner: str, row: dict[str, Any]) -> str | None:
        """Open rollout `key` for `owner`: the observation its environment's reset() appends to the prompt
        (None: none, or no environment). LoopFull past the bounds; a reset that breaks a limit ends it at once."""
        if len(self.rollouts) >= self.limits.rollouts_total or self.per_owner.get(owner, 0) >= self.limits.rollouts_per_owner:
            raise LoopFull(f"{len(self.rollouts)} rollouts open, {self.per_owner.get(owner, 0)} of them {owner[-8:]}'s")
        if key in self.rollouts:
            raise LoopFull(f"rollout {key} is already open")
        rollout = self.rollouts[key] = _Rollout(owner)
        self.per_owner[owner] = self.per_owner.get(owner, 0) + 1
        if self.sandbox.environment_spec is None:
            return None
        opened = await self._timed(self.sandbox.open_environment(key, row, owner))
        if opened.end is not None or opened.error:
            self._stop(rollout, opened.end or RolloutEnd.TOOL_CRASHED)
            return None
        return opened.text

    async def turn(self, key: str, model_ids: Sequence[int]) -> TurnAnswer:
        """The answer to rollout `key`'s next model turn (its ids, as sampled, its EOS included)."""
        rollout = self.rollouts[key]
        # Every turn a node sends is what its submission must hold, whatever the answer (and counts against the
        # rollout's token budget, which bounds how many it can send).
        rollout.exchanged.append(segment_digest(model_ids))
        rollout.tokens += len(model_ids)
        if rollout.done:
            return TurnAnswer(done=True, end=rollout.end)
        if rollout.tokens >= self.limits.max_completion_tokens:  # no room left for an answer: no call is run
            return self._stop(rollout, None)
        parsed = await trio.to_thread.run_sync(lambda: parse_turn(self._text(model_ids)), limiter=self._tokenizing)
        if parsed.end is not None:
            return self._stop(rollout, parsed.end)
        if not parsed.calls or rollout.rounds >= self.limits.max_tool_calls:
            return self._stop(rollout, None)
        rollout.rounds += 1
        messages = []
        for call in parsed.calls:
            rollout.tool_calls += 1
            self.tally.calls += 1
            outcome = await self._timed(self.sandbox.call(key, call.name, call.arguments, rollout.owner))
            if outcome.end is not None:
                return self._stop(rollout, outcome.end)
            rollout.tool_failures += outcome.error
            self.tally.errors += outcome.error
            messages.append({"role": "tool", "name": call.name, "content": outcome.text or ""})
        env_ids = tuple(await trio.to_thread.run_sync(tool_suffix_ids, self.tokenizer, messages, limiter=self._tokenizing))
        if rollout.tokens + len(env_ids) >= self.limits.max_completion_tokens:
            return self._stop(rollout, None)  # as TRL: an answer without room after it is dropped, the sample ends
        rollout.tokens += len(env_ids)
        rollout.exchanged.append(segment_digest(env_ids))
        return TurnAnswer(env_ids=env_ids)

    def stop(self, key: str, end: RolloutEnd) -> None:
        """End open rollout `key` early, for `end`: its next turn is answered done."""
        self._stop(self.rollouts[key], end)

    def done(self, key: str) -> bool:
        """Whether open rollout `key` is done (its last turn answered done)."""
        return self.rollouts[key].done

    def tokens_of(self, key: str) -> int:
        """The model and environment tokens open rollout `key` holds after its prompt."""
        return self.rollouts[key].tokens

    def exchanged_digests(self, key: str) -> tuple[str, ...]:
        """The digests of what open rollout `key` exchanged, in order: each model turn it was sent and each tool
        answer it got."""
        return tuple(self.rollouts[key].exchanged)

    def sent_matches(self, key: str, segments: Sequence[Sequence[int]]) -> bool:
        """Whether a submitted trajectory's segments (Completion.segments: model turns and tool answers, in order)
        are exactly, and all of, what the rollout exchanged with the hub."""
        rollout = self.rollouts.get(key)
        return rollout is not None and [segment_digest(ids) for ids in segments] == rollout.exchanged

    async def end(self, key: str, reward: bool = True) -> RolloutRecord | None:
        """Close rollout `key` (done, submitted, or its lease over): its account, its environment's reward asked
        first if it has one, was not ended early and `reward` (False for a lease that lapsed: a node letting leases
        lapse must not buy the hub's CPU). None if it was not open."""
        rollout = self.rollouts.pop(key, None)
        if rollout is None:
            return None
        left = self.per_owner[rollout.owner] - 1
        if left:
            self.per_owner[rollout.owner] = left
        else:
            del self.per_owner[rollout.owner]
        got = None
        if self.sandbox.environment_spec is not None:
            if reward and rollout.end is None and self.sandbox.environment_reward:
                outcome = await self._timed(self.sandbox.reward(key, rollout.owner))
                rollout.end = outcome.end
                if outcome.end is not None:
                    self.tally.ends[outcome.end.value] += 1
                got = float(outcome.text) if outcome.end is None and outcome.text is not None else None
            await self._timed(self.sandbox.close_environment(key, rollout.owner))
        return RolloutRecord(rollout.tool_calls, rollout.tool_failures, rollout.rounds, rollout.end, got)

    def _stop(self, rollout: _Rollout, end: RolloutEnd | None) -> TurnAnswer:
        if end is not None and not rollout.done:
            self.tally.ends[end.value] += 1
        rollout.done, rollout.end = True, end
        return TurnAnswer(done=True, end=end)

    async def _timed(self, work: Awaitable[_T]) -> _T:
        """`work`'s result, its wall time added to the sandbox's."""
        started = trio.current_time()
        try:
            return await work
        finally:
            self.tally.environment_s += trio.current_time() - started

    def _text(self, ids: Sequence[int]) -> str:
        """The turn as the parser reads it: special tokens kept (a `<tool_call>` may be one), the end of turn cut."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        return text.removesuffix(eos) if eos else text
