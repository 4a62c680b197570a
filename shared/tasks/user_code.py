"""User code named by a 'module.path:name' spec (a task class, a reward function), imported from the current
directory or installed packages, or by a 'path/to/file.py:name' spec (verl's custom_reward_function path and name),
loaded from that file."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def import_object(spec: str, what: str) -> Any:
    """The object a 'module.path:name' or 'FILE.py:name' spec names; ValueError saying what is wrong (code that
    raises while it is imported included: it is the user's). The current directory is importable, as it is for
    `python -m` (console scripts do not put it on sys.path)."""
    module_name, _, attr = spec.rpartition(":") if ".py:" in spec else spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} spec {spec!r}: expected 'module.path:{'ClassName' if what == 'task' else 'function'}'")
    if module_name.endswith(".py"):
        module = _file_module(Path(module_name), spec, what)
    else:
        module = _named_module(module_name, spec, what)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{what} spec {spec!r}: {module_name} has no attribute {attr!r}")
    return obj


def _named_module(module_name: str, spec: str, what: str) -> ModuleType:
    """An importable module by its dotted name."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} spec {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 -- the user's module failed as it ran
        raise ValueError(f"{what} spec {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from exc


def _file_module(path: Path, spec: str, what: str) -> ModuleType:
    """The module a Python file defines, loaded once per process under a name made from its absolute path (so two
    files of one name stay apart), as verl loads a custom reward file."""
    if not path.is_file():
        raise ValueError(f"{what} spec {spec!r}: no such file {path}")
    resolved = path.resolve()
    name = f"echo2_user_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}_{resolved.stem}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, resolved)
    if found is None or found.loader is None:
        raise ValueError(f"{what} spec {spec!r}: {path} cannot be loaded as Python")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    try:
        found.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 -- the user's file failed as it ran
        del sys.modules[name]
        raise ValueError(f"{what} spec {spec!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module
