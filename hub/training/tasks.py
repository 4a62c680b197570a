"""The hub's tasks from its config: the one it trains on and the held-out one it evaluates on."""

from __future__ import annotations

from pathlib import Path

from hub.config import HubConfig
from shared.tasks import Task, load_task
from shared.tasks.split import excluding, split_task


def load_hub_task(spec: str, config: HubConfig, model_dir: Path | None) -> Task:
    """A task spec read with the config's dataset options (columns, reward, chat)."""
    return load_task(spec, config.dataset.options(), model_dir)


def held_out(config: HubConfig, task: Task, model_dir: Path | None) -> tuple[Task, Task]:
    """(training task, evaluation task): the eval task minus every training prompt text when one is given,
    else the two sides of a split of `task` by prompt-text hash. ValueError when a side would be empty."""
    if config.eval.task is None:
        return split_task(task, config.eval.split)
    return task, excluding(load_hub_task(config.eval.task, config, model_dir), task)


def hub_tasks(config: HubConfig, model_dir: Path | None) -> tuple[Task, Task | None]:
    """(training task, evaluation task or None when evaluation is off)."""
    task = load_hub_task(config.task, config, model_dir)
    if config.eval.every == 0:
        return task, None
    return held_out(config, task, model_dir)


def context_tokens(task: Task, tokenizer, max_new_tokens: int) -> int:
    """What a lease of `task` can need of a model's context: its longest prompt, tokenized as engines tokenize
    (`tokenizer(text)["input_ids"]`), plus max_new_tokens. Nodes size their engines by it (vLLM's max_model_len)."""
    texts = [p.text for p in task.prompts()]
    longest = max(map(len, tokenizer(texts)["input_ids"])) if texts else 0
    return longest + max_new_tokens
