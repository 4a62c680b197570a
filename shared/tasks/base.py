"""The task interface: prompts with ids and a reward function; nothing else is known about a task."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """A prompt as sent to nodes; `answer` is metadata only the hub needs and never leaves it."""

    id: str
    text: str
    answer: str | None = field(default=None, repr=False)
    # What places it on one side of a held-out split (None: its text). A chat prompt's is its messages:
    # the rendered text may carry the day's date (templates calling strftime_now).
    split_key: str | None = field(default=None, repr=False)

    @property
    def identity(self) -> str:
        """The text a held-out split and an eval task's overlap check go by."""
        return self.text if self.split_key is None else self.split_key


class Task(ABC):
    """A source of prompts plus the hub-side reward R(x, y) in [0, 1]."""

    name: str = "task"

    @abstractmethod
    def prompts(self) -> list[Prompt]:
        """All prompts of the task, in a stable order."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score a decoded completion of `prompt`."""

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id (KeyError if unknown)."""
        index = getattr(self, "_index", None)
        if index is None:
            index = {p.id: p for p in self.prompts()}
            self._index = index
        return index[prompt_id]

    def sample(self, rng: random.Random, k: int) -> list[Prompt]:
        """k prompts drawn with replacement."""
        pool = self.prompts()
        return [pool[rng.randrange(len(pool))] for _ in range(k)]
