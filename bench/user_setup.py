"""bench/e2e.py --setup user: a model, a dataset and a reward as a TRL user brings them, to TRL and to echo-hub start.

- The model: a small Qwen2 checkpoint directory with its own tokenizer files and a chat template (a user message's
  text, then ">" as the generation prompt). Its weights are the embedded default's, so that it learns its task within
  a CPU run; what a user's model changes is the path: `--model DIR`, its tokenizer and chat template on both sides.
- The dataset: conversational JSONL (`prompt`: one user message, the word; `answer`: the word reversed), the words of
  the reverse task, its held-out split as test.jsonl and the rest as train.jsonl.
- The reward: `reversed_word` below, a TRL reward function of this file (`--reward FILE.py:reversed_word`).

Nothing at import time but the standard library: the hub loads this file for its reward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
MODEL_SUBDIR = "model"
TRAIN_FILE = "train.jsonl"
TEST_FILE = "test.jsonl"


def reversed_word(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the assistant's reply (TRL's conversational completion) is the answer, else 0.0."""
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def build(where: Path, eval_split: float) -> tuple[list[str], Path, str]:
    """Write the model, train.jsonl and test.jsonl (the reverse task's words, `eval_split` of them held out) under
    `where`: (echo-hub start's flags that train on them, the dataset TRL trains on, the reward as FILE.py:name)."""
    from shared.default_model import ensure_default_model
    from shared.tasks.reverse import ReverseTask
    from shared.tasks.split import split_task

    model = where / MODEL_SUBDIR
    shutil.copytree(ensure_default_model(progress=False), model)
    tokenizer_config = model / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps(json.loads(tokenizer_config.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    for name, part in zip((TRAIN_FILE, TEST_FILE), split_task(ReverseTask(), eval_split), strict=True):
        rows = [{"prompt": [{"role": "user", "content": p.answer[::-1]}], "answer": p.answer} for p in part.prompts()]
        (where / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = f"{Path(__file__).resolve()}:{reversed_word.__name__}"
    flags = ["--model", str(model), "--task", str(where / TRAIN_FILE), "--eval-task", str(where / TEST_FILE)]
    return [*flags, "--reward", reward], where / TRAIN_FILE, reward
