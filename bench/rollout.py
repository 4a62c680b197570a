"""Rollout throughput: the hf engine against a bare model.generate loop, same prompts and sampling, interleaved.

Usage: python bench/rollout.py [--json] [--prompts 32] [--n 8] [--max-new-tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _completion_tokens(rows: list[list[int]], stop_id: int) -> int:
    """Tokens up to and including the first stop token (the engine's count), per row, summed."""
    return sum(row.index(stop_id) + 1 if stop_id in row else len(row) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rich.progress import Progress

    from node.hf_engine import HFEngine
    from shared.default_model import ensure_default_model
    from shared.rollout import SamplingParams
    from shared.tasks.reverse import ReverseTask

    engine = HFEngine(ensure_default_model(progress=not args.json))
    model, tok = engine.model, engine.tokenizer
    texts = [p.text for p in ReverseTask().prompts()[: args.prompts]]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    batch = tok([t for t in texts for _ in range(args.n)], return_tensors="pt", padding=True)

    def run_engine() -> int:
        groups = engine.generate(texts, args.n, sampling)
        return sum(len(c.token_ids) for g in groups for c in g)

    def run_bare() -> int:
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        return _completion_tokens(out[:, batch["input_ids"].shape[1] :].tolist(), tok.eos_token_id)

    run_engine(), run_bare()  # warm-up: first calls pay one-off allocation and dispatch costs
    totals = {"engine": [0, 0.0], "bare": [0, 0.0]}
    with Progress(disable=args.json, transient=True) as progress:
        bar = progress.add_task("rollout bench", total=2 * args.repeats)
        for repeat in range(args.repeats):
            # Alternate which runs first so drift on a shared machine hits both equally.
            order = [("engine", run_engine), ("bare", run_bare)]
            for name, fn in order if repeat % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                tokens = fn()
                totals[name][0] += tokens
                totals[name][1] += time.perf_counter() - started
                progress.advance(bar)
    engine_tps = totals["engine"][0] / totals["engine"][1]
    bare_tps = totals["bare"][0] / totals["bare"][1]
    result = {
        "engine_tokens_per_s": round(engine_tps, 1),
        "bare_tokens_per_s": round(bare_tps, 1),
        "ratio": round(engine_tps / bare_tps, 3),
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    if args.json:
        print(json.dumps(result))
    else:
        from rich import print as rprint

        rprint(result)


if __name__ == "__main__":
    main()
