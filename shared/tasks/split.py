"""Held-out prompts for evaluation: a task split in two by a hash of each prompt's text.

By construction no prompt text is on both sides (a dataset with a prompt repeated under two ids
keeps both copies on one side), and the split of a task is the same on every run and machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from blake3 import blake3

from shared.tasks.base import GroupContext, Prompt, Scores, Task

_BUCKETS = 1 << 64


def is_held_out(text: str, fraction: float) -> bool:
    """Whether a prompt with this text (Prompt.identity) belongs to the held-out part of a split keeping
    `fraction` aside."""
    return int.from_bytes(blake3(text.encode("utf-8")).digest(8), "big") < fraction * _BUCKETS


class TaskPart(Task):
    """The prompts of `task` that `keep` accepts, with the task's reward."""

    def __init__(self, task: Task, keep: Callable[[Prompt], bool], label: str) -> None:
        self.task = task
        self.name = task.name
        self.light_reward = task.light_reward
        self.label = label
        self._prompts = [p for p in task.prompts() if keep(p)]

    def prompts(self) -> list[Prompt]:
        return list(self._prompts)

    def rewards(self, prompt: Prompt, completions: list[str]) -> Sequence[float]:
        return self.task.rewards(prompt, completions)

    def scores(self, prompt: Prompt, completions: list[str], context: GroupContext | None) -> Scores:
        return self.task.scores(prompt, completions, context)

    @property
    def reward_name(self) -> str:
        return self.task.reward_name


def split_task(task: Task, fraction: float) -> tuple[TaskPart, TaskPart]:
    """(training part, held-out part) of `task`; ValueError when either would be empty."""
    train = TaskPart(task, lambda p: not is_held_out(p.identity, fraction), "train")
    held = TaskPart(task, lambda p: is_held_out(p.identity, fraction), "held-out")
    total = len(train.prompts()) + len(held.prompts())
    if not held.prompts():
        raise ValueError(
            f"holding out {fraction:g} of the task's {total} prompts leaves none to evaluate on; "
            "raise --eval-split or give --eval-task"
        )
    if not train.prompts():
        raise ValueError(f"holding out {fraction:g} of the task's {total} prompts leaves none to train on; lower --eval-split")
    return train, held


def excluding(task: Task, training: Task) -> TaskPart:
    """`task` without any prompt whose text the training task also has; ValueError when nothing is left."""
    seen = {p.identity for p in training.prompts()}
    part = TaskPart(task, lambda p: p.identity not in seen, "held-out")
    if not part.prompts():
        raise ValueError("every prompt of the eval task is also a training prompt")
    return part
