"""Config plumbing shared by both processes: a strict pydantic base, TOML loading and flag overrides.

Precedence is defaults < TOML file < command-line flags. Each process has one root model
(`HubConfig`, `NodeConfig`); components receive only their own section.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class Section(BaseModel):
    """Base of every config model: typed, frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ConfigError(ValueError):
    """A config that cannot be used, with the reason in words."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set tree['a']['b'] = value for dotted = 'a.b', creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def load_config(model: type[T], toml_path: Path | None, overrides: dict[str, Any]) -> T:
    """Build `model` from defaults, then the TOML file, then `overrides` (dotted keys -> values)."""
    tree: dict[str, Any] = {}
    if toml_path is not None:
        try:
            tree = tomllib.loads(Path(toml_path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {toml_path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {toml_path} is not valid TOML: {exc}") from exc
    flags: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(flags, dotted, value)
    try:
        return model.model_validate(_merge(tree, flags))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(config)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
