"""Task lookup: turns a task spec string (CLI/config) into a Task instance.

Specs: a builtin name ("reverse"; "calc", the embedded tool task); "math:PATH.jsonl" for MathTask; a dataset on disk (a .jsonl or
.parquet file, or a `datasets` save_to_disk directory, "DIR:SPLIT" naming a DatasetDict's split) read and scored
as DatasetOptions say; or
"module.path:ClassName" for a user task (a Task subclass constructible with no arguments). User
modules are imported from the current directory or installed packages. Builtins are imported
lazily, so loading one task never imports another's dependencies.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from shared.tasks.base import Prompt, Task
from shared.tasks.dataset import Conversation, DatasetOptions, DatasetTask, MathTask, Messages, is_dataset_path, split_of
from shared.tasks.user_code import import_object

BUILTIN_TASKS: Mapping[str, str] = {"reverse": "shared.tasks.reverse:ReverseTask", "calc": "shared.tasks.calc:CalcTask"}
MATH_PREFIX = "math:"

__all__ = ["BUILTIN_TASKS", "MATH_PREFIX", "DatasetOptions", "Prompt", "Task", "import_object", "load_task"]


def _load_class(spec: str, import_path: str) -> type[Task]:
    cls = import_object(import_path, "task")
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise ValueError(f"task spec {spec!r}: {import_path} is not a subclass of shared.tasks.base.Task")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"task spec {spec!r}: {import_path} is abstract (does not implement {missing})")
    required = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise ValueError(f"task spec {spec!r}: {import_path} requires arguments {required}; a task class must take none")
    return cls


def load_task(
    spec: str,
    dataset: DatasetOptions = DatasetOptions(),
    render_chat: Callable[[], Callable[[Messages], str]] | None = None,
    conversation: Conversation | None = None,
) -> Task:
    """The task named by `spec`; ValueError saying what is wrong with a bad spec. `dataset` and `conversation` (how
    its rewards read a tool-using completion) apply to a dataset on disk; `render_chat` builds what renders its chat
    prompts (a chat template: called only once a chat prompt appears; None: chat prompts are refused)."""
    spec = spec.strip()
    if spec.startswith(MATH_PREFIX):
        path = spec[len(MATH_PREFIX) :]
        if not path:
            raise ValueError(f"task spec {spec!r}: expected 'math:PATH.jsonl'")
        if not Path(path).is_file():
            raise ValueError(f"task spec {spec!r}: no such file {path}")
        return MathTask(path)
    if is_dataset_path(spec):
        return DatasetTask(spec, dataset, render_chat=render_chat, conversation=conversation)
    saved, split = split_of(spec)
    if saved is not None:
        return DatasetTask(saved, replace(dataset, split=split), render_chat=render_chat, conversation=conversation)
    if spec.endswith((".jsonl", ".json", ".parquet")):
        raise ValueError(f"task spec {spec!r}: no such file {spec}")
    if ":" in spec:
        return _load_class(spec, spec)()
    if spec in BUILTIN_TASKS:
        cls = _load_class(spec, BUILTIN_TASKS[spec])
        from shared.tasks.calc import CALC_REWARD, CalcTask

        if issubclass(cls, CalcTask):  # a builtin dataset: read and scored as any, its chat rendered with its tools
            options = replace(dataset, reward=CALC_REWARD) if dataset.reward == DatasetOptions().reward else dataset
            return cls(options, render_chat, conversation)
        return cls()
    known = ", ".join(sorted(BUILTIN_TASKS))
    raise ValueError(
        f"unknown task {spec!r}: builtin tasks are {known}; or use a dataset (FILE.jsonl, FILE.parquet, a "
        "save_to_disk DIR), 'math:PATH.jsonl' or 'module.path:ClassName'"
    )
