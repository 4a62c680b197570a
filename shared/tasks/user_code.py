"""User code named by a 'module.path:name' spec (a task class, a reward function), imported from the current
directory or installed packages."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_object(spec: str, what: str) -> Any:
    """The object a 'module.path:name' spec names; ValueError saying what is wrong. The current directory
    is importable, as it is for `python -m` (console scripts do not put it on sys.path)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} spec {spec!r}: expected 'module.path:{'ClassName' if what == 'task' else 'function'}'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} spec {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{what} spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return obj
