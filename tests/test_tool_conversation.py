"""A tool-using completion read back as the conversation TRL's reward functions get (hub/agents/conversation.py),
through a dataset task's rewards, and the start check of a chat template that must carry tools."""

from __future__ import annotations

import json

import pytest

from hub.agents.conversation import ConversationReader, check_tool_template
from hub.agents.toolset import load_toolset
from shared.chat import tool_suffix_ids
from shared.tasks.base import GroupContext
from shared.tasks.dataset import DatasetOptions, DatasetTask, chat_renderer
from testbed.tool_chat import tool_chat_tokenizer

CALLS = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><tool_call>\n{"name": "bump", "arguments": {"by": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return tool_chat_tokenizer()


def rollout(tokenizer, answers: list[str]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A model turn calling add and bump, the tool answers `answers`, a last turn: ids and environment spans."""
    first = tokenizer.encode("Adding." + CALLS + "<|im_end|>")
    env = tool_suffix_ids(tokenizer, [{"role": "tool", "name": n, "content": c} for n, c in zip(("add", "bump"), answers)])
    last = tokenizer.encode("It is 7.<|im_end|>")
    return first + env + last, ((len(first), len(env)),)


def test_a_completion_reads_back_as_the_messages_trl_passes_its_rewards(tokenizer):
    # An answer holding the template's own closing text is still read whole: it is matched against the rendering.
    ids, spans = rollout(tokenizer, ["7", "3\n</tool_response>x"])
    assert ConversationReader(tokenizer).messages(ids, spans) == [
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
                {"type": "function", "function": {"name": "bump", "arguments": {"by": 2}}},
            ],
        },
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "bump", "content": "3\n</tool_response>x"},
        {"role": "assistant", "content": "It is 7."},
    ]
    single = tokenizer.encode("Just 7.<|im_end|>")
    assert ConversationReader(tokenizer).messages(single, ()) == [{"role": "assistant", "content": "Just 7."}]


def test_a_dataset_reward_gets_each_tool_using_rollout_as_its_conversation(tmp_path, tokenizer):
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Add 3 and 4."}]}) + "\n")
    schemas = load_toolset(["testbed.agent_tools:add"], "testbed.agent_tools:Counter").schemas
    task = DatasetTask(
        path,
        DatasetOptions(reward="testbed.agent_tools:tool_answers"),
        lambda: chat_renderer(tokenizer, "test", schemas),
        ConversationReader(tokenizer).messages,
    )
    (prompt,) = task.prompts()
    assert '"name": "add"' in prompt.text and '"name": "bump"' in prompt.text  # rendered with the tools' schemas
    tool_using, spans = rollout(tokenizer, ["7", "3"])
    plain = tokenizer.encode("7<|im_end|>")
    context = GroupContext((tuple(tool_using), tuple(plain)), 0, (spans, ()))
    assert task.scores(prompt, ["text", "7"], context).rewards == (2.0, 0.0)


def test_a_template_that_cannot_carry_tools_is_refused_in_words(tokenizer):
    schemas = load_toolset(["testbed.agent_tools:add"], None).schemas
    check_tool_template(tokenizer, schemas)
    plain = tool_chat_tokenizer("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="drops tool calls or tool answers"):
        check_tool_template(plain, schemas)
    untold = tool_chat_tokenizer(tokenizer.chat_template.replace("{%- if tools %}", "{%- if false %}"))
    with pytest.raises(ValueError, match="leaves the tools out of the prompt"):
        check_tool_template(untold, schemas)
