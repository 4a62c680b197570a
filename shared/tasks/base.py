"""The task interface: prompts with ids and a reward function; nothing else is known about a task.

A reward is called once per group, with every completion of one prompt, as TRL calls a reward function once
per batch: it returns one number per completion. The reward is the operator's code: `checked_scores` turns
its exception or a value other than one finite number per completion into a RewardError naming it, which
stops the run; it is never counted against the node whose completions it scored. A task made of several
reward functions (a dataset's `--reward a,b`) also gives each one's values (`Scores.parts`), which the
learner's metrics log apart.
"""

from __future__ import annotations

import math
import numbers
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload


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


@dataclass(frozen=True)
class GroupContext:
    """What a reward may know of a group besides its texts (TRL passes both): each completion's token ids, and
    the policy version that sampled the group (the learner steps taken before it: TRL's trainer_state.global_step);
    for a tool-using rollout, each completion's environment spans (shared.rollout.Completion.env_spans), from
    which its conversation is read (empty: single-turn)."""

    completion_ids: tuple[tuple[int, ...], ...]
    version: int
    env_spans: tuple[tuple[tuple[int, int], ...], ...] = ()


# Per reward function: its name and one value per completion (None where the function does not apply); then per
# number a verl dict holds beside its score, "<function>/<key>" and its values (None where a result lacks it).
RewardParts = tuple[tuple[str, tuple[float | None, ...]], ...]


# What TRL-style reward functions logged while scoring one group: each log_metric(name, value) call, and each
# log_extra(column, values) column with one value per completion (a number, text or None).
LoggedMetrics = tuple[tuple[str, float], ...]
LoggedColumns = tuple[tuple[str, tuple[str | float | None, ...]], ...]


@dataclass(frozen=True)
class Scores:
    """A group's rewards, one per completion, and, for a task of several reward functions, each one's values and what
    they logged (TRL's log_metric and log_extra)."""

    rewards: tuple[float, ...]
    parts: RewardParts = ()
    metrics: LoggedMetrics = ()
    columns: LoggedColumns = ()


class Task(ABC):
    """A source of prompts plus the hub-side reward R(x, y) in [0, 1]. A task implements `rewards` (one group at
    a time); a task written per completion implements `reward` instead, and is then scored one completion at
    a time."""

    name: str = "task"
    # A reward cheaper than shipping a submission to a check process and its verdicts back (an exact match: the
    # built-in reverse task): the hub's default checks it in a thread of its own process (hub/trust/checkpool.py).
    light_reward: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A task written per completion, or a subclass overriding its parent's `reward` only: scored one at a time
        # by that `reward` (an inherited `rewards` would silently score by the parent's).
        if "reward" in cls.__dict__ and "rewards" not in cls.__dict__:
            setattr(cls, "rewards", Task._rewards_per_completion)  # a class patched at its definition

    @abstractmethod
    def prompts(self) -> list[Prompt]:
        """All prompts of the task, in a stable order."""

    @abstractmethod
    def rewards(self, prompt: Prompt, completions: list[str]) -> Sequence[float]:
        """Score the decoded completions of one group of `prompt`: one number per completion, in order."""

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score one decoded completion of `prompt` (a group of one)."""
        return self.rewards(prompt, [completion])[0]

    def scores(self, prompt: Prompt, completions: list[str], context: GroupContext | None) -> Scores:
        """The group's rewards by `rewards`, checked; a task of several reward functions overrides it to give each
        one's values too, and one that takes token ids or the version reads them from `context` (None: unknown)."""
        return Scores(valid_rewards(self.reward_name, prompt, self.rewards(prompt, completions), len(completions)))

    def _rewards_per_completion(self, prompt: Prompt, completions: list[str]) -> Sequence[float]:
        """`rewards` of a task that implements `reward`: one call per completion."""
        return [self.reward(prompt, c) for c in completions]

    @property
    def reward_name(self) -> str:
        """The reward function as an import spec ("module:Class.rewards"), as messages about it name it."""
        cls = type(self)
        method = "reward" if cls.rewards is Task._rewards_per_completion else "rewards"
        return f"{cls.__module__}:{cls.__qualname__}.{method}"

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


class RewardError(Exception):
    """The task's reward raised, or returned other than one finite number per completion: the operator's code to
    fix, never a node's fault. The message is the one line that says so, naming the function."""


def _shown(value: Any) -> str:
    """A value a reward returned, short enough for one line: its repr (cut) and type."""
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _problem(out: Any, n: int, allow_none: bool = False) -> str | None:
    """What is wrong with `out` as the rewards of `n` completions (None: nothing). With `allow_none`, None is a
    value too: the function does not apply to that completion (TRL's convention)."""
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return f"returned {_shown(out)}; it must return a list of one number per completion"
    try:
        count = len(out)
    except TypeError:  # a 0-d numpy array has __len__ but no length
        return f"returned {_shown(out)}; it must return a list of one number per completion"
    if count != n:
        return f"returned {count} value{'' if count == 1 else 's'} for {n} completions; it must return one number per completion"
    for i, value in enumerate(out):
        if value is None and allow_none:
            continue
        if not isinstance(value, numbers.Real):
            return f"returned {_shown(value)} for completion {i + 1} of {n}; rewards must be numbers"
        if not math.isfinite(value):
            return f"returned {value!r} for completion {i + 1} of {n}; rewards must be finite numbers"
    return None


@overload
def valid_rewards(name: str, prompt: Prompt, out: Any, n: int, allow_none: Literal[False] = False) -> tuple[float, ...]: ...
@overload
def valid_rewards(name: str, prompt: Prompt, out: Any, n: int, allow_none: bool) -> tuple[float | None, ...]: ...
def valid_rewards(name: str, prompt: Prompt, out: Any, n: int, allow_none: bool = False) -> tuple[float | None, ...]:
    """`out` as one float per completion (None kept with `allow_none`); RewardError naming reward `name` when it
    is not one finite number per completion."""
    problem = _problem(out, n, allow_none)
    if problem is not None:
        raise RewardError(f"reward {name} {problem} (prompt {prompt.id})")
    return tuple(None if v is None else float(v) for v in out)


def checked_scores(task: Task, prompt: Prompt, completions: Sequence[str], context: GroupContext | None = None) -> Scores:
    """The task's scores for one group of `prompt`, one call for the group: RewardError naming the function when
    it raises or returns other than one finite number per completion."""
    try:
        return task.scores(prompt, list(completions), context)
    except RewardError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the operator's code: any failure is theirs to fix
        raise reward_raised(task.reward_name, prompt, exc) from exc


def reward_raised(name: str, prompt: Prompt, exc: Exception) -> RewardError:
    """The one line for reward `name` raising `exc` on a group of `prompt`."""
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return RewardError(
        f"reward {name} raised {type(exc).__name__}{': ' + detail if detail else ''} "
        f"(prompt {prompt.id}); fix the reward function"
    )


def checked_rewards(task: Task, prompt: Prompt, completions: Sequence[str]) -> tuple[float, ...]:
    """The task's rewards for one group of `prompt` (`checked_scores` without token ids or version)."""
    return checked_scores(task, prompt, completions).rewards
