"""A tool-using rollout as it is built, turn by turn: its prompt's ids, then each model turn and each answer of the
environment, and the completion it makes (Completion.env_spans marks the answers, log-prob 0.0). A node builds its
multi-turn lease's rollouts so (node/turns.py), and the hub its held-out evaluation's (hub/agents/evaluation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.rollout import Completion, FinishReason


class AnswerRefused(ValueError):
    """An environment answer a rollout cannot take: token ids past the model's, or no room left for a model token."""


@dataclass
class TurnedRollout:
    """One rollout: its prompt's ids, then its model and environment tokens."""

    prompt_id: str
    index: int
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    last_turn: tuple[int, ...] = ()
    finish: FinishReason = "stop"
    version: int = -1
    done: bool = False

    def context(self) -> list[int]:
        """The ids the next turn continues: the prompt and everything after it so far."""
        return self.prompt + self.ids

    def add_turn(self, turn: Completion) -> None:
        if self.version not in (-1, turn.version):
            raise AssertionError("a rollout's turns were generated with two versions (the engine lock was let go)")
        self.ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.last_turn, self.finish, self.version = turn.token_ids, turn.finish_reason, turn.version

    def add_environment(self, env_ids: Sequence[int], budget: int, vocab_size: int) -> None:
        if max(env_ids) >= vocab_size:  # a message bounds ids by any model's; this model's embedding is smaller
            raise AnswerRefused(f"token id {max(env_ids)} is past this model's {vocab_size}")
        if len(self.ids) + len(env_ids) >= budget:
            raise AnswerRefused(f"it leaves rollout {self.index} of {self.prompt_id[:40]!r} no room for a model token")
        self.spans.append((len(self.ids), len(env_ids)))
        self.ids += env_ids
        self.logprobs += [0.0] * len(env_ids)

    def completion(self, decode: Callable[[list[int]], str]) -> Completion:
        return Completion(
            token_ids=tuple(self.ids),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish,
            version=self.version,
            text=decode(self.ids),
            env_spans=tuple(self.spans),
        )
