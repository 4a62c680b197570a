"""Tasks for tests, loaded by spec like a user's own (`--task testbed.tasks:EchoTask`)."""

from __future__ import annotations

from shared.tasks.reverse import ReverseTask

# Groups a LateFailingTask scores before its reward starts raising: a few learner steps of a short run.
LATE_FAILURE_GROUPS = 40


class EchoTask(ReverseTask):
    """The reversal task under another name: a second task, for tests of runs that change task."""


class FlatTask(ReverseTask):
    """Every answer earns the same reward: no group teaches anything, so the learner never steps."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        return [0.0] * len(completions)


class RaisingRewardTask(ReverseTask):
    """An operator's reward with a bug: it raises on every group."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        raise KeyError("answer")


class NanRewardTask(ReverseTask):
    """An operator's reward that returns NaN for every completion."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        return [float("nan")] * len(completions)


class OneRewardTask(ReverseTask):
    """An operator's reward that returns one value for the whole group instead of one per completion."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        return [1.0]


class LateFailingTask(ReverseTask):
    """The reversal task whose reward raises once it scored LATE_FAILURE_GROUPS groups: a reward that breaks
    mid-run (on input the start check did not try)."""

    def __init__(self) -> None:
        super().__init__()
        self.scored = 0

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        self.scored += 1
        if self.scored > LATE_FAILURE_GROUPS:
            raise ValueError("the grader's lookup table has no entry for this prompt")
        return super().rewards(prompt, completions)
