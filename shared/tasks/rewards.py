"""A dataset's reward functions as TRL and verl users write them, and how several combine into one reward.

Specs (`--reward a,b`): "math" and "exact" (builtins scored against the answer column), or "module:function"
in one of two styles, found from the function's parameters unless `--reward-style` says:

- TRL: fn(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., log_metric=..., log_extra=...,
  **columns) -> one value per completion, called once per group (every list holds one entry per completion: the
  prompt and each dataset column repeated, as TRL repeats them per generation); an async function is awaited.
  `trainer_state` carries `global_step` (the policy version that sampled the group) and `max_steps`. A value may
  be None: the function does not apply to that completion.
- verl: compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> a number, or a
  dict holding one under "score", called once per completion; the dict's other keys that hold numbers are
  logged as metrics (`rewards/<name>/<key>/mean`), as verl's reward_extra_info. `ground_truth` is the answer
  column's raw value (`--answer-column reward_model.ground_truth` for verl's layout), `data_source` and
  `extra_info` the row's columns of those names (None when it has none).

Several functions combine as TRL's `reward_weights` do: each completion's reward is the weighted sum of the
values of the functions that apply to it (None skipped; 0.0 when none applies).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shared.tasks.base import LoggedColumns, LoggedMetrics, Prompt, RewardParts, reward_raised, valid_rewards
from shared.tasks.user_code import import_object

RewardStyle = Literal["auto", "trl", "verl"]
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


@dataclass(frozen=True)
class RewardState:
    """What TRL's `trainer_state` tells a reward function, by TRL's names: the optimizer steps taken before the
    policy that sampled the group, which is that policy's version, and the run's length in steps (--steps; 0: until
    interrupted)."""

    global_step: int
    max_steps: int = 0

    @property
    def version(self) -> int:
        return self.global_step


# A value log_extra logs is shown in tables of completions: text past this many characters is cut.
LOGGED_TEXT_CHARS = 1000


def _logged_value(value: Any) -> str | float | None:
    """A log_extra value as a completions table holds it: a number (a bool or a numpy scalar counts), None, or text."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy scalar or 0-d array
        value = value.item()
    if value is None or isinstance(value, str):
        return value if value is None else value[:LOGGED_TEXT_CHARS]
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    return str(value)[:LOGGED_TEXT_CHARS]


class RewardLog:
    """TRL's log_metric and log_extra for the reward functions scoring one group of `n` completions: what they log,
    kept with the group (a step's metrics average the log_metric values of the groups it trained on; log_extra
    columns join the sample completions of --log-completions). A mistake in a call raises in the function, which
    the start check and the run report as the reward's."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.metrics: list[tuple[str, float]] = []
        self.columns: dict[str, tuple[str | float | None, ...]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric(name, value): one scalar for this call."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric takes a metric name, got {name!r}")
        if not isinstance(_logged_value(value), float):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a finite number")
        self.metrics.append((name, float(value)))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's log_extra(column, values): one value per completion, shown beside it in the completions table."""
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra takes a column name, got {column!r}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != self.n:
            raise ValueError(f"log_extra({column!r}, ...) takes one value per completion ({self.n})")
        self.columns[column] = tuple(_logged_value(v) for v in values)


@dataclass(frozen=True)
class RewardCall:
    """One group as the reward functions see it: `prompts` and `completions` one per completion, in TRL's
    format (text, or chat messages for a chat prompt); `texts` the decoded completions."""

    prompt: Prompt
    prompts: list[Any]
    completions: list[Any]
    texts: list[str]
    completion_ids: list[list[int]]
    state: RewardState
    row: Mapping[str, Any]  # the dataset row's columns but the prompt's
    ground_truth: Any  # the answer column's raw value (None when the row has none)
    log: RewardLog  # TRL's log_metric and log_extra for this group


RewardFn = Callable[[RewardCall], Sequence[Any]]


@dataclass(frozen=True)
class Reward:
    """One reward function of a dataset task: its spec, the name its metrics go by, how to call it."""

    spec: str
    name: str
    style: Literal["builtin", "trl", "verl"]
    call: RewardFn
    fn: Callable[..., Any] | None = None  # the user's function (None: a builtin)


def combine_rewards(parts: Sequence[Sequence[float | None]], weights: Sequence[float]) -> tuple[float, ...]:
    """Each completion's weighted sum over the functions that scored it (`parts`: one list per function, one
    value per completion; None skipped, as TRL's nansum skips NaN; 0.0 when no function applies)."""
    return tuple(math.fsum(w * v for w, v in zip(weights, values) if v is not None) for values in zip(*parts))


def mean_applied(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are not None (TRL's nanmean); None when every one is."""
    applied = [v for v in values if v is not None]
    return math.fsum(applied) / len(applied) if applied else None


def std_applied(values: Sequence[float | None]) -> float | None:
    """The standard deviation of the values that are not None, with Bessel's correction (TRL's nanstd); None with
    fewer than two."""
    applied = [v for v in values if v is not None]
    if len(applied) < 2:
        return None
    mean = math.fsum(applied) / len(applied)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in applied) / (len(applied) - 1))


def reward_specs(reward: str | Sequence[str]) -> tuple[str, ...]:
    """The specs of `--reward a,b` (a string, or one spec per entry as hub.toml lists them)."""
    items = reward.split(",") if isinstance(reward, str) else list(reward)
    specs = tuple(s.strip() for s in items if s.strip())
    if not specs:
        raise ValueError("--reward names no reward function")
    return specs


def reward_weights(weights: Sequence[float], count: int) -> tuple[float, ...]:
    """The weights of `count` reward functions: one each as given, or 1.0 each when none is given."""
    if not weights:
        return (1.0,) * count
    if len(weights) != count:
        raise ValueError(
            f"--reward-weights gives {len(weights)} weight{'' if len(weights) == 1 else 's'} for "
            f"{count} reward function{'' if count == 1 else 's'}: give one per --reward"
        )
    return tuple(float(w) for w in weights)


def detected_style(fn: Callable[..., Any], style: RewardStyle) -> Literal["trl", "verl"]:
    """`style` unless auto: then verl when the function takes verl's `solution_str`, else TRL."""
    if style != "auto":
        return style
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "trl"
    return "verl" if "solution_str" in parameters else "trl"


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` returns a coroutine (TRL's is_async_callable): an async function, a partial of one, or an
    instance whose __call__ is async."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


# The process's event loop for async rewards, and the pid that made it (a forked child starts its own).
_REWARD_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_REWARD_LOOP_LOCK = threading.Lock()


def reward_loop() -> asyncio.AbstractEventLoop:
    """One event loop per process, on a daemon thread, for every async reward (TRL's pattern): a client a reward module
    made once (an AsyncOpenAI, an httpx.AsyncClient) stays bound to a loop that lives, which a loop per call closes."""
    global _REWARD_LOOP
    with _REWARD_LOOP_LOCK:
        if _REWARD_LOOP is None or _REWARD_LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="echo2-reward-loop", daemon=True).start()
            _REWARD_LOOP = (os.getpid(), loop)
        return _REWARD_LOOP[1]


def _trl_call(fn: Callable[..., Any]) -> RewardFn:
    """A TRL function called once per group; an async one (an LLM judge, say) run to its end on the process's reward
    loop, as TRL runs it on its daemon loop. A check stopped while it waits (its CPU budget spent) cancels it."""
    if is_async(fn):

        def run(c: RewardCall) -> Sequence[Any]:
            future = asyncio.run_coroutine_threadsafe(fn(**trl_arguments(c)), reward_loop())
            try:
                return future.result()
            except BaseException:
                future.cancel()
                raise

        return run

    def call(c: RewardCall) -> Sequence[Any]:
        return fn(**trl_arguments(c))

    return call


def trl_arguments(c: RewardCall) -> dict[str, Any]:
    """TRL's keywords for one group: prompts, completions, their token ids, trainer_state, log_metric, log_extra and
    every other column once per completion."""
    n = len(c.texts)
    columns = {k: [v] * n for k, v in c.row.items()}
    return {
        "prompts": c.prompts,
        "completions": c.completions,
        "completion_ids": c.completion_ids,
        "trainer_state": c.state,
        "log_metric": c.log.log_metric,
        "log_extra": c.log.log_extra,
        **columns,
    }


def check_trl_columns(columns: Iterable[str], where: str) -> None:
    """ValueError when a column of the row at `where` would override one of TRL's keyword arguments."""
    for column in columns:
        if column in TRL_KEYWORDS:
            raise ValueError(
                f"{where}: column {column!r} collides with TRL's keyword argument of the same name; rename the column"
            )


def verl_arguments(c: RewardCall, text: str) -> dict[str, Any]:
    """verl's keywords for one completion."""
    return {
        "data_source": c.row.get("data_source"),
        "solution_str": text,
        "ground_truth": c.ground_truth,
        "extra_info": c.row.get("extra_info"),
    }


def verl_score(out: Any) -> Any:
    """A compute_score result as a value: its "score" when it returns a dict, as verl reads it (KeyError without
    one, as verl raises)."""
    return out["score"] if isinstance(out, Mapping) else out


_NOT_A_NUMBER = object()


def _extra_value(value: Any) -> Any:
    """A value a verl dict holds beside its score as a metric's value: a float (a bool counts, a numpy scalar too),
    None when absent or not finite, or _NOT_A_NUMBER (a string, a list...)."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy scalar or 0-d array
        value = value.item()
    if not isinstance(value, numbers.Real):
        return _NOT_A_NUMBER
    return float(value) if math.isfinite(value) else None


def verl_extras(name: str, outs: Sequence[Any]) -> tuple[RewardParts, tuple[str, ...]]:
    """What compute_score's dicts hold beside "score" (verl's reward_extra_info): each key whose values are numbers,
    as "<name>/<key>" with one value per completion (None where a completion's result lacks it), and the names of
    the keys holding anything else, which no metric can log."""
    keys = dict.fromkeys(key for out in outs if isinstance(out, Mapping) for key in out if key != "score")
    extras, dropped = [], []
    for key in keys:
        values = [_extra_value(out.get(key)) if isinstance(out, Mapping) else None for out in outs]
        if isinstance(key, str) and _NOT_A_NUMBER not in values:
            extras.append((f"{name}/{key}", tuple(values)))
        else:
            dropped.append(f"{name}/{key}")
    return tuple(extras), tuple(dropped)


def _verl_call(fn: Callable[..., Any]) -> RewardFn:
    """compute_score called per completion; its results as it returned them (numbers or dicts)."""

    def call(c: RewardCall) -> Sequence[Any]:
        return [fn(**verl_arguments(c, text)) for text in c.texts]

    return call


def load_reward(spec: str, style: RewardStyle, builtins: Mapping[str, RewardFn]) -> Reward:
    """The reward a spec names: a builtin from `builtins`, else `module:function` in its style."""
    if spec in builtins:
        return Reward(spec, spec, "builtin", builtins[spec])
    fn = import_object(spec, "reward")
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    kind = detected_style(fn, style)
    name = getattr(fn, "__name__", None) or spec
    return Reward(spec, name, kind, _verl_call(fn) if kind == "verl" else _trl_call(fn), fn)


def check_callable(reward: Reward, fn_args: dict[str, Any]) -> None:
    """ValueError when the reward's function cannot take the keywords its style passes (`fn_args`)."""
    assert reward.fn is not None, "a builtin reward is not checked"
    try:
        inspect.signature(reward.fn).bind(**fn_args)
    except TypeError as exc:
        how = (
            "as verl calls compute_score (data_source=, solution_str=, ground_truth=, extra_info=)"
            if reward.style == "verl"
            else "as TRL calls reward functions (prompts=, completions=, "
            "completion_ids=, trainer_state=, one keyword per dataset column)"
        )
        raise ValueError(f"reward {reward.spec}: cannot be called {how}: {exc}") from None
    except ValueError:  # a builtin or extension callable without a readable signature: called as it is
        return


@dataclass(frozen=True)
class ScoredParts:
    """One group's values of each reward function, with what verl dicts held beside their scores (verl_extras) and
    what TRL functions logged (RewardLog)."""

    parts: tuple[tuple[float | None, ...], ...]
    extras: RewardParts = ()
    dropped: tuple[str, ...] = ()
    metrics: LoggedMetrics = ()
    columns: LoggedColumns = ()


def scored_parts(rewards: Sequence[Reward], call: RewardCall) -> ScoredParts:
    """Each reward function's values for one group, checked: RewardError naming the function when it raises or
    returns other than one finite number or None per completion."""
    parts: list[tuple[float | None, ...]] = []
    extras: list[tuple[str, tuple[float | None, ...]]] = []
    dropped: list[str] = []
    for reward in rewards:
        try:
            out = reward.call(call)
            if reward.style == "verl":
                more, left = verl_extras(reward.name, out)
                out = [verl_score(result) for result in out]
                extras += more
                dropped += left
        except Exception as exc:  # noqa: BLE001 -- the operator's code: any failure is theirs to fix
            raise reward_raised(reward.spec, call.prompt, exc) from exc
        parts.append(valid_rewards(reward.spec, call.prompt, out, len(call.texts), allow_none=reward.style != "builtin"))
    return ScoredParts(tuple(parts), tuple(extras), tuple(dropped), tuple(call.log.metrics), tuple(call.log.columns.items()))
