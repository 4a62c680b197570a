"""Config plumbing shared by both processes: a strict pydantic base, TOML loading and flag overrides.

Precedence is defaults < TOML file < command-line flags. Each process has one root model
(`HubConfig`, `NodeConfig`); components receive only their own section.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

T = TypeVar("T", bound=BaseModel)
# Where a status page listens (shared/web.py): HOST:PORT, [IPv6]:PORT, or off.
HttpBind = Annotated[str, Field(pattern=r"^(off|[A-Za-z0-9.\-]+:[0-9]{1,5}|\[[0-9a-fA-F:]+\]:[0-9]{1,5})$")]


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


def load_config(
    model: type[T], toml_path: Path | None, overrides: dict[str, Any], aliases: dict[str, str] | None = None
) -> T:
    """Build `model` from defaults, then the TOML file, then `overrides` (dotted keys -> values).

    `aliases` maps flat TOML keys (a flag's name, like `staleness`) to their dotted place (`learner.staleness`),
    so a file may say either. ConfigError (one line) names every bad value and what is expected.
    """
    tree: dict[str, Any] = {}
    if toml_path is not None:
        try:
            tree = tomllib.loads(Path(toml_path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {toml_path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {toml_path} is a directory") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {toml_path} is not valid TOML: {exc}") from None
        for flat, dotted in (aliases or {}).items():
            if flat in tree and flat not in model.model_fields and "." in dotted:
                set_dotted(tree, dotted, tree.pop(flat))
    flags: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(flags, dotted, value)
    try:
        return model.model_validate(_merge(tree, flags))
    except ValidationError as exc:
        raise ConfigError("invalid configuration: " + "; ".join(_describe(model, err) for err in exc.errors())) from None


def _describe(model: type[BaseModel], err: dict) -> str:
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        *section, key = err["loc"]
        if not section:
            owners = [name for name, f in model.model_fields.items() if isinstance(f.annotation, type)
                      and issubclass(f.annotation, BaseModel) and key in f.annotation.model_fields]
            if owners:
                return f"key {key!r} belongs in section [{owners[0]}] ({owners[0]}.{key}), not at the top level"
        fields = _section_model(model, section).model_fields
        place = f"[{'.'.join(map(str, section))}]" if section else "the top level"
        return f"unknown key {key!r} in {place} (known there: {', '.join(fields)})"
    if err["type"] == "missing":
        field = _leaf_field(model, where)
        return f"{where} is required: {field.description}" if field.description else f"{where} is required"
    message = err["msg"].removeprefix("Value error, ")
    return f"{where or '(config)'}: {message} (got {err['input']!r})" if "input" in err and not isinstance(
        err["input"], dict) else f"{where or '(config)'}: {message}"


def _section_model(model: type[BaseModel], path: list) -> type[BaseModel]:
    for part in path:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return model


def _default(model: type[BaseModel], dotted: str) -> Any:
    """The default of a dotted field, as the root model's defaults set it (a section's default instance wins)."""
    *sections, leaf = dotted.split(".")
    owner: Any = model
    value: Any = None
    for part in sections:
        field = owner.model_fields[part]
        value = field.get_default(call_default_factory=True)
        owner = type(value)
    field = owner.model_fields[leaf]
    if sections:
        return getattr(value, leaf)
    return field.get_default(call_default_factory=True)


def _leaf_field(model: type[BaseModel], dotted: str):
    *sections, leaf = dotted.split(".")
    owner: Any = model
    for part in sections:
        owner = type(owner.model_fields[part].get_default(call_default_factory=True))
    return owner.model_fields[leaf]


def _show(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if value is PydanticUndefined:
        return "required"
    return repr(value) if isinstance(value, str) else str(value)


def flag_help(model: type[BaseModel], dotted: str) -> str:
    """A flag's help from the config field it sets: its description, its choices, its default."""
    field = _leaf_field(model, dotted)
    text = field.description or ""
    choices = [a for a in get_args(field.annotation) if get_origin(field.annotation) is Literal]
    if choices:
        text += f" (one of {', '.join(map(str, choices))})"
    default = _default(model, dotted)
    if default is not None and default is not PydanticUndefined:
        text += f" (default {_show(default)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def example_toml(model: type[BaseModel], title: str) -> str:
    """Every field of `model`, section by section, with its help line and default: a config file to start from.

    Fields whose default is unset (None) are shown commented out."""
    head = [f"# {title}", "# Every field with its default; flags given on the command line override this file.", ""]
    return "\n".join(head + _toml_lines(model, lambda name, field: field.get_default(call_default_factory=True))) + "\n"


def config_toml(config: BaseModel, title: str) -> str:
    """Every field of `config` with its value, in example_toml's layout: the file that loads back to `config`."""
    return "\n".join([f"# {title}", ""] + _toml_lines(type(config), lambda name, field: getattr(config, name))) + "\n"


def _toml_lines(model: type[BaseModel], value_of: Callable[[str, Any], Any]) -> list[str]:
    """The fields of `model` as TOML lines, top-level ones first, then one table per section."""
    lines, sections = [], []
    for name, field in model.model_fields.items():
        value = value_of(name, field)
        if isinstance(value, BaseModel):
            sections.append((name, value))
            continue
        lines += _toml_field(name, field, value)
    for name, section in sections:
        lines += ["", f"[{name}]", f"# {(type(section).__doc__ or '').strip().splitlines()[0]}"]
        for key, field in type(section).model_fields.items():
            lines += _toml_field(key, field, getattr(section, key))
    return lines


def _toml_field(name: str, field, default: Any) -> list[str]:
    out = [f"# {field.description}"] if field.description else []
    if default is None or default is PydanticUndefined:
        out.append(f"# {name} = ")
    else:
        out.append(f"{name} = {_toml_value(default)}")
    return out
