"""`echo-hub eval`: one held-out evaluation of a saved policy (a run's final dir, a checkpoint, any model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hub.config import HubConfig
from shared.checks import check_model_dir
from shared.tasks.base import Task


def check_eval(config: HubConfig, model: Path) -> Task:
    """The held-out task to evaluate on (UserError on a mistake)."""
    from hub.cli.preflight import checked_tasks

    check_model_dir(model)
    return checked_tasks(config, model, evaluate=True)[1]


def run_eval(config: HubConfig, model: Path, task: Task, device: str | None, as_json: bool) -> int:
    import torch
    import transformers

    from hub.training.evaluation import Evaluator
    from shared.precision import resolve_dtype

    transformers.utils.logging.disable_progress_bar()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.learner.dtype, device)
    print(f"echo-hub eval: {model} on {min(config.eval.prompts, len(task.prompts()))} held-out prompts of "
          f"{config.eval.task or config.task} x {config.eval.samples} samples ({dtype}, {device})", file=sys.stderr)
    evaluator = Evaluator(model, task, config.eval, config.sampling, dtype, device, config.learner.seed)
    row = evaluator.evaluate(0)
    if as_json:
        out = {"model": str(model), **row.as_metrics_row()}
        del out["eval_step"]
        print(json.dumps(out, sort_keys=True))
    else:
        passes = f"pass@1 {row.pass_at_1:.3f}" + (f"  pass@{row.k} {row.pass_at_k:.3f}" if row.k > 1 else "")
        print(f"reward {row.reward:.3f}  {passes}  ({row.prompts} prompts, {row.seconds:.1f} s)")
    return 0
