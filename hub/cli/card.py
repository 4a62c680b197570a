"""The run card `echo-hub start` saves beside every policy (each checkpoint and DATA_DIR/final), so a saved
policy says what it is: the run's whole config as TOML (RUN_CONFIG_FILE, which `echo-hub eval --model DIR` reads
by default and `echo-hub start --config` takes) and a model card (MODEL_CARD_FILE: base model, task, steps,
rewards, evaluation)."""

from __future__ import annotations

from pathlib import Path

from hub.cli.summary import fifth_means
from hub.config import HubConfig
from hub.training.metrics import policy_reward, read_evals, read_metrics
from shared.config import config_toml
from shared.layout import METRICS_FILE, MODEL_CARD_FILE, RUN_CONFIG_FILE
from shared.tasks.dataset import is_saved_dataset


def run_card(config: HubConfig, model_dir: Path, step: int) -> dict[str, str]:
    """The run card of the policy after `step`: file name -> text."""
    title = (
        f"the config of the echo2 run that trained this policy; `echo-hub eval --model` this directory reads it, "
        f"`echo-hub start --config {RUN_CONFIG_FILE}` takes it"
    )
    return {RUN_CONFIG_FILE: config_toml(absolute_paths(config), title), MODEL_CARD_FILE: model_card(config, model_dir, step)}


def absolute_paths(config: HubConfig) -> HubConfig:
    """`config` with every file it names made absolute (as resolved where the hub runs), so a run card read from
    another directory (`echo-hub eval --model final`) finds the task, model and reward the run used."""
    resolve = lambda path: None if path is None else path.resolve()
    return config.model_copy(
        update={
            "data_dir": config.data_dir.resolve(),
            "model": resolve(config.model),
            "save_rollouts": resolve(config.save_rollouts),
            "task": absolute_spec(config.task),
            "eval": config.eval.model_copy(update={"task": config.eval.task and absolute_spec(config.eval.task)}),
            "dataset": config.dataset.model_copy(
                update={"reward": ",".join(absolute_spec(r) for r in config.dataset.reward.split(","))}
            ),
        }
    )


def absolute_spec(spec: str) -> str:
    """A task or reward spec with its file made absolute when that file exists here: FILE, math:FILE, FILE.py:function
    or DIR:SPLIT; a builtin name or module:Class is kept as it is (a package directory made absolute would not
    import)."""
    if spec and Path(spec).exists():  # Path('') is the working directory
        return str(Path(spec).resolve())
    head, sep, tail = spec.partition(":")
    if sep and tail and Path(tail).exists():  # math:FILE
        return f"{head}:{Path(tail).resolve()}"
    if sep and head and (Path(head).is_file() or is_saved_dataset(Path(head))):  # FILE.py:function, DIR:SPLIT
        return f"{Path(head).resolve()}:{tail}"
    return spec


def model_card(config: HubConfig, model_dir: Path, step: int) -> str:
    """README.md of the policy after `step`: what it was trained from, on what, how long, and how it scored."""
    lc, sampling = config.learner, config.sampling
    lora = f" + LoRA rank {lc.lora_rank} (merged into final/)" if lc.lora_rank else ""
    facts = [
        ("base model", f"{model_dir}{lora}"),
        ("task", config.task),
        ("steps", str(step)),
        (
            "GRPO",
            f"group size {lc.group_size}, {lc.prompts_per_step} prompts per step, lr {lc.lr:g}, "
            f"staleness {lc.staleness}, kappa {lc.effective_kappa}",
        ),
        (
            "sampling",
            f"temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, top_k {sampling.top_k}, min_p "
            f"{sampling.min_p:g}, max_new_tokens {sampling.max_new_tokens}",
        ),
        *reward_facts(config.data_dir / METRICS_FILE, step),
    ]
    table = ["| | |", "|---|---|", *(f"| {what} | {value.replace('|', '/')} |" for what, value in facts)]
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "tags:",
            "- echo2",
            "- grpo",
            "---",
            "",
            f"# {config.data_dir.name}: step {step}",
            "",
            "A policy trained with echo2 (GRPO on rollouts from volunteer nodes).",
            "",
            *table,
            "",
            f"The run's whole config is in `{RUN_CONFIG_FILE}`: `echo-hub eval --model <this directory>` evaluates on "
            "the run's task with its sampling.",
            "",
        ]
    )


def reward_facts(metrics: Path, step: int) -> list[tuple[str, str]]:
    """The rollout reward (first and last fifth of the steps up to `step`) and the held-out evaluations, if any."""
    rows = [row for row in read_metrics(metrics) if row["step"] <= step]
    facts = []
    if rows:
        first, last = fifth_means([policy_reward(row) for row in rows])
        facts.append(("rollout reward (mean of the first -> last fifth of steps)", f"{first:.3f} -> {last:.3f}"))
    return facts + eval_facts([row for row in read_evals(metrics) if row["eval_step"] <= step])


def eval_facts(evals: list[dict[str, float]]) -> list[tuple[str, str]]:
    """The held-out reward of the first and last evaluation (of the one, when one), and the last pass@k."""
    if not evals:
        return []
    a, b = evals[0], evals[-1]
    steps, rewards = (
        (f"step {b['eval_step']}", f"{b['eval_reward']:.3f}")
        if a is b
        else (f"step {a['eval_step']} -> {b['eval_step']}", f"{a['eval_reward']:.3f} -> {b['eval_reward']:.3f}")
    )
    facts = [(f"held-out reward ({steps}, {b['eval_prompts']} prompts)", rewards)]
    if int(b["eval_k"]) > 1:
        facts.append(
            (f"held-out pass@1 / pass@{int(b['eval_k'])} (last)", f"{b['eval_pass_at_1']:.3f} / {b['eval_pass_at_k']:.3f}")
        )
    return facts
