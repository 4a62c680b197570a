"""CalcTask: multiply two 2-digit numbers, with a calculator the model may call (TRL's `tools`): the embedded tool
task, `echo-hub start --task calc`.

A prompt is one user message, "37*48"; the answer, "1776", is the model's last turn, exactly. The products are
4-digit numbers the embedded tool model (shared/tool_model.py) cannot compute, but `mul` computes them exactly, so
the reward rises as the model learns to call it, copy the operands into the call and read the product off its
answer. The tool runs on the hub, in the tool sandbox (hub/agents/sandbox.py), like any user's tool.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from shared.tasks.dataset import Conversation, DatasetOptions, DatasetTask, Messages, Row

CALC_TASK = "calc"
CALC_TOOL = "shared.tasks.calc:mul"
CALC_REWARD = "shared.tasks.calc:correct"
CALC_OPERANDS = (10, 99)  # both ends included: 8,100 problems
CALC_DEFAULT_SEED = 1234
CALC_DEFAULT_SIZE = 4096


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def correct(completions: Sequence[Sequence[dict[str, Any]]], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 where the conversation's last message is the model's and says the answer exactly, else 0.0 (TRL's
    reward-function form: the completions as messages, the dataset's answer column)."""
    return [
        float(bool(c) and c[-1].get("role") == "assistant" and c[-1].get("content", "").strip() == a)
        for c, a in zip(completions, answer)
    ]


def problems(seed: int, size: int) -> list[tuple[int, int]]:
    """`size` distinct operand pairs drawn by `seed`, in a stable order."""
    low, high = CALC_OPERANDS
    if not 1 <= size <= (high - low + 1) ** 2:
        raise ValueError(f"size must be within 1..{(high - low + 1) ** 2}, got {size}")
    rng = random.Random(seed)
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < size:
        seen.setdefault((rng.randint(low, high), rng.randint(low, high)))
    return list(seen)


def question(a: int, b: int) -> Messages:
    return ({"role": "user", "content": f"{a}*{b}"},)


class CalcTask(DatasetTask):
    """The embedded tool task's prompts as a dataset of chat messages and answers, scored by `options.reward`
    (`correct`, unless the run names its own)."""

    name = CALC_TASK

    def __init__(
        self,
        options: DatasetOptions = DatasetOptions(reward=CALC_REWARD),
        render_chat: Callable[[], Callable[[Messages], str]] | None = None,
        conversation: Conversation | None = None,
        seed: int = CALC_DEFAULT_SEED,
        size: int = CALC_DEFAULT_SIZE,
    ) -> None:
        self._problems = problems(seed, size)
        super().__init__(CALC_TASK, options, render_chat, conversation)

    def _read(self) -> Iterator[Row]:
        for i, (a, b) in enumerate(self._problems):
            yield Row(i, f"{CALC_TASK}:{i}", {"prompt": list(question(a, b)), "answer": str(a * b)})
