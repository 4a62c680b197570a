"""Tasks whose reward a node's text can poison, for tests of the reward's budget (hub/trust/checkpool.py): each
is the reversal task, and costly or failing only on a completion that holds POISON. The start check's own
completions (hub/training/tasks.py) never do, so the reward passes the operator's probe."""

from __future__ import annotations

import time

from shared.tasks.reverse import ReverseTask

POISON = "poison"  # in the embedded model's vocabulary: lower-case letters
# CPU a SpinningRewardTask spends per poisoned group, and wall time a SleepingRewardTask waits: far past any
# budget a test sets, short enough that a thread left running ends within the test.
SPIN_S = 1.0
SLEEP_S = 4.0


def _poisoned(completions: list[str]) -> bool:
    return any(POISON in c for c in completions)


class ChokingRewardTask(ReverseTask):
    """Its reward raises on a poisoned group."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        if _poisoned(completions):
            raise ValueError("the grader cannot parse this")
        return super().rewards(prompt, completions)


class SpinningRewardTask(ReverseTask):
    """Its reward spends SPIN_S of CPU on a poisoned group, as sympy does on a tower of \\exp, then scores it."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        if _poisoned(completions):
            start = time.thread_time()
            while time.thread_time() - start < SPIN_S:
                pass
        return super().rewards(prompt, completions)


class SleepingRewardTask(ReverseTask):
    """Its reward waits SLEEP_S on a poisoned group without using CPU: only a wall clock limit stops it."""

    def rewards(self, prompt, completions: list[str]) -> list[float]:
        if _poisoned(completions):
            time.sleep(SLEEP_S)
        return super().rewards(prompt, completions)
