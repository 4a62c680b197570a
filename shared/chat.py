"""The ids a tool's answer adds after a model turn, cut from a chat template's rendering of a short conversation
with and without the tool messages (TRL's `_get_tool_suffix_ids`): what the hub's tool loop sends a node, and what
the embedded tool model (shared/tool_model.py) is warmed up on. Earlier turns are never tokenized again: the ids the
model saw stay the ids the learner trains on.
"""

from __future__ import annotations

from typing import Any


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The ids `tool_messages` (role "tool", name, content) add after an assistant turn, up to and including the
    next assistant header: the rendering of [user, assistant with a call] and of it plus the tool messages,
    the first cut at its last end-of-sequence token, must be a prefix of the second (ValueError if the
    template is not prefix-preserving, which TRL also requires)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = _ids(tokenizer.apply_chat_template(head, add_generation_prompt=False, tokenize=True))
    full = _ids(tokenizer.apply_chat_template(head + tool_messages, add_generation_prompt=True, tokenize=True))
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:  # templates such as Qwen's render "<|im_end|>\n" after a turn: the model stops at the EOS
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template does not keep a conversation's rendering as the prefix of a longer one")
    return full[len(prefix) :]


def _ids(rendered: Any) -> list[int]:
    """apply_chat_template's ids, whether it returned a list or a BatchEncoding (transformers 5)."""
    if isinstance(rendered, list):
        return [int(token) for token in rendered]
    return [int(token) for token in rendered["input_ids"]]
