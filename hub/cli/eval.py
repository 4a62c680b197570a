"""`echo-hub eval`: one held-out evaluation of a saved policy (a run's final dir, a checkpoint, any model), by
default on the task and with the sampling of the run that saved it (its echo2.toml, hub/cli/card.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hub.config import HubConfig
from shared.checks import UserError
from shared.layout import RUN_CONFIG_FILE
from shared.tasks.base import Task

if TYPE_CHECKING:
    from shared.model_identity import ModelIdentity


def saved_run_config(model: Path) -> Path | None:
    """The config of the run that saved the policy in `model`: beside it in final/, one level up from a checkpoint's
    model/ (None: it has none, as a model from elsewhere)."""
    from hub.training.checkpoint import MODEL_SUBDIR

    for saved in (model / RUN_CONFIG_FILE, model.parent / RUN_CONFIG_FILE if model.name == MODEL_SUBDIR else None):
        if saved is not None and saved.is_file():
            return saved
    return None


def check_eval(config: HubConfig, model_dir: Path) -> tuple[ModelIdentity, Task]:
    """The model in `model_dir`, read once, and the held-out task to evaluate it on (UserError on a mistake)."""
    from hub.cli.preflight import checked_tasks, read_model

    if config.agents.enabled:  # its held-out rollouts need the hub's tool loop and sandbox, which only a run starts
        raise UserError(
            "a tool-using run's policy is evaluated during its run (--eval-every N), through its tool loop; "
            "echo-hub eval of one is not built yet"
        )
    model = read_model(model_dir)
    task = checked_tasks(config, model, evaluate=True)[1]
    assert task is not None  # asked to evaluate
    return model, task


def run_eval(
    config: HubConfig, model: ModelIdentity, task: Task, device: str | None, as_json: bool, saved: Path | None = None
) -> int:
    """Evaluate `model` once and print the result (`saved`: the run config it came with, said to be used)."""
    import torch
    import transformers

    from hub.training.evaluation import Evaluator
    from shared.precision import resolve_dtype

    transformers.utils.logging.disable_progress_bar()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.learner.dtype, device)
    if saved is not None:
        s, temperature = config.sampling, config.eval.temperature
        temperature = s.temperature if temperature is None else temperature
        print(
            f"echo-hub eval: the run's config {saved}: task {config.task}, temperature {temperature:g}, top_p "
            f"{s.top_p:g}, max_new_tokens {s.max_new_tokens} (--config or flags override it)",
            file=sys.stderr,
        )
    print(
        f"echo-hub eval: {model.model_dir} on {min(config.eval.prompts, len(task.prompts()))} held-out prompts of "
        f"{config.eval.task or config.task} x {config.eval.samples} samples ({dtype}, {device})",
        file=sys.stderr,
    )
    evaluator = Evaluator(model, task, config.eval, config.sampling, dtype, device, config.learner.seed)
    row = evaluator.evaluate(0)
    assert row is not None  # None only when told to stop
    if as_json:
        out = {"model": str(model.model_dir), **row.as_metrics_row()}
        del out["eval_step"]
        print(json.dumps(out, sort_keys=True))
    else:
        passes = f"pass@1 {row.pass_at_1:.3f}" + (f"  pass@{row.k} {row.pass_at_k:.3f}" if row.k > 1 else "")
        print(f"reward {row.reward:.3f}  {passes}  ({row.prompts} prompts, {row.seconds:.1f} s)")
    return 0
