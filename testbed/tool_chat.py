"""Models for the tool-loop tests over the tokenizer whose chat template renders tools as Qwen's does
(shared/tool_model.py, where the embedded tool model's is built from it): a random one, and a small one that already
calls tools."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shared.tool_model import NAMES_TEMPLATE, TEMPLATE, tool_chat_tokenizer

__all__ = ["NAMES_TEMPLATE", "TEMPLATE", "random_tool_model", "tool_chat_tokenizer", "tool_model_dir"]


def random_tool_model(out_dir: Path) -> Path:
    """A random 1-layer Qwen2 model over this tokenizer (its template renders tools' schemas), in `out_dir`/model:
    a hub's model for tests whose turns are written by hand, or whose engine's turns need not make sense."""
    from testbed.models import random_model_dir

    tool_chat_tokenizer().save_pretrained(out_dir / "tokenizer")
    return random_model_dir(out_dir / "model", layers=1, tokenizer_dir=out_dir / "tokenizer", context=2048)


def tool_model_dir(
    out_dir: Path,
    prompt: str,
    turns: Sequence[str],
    answers: Sequence[Sequence[tuple[str, str]]],
    steps: int = 60,
    context: int = 512,
) -> Path:
    """A small Qwen2 model over this tokenizer (NAMES_TEMPLATE) in `out_dir`, trained to answer `prompt` (the text a
    hub leases: the chat template with the tools rendered) with `turns[0]`, then after each `answers[i]` (tool messages as (name,
    content), rendered as the hub's tool loop renders them) with `turns[i + 1]`: a policy that calls tools from its
    first rollout, which end-to-end tests of tool-using runs start from. Each turn's text ends with `<|im_end|>`."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.chat import tool_suffix_ids
    from testbed.models import random_model_dir

    tokenizer = tool_chat_tokenizer(NAMES_TEMPLATE)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    random_model_dir(out_dir, layers=1, tokenizer_dir=out_dir / "tokenizer", context=context)
    ids = list(tokenizer(prompt)["input_ids"])
    labels = [-100] * len(ids)
    for i, turn in enumerate(turns):
        sampled = tokenizer.encode(turn, add_special_tokens=False)
        ids, labels = ids + sampled, labels + sampled
        if i < len(answers):
            env = tool_suffix_ids(tokenizer, [{"role": "tool", "name": n, "content": c} for n, c in answers[i]])
            ids, labels = ids + env, labels + [-100] * len(env)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    batch = torch.tensor([ids])
    for _ in range(steps):
        loss = model(input_ids=batch, labels=torch.tensor([labels])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir)
    return out_dir
