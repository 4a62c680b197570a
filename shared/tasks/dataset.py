"""Prompt datasets from local files, scored by a reward: what users of TRL and verl bring.

Sources: a JSONL file (one object per line), a Parquet file, or a directory written by
`datasets.Dataset.save_to_disk` (a DatasetDict's split chosen by name). Columns are chosen by
name (default `prompt` and `answer`); every other column travels with its row to a reward
function. A prompt is a string, or chat messages (a list of {"role", "content"}) rendered with
the model tokenizer's chat template; `chat` also renders string prompts as one user message.

Rewards: "math" (math-verify equivalence of the final answer with the `answer` column), "exact"
(the stripped completion equals the answer), or "module:function" with TRL's reward-function
signature: fn(prompts=[...], completions=[...], **columns) -> list[float], called once per group
with the group's prompt repeated once per completion, as TRL repeats it per generation (chat
prompts get chat completions, [{"role": "assistant", ...}]).

Prompt ids are "<prefix>-<n>": n is the JSONL line number or the row index, so they are stable
across runs of the same file. Nothing here leaves the hub: answers and columns are hub-side.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.tasks.base import Prompt, Task
from shared.tasks.user_code import import_object

DATA_EXTRA = "pip install 'echo2[data]'"
BUILTIN_REWARDS = ("math", "exact")


@dataclass(frozen=True)
class DatasetOptions:
    """How to read a dataset and score its completions."""

    prompt_column: str = "prompt"
    answer_column: str = "answer"
    reward: str = "math"
    split: str = "train"
    chat: bool = False
    id_prefix: str = "row"


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
            raise ValueError(f"{path}: no split {split!r} (it has {', '.join(loaded)}); choose one with --dataset-split")
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


# -- prompts ---------------------------------------------------------------------------------------------

Messages = tuple[Mapping[str, str], ...]


def _messages(value: Any, where: str, column: str) -> Messages | None:
    """The chat messages in a prompt cell, None for a string; ValueError for anything else."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: {column!r} is empty")
        return None
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise ValueError(f"{where}: {column!r} must be a non-empty string or a list of {{'role', 'content'}} messages")


def chat_renderer(model_dir: Path) -> Callable[[Messages], str]:
    """Messages -> the prompt text the model sees, by its tokenizer's chat template (generation prompt added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {model_dir} has no chat template, so chat prompts cannot be rendered")
    return lambda messages: tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


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


def load_reward_function(spec: str) -> Callable[..., Any]:
    """`module:function` (imported from the current directory or installed packages)."""
    fn = import_object(spec, "reward")
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    return fn


class DatasetTask(Task):
    """Prompts from a dataset on disk, scored by `options.reward`. `render_chat` builds the chat renderer,
    called only if a chat prompt appears (it loads the tokenizer)."""

    name = "dataset"

    def __init__(
        self, path: str | Path, options: DatasetOptions = DatasetOptions(),
        render_chat: Callable[[], Callable[[Messages], str]] | None = None,
    ) -> None:
        from shared.tasks.math import MathReward

        self.path = Path(path)
        self.options = opts = options
        self._function = None if opts.reward in BUILTIN_REWARDS else load_reward_function(opts.reward)
        self._math = MathReward(str(self.path)) if opts.reward == "math" else None
        renderer: Callable[[Messages], str] | None = None
        self._prompts: list[Prompt] = []
        self._columns: dict[str, Mapping[str, Any]] = {}
        self._messages: dict[str, Messages] = {}
        for row in read_rows(self.path, opts.split):
            if opts.prompt_column not in row.record:
                raise ValueError(f"{row.where}: no column {opts.prompt_column!r} (columns: {', '.join(row.record)}); "
                                 "choose one with --prompt-column")
            value = row.record[opts.prompt_column]
            messages = _messages(value, row.where, opts.prompt_column)
            if messages is None and opts.chat:
                messages = ({"role": "user", "content": value},)
            answer = None
            if self._function is None:  # a reward function gets the raw column instead, whatever it holds
                if opts.answer_column not in row.record:
                    raise ValueError(f"{row.where}: no column {opts.answer_column!r} (the {opts.reward} reward needs "
                                     "it); choose one with --answer-column")
                answer = _answer_text(row.record[opts.answer_column], row.where, opts.answer_column)
            if messages is not None:
                if renderer is None:
                    if render_chat is None:
                        raise ValueError(f"{row.where}: a chat prompt, but no model tokenizer to render it with")
                    renderer = render_chat()
                text = renderer(messages)
            else:
                text = value
            key = None if messages is None else json.dumps([dict(m) for m in messages], sort_keys=True)
            prompt = Prompt(id=f"{opts.id_prefix}-{row.index}", text=text, answer=answer, split_key=key)
            self._prompts.append(prompt)
            if messages is not None:
                self._messages[prompt.id] = messages
            if self._function is not None:
                self._columns[prompt.id] = {k: v for k, v in row.record.items() if k != opts.prompt_column}
        if not self._prompts:
            raise ValueError(f"{self.path}: no prompts (empty dataset)")
        if self._function is not None:
            self._check_signature()

    def _check_signature(self) -> None:
        """The function must take what TRL passes: prompts, completions and the dataset's other columns."""
        first = self._prompts[0]
        try:
            inspect.signature(self._function).bind(**self._call_arguments(first, ["x"]))
        except TypeError as exc:
            raise ValueError(f"reward {self.options.reward}: cannot be called as TRL calls reward functions "
                             f"(prompts=, completions=, one keyword per dataset column): {exc}") from None

    def _call_arguments(self, prompt: Prompt, completions: list[str]) -> dict[str, Any]:
        """TRL's keywords for one group: its prompt and every other column once per completion."""
        n = len(completions)
        messages = self._messages.get(prompt.id)
        if messages is not None:
            prompts: list[Any] = [list(messages)] * n
            shown: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            prompts, shown = [prompt.text] * n, list(completions)
        columns = {k: [v] * n for k, v in self._columns.get(prompt.id, {}).items()}
        return {"prompts": prompts, "completions": shown, **columns}

    def prompts(self) -> list[Prompt]:
        return list(self._prompts)

    @property
    def reward_name(self) -> str:
        return self.options.reward

    def rewards(self, prompt: Prompt, completions: list[str]) -> Sequence[float]:
        if self._function is not None:
            return self._function(**self._call_arguments(prompt, completions))
        if self._math is not None:
            return [self._math.score(prompt, c) for c in completions]
        answer = (prompt.answer or "").strip()
        return [1.0 if c.strip() == answer else 0.0 for c in completions]


class MathTask(DatasetTask):
    """`math:FILE.jsonl`: one {"prompt": str, "answer": str} object per line (blank lines skipped, other keys
    ignored, anything else a ValueError naming the file and line), scored by shared.tasks.math.MathReward. A
    prompt's id is "math-<line number>", stable across runs of the same file."""

    name = "math"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, DatasetOptions(reward="math", id_prefix="math"))
