"""Prompt datasets from local files, scored by rewards: what users of TRL and verl bring.

Sources: a JSONL file (one object per line), a Parquet file, or a directory written by
`datasets.Dataset.save_to_disk` (a DatasetDict's split chosen by name: --dataset-split, or `DIR:SPLIT`). Columns are chosen by
name (default `prompt` and `answer`), or by a dotted path into a nested column
(`reward_model.ground_truth`, as verl's layout keeps the answer); every other column travels with its row to
a reward function. A prompt is a string, or chat messages (a list of {"role", "content"}) rendered with
the model tokenizer's chat template; `chat` also renders string prompts as one user message.

Rewards (shared/tasks/rewards.py): "math" (math-verify equivalence of the final answer with the answer
column), "exact" (the stripped completion equals the answer), or "module:function" in TRL's style or
verl's `compute_score`; several, comma-separated, add up weighted as TRL's `reward_weights` do. A TRL
function is called once per group with the group's prompt repeated once per completion, as TRL repeats it
per generation (chat prompts get chat completions, [{"role": "assistant", ...}]).

Prompt ids are "<prefix>-<n>": n is the JSONL line number or the row index, so they are stable
across runs of the same file. Nothing here leaves the hub: answers and columns are hub-side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.tasks.base import GroupContext, Prompt, Scores, Task, valid_rewards
from shared.tasks.rewards import (
    Reward,
    RewardCall,
    RewardFn,
    RewardLog,
    RewardState,
    RewardStyle,
    check_callable,
    check_trl_columns,
    combine_rewards,
    load_reward,
    reward_specs,
    reward_weights,
    scored_parts,
    trl_arguments,
    verl_arguments,
)

DATA_EXTRA = "pip install 'echo2[data]'"


@dataclass(frozen=True)
class DatasetOptions:
    """How to read a dataset and score its completions."""

    prompt_column: str = "prompt"
    answer_column: str = "answer"
    reward: str | tuple[str, ...] = "math"  # one spec, several comma-separated, or a tuple of them
    split: str = "train"
    chat: bool = False
    id_prefix: str = "row"
    reward_weights: tuple[float, ...] = ()  # one per reward (empty: 1.0 each)
    reward_style: RewardStyle = "auto"
    max_steps: int = 0  # the run's --steps, TRL's trainer_state.max_steps (0: until interrupted)
    keep_rows: bool = False  # keep each row whole: an environment's reset(**row) gets it, as TRL passes the example


@dataclass(frozen=True)
class Row:
    index: int
    where: str
    record: Mapping[str, Any]


def _jsonl_rows(path: Path) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")  # noqa: TRY004
            yield Row(line_no, where, record)


def _parquet_rows(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: {DATA_EXTRA}") from None
    table = pq.read_table(path)
    for i, record in enumerate(table.to_pylist()):
        yield Row(i, f"{path} row {i}", record)


def _saved_rows(path: Path, split: str) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading a save_to_disk directory needs the datasets package: {DATA_EXTRA}") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{path}: no split {split!r} (it has {', '.join(loaded)}); choose one with --dataset-split, or as "
                f"{path}:{next(iter(loaded))}"
            )
        loaded = loaded[split]
    for i, record in enumerate(loaded):
        yield Row(i, f"{path} row {i}", record)


def read_rows(path: Path, split: str = "train") -> Iterator[Row]:
    """The rows of a JSONL file, a Parquet file or a save_to_disk directory, by what `path` is."""
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise ValueError(f"{path}: a directory, but not one written by datasets' save_to_disk")
        return _saved_rows(path, split)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    raise ValueError(f"{path}: expected a .jsonl or .parquet file or a save_to_disk directory")


def is_dataset_path(spec: str) -> bool:
    """Whether a task spec names a dataset on disk (a file or directory that exists)."""
    return Path(spec).exists()


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a save_to_disk directory: a DatasetDict's or one Dataset's."""
    return (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()


def split_of(spec: str) -> tuple[Path | None, str]:
    """(the save_to_disk directory, the split) a "DIR:SPLIT" spec names (`conv_ds:test`); (None, "") when the part
    before its last ":" is no save_to_disk directory (a package's `pkg:Class`, say). ValueError when that directory
    holds one Dataset, which has no splits."""
    head, sep, split = spec.rpartition(":")
    if not sep or not head or not split or "/" in split or not is_saved_dataset(Path(head)):
        return None, ""
    path = Path(head)
    if not (path / "dataset_dict.json").exists():
        raise ValueError(f"{path} holds one Dataset (no splits): it has no split {split!r}; name the directory alone")
    return path, split


_ABSENT = object()


def column_value(record: Mapping[str, Any], path: str) -> Any:
    """The value a column path names: the column of that name, else for `a.b` the key `b` of column `a`'s
    mapping (verl's `reward_model.ground_truth`); _ABSENT when the row has none."""
    if path in record:
        return record[path]
    value: Any = record
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return _ABSENT
        value = value[key]
    return value


# -- prompts ---------------------------------------------------------------------------------------------

Messages = tuple[Mapping[str, str], ...]


def _messages(value: Any, where: str, column: str) -> Messages | None:
    """The chat messages in a prompt cell, None for a string; ValueError for anything else."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: {column!r} is empty")
        return None
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    ):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise ValueError(f"{where}: {column!r} must be a non-empty string or a list of {{'role', 'content'}} messages")


def chat_renderer(tokenizer: Any, whose: str, tools: Sequence[Mapping[str, Any]] = ()) -> Callable[[Messages], str]:
    """Messages -> the prompt text the model sees, by `tokenizer`'s chat template (generation prompt added), with
    `tools`' JSON schemas when given (TRL's `tools`: None, not [], when there are none); `whose` names the tokenizer
    in the ValueError when it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{whose} has no chat template, so chat prompts cannot be rendered: pass --model with a model whose tokenizer has one"
        )
    schemas = [dict(t) for t in tools] or None
    return lambda messages: tokenizer.apply_chat_template(
        list(messages), tools=schemas, tokenize=False, add_generation_prompt=True
    )


# -- rewards ---------------------------------------------------------------------------------------------


def _answer_text(value: Any, where: str, column: str) -> str:
    """A gold answer as text: a whole float as an integer (Parquet stores 3 as 3.0); NaN refused."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {column!r} is {value!r}, not an answer")
        if value.is_integer():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"{where}: {column!r} must be a non-empty string or a number, got {value!r}")
    return str(value)


def _builtin_rewards(source: str) -> dict[str, RewardFn]:
    """The builtin rewards against a prompt's answer text; math-verify's gold answers parsed once per prompt."""
    from shared.tasks.math import MathReward

    math_reward = MathReward(source)
    return {
        "math": lambda c: [math_reward.score(c.prompt, t) for t in c.texts],
        "exact": lambda c: [1.0 if t.strip() == (c.prompt.answer or "").strip() else 0.0 for t in c.texts],
    }


def _loaded_rewards(source: str, opts: DatasetOptions) -> tuple[tuple[Reward, ...], tuple[float, ...]]:
    """(the rewards `opts.reward` names, their weights); ValueError naming the mistake."""
    builtins = _builtin_rewards(source)
    rewards = tuple(load_reward(spec, opts.reward_style, builtins) for spec in reward_specs(opts.reward))
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"--reward names two reward functions called {twice!r}: their metrics would mix")
    return rewards, reward_weights(opts.reward_weights, len(rewards))


# A tool-using completion's token ids and environment spans -> the messages TRL's reward functions read
# (hub/agents/conversation.py).
Conversation = Callable[[Sequence[int], Sequence[tuple[int, int]]], list[dict[str, Any]]]


class DatasetTask(Task):
    """Prompts from a dataset on disk, scored by `options.reward`. `render_chat` builds the chat renderer,
    called only if a chat prompt appears (it loads the tokenizer). `conversation` reads a tool-using completion
    of a chat prompt as its messages (None: none is tool-using)."""

    name = "dataset"

    def __init__(
        self,
        path: str | Path,
        options: DatasetOptions = DatasetOptions(),
        render_chat: Callable[[], Callable[[Messages], str]] | None = None,
        conversation: Conversation | None = None,
    ) -> None:
        self.path = Path(path)
        self.options = opts = options
        self._rewards, self._weights = _loaded_rewards(str(self.path), opts)
        self._render_chat = render_chat
        self._conversation = conversation
        self._renderer: Callable[[Messages], str] | None = None
        self._prompts: list[Prompt] = []
        self._rows: dict[str, Mapping[str, Any]] = {}
        self._truths: dict[str, Any] = {}
        self._messages: dict[str, Messages] = {}
        self._whole: dict[str, dict[str, Any]] = {}  # each row as read, when options.keep_rows
        # Keys of verl dicts seen holding other than numbers ("<function>/<key>"): no metric logs them; the start says so.
        self.unlogged: set[str] = set()
        for row in self._read():
            self._add_row(row)
        if not self._prompts:
            raise ValueError(f"{self.path}: no prompts (empty dataset)")
        self._check_signatures()

    def _read(self) -> Iterator[Row]:
        """The dataset's rows (a builtin dataset task makes its own)."""
        return read_rows(self.path, self.options.split)

    def _styles(self) -> set[str]:
        return {r.style for r in self._rewards}

    def _prompt_of(self, row: Row) -> tuple[str, Messages | None]:
        """(the prompt text the model sees, its chat messages or None) of a row."""
        opts = self.options
        value = column_value(row.record, opts.prompt_column)
        if value is _ABSENT:
            raise ValueError(
                f"{row.where}: no column {opts.prompt_column!r} (columns: {', '.join(row.record)}); "
                "choose one with --prompt-column"
            )
        messages = _messages(value, row.where, opts.prompt_column)
        if messages is None and opts.chat:
            messages = ({"role": "user", "content": value},)
        if messages is None:
            return value, None
        if self._renderer is None:
            if self._render_chat is None:
                raise ValueError(f"{row.where}: a chat prompt, but no model tokenizer to render it with")
            self._renderer = self._render_chat()
        return self._renderer(messages), messages

    def _answer_of(self, row: Row) -> Any:
        """The answer column's raw value, when a reward needs it (None when none does)."""
        opts = self.options
        if not self._styles() & {"builtin", "verl"}:
            return None  # a TRL function gets the raw columns instead, whatever they hold
        value = column_value(row.record, opts.answer_column)
        if value is _ABSENT:
            needs = ", ".join(r.spec for r in self._rewards if r.style != "trl")
            hint = (
                "; verl's layout keeps it in reward_model.ground_truth"
                if "verl" in self._styles() and "." not in opts.answer_column
                else ""
            )
            raise ValueError(
                f"{row.where}: no column {opts.answer_column!r} (the {needs} reward needs it{hint}); "
                "choose one with --answer-column"
            )
        return value

    def _add_row(self, row: Row) -> None:
        """The row's prompt, with what its rewards need of the row kept hub-side."""
        opts = self.options
        text, messages = self._prompt_of(row)
        truth = self._answer_of(row)
        answer = _answer_text(truth, row.where, opts.answer_column) if "builtin" in self._styles() else None
        key = None if messages is None else json.dumps([dict(m) for m in messages], sort_keys=True)
        prompt = Prompt(id=f"{opts.id_prefix}-{row.index}", text=text, answer=answer, split_key=key)
        self._prompts.append(prompt)
        if messages is not None:
            self._messages[prompt.id] = messages
        if opts.keep_rows:
            self._whole[prompt.id] = dict(row.record)
        if self._styles() - {"builtin"}:
            self._rows[prompt.id] = columns = {k: v for k, v in row.record.items() if k != opts.prompt_column}
            if "trl" in self._styles():
                check_trl_columns(columns, row.where)
        if "verl" in self._styles():
            self._truths[prompt.id] = truth

    def _check_signatures(self) -> None:
        """Each function must take what its style passes: TRL's keywords and the dataset's other columns, or
        verl's four."""
        call = self._call(self._prompts[0], ["x"], None)
        for reward in self._rewards:
            if reward.style == "trl":
                check_callable(reward, trl_arguments(call))
            elif reward.style == "verl":
                check_callable(reward, verl_arguments(call, "x"))

    def _call(self, prompt: Prompt, completions: list[str], context: GroupContext | None) -> RewardCall:
        """One group as the reward functions see it. Without a context (made-up completions: the start check)
        the token ids are empty and the step is 0."""
        n = len(completions)
        messages = self._messages.get(prompt.id)
        if messages is not None:
            prompts: list[Any] = [list(messages)] * n
            shown: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
            if context is not None and context.env_spans and self._conversation is not None:
                # A tool-using rollout as TRL passes it: its assistant turns and the tool messages between them.
                shown = [
                    self._conversation(ids, spans) if spans else turn
                    for ids, spans, turn in zip(context.completion_ids, context.env_spans, shown)
                ]
        else:
            prompts, shown = [prompt.text] * n, list(completions)
        ids = [list(t) for t in context.completion_ids] if context is not None else [[] for _ in completions]
        state = RewardState(context.version if context is not None else 0, self.options.max_steps)
        return RewardCall(
            prompt,
            prompts,
            shown,
            list(completions),
            ids,
            state,
            self._rows.get(prompt.id, {}),
            self._truths.get(prompt.id),
            RewardLog(n),
        )

    def prompts(self) -> list[Prompt]:
        return list(self._prompts)

    def messages_of(self, prompt_id: str) -> Messages | None:
        """The chat messages prompt `prompt_id` was rendered from (None: a string prompt)."""
        return self._messages.get(prompt_id)

    def row_of(self, prompt_id: str) -> dict[str, Any]:
        """Prompt `prompt_id`'s row as read, every column (options.keep_rows; KeyError without it)."""
        return self._whole[prompt_id]

    @property
    def reward_name(self) -> str:
        return ",".join(r.spec for r in self._rewards)

    @property
    def reward_names(self) -> tuple[str, ...]:
        """The name each reward function's metrics go by (a function's __name__, as TRL logs it)."""
        return tuple(r.name for r in self._rewards)

    def scores(self, prompt: Prompt, completions: list[str], context: GroupContext | None) -> Scores:
        scored = scored_parts(self._rewards, self._call(prompt, completions, context))
        total = combine_rewards(scored.parts, self._weights)
        self.unlogged.update(scored.dropped)
        named = tuple(zip(self.reward_names, scored.parts)) + scored.extras
        rewards = valid_rewards(self.reward_name, prompt, total, len(completions))
        return Scores(rewards, named, scored.metrics, scored.columns)

    def rewards(self, prompt: Prompt, completions: list[str]) -> Sequence[float]:
        return self.scores(prompt, completions, None).rewards


class MathTask(DatasetTask):
    """`math:FILE.jsonl`: one {"prompt": str, "answer": str} object per line (blank lines skipped, other keys
    ignored, anything else a ValueError naming the file and line), scored by shared.tasks.math.MathReward. A
    prompt's id is "math-<line number>", stable across runs of the same file."""

    name = "math"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, DatasetOptions(reward="math", id_prefix="math"))
