"""The hub's tasks from its config: the one it trains on and the held-out one it evaluates on, and the checks at
start that the model reads every prompt whole and has room in its context to answer it, and that the reward gives
one finite number per completion."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hub.config import HubConfig
from shared.checks import UserError
from shared.tasks import Task, load_task
from shared.tasks.base import Prompt, checked_rewards
from shared.tasks.dataset import DatasetTask, chat_renderer
from shared.tasks.split import excluding, split_task
from shared.tool_model import embedded_recipe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from shared.model_identity import ModelIdentity


def embedded_tokenizer(task: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the embedded model a run of `task` trains without --model, built by its recipe (its directory
    may not exist yet)."""
    return embedded_recipe(task).tokenizer()


def load_hub_task(spec: str, config: HubConfig, model: ModelIdentity | None) -> Task:
    """A task spec read with the config's dataset options (columns, reward, chat) and the run's length (the rewards'
    trainer_state.max_steps); chat prompts are rendered by the chat template of `model`'s tokenizer, or of the
    embedded model's the task trains (None: it may not be built yet). A tool-using run's prompts are rendered with its
    tools' schemas, and its rewards read each tool-using completion as its conversation (hub/agents/)."""
    options = replace(config.dataset.options(), max_steps=config.steps)
    embedded = f"the embedded {embedded_recipe(config.task).label}'s tokenizer (no --model given)"
    if not config.agents.enabled:
        renderer = model.chat_renderer if model is not None else lambda: chat_renderer(embedded_tokenizer(config.task), embedded)
        return load_task(spec, options, renderer)
    from hub.agents.conversation import ConversationReader
    from hub.agents.toolset import load_toolset

    agents = config.agents
    schemas = load_toolset(agents.tools, agents.environment).schemas
    if model is not None:
        tokenizer, whose = model.tokenizer, f"the tokenizer in {model.model_dir}"
    else:
        tokenizer, whose = embedded_tokenizer(config.task), embedded
    options = replace(options, keep_rows=agents.environment is not None)
    return load_task(spec, options, lambda: chat_renderer(tokenizer, whose, schemas), ConversationReader(tokenizer).messages)


def held_out(config: HubConfig, task: Task, model: ModelIdentity | None) -> tuple[Task, Task]:
    """(training task, evaluation task): the eval task minus every training prompt text when one is given,
    else the two sides of a split of `task` by prompt-text hash. ValueError when a side would be empty."""
    if config.eval.task is None:
        return split_task(task, config.eval.split)
    return task, excluding(load_hub_task(config.eval.task, config, model), task)


def hub_tasks(config: HubConfig, model: ModelIdentity | None) -> tuple[Task, Task | None]:
    """(training task, evaluation task or None when evaluation is off)."""
    task = load_hub_task(config.task, config, model)
    if config.eval.every == 0:
        return task, None
    return held_out(config, task, model)


def context_tokens(task: Task, tokenizer, max_new_tokens: int) -> int:
    """What a lease of `task` can need of a model's context: its longest prompt, tokenized as engines tokenize
    (`tokenizer(text)["input_ids"]`), plus max_new_tokens. Nodes size their engines by it (vLLM's max_model_len)."""
    texts = [p.text for p in task.prompts()]
    longest = max(map(len, tokenizer(texts)["input_ids"])) if texts else 0
    return longest + max_new_tokens


# The data checks at start: what the model reads of each prompt, against its text and the model's context.
EXAMPLE_CHARS = 60  # of a prompt shown in a message, from a little before its first lost character
LOST_CHARS_SHOWN = 8


@dataclass(frozen=True)
class PromptReading:
    """How the model reads a task's prompts: each one's length in tokens and the text its tokens decode to."""

    flag: str  # the flag that named the task, for the message
    prompts: list[Prompt]
    lengths: list[int]
    seen: list[str]


def model_reading(model: ModelIdentity | None, task: str) -> tuple[PreTrainedTokenizerBase, int | None]:
    """(tokenizer, context in tokens: max_position_embeddings, None when its config has none) of a model, or of the
    embedded model a run of `task` trains, by its recipe (its directory may not be built yet)."""
    if model is None:
        recipe = embedded_recipe(task)
        return recipe.tokenizer(), recipe.max_position_embeddings
    return model.tokenizer, model.context


def prompt_readings(texts: list[str], tokenizer) -> tuple[list[int], list[str]]:
    """(each text's length in tokens as engines count it, `tokenizer(text)["input_ids"]`; the text its tokens
    decode to), from one batch encoding: a 100k-row dataset takes seconds, not minutes."""
    if not texts:
        return [], []
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    seen = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    added = tokenizer.num_special_tokens_to_add()
    return [len(row) + added for row in ids], seen


def read_task(flag: str, task: Task, tokenizer) -> PromptReading:
    """How the model reads every prompt of `task`."""
    prompts = task.prompts()
    return PromptReading(flag, prompts, *prompt_readings([p.text for p in prompts], tokenizer))


def _around(text: str, start: int) -> str:
    """EXAMPLE_CHARS of `text` from `start`, marked … where cut."""
    end = start + EXAMPLE_CHARS
    return ("…" if start else "") + text[start:end] + ("…" if end < len(text) else "")


def _lost_chars(text: str, after: str) -> list[str]:
    """The characters of `text` that `after` (its tokens decoded) holds nowhere, in order."""
    kept = set(after)
    return [c for c in text if c not in kept]


def lossy_prompts(prompts: list[Prompt], seen: list[str]) -> str | None:
    """'N of M prompts lose characters to the tokenizer (lost: ...), e.g. ID 'text' -> 'what the model sees'';
    None when the model sees every prompt whole."""
    lost = [(prompt, after) for prompt, after in zip(prompts, seen) if prompt.text != after]
    if not lost:
        return None
    chars = list(dict.fromkeys(c for prompt, after in lost for c in _lost_chars(prompt.text, after)))
    shown = ", ".join(map(repr, chars[:LOST_CHARS_SHOWN])) + (
        f" and {len(chars) - LOST_CHARS_SHOWN} more" if len(chars) > LOST_CHARS_SHOWN else ""
    )
    first, after = lost[0]
    start = max(0, len(os.path.commonprefix([first.text, after])) - EXAMPLE_CHARS // 3)
    return (
        f"{len(lost)} of {len(prompts)} prompts lose characters to the tokenizer (lost: {shown}), "
        f"e.g. {first.id} {_around(first.text, start)!r} -> {_around(after, start)!r}"
    )


def _longest_past(prompts: list[Prompt], lengths: list[int], limit: int) -> tuple[int, str] | None:
    """How many prompts are longer than `limit` tokens, and 'ID with L tokens' of the longest; None when all fit."""
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return None
    worst = max(over, key=lengths.__getitem__)
    return len(over), f"{prompts[worst].id} with {lengths[worst]} tokens"


def overlong_prompts(prompts: list[Prompt], lengths: list[int], context: int, max_new_tokens: int) -> str | None:
    """'N of M prompts leave no room for --max-new-tokens ...' naming the longest; None when every prompt fits."""
    room = context - max_new_tokens
    if (past := _longest_past(prompts, lengths, room)) is None:
        return None
    count, longest = past
    return (
        f"{count} of {len(prompts)} prompts leave no room for --max-new-tokens {max_new_tokens} in the model's "
        f"context of {context} tokens (at most {room} prompt tokens), e.g. {longest}: shorten or drop them, or "
        "lower --max-new-tokens"
    )


def prompts_past(prompts: list[Prompt], lengths: list[int], limit: int) -> str | None:
    """'N of M prompts are longer than --max-prompt-length ...' naming the longest; None when every one fits."""
    if (past := _longest_past(prompts, lengths, limit)) is None:
        return None
    count, longest = past
    return (
        f"{count} of {len(prompts)} prompts are longer than --max-prompt-length {limit} tokens, e.g. {longest}: "
        "shorten or drop them, or raise --max-prompt-length"
    )


def max_new_tokens_past_context(max_new_tokens: int, context: int, longest: int) -> str | None:
    """'--max-new-tokens N is past the model's context ...' when no prompt could fit beside it; None when it fits."""
    if max_new_tokens < context:
        return None
    room = context - longest
    fix = (
        f"pass at most {room} (the longest prompt has {longest} tokens)"
        if room > 0
        else f"the longest prompt alone has {longest} tokens: shorten the prompts too"
    )
    return (
        f"--max-new-tokens {max_new_tokens} is past the model's context of {context} tokens "
        f"(max_position_embeddings), which holds the prompt and the completion together; {fix}"
    )


def _check_context(readings: list[PromptReading], context: int, max_new_tokens: int) -> None:
    """UserError with the numbers when max_new_tokens, or a prompt beside it, does not fit the model's context."""
    longest = max(max(r.lengths, default=0) for r in readings)
    if (mistake := max_new_tokens_past_context(max_new_tokens, context, longest)) is not None:
        raise UserError(mistake)
    for r in readings:
        if (mistake := overlong_prompts(r.prompts, r.lengths, context, max_new_tokens)) is not None:
            raise UserError(f"{r.flag}: {mistake}")


def check_prompts(config: HubConfig, model: ModelIdentity | None, task: Task, eval_task: Task | None) -> list[str]:
    """The data checks of `echo-hub start`: every prompt of the training task (and of --eval-task) fits the
    model's context beside max_new_tokens, and --max-prompt-length when given, and reaches the model whole (`model`:
    --model's, None for the embedded default). UserError with the numbers on the first mistake; the warning lines to
    print when --allow-lossy-prompts lets lossy prompts through."""
    tokenizer, context = model_reading(model, config.task)
    tasks = {f"--task {config.task}": task}
    if eval_task is not None and config.eval.task is not None:  # a held-out split is part of the training task
        tasks[f"--eval-task {config.eval.task}"] = eval_task
    readings = [read_task(flag, t, tokenizer) for flag, t in tasks.items()]
    if context is not None:
        _check_context(readings, context, config.sampling.max_new_tokens)
    limit = config.dataset.max_prompt_length
    for r in readings:
        if limit is not None and (mistake := prompts_past(r.prompts, r.lengths, limit)) is not None:
            raise UserError(f"{r.flag}: {mistake}")
    warnings = []
    for r in readings:
        if (lossy := lossy_prompts(r.prompts, r.seen)) is None:
            continue
        if not config.dataset.allow_lossy_prompts:
            raise UserError(f"{r.flag}: {lossy}: fix the data or pass --allow-lossy-prompts")
        warnings.append(f"warning: {r.flag}: {lossy}; going on (--allow-lossy-prompts)")
    return warnings


# The start check: this many prompts, each with a group of these made-up completions (an empty one, numbers,
# prose, a boxed answer), as a run's completions may look.
REWARD_CHECK_PROMPTS = 3
DUMMY_COMPLETIONS = ("", "42", "The answer is 42.", "\\boxed{1}", "I don't know")


def check_reward(task: Task, group_size: int) -> None:
    """Call the task's reward as a run calls it, once per group, on its first few prompts with made-up
    completions: a RewardError naming the function when it raises or returns other than one finite number per
    completion. Groups of at least two, so that one value per group is not taken for one per completion."""
    n = max(2, group_size)
    completions = [DUMMY_COMPLETIONS[i % len(DUMMY_COMPLETIONS)] for i in range(n)]
    for prompt in task.prompts()[:REWARD_CHECK_PROMPTS]:
        checked_rewards(task, prompt, completions)


def unlogged_note(task: Task) -> str | None:
    """The line that says which keys of a verl reward's dicts the start check saw holding other than numbers, which
    no metric can log (None: none did)."""
    unlogged = sorted(task.unlogged) if isinstance(task, DatasetTask) else []
    if not unlogged:
        return None
    return (
        f"reward {', '.join(unlogged)} (beside the score of its dict) is not a number, so no metric logs it; the "
        "numbers a dict holds are logged as rewards/<function>/<key>/mean"
    )
