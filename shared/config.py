"""Config plumbing shared by both processes and the tools: a strict pydantic base, TOML loading with one-line
errors, and flag overrides.

Precedence is defaults < TOML file < command-line flags. Each process has one root model
(`HubConfig`, `NodeConfig`); components receive only their own section.
"""

from __future__ import annotations

import copy
import difflib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

T = TypeVar("T", bound=BaseModel)
# A bad value longer than this (a whole array of tables, say) is not repeated in the one-line error.
SHOWN_INPUT_CHARS = 120
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


def field_of(model: type[BaseModel], dotted: str, **changes: Any) -> Any:
    """Another model's field (its type's bounds and its default) for a model that takes the same value, so that the
    rule is defined once; `changes`: Field() arguments it differs by (a description, say)."""
    field = _leaf_field(model, dotted)
    return FieldInfo.merge_field_infos(field, **changes) if changes else copy.copy(field)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set tree['a']['b'] = value for dotted = 'a.b', creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """The TOML document at `path`; ConfigError (one line, naming `what` and the path) when it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"cannot read {what} {path}: it does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"cannot read {what} {path}: it is a directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def validated(
    model: type[T], document: dict[str, Any], context: str = "invalid configuration", flat: list[str] | None = None
) -> T:
    """`document` as `model`; ConfigError (one line, after `context`) naming every bad value and what is expected.
    `flat`: the top-level names a file may also use (a flag's name), offered as "did you mean"."""
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        errors = exc.errors()
        # A table that failed inside an array of them also leaves the array short: the inner error says it all.
        errors = [
            err
            for err in errors
            if not (
                err["type"] == "too_short"
                and any(other["loc"][: len(err["loc"])] == err["loc"] and len(other["loc"]) > len(err["loc"]) for other in errors)
            )
        ]
        raise ConfigError(f"{context}: " + "; ".join(_describe(model, err, flat) for err in errors)) from None


def load_config(model: type[T], toml_path: Path | None, overrides: dict[str, Any], aliases: dict[str, str] | None = None) -> T:
    """Build `model` from defaults, then the TOML file, then `overrides` (dotted keys -> values).

    `aliases` maps flat TOML keys (a flag's name, like `staleness`) to their dotted place (`learner.staleness`),
    so a file may say either. ConfigError (one line) names every bad value and what is expected.
    """
    tree: dict[str, Any] = {}
    if toml_path is not None:
        tree = read_toml(toml_path)
        for flat, dotted in (aliases or {}).items():
            if flat in tree and flat not in model.model_fields and flat != dotted:
                set_dotted(tree, dotted, tree.pop(flat))
    flags: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(flags, dotted, value)
    return validated(model, _merge(tree, flags), flat=list(aliases or {}))


def _did_you_mean(key: str, known: list[str]) -> str:
    """ "did you mean X? " for the known key closest to `key`, or nothing."""
    found = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean {found[0]!r}? " if found else ""


def _describe(model: type[BaseModel], err: Any, flat: list[str] | None = None) -> str:
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return _unknown_key(model, err["loc"], flat)
    if err["type"] == "missing":
        *section, key = err["loc"]
        field = _section_model(model, section).model_fields.get(str(key))
        return f"{where} is required: {field.description}" if field and field.description else f"{where} is required"
    if err["type"] in ("tuple_type", "list_type") and not isinstance(err.get("input"), (dict, list, tuple)):
        # A scalar where a list goes (`staleness = 3`): say the list, not "Input should be a valid tuple".
        *section, leaf = err["loc"]
        field = _section_model(model, section).model_fields.get(str(leaf))
        given = f"{leaf} = {_toml_value(err['input'])}"
        if field is not None and _model_in(field.annotation) is not None:
            return f"{where} takes tables: write [[{where}]] sections, not {given}"
        return f"{where} takes a list: write {leaf} = [{_toml_value(err['input'])}], not {given}"
    message = err["msg"].removeprefix("Value error, ")
    shown = repr(err.get("input"))
    if "input" not in err or isinstance(err["input"], dict) or len(shown) > SHOWN_INPUT_CHARS:
        return f"{where or '(config)'}: {message}"
    return f"{where or '(config)'}: {message} (got {shown})"


def _unknown_key(model: type[BaseModel], loc: tuple, flat: list[str] | None) -> str:
    """A key no model field takes: the section it belongs in, or the closest known key."""
    *section, key = loc
    if not section:
        owners = [
            name
            for name, f in model.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) and key in f.annotation.model_fields
        ]
        if owners:
            return f"key {key!r} belongs in section [{owners[0]}] ({owners[0]}.{key}), not at the top level"
    fields = list(_section_model(model, section).model_fields)
    place = f"[{'.'.join(map(str, section))}]" if section else "the top level"
    # At the top level a flag's name (staleness = 4) is a key too.
    guess = _did_you_mean(str(key), fields + ([] if section else list(flat or [])))
    return f"unknown key {key!r} in {place}: {guess}(known there: {', '.join(fields)})"


def _section_model(model: type[BaseModel], path: list) -> type[BaseModel]:
    """The model a key at `path` belongs to: sections, and the tables of an array of them (`[[node]]`: an index)."""
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        inner = None if field is None else _model_in(field.annotation)
        if inner is None:
            break
        model = inner
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or the one in its tuple or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _arrays_of_tables(section: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel], str, Any]]:
    """reference_markdown's tables for the arrays of tables of `section` (`[[fleet.gpu]]`: a tuple of models)."""
    return [
        (f"[[{prefix}{name}]]", inner, prefix + name + ".", field)
        for name, field in section.model_fields.items()
        if (inner := _array_of_tables(field.annotation)) is not None
    ]


def _array_of_tables(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that holds an array of tables (a tuple of one model), or None."""
    args = [arg for arg in get_args(annotation) if arg is not Ellipsis]
    if get_origin(annotation) is tuple and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


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
    """A default as a person types it on the command line: on/off, comma lists, bare words."""
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "empty"
    if isinstance(value, str) and not value:
        return '""'
    return str(value)


def _choices(annotation: Any) -> tuple[list[Any], bool]:
    """The values a Literal field takes, and whether it takes several (a tuple of them)."""
    if get_origin(annotation) is tuple and get_args(annotation):
        return _choices(get_args(annotation)[0])[0], True
    return (list(get_args(annotation)) if get_origin(annotation) is Literal else []), False


def flag_help(model: type[BaseModel], dotted: str, switch: bool = False) -> str:
    """A flag's help from the config field it sets: its description, its choices (on or off for a boolean, unless
    it is a `switch` that takes no value), its default."""
    field = _leaf_field(model, dotted)
    text = field.description or ""
    choices, several = _choices(field.annotation)
    if choices:
        text += f" ({'any of' if several else 'one of'} {', '.join(map(str, choices))}{', comma-separated' if several else ''})"
    elif field.annotation is bool and not switch:
        text += " (on or off)"
    default = _default(model, dotted)
    if default is not None and not switch:
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


def example_toml(model: type[BaseModel], title: str, notes: dict[str, str] | None = None) -> str:
    """Every field of `model`, section by section, with its help line and its default commented out: a config file
    to start from that sets nothing until a line is uncommented, so a default that depends on other values (the hub's
    for a model of the user's: hub/config.py's with_user_model_defaults) still applies to every line left as it is.

    `notes`: a remark after a dotted field's default (`# lr = 0.0003  # a --model of your own: 1e-06`)."""
    head = [
        f"# {title}",
        "# Every field, its default commented out: uncomment a line (or add one) to set it. Flags given on the command",
        "# line override this file.",
        "",
    ]
    lines = _toml_lines(model, lambda name, field: field.get_default(call_default_factory=True), notes or {})
    return "\n".join(head + lines) + "\n"


def config_toml(config: BaseModel, title: str) -> str:
    """Every field of `config` with its value, in example_toml's layout: the file that loads back to `config`."""
    return "\n".join([f"# {title}", ""] + _toml_lines(type(config), lambda name, field: getattr(config, name))) + "\n"


def _toml_lines(model: type[BaseModel], value_of: Callable[[str, Any], Any], notes: dict[str, str] | None = None) -> list[str]:
    """The fields of `model` as TOML lines, top-level ones first, then one table per section. With `notes` (None:
    the values are set) every value is a commented-out default, a dotted field's note after it."""
    lines, sections = [], []
    for name, field in model.model_fields.items():
        value = value_of(name, field)
        if isinstance(value, BaseModel):
            sections.append((name, value))
            continue
        lines += _toml_field(name, field, value, notes, name)
    for name, section in sections:
        lines += ["", f"[{name}]", f"# {(type(section).__doc__ or '').strip().splitlines()[0]}"]
        for key, field in type(section).model_fields.items():
            lines += _toml_field(key, field, getattr(section, key), notes, f"{name}.{key}")
    return lines


def _toml_field(name: str, field, value: Any, notes: dict[str, str] | None, dotted: str) -> list[str]:
    """A field's help line and `name = value`: commented out where `value` is unset, or is a default (`notes` is
    given), with its note."""
    out = [f"# {field.description}"] if field.description else []
    if value is None or value is PydanticUndefined:
        out.append(f"# {name} = ")
    elif notes is None:
        out.append(f"{name} = {_toml_value(value)}")
    else:
        note = notes.get(dotted)
        out.append(f"# {name} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
    return out


def reference_markdown(model: type[BaseModel], flags: dict[str, list[str]], title: str) -> str:
    """Every field of `model` as Markdown tables, one per section: key, the flags that set it, default, description.

    `flags` maps a dotted field to its flags (`{"learner.lr": ["--lr", "--learning-rate"]}`); docs/configuration.md
    is built from it, so the reference cannot drift from the model."""
    out = [f"## {title}", ""]
    # (heading, model, dotted prefix, the field that holds an array of tables or None)
    tables: list[tuple[str, type[BaseModel], str, Any]] = [("top level", model, "", None)]
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            tables.append((f"[{name}]", field.annotation, name + ".", None))
            tables += _arrays_of_tables(field.annotation, name + ".")
    tables += _arrays_of_tables(model, "")
    for heading, section, prefix, array in tables:
        out += _reference_table(model, flags, heading, section, prefix, array)
    return "\n".join(out)


def _reference_table(
    model: type[BaseModel], flags: dict[str, list[str]], heading: str, section: type[BaseModel], prefix: str, array: Any
) -> list[str]:
    """reference_markdown's table of one section (or of an array's tables: `array` is the field holding them)."""
    rows = [
        (key, field)
        for key, field in section.model_fields.items()
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
        and _array_of_tables(field.annotation) is None
    ]
    if not rows:
        return []
    doc = next(iter((section.__doc__ or "").strip().splitlines()), "") if section is not model else ""
    if array is not None:
        tables = _default(model, prefix.removesuffix("."))
        count = 0 if tables is PydanticUndefined else len(tables)  # a required array has no default tables
        doc = f"{array.description or doc} ({'any number of tables' if not count else f'default: {count} tables'})"
    out = [f"### {heading}", ""] + ([doc, ""] if doc else [])
    out += ["| key | flag | default | description |", "| --- | --- | --- | --- |"]
    for key, field in rows:
        # A key of an array's tables has its own field's default (each table sets it or takes that).
        default = field.get_default(call_default_factory=True) if array is not None else _default(model, prefix + key)
        shown = "(none)" if default is None else "required" if default is PydanticUndefined else f"`{_toml_value(default)}`"
        given = ", ".join(f"`{flag}`" for flag in flags.get(prefix + key, [])) or "(file only)"
        text = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {given} | {shown} | {text} |")
    return out + [""]
