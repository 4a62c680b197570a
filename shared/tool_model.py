"""The embedded tool model: a tiny Qwen2 whose chat template renders tools as Qwen's does, warmed up on the
embedded tool task (shared/tasks/calc.py) until it can call its calculator but seldom does. `echo-hub start --task
calc` trains it when no --model is given: its tool calls per rollout rise from near 0 as its reward does.

Built like the default model (shared/default_model.py): a fixed recipe whose digest names the cache directory, saved
with save_pretrained, then loaded like any checkpoint. Its vocabulary is bytes plus a few tokens a real tokenizer's
merges would give (the chat roles, the call's fixed JSON, the numbers 10..99), so that a rollout is ~60 tokens.
The warm-up has phases: first, most examples call the tool and answer with the product it gives (copying operands
into a call takes the model a few hundred steps to learn); then, at a lower rate, mostly direct answers (4-digit
products it cannot compute), so that the run starts with the tool called on a few percent of rollouts.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.chat import tool_suffix_ids
from shared.default_model import BUILD_STATS_FILE, DEFAULT_MODEL_RECIPE, EmbeddedRecipe, build_model, recipe_digest, save_quietly
from shared.tasks.calc import CALC_OPERANDS, CALC_TASK, mul, problems, question

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}'
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same template naming the tools instead of rendering their schemas: a prompt a tiny model reads quickly.
NAMES_TEMPLATE = TEMPLATE.replace("{{ t | tojson }}", "{{ t.function.name }};")
TOOL_NAME = mul.__name__
# What a real tokenizer's merges would make single tokens: the template's fixed text, a call's fixed JSON.
WORD_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "system",
    "user",
    "assistant",
)
CALL_TOKENS = (f'{{"name": "{TOOL_NAME}", "arguments": {{"a": ', ', "b": ', "}}")


def tool_chat_tokenizer(template: str = TEMPLATE) -> Any:
    """A byte-level tokenizer with no merges, `<|im_end|>` its EOS, with `template` as its chat template."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials + sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = template
    return tokenizer


@dataclass(frozen=True)
class ToolModelRecipe:
    """Everything that determines the built model; its digest names the cache directory."""

    recipe_version: int = 2  # 2: the tokenizer keeps no model_max_length (the hub's own checks render past it)
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 128
    batch_size: int = 32
    # (steps, share of examples that call the tool, learning rate) of each warm-up phase, in order.
    phases: tuple[tuple[int, float, float], ...] = ((450, 0.7, 6e-4), (50, 0.04, 1e-4))
    weight_decay: float = 0.01
    torch_seed: int = 0
    warmup_task_seed: int = 777  # warm-up problems come from another draw than the task's own
    eval_prompts: int = 128
    eval_seed: int = 1

    label = "tool model"

    @property
    def warmup_steps(self) -> int:
        return sum(steps for steps, _, _ in self.phases)

    def digest(self) -> str:
        return recipe_digest(self)

    def dir_name(self) -> str:
        return f"default-calc-qwen2-{self.digest()}"

    def tokenizer(self) -> Any:
        tokenizer = tool_chat_tokenizer(NAMES_TEMPLATE)
        low, high = CALC_OPERANDS
        tokenizer.add_tokens([*WORD_TOKENS, *CALL_TOKENS, *map(str, range(low, high + 1))], special_tokens=False)
        return tokenizer

    def build(self, out_dir: Path, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        return build_tool_model(out_dir, self, on_step)


TOOL_MODEL_RECIPE = ToolModelRecipe()


def _schemas() -> list[dict[str, Any]]:
    from transformers.utils import get_json_schema

    return [get_json_schema(mul)]


def _call_text(a: int, b: int) -> str:
    """A call to the tool as the template renders one."""
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {json.dumps({"a": a, "b": b})}}}\n</tool_call>'


class _Examples:
    """Warm-up rows: (ids, labels), the loss on the model's own tokens only (not the prompt's, not the tool's)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.schemas = _schemas()
        self.pairs = problems(seed, 4096)
        self.rng = random.Random(seed)

    def prompt_ids(self, a: int, b: int) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(question(a, b)), tools=self.schemas, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def one(self, tool_share: float) -> tuple[list[int], list[int]]:
        a, b = self.pairs[self.rng.randrange(len(self.pairs))]
        encode = self.tokenizer.encode
        prompt = self.prompt_ids(a, b)
        answer = encode(f"{a * b}{self.tokenizer.eos_token}", add_special_tokens=False)
        if self.rng.random() >= tool_share:
            return prompt + answer, [-100] * len(prompt) + answer
        call = encode(_call_text(a, b) + self.tokenizer.eos_token, add_special_tokens=False)
        reply = tool_suffix_ids(self.tokenizer, [{"role": "tool", "name": TOOL_NAME, "content": str(mul(a, b))}])
        return prompt + call + reply + answer, [-100] * len(prompt) + call + [-100] * len(reply) + answer

    def batch(self, size: int, tool_share: float) -> tuple[Any, Any, Any]:
        import torch

        rows = [self.one(tool_share) for _ in range(size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((size, width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        labels = torch.full((size, width), -100, dtype=torch.long)
        for i, (row, row_labels) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            labels[i, : len(row)] = torch.tensor(row_labels)
        return ids, mask, labels


def first_turns(model: Any, examples: _Examples, n: int, seed: int, forced_call: bool) -> tuple[float, float]:
    """(share of sampled first turns that call the tool, share that call it with the prompt's operands), at
    temperature 1.0; `forced_call`: each turn starts with "<tool_call>" (how well the model calls when it does)."""
    import torch

    tokenizer = examples.tokenizer
    pairs = problems(seed, n)
    opening = tokenizer.encode("<tool_call>", add_special_tokens=False) if forced_call else []
    rows = [examples.prompt_ids(a, b) + opening for a, b in pairs]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    turns = [
        ("<tool_call>" if forced_call else "") + t for t in tokenizer.batch_decode(out[:, width:], skip_special_tokens=False)
    ]
    calls = sum("<tool_call>" in t for t in turns) / n
    exact = sum(t.startswith(_call_text(a, b)) for t, (a, b) in zip(turns, pairs)) / n
    return calls, exact


def build_tool_model(
    out_dir: Path, recipe: ToolModelRecipe = TOOL_MODEL_RECIPE, on_step: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Build, warm up and save the tool model into out_dir (created); its build stats, also written beside it."""
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the default model's build: the steadiest on a small shared machine
    try:
        tokenizer = recipe.tokenizer()
        model = build_model(recipe, tokenizer)
        examples = _Examples(tokenizer, recipe.warmup_task_seed)
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=recipe.weight_decay)
        model.train()
        done = 0
        for steps, tool_share, lr in recipe.phases:
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(steps):
                ids, mask, labels = examples.batch(recipe.batch_size, tool_share)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                done += 1
                if on_step is not None:
                    on_step(done, recipe.warmup_steps)
        model.eval()
        calls, exact = first_turns(model, examples, recipe.eval_prompts, recipe.eval_seed, forced_call=False)
        _, forced_exact = first_turns(model, examples, recipe.eval_prompts, recipe.eval_seed, forced_call=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        save_quietly(model, tokenizer, out_dir)
    finally:
        torch.set_num_threads(threads)
    stats = {
        "params": sum(p.numel() for p in model.parameters()),
        "build_seconds": time.perf_counter() - started,
        "tool_calls_first_turn": calls,
        "exact_calls_first_turn": exact,
        "exact_calls_when_calling": forced_exact,
    }
    (out_dir / BUILD_STATS_FILE).write_text(json.dumps({"recipe": dataclasses.asdict(recipe), "stats": stats}, indent=2))
    return stats


def embedded_recipe(task: str) -> EmbeddedRecipe:
    """The embedded model a run of `task` trains when no --model is given: the tool model for the embedded tool task,
    the default model for every other task."""
    return TOOL_MODEL_RECIPE if task.strip() == CALC_TASK else DEFAULT_MODEL_RECIPE
