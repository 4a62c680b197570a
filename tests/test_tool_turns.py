"""Reading a model turn's tool calls and rendering the tool answers (hub/agents/turns.py), against a real
tokenizer with a Qwen-style chat template that renders tools."""

from __future__ import annotations

import json

import pytest

from hub.agents.turns import ToolCall, parse_turn
from shared.chat import tool_suffix_ids
from shared.tools import TOOL_ARGUMENT_MAX_BYTES, TOOL_CALLS_PER_TURN_MAX, RolloutEnd
from testbed.tool_chat import tool_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tool_chat_tokenizer()


def test_a_turns_calls_are_read_with_their_arguments_and_the_text_around_them():
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><tool_call>{"name": "look", "arguments": "{\\"k\\": \\"x\\"}"}</tool_call>'
    turn = parse_turn(text)
    assert turn.content == "Let me add." and turn.end is None
    assert turn.calls == (ToolCall("add", {"a": 3, "b": 4}), ToolCall("look", {"k": "x"}))
    assert parse_turn("The answer is 7.").calls == ()


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "add", "arguments": {"a": 3',
        '["add"]',
        '{"arguments": {}}',
        '{"name": "add", "arguments": [1, 2]}',
        '{"name": ""}',
    ],
)
def test_a_malformed_call_makes_the_turn_plain_text_as_under_trl(body):
    text = f"x<tool_call>{body}</tool_call>"
    assert parse_turn(text).calls == () and parse_turn(text).content == text


def test_hostile_turns_end_their_rollout_before_any_tool_runs():
    many = '<tool_call>{"name": "add", "arguments": {}}</tool_call>' * (TOOL_CALLS_PER_TURN_MAX + 1)
    assert parse_turn(many).end is RolloutEnd.TOO_MANY_CALLS
    big = json.dumps({"name": "add", "arguments": {"a": "x" * TOOL_ARGUMENT_MAX_BYTES}})
    assert parse_turn(f"<tool_call>{big}</tool_call>").end is RolloutEnd.ARGUMENTS_TOO_LARGE


def test_tool_answers_are_appended_as_ids_so_the_conversation_is_never_tokenized_again(tokenizer):
    """prompt ids + the model's turn + the suffix == the template's own rendering of the whole conversation."""
    user = [{"role": "user", "content": "What is 3+4?"}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}
    turn = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    answers = [{"role": "tool", "name": "add", "content": "7"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    model_turn = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>')
    suffix = tool_suffix_ids(tokenizer, answers)
    whole = tokenizer.apply_chat_template(user + turn + answers, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(prompt) + model_turn + suffix == list(whole)
    assert (
        tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    original = tokenizer.chat_template
    # Marks whichever message is last: adding the tool answer changes how the assistant's turn renders.
    tokenizer.chat_template = "{%- for m in messages %}{{ m.role }}{% if loop.last %}!{% endif %}{%- endfor %}"
    try:
        with pytest.raises(ValueError, match="prefix"):
            tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "7"}])
    finally:
        tokenizer.chat_template = original
