"""What ends a tool-using rollout early, and the bounds of what a model turn may ask a tool for: the contract
between the hub's tool sandbox, its status and metrics, and the dashboard.

A tool call's name and arguments come from a model turn a node sent, so they are hostile: the node chooses
what "the model" said. A call the tool itself refuses (it raises) is an ordinary answer the model sees, as in
TRL. A call that breaks one of the sandbox's limits ends its rollout with one of these reasons, and never the
run.
"""

from __future__ import annotations

from enum import StrEnum

# A tool call's arguments as JSON text: more is refused before any tool code runs.
TOOL_ARGUMENT_MAX_BYTES = 64 * 1024
# A tool's answer as the model reads it: longer is cut, with a marker, before it is rendered into tokens.
TOOL_RESULT_MAX_CHARS = 16 * 1024
# Tool calls one model turn may hold; more end the rollout (TRL runs every call a turn holds).
TOOL_CALLS_PER_TURN_MAX = 16
# The metrics.jsonl key of a tool-using run's rounds of tool calls per rollout offered (TRL's name), which the
# status's history, the dashboard and /metrics read back.
TOOL_CALLS_METRIC = "tools/call_frequency"


class RolloutEnd(StrEnum):
    """Why a tool-using rollout ended before the model finished (the value is the reason as logged and counted)."""

    TOOL_WALL_TIME = "tool_wall_time"  # a call ran past its wall-clock limit: its worker was killed
    TOOL_CPU = "tool_cpu"  # a call spent past its CPU limit
    TOOL_MEMORY = "tool_memory"  # a call needed more memory than the sandbox allows
    TOOL_NETWORK = "tool_network"  # a call tried to open a connection: tools get no network
    TOOL_CRASHED = "tool_crashed"  # the worker died under the call (a native crash, an exit)
    ARGUMENTS_TOO_LARGE = "arguments_too_large"  # the call's arguments past TOOL_ARGUMENT_MAX_BYTES
    TOO_MANY_CALLS = "too_many_calls"  # a turn past TOOL_CALLS_PER_TURN_MAX
    ENVIRONMENT_LOST = "environment_lost"  # its environment lived in a worker another call had killed
    OBSERVATION_DIFFERS = "observation_differs"  # its reset() answered otherwise than its group's first rollout's


def rollout_key(lease_id: str, prompt_id: str, index: int) -> str:
    """The name of one rollout of a lease (its prompt, and its place among the prompt's completions) on both sides:
    the turns a node sends for it, the hub's tool loop, and the check of the environment segments it submits."""
    return f"{lease_id}/{prompt_id}/{index}"
