"""Tasks for tests, loaded by spec like a user's own (`--task testbed.tasks:EchoTask`)."""

from __future__ import annotations

from shared.tasks.reverse import ReverseTask


class EchoTask(ReverseTask):
    """The reversal task under another name: a second task, for tests of runs that change task."""


class FlatTask(ReverseTask):
    """Every answer earns the same reward: no group teaches anything, so the learner never steps."""

    def reward(self, prompt, completion: str) -> float:
        return 0.0
