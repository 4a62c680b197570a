"""Learner step time and memory: echo2's Learner.train_step against TRL's GRPOTrainer step, same model, batch and loss.

Both sides train on one fixed batch of `--prompts` prompts x `--n` completions of `--completion-len`/2 to
`--completion-len` tokens (random tokens: speed and memory do not depend on what they say), from the same
weights: the embedded default model, or a shape built from its config with random weights
(`--shape qwen3-0.6b` etc., cached under $ECHO2_CACHE/bench-shapes). The nodes' log-probs of the batch are
the model's own, computed once by echo2's side and handed to TRL's. Loss settings match: token-level
(TRL loss_type "dapo") clipped ratio to the sampling log-probs, eps_low 0.2, eps_high 0.28, beta 0,
group-normalised advantages, AdamW with the same lr and no weight decay, global grad clip 1.0. On CUDA both
run bf16 autocast over fp32 master weights. TRL's time is its training step on prepared inputs:
compute_loss + backward over the gradient-accumulation chunks that hold as many padded tokens as our
micro-batch, grad clip, optimizer step (its generation never runs). Ours is all of Learner.train_step.

Each side runs in a process of its own, so its memory is its own: on a CPU both processes live at once and
alternate steps (drift on a shared machine hits both equally); on CUDA each has the GPU alone in turn. The
result is each side's median step, peak memory (CUDA: torch.cuda.max_memory_allocated over the side, model
and optimizer included; CPU: the largest growth of peak RSS during one step), MFU (6 x parameters x tokens /
step time / the chip's dense bf16 peak), and the first step's loss and gradient norm on each side (equal
values show the two compute the same objective). `--tool-tokens K` makes every completion a tool-using rollout:
K tokens of a tool's answer in its middle, an environment segment neither side trains on (echo2's
Completion.env_spans; TRL's tool_mask, as its environment_factory loop marks a tool's answer).

    python bench/learner.py [--json] [--device cpu|cuda] [--shape default|tiny-vocab152k|qwen3-0.6b|...]
        [--prompts 16] [--n 8] [--completion-len 10] [--tool-tokens 0] [--micro-batch-tokens N] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# transformers would otherwise try to download kernels from the Hub (a GPU machine here reaches no network).
os.environ.setdefault("USE_HUB_KERNELS", "NO")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from hub.config import HubConfig

SAMPLING_SEED = 0
EPS_LOW = 0.2
EPS_HIGH = 0.28
GRAD_CLIP = 1.0
PROMPT_CHARS = 48
# Qwen3's published configurations (config.json of each), built with random weights. tiny-vocab152k: a small
# model with Qwen3's vocabulary, where the LM head is most of the work, as it is for a small real model.
SHAPES: dict[str, dict | None] = {
    "default": None,
    "tiny-vocab152k": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
QWEN3_VOCAB = 151936
# Dense bf16 tensor-core peak (FLOP/s) by device name, from the vendors' data sheets.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "H800": 989.4e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "RTX 5090": 209.5e12,
    "RTX 4090": 165.2e12,
    "B200": 2250e12,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a progress display")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--shape", choices=tuple(SHAPES), default="default", help="the model: the default one, or a shape with random weights"
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) in the batch")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion-len", type=int, default=10, help="the longest completion; they are uniform from half of it")
    parser.add_argument(
        "--tool-tokens",
        type=int,
        default=0,
        help="a tool's answer of this many tokens in the middle of every completion (not trained on: a multi-turn batch)",
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="tokens per micro-batch on both sides (default: the learner's)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    parser.add_argument(
        "--attention",
        choices=("sdpa", "eager", "flex_attention", "flash_attention_2"),
        default="sdpa",
        help="echo2's attention kernel (LearnerConfig.attention); TRL's stays sdpa",
    )
    parser.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw", help="echo2's (LearnerConfig.optimizer)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="echo2's decoder layers under torch.compile (LearnerConfig.compile); the compile is in "
        "echo2_compile_s, apart from the timed steps",
    )
    parser.add_argument("--no-trl", action="store_true", help="echo2's side only (where TRL's would not fit, or to probe sizes)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per side (after one warm-up step)")
    parser.add_argument("--lr", type=float, default=None, help="default: LearnerConfig's")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per side")
    parser.add_argument("--side", choices=("echo2", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("prompts", "n", "completion_len", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tool_tokens < 0:
        parser.error("--tool-tokens must be >= 0")
    if args.tool_tokens and args.completion_len < 2:
        parser.error("--tool-tokens needs --completion-len >= 2: a model token before the answer and one after it")
    if args.n < 2:
        parser.error("--n must be >= 2: a group needs two completions to differ in reward")
    return args


def model_dir_for(shape: str, device: str) -> Path:
    """The model a shape names, built once and cached (random weights, the default model's tokenizer)."""
    from shared.default_model import default_cache_root, ensure_default_model

    default = ensure_default_model(progress=False)
    if SHAPES[shape] is None:
        return default
    out = default_cache_root() / "bench-shapes" / shape
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(default)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        max_position_embeddings=40960,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}.", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def make_batch(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    """The batch: per prompt its text and token ids, and n completions of random tokens with rewards that differ."""
    from transformers import AutoConfig, AutoTokenizer

    from shared.default_model import CHARACTERS
    from shared.tasks.reverse import ReverseTask

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    # The default model's context is 64 tokens: its prompts leave room for the completions (and BOS, ">").
    prompt_chars = min(PROMPT_CHARS, config.max_position_embeddings - args.completion_len - args.tool_tokens - 2)
    if prompt_chars < 1:
        raise SystemExit(
            f"--completion-len {args.completion_len} (+ --tool-tokens {args.tool_tokens}): the {args.shape} model's context is "
            f"{config.max_position_embeddings} tokens; use a shorter one or another --shape"
        )
    rng = random.Random(SAMPLING_SEED)
    # The default model's own task's prompts on its shape (short words); random characters on the others.
    texts = (
        [p.text for p in ReverseTask().sample(random.Random(SAMPLING_SEED), args.prompts)]
        if args.shape == "default"
        else ["".join(rng.choice(CHARACTERS) for _ in range(prompt_chars)) + ">" for _ in range(args.prompts)]
    )
    batch = []
    for index, text in enumerate(texts):
        lengths = [
            rng.randint(max(2 if args.tool_tokens else 1, args.completion_len // 2), args.completion_len) for _ in range(args.n)
        ]
        completions = [[rng.randrange(config.vocab_size) for _ in range(length)] for length in lengths]
        # A tool's answer after the first half of the model's tokens, the second half after it.
        env_spans = [[length // 2, args.tool_tokens] if args.tool_tokens else None for length in lengths]
        for c, span in zip(completions, env_spans):
            if span is not None:
                c[span[0] : span[0]] = [rng.randrange(config.vocab_size) for _ in range(span[1])]
        rewards = [float(rng.random() < 0.5) for _ in range(args.n)]
        rewards[0], rewards[1] = 1.0, 0.0  # every group has reward variance, as the hub's buffer passes them
        batch.append(
            {
                "id": f"p{index}",
                "text": text,
                "prompt_ids": tokenizer(text)["input_ids"],
                "completions": completions,
                "env_spans": env_spans,
                "rewards": rewards,
            }
        )
    return batch


# ---- each side, in a process of its own ----------------------------------------------------------------------


def side_main(args: argparse.Namespace) -> None:
    """A side's process: set up, then answer one JSON line per command read ("step", "quit") on stdin."""
    import torch

    torch.set_num_threads(args.threads)
    work = args.work
    config = json.loads((work / "config.json").read_text())
    batch = json.loads((work / "batch.json").read_text())
    reply = lambda obj: print(json.dumps(obj), flush=True)
    try:
        step = (echo2_side if args.side == "echo2" else trl_side)(Path(config["model_dir"]), batch, config, reply)
    except torch.OutOfMemoryError as exc:
        reply({"error": f"out of memory at set-up: {str(exc).splitlines()[0]}"})
        return
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        try:
            reply(measure(step, config["device"]))
        except torch.OutOfMemoryError as exc:
            reply({"error": f"out of memory: {str(exc).splitlines()[0]}"})
            return


def measure(step, device: str) -> dict:
    """One step: its time, loss and grad norm, and its memory (CUDA: the side's peak so far; CPU: peak RSS growth)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
        rss_before = _status_kib("VmRSS")
    started = time.perf_counter()
    loss, grad_norm = step()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    memory = torch.cuda.max_memory_allocated() if device == "cuda" else (_status_kib("VmHWM") - rss_before) * 1024
    return {"s": elapsed, "loss": loss, "grad_norm": grad_norm, "memory": memory}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def side_config(batch: list[dict], config: dict) -> HubConfig:
    """What both sides train with: echo2's learner and sampling settings, whose recipe TRL's side reads."""
    from hub.config import HubConfig, LearnerConfig

    sampling = HubConfig().sampling.model_copy(update={"max_new_tokens": config["completion_len"], "seed": SAMPLING_SEED})
    learner = LearnerConfig(
        prompts_per_step=len(batch),
        group_size=config["n"],
        lr=config["lr"],
        weight_decay=0.0,
        grad_clip=GRAD_CLIP,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        beta=0.0,
        threads=config["threads"],
        device=config["device"],
        dtype="bfloat16" if config["device"] == "cuda" else "float32",
        micro_batch_tokens=config["micro_batch_tokens"],
        gradient_checkpointing=config["gradient_checkpointing"],
        attention=config["attention"],
        optimizer=config["optimizer"],
        compile=config["compile"],
    )
    return HubConfig(learner=learner, sampling=sampling)


def echo2_side(model_dir: Path, batch: list[dict], config: dict, reply):
    import torch

    from hub.training.learner import Learner
    from shared.logprobs import completion_logprobs
    from shared.model_identity import load_model_identity
    from shared.rollout import Completion, Group

    hub = side_config(batch, config)
    sampling = hub.sampling
    learner = Learner(load_model_identity(model_dir), hub.learner, sampling)
    prompts = [row["prompt_ids"] for row in batch for _ in row["completions"]]
    completions = [c for row in batch for c in row["completions"]]
    with torch.no_grad(), torch.autocast(config["device"], dtype=torch.bfloat16, enabled=config["device"] == "cuda"):
        logprobs, _ = completion_logprobs(learner.model, prompts, completions, sampling.temperature, sampling.top_p)
    rows = [row[: len(c)] for row, c in zip(logprobs.tolist(), completions)]
    spans = [span for row in batch for span in row["env_spans"]]
    for lp, span in zip(rows, spans):
        if span is not None:  # a tool's answer was never sampled: its log-probs are 0.0, as a node sends them
            lp[span[0] : span[0] + span[1]] = [0.0] * span[1]
    reply(
        {
            "behaviour": rows,
            "params": sum(p.numel() for p in learner.model.parameters()),
            "micro_batch_tokens": learner.micro_batch_tokens,
        }
    )
    it, spans_of = iter(rows), iter(spans)
    groups = [
        Group(
            prompt_id=row["id"],
            prompt_text=row["text"],
            version=0,
            rewards=tuple(row["rewards"]),
            completions=tuple(
                Completion(
                    token_ids=tuple(c),
                    logprobs=tuple(next(it)),
                    finish_reason="length",
                    version=0,
                    text="",
                    env_spans=(tuple(span),) if (span := next(spans_of)) is not None else (),
                )
                for c in row["completions"]
            ),
        )
        for row in batch
    ]
    count = iter(range(1, 1 << 30))

    def step() -> tuple[float, float]:
        stats = learner.train_step(groups, next(count))
        return stats.loss, stats.grad_norm

    return step


def trl_side(model_dir: Path, batch: list[dict], config: dict, reply):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bench.trl_grpo import grpo_settings
    from hub.method.grpo import group_advantages

    cuda = config["device"] == "cuda"
    with warnings.catch_warnings():
        # GRPOConfig and GRPOTrainer warn about options this bench never uses (deprecations, generation).
        warnings.simplefilter("ignore")
        args = GRPOConfig(
            **grpo_settings(side_config(batch, config)),
            output_dir=str(config["work"]),
            use_cpu=not cuda,
            bf16=cuda,
            fp16=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [row["text"] for row in batch]}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
        )
    trainer.create_optimizer()
    behaviour = config["behaviour"]
    inputs = trl_inputs(batch, behaviour, trainer.processing_class.pad_token_id, group_advantages)
    device = trainer.accelerator.device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    # Gradient accumulation over chunks holding as many padded tokens as our micro-batch holds real ones.
    rows_per_chunk = max(1, config["micro_batch_tokens"] // width)
    total = inputs["prompt_ids"].shape[0]
    chunks = [slice(start, start + rows_per_chunk) for start in range(0, total, rows_per_chunk)]
    trainer.current_gradient_accumulation_steps = len(chunks)
    reply({"params": sum(p.numel() for p in trainer.model.parameters()), "chunks": len(chunks)})

    def step() -> tuple[float, float]:
        """What Trainer's loop does per optimizer step once inputs are prepared."""
        model = trainer.model
        model.train()
        loss_sum = 0.0
        for part in chunks:
            chunk = {k: (v if k == "num_items_in_batch" else v[part]) for k, v in inputs.items()}
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, chunk)
            trainer.accelerator.backward(loss)
            loss_sum += float(loss.detach())
        grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return loss_sum, float(grad_norm)

    return step


def trl_inputs(batch: list[dict], behaviour: list[list[float]], pad_id: int, group_advantages) -> dict:
    """The dict GRPOTrainer._compute_loss reads, built from the same rows and advantages as ours: left-padded
    prompts, right-padded completions (TRL's own layout after generation)."""
    import torch

    prompt_rows = [row["prompt_ids"] for row in batch for _ in row["completions"]]
    completion_rows = [c for row in batch for c in row["completions"]]
    rows = len(prompt_rows)
    p_width = max(len(r) for r in prompt_rows)
    c_width = max(len(r) for r in completion_rows)
    prompt_ids = torch.full((rows, p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, p_width), dtype=torch.long)
    completion_ids = torch.full((rows, c_width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((rows, c_width), dtype=torch.long)
    old_logps = torch.zeros((rows, c_width), dtype=torch.float32)
    tool_mask = torch.ones((rows, c_width), dtype=torch.long)  # TRL's: 0 on a tool's answer, 1 elsewhere
    spans = [span for row in batch for span in row["env_spans"]]
    for i, (p, c, lp, span) in enumerate(zip(prompt_rows, completion_rows, behaviour, spans)):
        prompt_ids[i, p_width - len(p) :] = torch.tensor(p)
        prompt_mask[i, p_width - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
        old_logps[i, : len(lp)] = torch.tensor(lp)
        if span is not None:
            tool_mask[i, span[0] : span[0] + span[1]] = 0
    rewards = torch.tensor([r for row in batch for r in row["rewards"]], dtype=torch.float32)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": group_advantages(rewards, len(batch[0]["completions"])),
        "old_per_token_logps": old_logps,
        # TRL counts the model's tokens only (its _generate's completion lengths under a tool_mask).
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
    }
    if any(span is not None for span in spans):
        inputs["tool_mask"] = tool_mask
    return inputs


# ---- the driver -------------------------------------------------------------------------------------------------


class Side:
    """A side's process: commands on its stdin, one JSON reply per line on its stdout."""

    def __init__(self, name: str, args: argparse.Namespace, work: Path):
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--side", name, "--work", str(work), "--threads", str(args.threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self.read()

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} side exited (rc {self.process.wait()}) before it answered")
        return json.loads(line)

    def step(self) -> dict:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        self.process.wait()


def run_sides(args: argparse.Namespace, work: Path, config: dict, progress) -> dict[str, list[dict]]:
    """Each side's warm-up and timed steps: alternating on a CPU, one side after the other on CUDA."""
    steps: dict[str, list[dict]] = {"echo2": [], "trl": []}
    echo2 = Side("echo2", args, work)
    setup = {"echo2": echo2.ready}
    steps["setup"] = setup  # type: ignore[assignment]
    if "error" in echo2.ready:
        echo2.close()
        return steps
    config.update(behaviour=echo2.ready["behaviour"], micro_batch_tokens=echo2.ready["micro_batch_tokens"])
    (work / "config.json").write_text(json.dumps(config))
    sides = [echo2]
    if args.device == "cuda" or args.no_trl:  # the GPU to each side alone
        _run(echo2, steps, args.repeats + 1, progress)
        echo2.close()
        if args.no_trl:
            return steps
        trl = Side("trl", args, work)
        setup["trl"] = trl.ready
        if "error" not in trl.ready:
            _run(trl, steps, args.repeats + 1, progress)
        trl.close()
        return steps
    trl = Side("trl", args, work)
    setup["trl"] = trl.ready
    sides.append(trl)
    try:
        for repeat in range(args.repeats + 1):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                _run(side, steps, 1, progress)
    finally:
        for side in sides:
            side.close()
    return steps


def _run(side: Side, steps: dict[str, list[dict]], count: int, progress) -> None:
    for _ in range(count):
        if steps[side.name] and "error" in steps[side.name][-1]:
            return
        steps[side.name].append(side.step())
        progress()


def peak_flops(device: str) -> tuple[str, float | None]:
    """The device's name and dense bf16 peak (None: not known, or a CPU)."""
    if device != "cuda":
        import platform

        return platform.processor() or "cpu", None
    import torch

    name = torch.cuda.get_device_name()
    return name, next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def summarise(args: argparse.Namespace, steps: dict, tokens: int, completion_tokens: int) -> dict:
    device_name, peak = peak_flops(args.device)
    params = steps["setup"]["echo2"].get("params")
    result: dict = {
        "device": args.device,
        "device_name": device_name,
        "shape": args.shape,
        "params": params,
        "tokens": tokens,
        "completion_tokens": completion_tokens,
        "prompts": args.prompts,
        "n": args.n,
        "completion_len": args.completion_len,
        "tool_tokens": args.tool_tokens,
        "micro_batch_tokens": steps["setup"]["echo2"].get("micro_batch_tokens"),
        "gradient_checkpointing": args.gradient_checkpointing,
        "attention": args.attention,
        "optimizer": args.optimizer,
        "compile": args.compile,
        "repeats": args.repeats,
        "lr": args.lr,
        "threads": args.threads,
        "trl_version": _trl_version(),
        "peak_bf16_flops": peak,
    }
    memory_key, scale = ("peak_gib", 1 / 2**30) if args.device == "cuda" else ("peak_bytes", 1)
    first: dict = {}
    for name in ("echo2", "trl"):
        runs = steps[name]
        error = next((r["error"] for r in runs if "error" in r), None) or steps["setup"].get(name, {}).get("error")
        timed = [r for r in runs[1:] if "error" not in r]
        if error or not timed:
            result.update(
                {
                    f"{name}_step_s": None,
                    f"{name}_{memory_key}": None,
                    f"{name}_mfu": None,
                    f"{name}_error": error or "no timed step",
                }
            )
            continue
        step_s = statistics.median(r["s"] for r in timed)
        memory = max(r["memory"] for r in (timed if args.device == "cpu" else runs))
        result.update(
            {
                f"{name}_step_s": round(step_s, 4),
                f"{name}_step_s_all": [round(r["s"], 4) for r in timed],
                f"{name}_first_step_s": round(runs[0]["s"], 4),
                f"{name}_{memory_key}": round(memory * scale, 3) if args.device == "cuda" else int(memory),
                f"{name}_tokens_per_s": round(tokens / step_s, 1),
                f"{name}_mfu": round(6 * params * tokens / step_s / peak, 4) if peak and params else None,
            }
        )
        first[f"{name}_loss"], first[f"{name}_grad_norm"] = runs[0]["loss"], runs[0]["grad_norm"]
    if args.compile and result["echo2_step_s"]:
        # The first step is the only one that compiles (dynamic shapes): what it took beyond a steady step.
        result["echo2_compile_s"] = round(result["echo2_first_step_s"] - result["echo2_step_s"], 2)
    if result["echo2_step_s"] and result["trl_step_s"]:
        result["ratio"] = round(result["echo2_step_s"] / result["trl_step_s"], 3)
        # Each repeat's two steps run back to back, so their ratio shares the machine's load at that moment.
        result["ratio_paired_median"] = round(
            statistics.median(e / t for e, t in zip(result["echo2_step_s_all"], result["trl_step_s_all"])), 3
        )
        result["memory_ratio"] = round(result[f"echo2_{memory_key}"] / max(result[f"trl_{memory_key}"], 1e-9), 3)
        first["loss_rel_diff"] = abs(first["echo2_loss"] - first["trl_loss"]) / max(abs(first["trl_loss"]), 1e-12)
    else:
        result["ratio"] = None
    result["first_step"] = first
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    from shared.logs import quiet_wheel_noise

    quiet_wheel_noise()  # before TRL imports transformers, which imports torchao
    args = parse_args(argv)
    if args.side:
        side_main(args)
        return {}
    from rich.progress import Progress

    from hub.cli.preflight import check_learner_kernels
    from hub.config import HubConfig, LearnerConfig
    from shared.checks import UserError

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda: torch {torch.__version__} here has no CUDA; use --device cpu")
    # What echo-hub start refuses (flex attention off CUDA, a missing torchao or flash-attn), before a model is built.
    kernels = LearnerConfig(device=args.device, attention=args.attention, optimizer=args.optimizer, compile=args.compile)
    try:
        check_learner_kernels(HubConfig(learner=kernels))
    except UserError as mistake:
        print(f"bench/learner.py: {mistake}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.lr is None:
        args.lr = LearnerConfig().lr
    model_dir = model_dir_for(args.shape, args.device)
    batch = make_batch(model_dir, args)
    tokens = sum(len(row["prompt_ids"]) + len(c) for row in batch for c in row["completions"])
    completion_tokens = sum(len(c) for row in batch for c in row["completions"])
    with tempfile.TemporaryDirectory(prefix="echo2-bench-learner-") as tmp:
        work = Path(tmp)
        (work / "batch.json").write_text(json.dumps(batch))
        config = {
            "model_dir": str(model_dir),
            "device": args.device,
            "n": args.n,
            "lr": args.lr,
            "threads": args.threads,
            "completion_len": args.completion_len + args.tool_tokens,
            "micro_batch_tokens": args.micro_batch_tokens,
            "gradient_checkpointing": args.gradient_checkpointing,
            "attention": args.attention,
            "optimizer": args.optimizer,
            "compile": args.compile,
            "work": str(work),
        }
        (work / "config.json").write_text(json.dumps(config))
        with Progress(disable=args.json, transient=True) as progress:
            bar = progress.add_task(f"learner step bench ({args.shape} on {args.device})", total=2 * (args.repeats + 1))
            steps = run_sides(args, work, config, lambda: progress.advance(bar))
    result = summarise(args, steps, tokens, completion_tokens)
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
