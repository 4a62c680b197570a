"""The tools a run offers its model, as TRL's GRPOTrainer takes them, named by 'module:name' specs.

- `tools`: plain functions with type hints and a docstring whose Args section describes each parameter;
- `environment_factory`: a class (or any callable) making one environment per rollout, with `reset(**row)`
  (its answer, if any, is appended to the prompt), its public methods as tools, and an optional
  `get_reward()`.

Their JSON schemas are the ones transformers renders into a chat template (`get_json_schema`), so the model
sees what it would see under TRL. The tools are the operator's code; what is hostile is the arguments a
node's model turn passes them, which the sandbox (hub/agents/sandbox.py) bounds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.tasks.user_code import import_object

# What TRL calls on an environment itself: never offered to the model as a tool.
ENVIRONMENT_HOOKS = ("reset", "get_reward")


@dataclass(frozen=True)
class Toolset:
    """The functions by name, the environment factory and the names of its tool methods."""

    functions: dict[str, Callable[..., Any]]
    environment: Callable[[], Any] | None = None
    environment_methods: tuple[str, ...] = ()
    environment_reward: bool = False
    schemas: tuple[dict[str, Any], ...] = field(default=())

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.functions, *self.environment_methods)


def load_toolset(tool_specs: Sequence[str], environment_spec: str | None, schemas: bool = True) -> Toolset:
    """The toolset the specs name; ValueError in one line naming what is wrong and how TRL expects it.

    schemas: build the JSON schemas (imports transformers; the sandbox's workers only call the tools).
    """
    functions: dict[str, Callable[..., Any]] = {}
    for spec in tool_specs:
        func = import_object(spec, "tool")
        if not inspect.isfunction(func) and not inspect.isbuiltin(func):
            raise ValueError(f"tool spec {spec!r}: {type(func).__name__} is not a function (TRL's tools are plain functions)")
        _add(functions, func.__name__, func, spec)
    factory = import_object(environment_spec, "environment") if environment_spec else None
    methods: tuple[str, ...] = ()
    reward = False
    probe = None
    if factory is not None:
        assert environment_spec is not None
        if not callable(factory):
            raise ValueError(f"environment spec {environment_spec!r}: not a class or factory (TRL's environment_factory)")
        probe = _probe(factory, environment_spec)
        kind = type(probe)
        members = [name for name, _ in inspect.getmembers(kind, predicate=inspect.isfunction)]
        if "reset" not in members:
            raise ValueError(f"environment spec {environment_spec!r}: {kind.__name__} has no reset() method, which TRL requires")
        reward = "get_reward" in members
        methods = tuple(name for name in members if not name.startswith("_") and name not in ENVIRONMENT_HOOKS)
        for name in methods:
            if name in functions:
                raise ValueError(f"{environment_spec!r}: its method {name!r} has a tool's name; tool names must be unique")
    toolset = Toolset(functions, factory, methods, reward)
    if not schemas:
        return toolset
    bound = [*functions.values(), *(getattr(probe, name) for name in methods)]
    return Toolset(functions, factory, methods, reward, tuple(_schema(func) for func in bound))


def _add(functions: dict[str, Callable[..., Any]], name: str, func: Callable[..., Any], spec: str) -> None:
    if name in functions:
        raise ValueError(f"{spec!r}: a second tool named {name!r}; tool names must be unique")
    functions[name] = func


def _probe(factory: Callable[[], Any], spec: str) -> Any:
    """One environment, made as TRL makes one at start: to list its tools and check it can be made at all."""
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 -- the operator's code failed as it ran
        raise ValueError(f"environment spec {spec!r}: making one raised {type(exc).__name__}: {exc}") from exc


def _schema(func: Callable[..., Any]) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as exc:  # noqa: BLE001 -- transformers' parsing errors share no base class but Exception
        raise ValueError(
            f"tool {func.__name__!r}: {exc} (a tool needs type hints and a docstring with an Args: section, as TRL's)"
        ) from exc
