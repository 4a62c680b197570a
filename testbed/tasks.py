"""Tasks for tests, loaded by spec like a user's own (`--task testbed.tasks:EchoTask`)."""

from __future__ import annotations

import os
import time

from shared.tasks.reverse import ReverseTask

# Groups a LateFailingTask scores before its reward starts raising: a few learner steps of a short run.
LATE_FAILURE_GROUPS = 40


class EchoTask(ReverseTask):
    """The reversal task under another name: a second task, for tests of runs that change task."""


class FlatTask(ReverseTask):
    """Every answer earns the same reward: no group teaches anything, so the learner never steps."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        return [0.0] * len(completions)


class SaturatedTask(ReverseTask):
    """Every answer earns the top reward, 1: a saturated reward (a task already learned), which teaches nothing."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        return [1.0] * len(completions)


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


class HangingRewardTask(ReverseTask):
    """An operator's reward that never returns (a grader waiting on something that never comes)."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        time.sleep(3600.0)
        return super().rewards(prompt, completions)


class SlowRewardTask(ReverseTask):
    """The reversal task with a reward that takes a second: a check worker can be killed in the middle of one."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        time.sleep(1.0)
        return super().rewards(prompt, completions)


class OverlapTask(ReverseTask):
    """Reward: the share of a completion's characters found in its prompt. Unlike the exact reversal, a random model's
    long completions score apart, so every group carries an advantage (bench/soak.py's long runs train for real)."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        chars = set(prompt.text)
        return [sum(c in chars for c in text) / len(text) if text else 0.0 for text in completions]


class DyingRewardTask(ReverseTask):
    """A reward that takes its process down with it (a native extension crashing, say)."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        os._exit(3)
