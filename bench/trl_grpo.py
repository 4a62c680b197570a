"""TRL's GRPOTrainer on echo2's recipe: the recipe read from a HubConfig and handed to TRL under TRL's names
(bench/learner.py's and bench/e2e.py's TRL side), and one whole TRL training run as a process of its own
(bench/e2e.py --against trl), with its own generation.

    python bench/trl_grpo.py SPEC.json

SPEC.json: {"hub_args": echo-hub start's flags (the run's config, read as that command reads it), "out": the run's
directory, "save_steps": weights saved every that many steps and at the end, "threads": torch CPU threads, "dataset":
a JSONL file TRL trains on and "reward": its TRL reward function as FILE.py:name (both null: the config's task, its
training part, scored by the task's own reward)}. The run writes OUT/steps.jsonl (per step: its end in wall-clock
seconds since the epoch, TRL's logged rollout reward, share of groups whose rewards were all equal and mean
completion length), OUT/checkpoint-N/ and OUT/final/.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

# transformers would otherwise try to download kernels from the Hub (a GPU machine here reaches no network).
os.environ.setdefault("USE_HUB_KERNELS", "NO")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from hub.config import HubConfig
    from shared.tasks.base import Task

# The recipe: echo-hub start's flags whose settings TRL's GRPOConfig has too (prompts_per_step as its batch).
RECIPE_FLAGS = (
    "lr",
    "lr_scheduler",
    "warmup_ratio",
    "weight_decay",
    "grad_clip",
    "group_size",
    "prompts_per_step",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "loss_type",
    "beta",
    "eps_low",
    "eps_high",
    "num_iterations",
    "seed",
    "gradient_checkpointing",  # not the recipe but its speed: TRL's default is on, echo2's off
)
STEPS_FILE = "steps.jsonl"
FINAL_SUBDIR = "final"
CHECKPOINT_PREFIX = "checkpoint-"  # transformers' Trainer's


def hub_config(hub_args: list[str]) -> HubConfig:
    """The config `echo-hub start HUB_ARGS` runs with (hub/cli/main.py's effective_start_config); ConfigError on a
    mistake."""
    from hub.cli.main import build_parser, effective_start_config

    return effective_start_config(build_parser().parse_args(["start", *hub_args]))[0]


def recipe(config: HubConfig) -> dict[str, Any]:
    """The recipe as echo-hub start's flags name it: flag -> its value in `config`."""
    from hub.cli.main import START_FLAGS

    return {flag: attrgetter(START_FLAGS[flag][0])(config) for flag in RECIPE_FLAGS}


def recipe_flags(config: HubConfig) -> list[str]:
    """`config`'s recipe as echo-hub start's flags, every one given: what echo2's side of a comparison runs with."""
    return [part for flag, value in recipe(config).items() for part in (f"--{flag.replace('_', '-')}", str(value))]


def grpo_settings(config: HubConfig) -> dict[str, Any]:
    """GRPOConfig's keyword arguments for `config`'s recipe: each setting under TRL's name (echo-hub start's own
    aliases, hub/cli/main.py), a step of prompts_per_step groups generated and trained on at once."""
    from hub.cli.main import FLAG_ALIASES

    values = recipe(config)
    prompts = values.pop("prompts_per_step")
    out = {FLAG_ALIASES.get(flag, (flag,))[0]: value for flag, value in values.items()}
    out["min_p"] = out["min_p"] or None  # off: echo2's 0.0 is TRL's None (top_k 0 is off in both)
    # transformers 5 took warmup_ratio into warmup_steps: a float below 1 is the share of the steps.
    ratio = out.pop("warmup_ratio")
    out["warmup_steps"] = ratio if ratio < 1 else config.steps
    out.update(
        per_device_train_batch_size=prompts * config.learner.group_size,
        gradient_accumulation_steps=1,
        scale_rewards=config.learner.advantage_scale,  # TRL's three values are echo2's
        optim="adamw_torch",  # torch's AdamW, as the learner's
    )
    return out


def hub_tasks_of(config: HubConfig, model_dir: Path) -> tuple[Task, Task]:
    """(training task, held-out task) as the hub that runs `config` on `model_dir` has them: what it trains on and
    what it evaluates on (`config` must evaluate: eval.every > 0)."""
    from hub.training.tasks import hub_tasks
    from shared.model_identity import load_model_identity

    train, held = hub_tasks(config, load_model_identity(model_dir))
    assert held is not None, "a config that evaluates (eval.every > 0)"
    return train, held


def task_reward(task: Task):
    """A TRL reward function that scores with `task`'s own reward, one completion at a time (its prompts by text)."""
    by_text = {p.text: p for p in task.prompts()}

    def reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [float(task.rewards(by_text[p], [c])[0]) for p, c in zip(prompts, completions, strict=True)]

    reward.__name__ = f"{task.name}_reward"
    return reward


def _data(spec: dict, config: HubConfig, model_dir: Path):
    """(TRL's training dataset, its reward functions): the spec's own, or the config task's training part."""
    from datasets import Dataset, load_dataset

    if spec["dataset"] is not None:
        from shared.tasks.user_code import import_object

        return load_dataset("json", data_files=spec["dataset"], split="train"), [import_object(spec["reward"], "reward")]
    task = hub_tasks_of(config, model_dir)[0]
    return Dataset.from_list([{"prompt": p.text} for p in task.prompts()]), [task_reward(task)]


def run(spec: dict) -> None:
    """One TRL training run as SPEC says (the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shared.default_model import ensure_default_model

    torch.set_num_threads(spec["threads"])
    config = hub_config(spec["hub_args"])
    model_dir = config.model or ensure_default_model(progress=False)
    out = Path(spec["out"])
    dataset, rewards = _data(spec, config, model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GRPOConfig's warnings about options this run does not use
        args = GRPOConfig(
            **grpo_settings(config),
            output_dir=str(out),
            max_steps=config.steps,
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            save_strategy="steps",
            save_steps=spec["save_steps"],
            save_only_model=True,
            report_to=[],
            disable_tqdm=True,
        )
    with (out / STEPS_FILE).open("a") as log:

        class StepLog(TrainerCallback):
            """A line per step, written as the step's metrics are logged (logging_steps=1): right after it."""

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    row = {"step": state.global_step, "at": time.time(), "reward": logs["reward"]}
                    row |= {"zero_std": logs["frac_reward_zero_std"], "completion_length": logs["completions/mean_length"]}
                    log.write(json.dumps(row) + "\n")
                    log.flush()

        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=rewards,
            args=args,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[StepLog()],
        )
        trainer.train()
    trainer.save_model(str(out / FINAL_SUBDIR))


if __name__ == "__main__":
    from shared.logs import quiet_wheel_noise

    quiet_wheel_noise()  # before TRL imports transformers, which imports torchao
    run(json.loads(Path(sys.argv[1]).read_text()))
