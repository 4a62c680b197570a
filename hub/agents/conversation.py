"""A multi-turn completion read back as the conversation TRL's reward functions see, and the start check that a
model's chat template can carry one.

- Reading: a completion's token ids and environment spans (shared.rollout.Completion) as TRL passes a tool-using
  rollout to its reward functions: the assistant turns (their text, and the calls a turn made as `tool_calls`) and
  the tool messages between them, each {"role": "tool", "name", "content"}. A tool message's content is read out of
  the environment segment's text by the chat template's own rendering of placeholder answers to the same calls; a
  segment the template rendered otherwise (a template that rewrites what a tool said) gives its whole text as the
  content of one message.
- Checking: what TRL checks before it runs tools (supports_tool_calling, is_chat_template_prefix_preserving), plus
  that the tools' schemas reach the prompt and a tool answer reads back, so that a template that cannot is refused
  at start in one line, not found out by the first rollout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from hub.agents.turns import parse_turn
from shared.chat import tool_suffix_ids

# Placeholders no honest tool answer or tool name holds: where the template puts each answer, found by its text.
_PLACEHOLDER = "echo2tool{}answer7c1f"
_SAMPLE_ANSWER = "42 is\nthe answer"


class ConversationReader:
    """Token ids and environment spans -> TRL's completion messages, for one tokenizer (its chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def messages(self, token_ids: Sequence[int], env_spans: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        """The conversation after the prompt: each model segment an assistant message, each environment segment the
        tool messages answering the calls of the turn before it."""
        out: list[dict[str, Any]] = []
        start = 0
        names: tuple[str, ...] = ()
        for env_start, length in [*env_spans, (len(token_ids), 0)]:
            message, names = self._assistant(token_ids[start:env_start])
            out.append(message)
            if length:
                out += self.tool_messages(token_ids[env_start : env_start + length], names)
            start = env_start + length
        return out

    def _assistant(self, ids: Sequence[int]) -> tuple[dict[str, Any], tuple[str, ...]]:
        """A model turn as TRL's parse_response gives it, and the names of the tools it called."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        parsed = parse_turn(text.removesuffix(eos) if eos else text)
        if not parsed.calls:
            return {"role": "assistant", "content": self.tokenizer.decode(list(ids), skip_special_tokens=True)}, ()
        calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, tuple(c.name for c in parsed.calls)

    def tool_messages(self, ids: Sequence[int], names: Sequence[str]) -> list[dict[str, Any]]:
        """The tool messages of one environment segment that answered calls to `names`, in order."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        pattern = self._answers_pattern(tuple(names)) if names else None
        found = pattern.fullmatch(text) if pattern is not None else None
        if found is None:
            return [{"role": "tool", "name": names[0] if names else "", "content": text}]
        return [{"role": "tool", "name": name, "content": content} for name, content in zip(names, found.groups())]

    @functools.lru_cache(maxsize=256)  # noqa: B019 -- one reader per process, a few call patterns
    def _answers_pattern(self, names: tuple[str, ...]) -> re.Pattern[str] | None:
        """The text the template renders answers to calls of `names` as, each answer a group (None: the
        placeholders do not come out as they went in)."""
        placeholders = [_PLACEHOLDER.format(i) for i in range(len(names))]
        messages = [{"role": "tool", "name": n, "content": p} for n, p in zip(names, placeholders)]
        rendered = self.tokenizer.decode(tool_suffix_ids(self.tokenizer, messages), skip_special_tokens=False)
        pieces = re.split("|".join(map(re.escape, placeholders)), rendered)
        if len(pieces) != len(names) + 1:
            return None
        return re.compile("(.*?)".join(map(re.escape, pieces)), re.DOTALL)


def check_tool_template(tokenizer: Any, schemas: Sequence[dict[str, Any]]) -> None:
    """ValueError, in words, when `tokenizer`'s chat template cannot run a tool-using rollout: it renders no
    tool-calling conversation (a call's name and arguments and the tool's answer must all show), leaves the tools'
    schemas out of the prompt, renders a conversation otherwise once it grows (the loop appends tool answers to the
    ids the model saw, as TRL does), or renders a tool answer in a way it cannot be read back for the rewards."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("its tokenizer has no chat template")
    name, key, value, answer = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9"
    call = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "name": name, "content": answer},
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:1], tools=list(schemas), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 -- jinja's errors share no base class with the template's own raise_exception
        raise ValueError(f"its chat template cannot render a tool-calling conversation ({type(exc).__name__}: {exc})") from None
    if not all(part in rendered for part in (name, key, value, answer)):
        raise ValueError("its chat template drops tool calls or tool answers (as TRL's supports_tool_calling checks)")
    missing = [s["function"]["name"] for s in schemas if s["function"]["name"] not in prompt]
    if missing:
        raise ValueError(f"its chat template leaves the tools out of the prompt (no {missing[0]!r} in it)")
    reader = ConversationReader(tokenizer)
    ids = tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": _SAMPLE_ANSWER}])
    if reader.tool_messages(ids, [name]) != [{"role": "tool", "name": name, "content": _SAMPLE_ANSWER}]:
        raise ValueError("its chat template renders a tool's answer in a way the rewards cannot read back")
