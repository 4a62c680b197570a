"""Learner step time: echo2's Learner.train_step against TRL's GRPOTrainer step, same model, batch and loss.

Both start from the default model (ensure_default_model) and train on one fixed batch of
`--prompts` reverse prompts x `--n` completions, generated once with HFEngine and reused by
both (only groups with reward variance, as the hub's buffer passes them to the learner).
Loss settings match: token-level (TRL loss_type "dapo") clipped ratio to the sampling
log-probs, eps_low 0.2, eps_high 0.28, beta 0, group-normalised advantages, AdamW with the
same lr and no weight decay, global grad clip 1.0. TRL's time is its training step on the
prepared inputs only: compute_loss + backward + grad clip + optimizer step (its generation
never runs). Ours is all of Learner.train_step (tokenising, padding, forward, backward, clip,
step). The two alternate which goes first every repeat; the result is each side's median.

The first (warm-up) step of each side starts from identical weights on the same batch, so
their losses, gradient norms and the largest weight difference after that step are reported
too: equal values show the two compute the same objective and take the same update.

    python bench/learner.py [--json] [--prompts 16] [--n 8] [--max-new-tokens 10] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

SAMPLING_SEED = 0
EPS_LOW = 0.2
EPS_HIGH = 0.28
GRAD_CLIP = 1.0
# Generation rounds allowed to find enough groups with reward variance (most groups have it).
MAX_BATCH_ROUNDS = 20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) in the batch")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per side (after one warm-up step)")
    parser.add_argument("--lr", type=float, default=None, help="default: LearnerConfig's")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


def make_batch(model_dir: Path, prompts: int, n: int, sampling):
    """`prompts` groups of n completions from the default model, with hub-side rewards.

    Only groups whose rewards differ are kept, as the hub's buffer does (skip_zero_variance):
    a learner step never sees the others, and a batch of them would have a zero loss.
    """
    import random

    from hub.records.buffer import has_reward_variance
    from node.hf_engine import HFEngine
    from shared.rollout import Group
    from shared.tasks.reverse import ReverseTask

    task = ReverseTask()
    engine = HFEngine(model_dir)
    rng = random.Random(SAMPLING_SEED)
    groups: list[Group] = []
    for _ in range(MAX_BATCH_ROUNDS):
        chosen = task.sample(rng, prompts)
        outputs = engine.generate([p.text for p in chosen], n, sampling)
        for prompt, completions in zip(chosen, outputs, strict=True):
            group = Group(
                prompt_id=prompt.id, prompt_text=prompt.text, version=0, completions=tuple(completions),
                rewards=tuple(task.rewards(prompt, [c.text for c in completions])),
            )
            if has_reward_variance(group):
                groups.append(group)
        if len(groups) >= prompts:
            return groups[:prompts]
    raise RuntimeError(f"only {len(groups)} of {prompts} groups with reward variance after {MAX_BATCH_ROUNDS} rounds")


def trl_inputs(groups, tokenizer, n: int) -> dict[str, torch.Tensor]:
    """The dict GRPOTrainer._compute_loss reads, built from the same groups and advantages as ours."""
    from hub.method.grpo import group_advantages

    prompt_rows, completion_rows, logprob_rows = [], [], []
    for group in groups:
        ids = tokenizer(group.prompt_text)["input_ids"]
        for completion in group.completions:
            prompt_rows.append(ids)
            completion_rows.append(completion.token_ids)
            logprob_rows.append(completion.logprobs)
    batch = len(prompt_rows)
    p_width = max(len(r) for r in prompt_rows)
    c_width = max(len(r) for r in completion_rows)
    prompt_ids = torch.full((batch, p_width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch, p_width), dtype=torch.long)
    completion_ids = torch.full((batch, c_width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((batch, c_width), dtype=torch.long)
    old_logps = torch.zeros((batch, c_width), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_rows, completion_rows, logprob_rows)):
        # Left-padded prompts, right-padded completions: TRL's own layout after generation.
        prompt_ids[i, p_width - len(p) :] = torch.tensor(p)
        prompt_mask[i, p_width - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
        old_logps[i, : len(lp)] = torch.tensor(lp)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": group_advantages(rewards, n),
        "old_per_token_logps": old_logps,
        "num_items_in_batch": completion_mask.sum(),
    }


def make_trl_trainer(model_dir: Path, texts: list[str], args: argparse.Namespace, out_dir: Path, sampling):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    with warnings.catch_warnings():
        # GRPOConfig and GRPOTrainer warn about options this bench never uses (deprecations, generation).
        warnings.simplefilter("ignore")
        config = GRPOConfig(
            output_dir=str(out_dir),
            per_device_train_batch_size=args.prompts * args.n,
            num_generations=args.n,
            max_completion_length=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            loss_type="dapo",
            beta=0.0,
            epsilon=EPS_LOW,
            epsilon_high=EPS_HIGH,
            scale_rewards="group",
            num_iterations=1,
            learning_rate=args.lr,
            weight_decay=0.0,
            max_grad_norm=GRAD_CLIP,
            optim="adamw_torch",
            lr_scheduler_type="constant",
            use_cpu=True,
            bf16=False,
            fp16=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tokenizer,
        )
    trainer.create_optimizer()
    # Set by Trainer's training loop before its first step; one micro-batch per optimizer step here.
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_step(trainer, inputs: dict[str, torch.Tensor]) -> tuple[float, float]:
    """What Trainer's loop does per optimizer step once inputs are prepared; (loss, grad norm)."""
    model = trainer.model
    model.train()
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), float(grad_norm)


def max_weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest elementwise difference of two same-architecture models' parameters."""
    b_params = dict(b.named_parameters())
    with torch.no_grad():
        return max(float((p - b_params[name]).abs().max()) for name, p in a.named_parameters())


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from rich.progress import Progress
    from transformers.utils import logging as hf_logging

    from hub.config import HubConfig, LearnerConfig
    from hub.training.learner import Learner
    from shared.default_model import ensure_default_model

    # transformers' weight-loading bars would garble ours and the JSON line.
    hf_logging.disable_progress_bar()
    model_dir = ensure_default_model(progress=not args.json)
    if args.lr is None:
        args.lr = LearnerConfig().lr
    sampling = HubConfig().sampling.model_copy(
        update={"max_new_tokens": args.max_new_tokens, "seed": SAMPLING_SEED}
    )
    groups = make_batch(model_dir, args.prompts, args.n, sampling)
    cfg = LearnerConfig(
        prompts_per_step=args.prompts, group_size=args.n, lr=args.lr, weight_decay=0.0, grad_clip=GRAD_CLIP,
        eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=0.0, threads=args.threads,
    )
    learner = Learner(model_dir, cfg, sampling)
    with tempfile.TemporaryDirectory(prefix="echo2-bench-learner-") as tmp:
        trainer = make_trl_trainer(model_dir, [g.prompt_text for g in groups], args, Path(tmp), sampling)
        inputs = trl_inputs(groups, trainer.processing_class, args.n)
        torch.set_num_threads(args.threads)  # the trainer's setup may have changed it

        ours_first = learner.train_step(groups, 1)
        trl_loss, trl_grad_norm = trl_step(trainer, inputs)
        weight_diff = max_weight_diff(learner.model, trainer.model)
        times: dict[str, list[float]] = {"echo2": [], "trl": []}
        sides = [
            ("echo2", lambda step: learner.train_step(groups, step)),
            ("trl", lambda step: trl_step(trainer, inputs)),
        ]
        with Progress(disable=args.json, transient=True) as progress:
            bar = progress.add_task("learner step bench", total=2 * args.repeats)
            for repeat in range(args.repeats):
                # Alternate which side runs first so drift on a shared machine hits both equally.
                for name, fn in sides if repeat % 2 == 0 else sides[::-1]:
                    started = time.perf_counter()
                    fn(repeat + 2)
                    times[name].append(time.perf_counter() - started)
                    progress.advance(bar)
    echo2_s = statistics.median(times["echo2"])
    trl_s = statistics.median(times["trl"])
    result = {
        "echo2_step_s": round(echo2_s, 4),
        "trl_step_s": round(trl_s, 4),
        "ratio": round(echo2_s / trl_s, 3),
        # Each repeat's two steps run back to back, so their ratio shares the machine's load at that moment.
        "ratio_paired_median": round(statistics.median(e / t for e, t in zip(times["echo2"], times["trl"])), 3),
        "echo2_step_s_min": round(min(times["echo2"]), 4),
        "trl_step_s_min": round(min(times["trl"]), 4),
        "echo2_step_s_all": [round(t, 4) for t in times["echo2"]],
        "trl_step_s_all": [round(t, 4) for t in times["trl"]],
        "first_step": {
            "echo2_loss": ours_first.loss,
            "trl_loss": trl_loss,
            "echo2_grad_norm": ours_first.grad_norm,
            "trl_grad_norm": trl_grad_norm,
            "weights_max_abs_diff": weight_diff,
        },
        "prompts": args.prompts,
        "n": args.n,
        "completion_tokens": int(inputs["completion_mask"].sum()),
        "repeats": args.repeats,
        "lr": args.lr,
        "threads": args.threads,
        "trl_version": _trl_version(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        from rich import print as rprint

        rprint(result)
    return result


def _trl_version() -> str:
    import trl

    return trl.__version__


if __name__ == "__main__":
    main()
