"""Reward functions as TRL users write them today, for tests of several weighted `--reward` functions."""

from __future__ import annotations

import asyncio

import numpy as np


def reversed_chars(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
    """The share of the answer's characters the completion has in place; a numpy array, as TRL accepts.
    Checks that every keyword arrives as TRL passes it: one entry per completion, ids beside the texts."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer) == len(kwargs["kind"])
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in completion_ids)
    assert isinstance(trainer_state.global_step, int) and trainer_state.global_step >= 0
    return np.array([sum(a == b for a, b in zip(c.strip(), gold)) / len(gold) for c, gold in zip(completions, answer)])


def length_gap(prompts, completions, completion_ids, trainer_state, answer, kind, **kwargs):
    """-|tokens - answer length| / 10, or None for a row of kind "free": the function does not apply there."""
    return [None if k == "free" else -abs(len(ids) - len(gold) - 1) / 10 for ids, gold, k in zip(completion_ids, answer, kind)]


def never_applies(prompts, completions, **kwargs):
    """None for every completion: a function that applies to no row of the dataset."""
    return [None] * len(completions)


async def judged(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """An async judge, as TRL awaits one: it logs the run's length and each completion's verdict with TRL's
    log_metric and log_extra, and scores 1 for a completion without spaces."""
    import asyncio

    await asyncio.sleep(0)
    log_metric("judge/max_steps", trainer_state.max_steps)
    log_extra("verdict", ["tidy" if " " not in c.strip() else "spaced" for c in completions])
    return [float(" " not in c.strip()) for c in completions]


def logs_badly(prompts, completions, log_extra, **kwargs):
    """log_extra with one value for the whole group, not one per completion."""
    log_extra("verdict", ["one"])
    return [0.0] * len(completions)


class _Client:
    """A judge's client made once at import, as an AsyncOpenAI or httpx.AsyncClient is: its replies come through the
    loop it first ran on, so once that loop has closed every call fails ("Event loop is closed")."""

    loop: asyncio.AbstractEventLoop | None = None

    async def ask(self, text: str) -> bool:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        reply = self.loop.create_future()
        self.loop.call_soon(reply.set_result, text == text[::-1])
        return await reply


_CLIENT = _Client()


async def pooled_judge(completions, **kwargs):
    return [1.0 if await _CLIENT.ask(c) else 0.0 for c in completions]
