"""Task lookup: turns a task spec string (CLI/config) into a Task instance.

Specs: a builtin name ("reverse"), "math:PATH.jsonl" for MathTask, or "module.path:ClassName"
for a user task (a Task subclass constructible with no arguments). Builtins are imported
lazily, so loading one task never imports another's dependencies.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from pathlib import Path

from shared.tasks.base import Prompt, Task

BUILTIN_TASKS: Mapping[str, str] = {
    "reverse": "shared.tasks.reverse:ReverseTask",
}
MATH_PREFIX = "math:"

__all__ = ["BUILTIN_TASKS", "MATH_PREFIX", "Prompt", "Task", "load_task"]


def _load_class(spec: str, import_path: str) -> type[Task]:
    module_name, _, class_name = import_path.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"task spec {spec!r}: expected 'module.path:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task spec {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"task spec {spec!r}: module {module_name!r} has no attribute {class_name!r}")
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
        raise ValueError(
            f"task spec {spec!r}: {import_path} requires arguments {required}; a task class must take none"
        )
    return cls


def load_task(spec: str) -> Task:
    """The task named by `spec`; ValueError saying what is wrong with a bad spec."""
    spec = spec.strip()
    if spec.startswith(MATH_PREFIX):
        from shared.tasks.math import MathTask

        path = spec[len(MATH_PREFIX) :]
        if not path:
            raise ValueError(f"task spec {spec!r}: expected 'math:PATH.jsonl'")
        if not Path(path).is_file():
            raise ValueError(f"task spec {spec!r}: no such file {path}")
        return MathTask(path)
    if ":" in spec:
        return _load_class(spec, spec)()
    if spec in BUILTIN_TASKS:
        return _load_class(spec, BUILTIN_TASKS[spec])()
    known = ", ".join(sorted(BUILTIN_TASKS))
    raise ValueError(
        f"unknown task {spec!r}: builtin tasks are {known}; or use 'math:PATH.jsonl' or 'module.path:ClassName'"
    )
