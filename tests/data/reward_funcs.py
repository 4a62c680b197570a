"""Reward functions with TRL's signature, for tests of `--reward module:function`."""

from __future__ import annotations


def length_match(prompts, completions, **kwargs):
    """1.0 when the completion is as long as the row's `target_len` column (an extra dataset column)."""
    return [1.0 if len(c) == int(n) else 0.0 for c, n in zip(completions, kwargs["target_len"])]


def chat_echo(prompts, completions, **kwargs):
    """Chat format as TRL passes it: prompts are message lists, completions [{"role": "assistant", ...}]."""
    return [1.0 if c[0]["content"] == p[-1]["content"] else 0.0 for p, c in zip(prompts, completions)]


def no_kwargs(prompts, completions):
    """Cannot take the dataset's other columns (TRL passes them all)."""
    return [0.0 for _ in completions]


def not_finite(prompts, completions, **kwargs):
    return [float("nan") for _ in completions]


def group_echo(prompts, completions, **kwargs):
    """How many completions it was called with, for each: a group arrives in one call."""
    assert len(prompts) == len(completions) == len(kwargs["n"]) and len(set(prompts)) == 1
    return [float(len(completions))] * len(completions)


def first_only(prompts, completions, **kwargs):
    """Scores only the first completion: one value for the whole group."""
    return [1.0]
