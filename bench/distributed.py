"""The sharded learner: the same GRPO steps on the same batches with 1 process and with N (FSDP2, gloo on CPU).

Usage: python bench/distributed.py [--json] [--models default,25M] [--procs 2] [--steps 10] [--lr 1e-5]

For each model (the embedded default, or a random-init Qwen2 of bench/scale.py's sizes built
locally): PROMPTS groups generated once by the model itself (bench/delta.py's make_groups), the
same batch for every step. One process runs hub.training.learner.Learner for --steps steps; then --procs
processes (torch.distributed, gloo) each run the same Learner sharded with FSDP2 on the same
steps, each computing its share of the rows (hub.training.distributed.partition_rows). Printed per run:
step_s (median wall time of a step, one torch thread per process) and
max_abs_weight_diff_vs_1proc (largest elementwise difference of the final fp32 weights from the
one-process run's). Target (issue 17): <= 1e-5 in fp32.

The learning rate matters for that figure: AdamW moves every weight by about lr per step whatever
its gradient's size, so a weight whose gradient is ~1e-9 (summed in another order across ranks)
can move in either direction. The bench reports the default lr 1e-5 and any --lr you ask for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--models", default="default,25M", help="comma-separated: default and/or 25M, 100M")
    parser.add_argument("--procs", type=int, default=2, help="learner processes of the sharded run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-5)
    return parser.parse_args(argv)


def learner_config(lr: float):
    from hub.config import LearnerConfig

    return LearnerConfig(prompts_per_step=8, group_size=4, lr=lr, dtype="float32", threads=1)


def run_steps(learner, groups, steps: int) -> list[float]:
    times = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        learner.train_step(groups, step)
        times.append(time.perf_counter() - started)
    return times


def rank_main(rank: int, world: int, store: str, model_dir: str, groups, steps: int, lr: float, out: str) -> None:
    """One learner rank of the sharded run (torch.multiprocessing.spawn target)."""
    import torch
    from transformers.utils import logging as hf_logging

    from hub.config import HubConfig
    from hub.training.distributed import init_ranks
    from hub.training.learner import Learner
    from hub.training.ranks import RankEnv
    from shared.model_identity import load_model_identity

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    collective = init_ranks(RankEnv(rank, world, rank, store_file=store), "cpu")
    learner = Learner(
        load_model_identity(Path(model_dir)), learner_config(lr), HubConfig().sampling, collective=collective, device="cpu"
    )
    times = run_steps(learner, groups, steps)
    weights = learner.state_dict()
    if rank == 0:
        torch.save({"weights": weights, "times": times}, out)
    import torch.distributed as dist

    dist.destroy_process_group()


def run_model(name: str, args: argparse.Namespace, work: Path, log) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    from bench.delta import make_groups, model_dir_for
    from hub.config import HubConfig
    from hub.training.distributed import rank_store
    from hub.training.learner import Learner
    from shared.model_identity import load_model_identity

    torch.set_num_threads(1)
    model_dir, params = model_dir_for(name, work)
    sampling = HubConfig().sampling.model_copy(update={"max_new_tokens": 12, "seed": 0})
    groups = make_groups(model_dir, sampling)
    log(f"{name} ({params / 1e6:.1f}M parameters): {args.steps} steps on 1 process")
    single = Learner(load_model_identity(model_dir), learner_config(args.lr), HubConfig().sampling)
    single_times = run_steps(single, groups, args.steps)
    reference = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    del single
    log(f"{name}: the same steps on {args.procs} processes (FSDP2, gloo)")
    out = work / f"{name}-sharded.pt"
    mp.spawn(
        rank_main,
        args=(args.procs, str(rank_store(work)), str(model_dir), groups, args.steps, args.lr, str(out)),
        nprocs=args.procs,
    )
    sharded = torch.load(out)
    diff = max(float((sharded["weights"][k] - reference[k]).abs().max()) for k in sharded["weights"])
    return [
        {
            "model": name,
            "params": params,
            "procs": 1,
            "step_s": round(statistics.median(single_times), 4),
            "max_abs_weight_diff_vs_1proc": 0.0,
        },
        {
            "model": name,
            "params": params,
            "procs": args.procs,
            "step_s": round(statistics.median(sharded["times"]), 4),
            "max_abs_weight_diff_vs_1proc": diff,
        },
    ]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from bench.delta import progress_log

    log = progress_log(args.json)
    results = []
    with tempfile.TemporaryDirectory(prefix="echo2-distributed-") as tmp:
        for name in args.models.split(","):
            results += run_model(name, args, Path(tmp), log)
            log(f"  -> {results[-1]}")
    out = {"lr": args.lr, "steps": args.steps, "results": results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
