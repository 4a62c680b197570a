"""A model turn's tool calls read from its text: the calls a turn holds, in the Hermes/Qwen form chat templates with
tools render (`<tool_call>` `{"name": ..., "arguments": {...}}` `</tool_call>`), as TRL's parser reads them. The turn
is a node's text, so every call is bounded before anything runs it: how many a turn holds, and its arguments' size
and shape. A malformed call is not a tool call (TRL decodes such a turn as plain text, and the rollout ends). The
tokens a tool's answer adds are rendered by shared/chat.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shared.tools import TOOL_ARGUMENT_MAX_BYTES, TOOL_CALLS_PER_TURN_MAX, RolloutEnd

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: its text outside the calls, its calls, or why its rollout ends (too many calls)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    end: RolloutEnd | None = None


def parse_turn(text: str) -> ParsedTurn:
    """The tool calls `text` holds. A malformed call makes the whole turn plain text (TRL's fallback): the model
    answered, and its rollout ends there. A call naming no tool is still a call: the model reads "Tool X not
    found." as under TRL."""
    bodies = _CALL.findall(text)
    content = _CALL.sub("", text).strip()
    if not bodies:
        return ParsedTurn(text)
    if len(bodies) > TOOL_CALLS_PER_TURN_MAX:
        return ParsedTurn(content, end=RolloutEnd.TOO_MANY_CALLS)
    calls = []
    for body in bodies:
        if len(body.encode()) > TOOL_ARGUMENT_MAX_BYTES:
            return ParsedTurn(content, end=RolloutEnd.ARGUMENTS_TOO_LARGE)
        call = _call(body)
        if call is None:
            return ParsedTurn(text)
        calls.append(call)
    return ParsedTurn(content, tuple(calls))


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some templates render the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not all(isinstance(k, str) for k in arguments):
        return None
    return ToolCall(value["name"], arguments)
