"""The embedded default model: a tiny character-level Qwen2 warmed up on ReverseTask, built locally and cached.

Nothing can be downloaded, so the model is made from a fixed recipe (tokenizer, architecture,
a short supervised warm-up with fixed seeds), saved with save_pretrained and from then on loaded
with from_pretrained like any real checkpoint. The recipe's hash names the cache directory, so a
changed recipe builds a new model instead of reusing a stale one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from shared.tasks.reverse import ReverseTask

CACHE_ENV_VAR = "ECHO2_CACHE"
DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "echo2"
BUILD_STATS_FILE = "build_stats.json"
PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
# One token per character; " " and ">" matter to the tasks, the rest keep the vocabulary general.
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 >.,+-*/="


def recipe_digest(recipe: object) -> str:
    """A recipe dataclass's digest: every field, so that a changed recipe names another cache directory."""
    blob = json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode()  # type: ignore[call-overload]
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class DefaultModelRecipe:
    """Everything that determines the built weights; its digest names the cache directory."""

    recipe_version: int = 2
    characters: str = CHARACTERS
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 64
    warmup_steps: int = 110
    batch_size: int = 64
    learning_rate: float = 1.6e-3
    weight_decay: float = 0.01
    torch_seed: int = 0
    # Warm-up words come from a task instance other than the default one the learner trains on.
    warmup_task_seed: int = 777
    eval_prompts: int = 512
    eval_seed: int = 1
    eval_max_new_tokens: int = 10

    label = "default model"

    def digest(self) -> str:
        return recipe_digest(self)

    def dir_name(self) -> str:
        return f"default-reverse-qwen2-{self.digest()}"

    def tokenizer(self) -> Any:
        return build_tokenizer(self)

    def build(self, out_dir: Path, on_step: Callable[[int, int], None] | None = None) -> BuildStats:
        return build_default_model(out_dir, self, on_step)


DEFAULT_MODEL_RECIPE = DefaultModelRecipe()


class EmbeddedRecipe(Protocol):
    """An embedded model's recipe (this default, or shared/tool_model.py's): what names its cache directory, its
    architecture, and how it is built."""

    @property
    def label(self) -> str: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def torch_seed(self) -> int: ...

    @property
    def warmup_steps(self) -> int: ...

    def dir_name(self) -> str: ...

    def tokenizer(self) -> Any: ...

    def build(self, out_dir: Path, on_step: Callable[[int, int], None] | None = None) -> object: ...


@dataclass(frozen=True)
class BuildStats:
    params: int
    build_seconds: float
    warmup_accuracy: float
    safetensors_bytes: int


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else DEFAULT_CACHE_ROOT


def default_model_dir(cache_root: Path | None = None, recipe: EmbeddedRecipe = DEFAULT_MODEL_RECIPE) -> Path:
    root = cache_root if cache_root is not None else default_cache_root()
    return root / recipe.dir_name()


def _byte_level_symbol(char: str) -> str:
    """GPT-2 byte-level alphabet: printable ASCII maps to itself, the space byte to U+0120."""
    if char == " ":
        return "\u0120"
    if "!" <= char <= "~":
        return char
    raise ValueError(f"default vocabulary holds printable ASCII only, got {char!r}")


def build_tokenizer(recipe: DefaultModelRecipe = DEFAULT_MODEL_RECIPE):
    """Character-level tokenizer (one token per character, no merges), left padding, pad/eos set.

    It is a Qwen2Tokenizer (byte-level BPE with an empty merge list) rather than a WordLevel one:
    transformers 5's AutoTokenizer (and so vLLM) always rebuilds "qwen2" checkpoints' tokenizers
    as Qwen2Tokenizer from the saved vocab, which would silently change a WordLevel tokenizer.
    """
    from transformers import Qwen2Tokenizer

    symbols = list(SPECIAL_TOKENS) + [_byte_level_symbol(c) for c in recipe.characters]
    if len(set(symbols)) != len(symbols):
        raise ValueError("duplicate symbols in the default tokenizer vocabulary")
    return Qwen2Tokenizer(
        vocab={s: i for i, s in enumerate(symbols)},
        merges=[],
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=recipe.max_position_embeddings,
    )


def build_model(recipe: EmbeddedRecipe, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype="float32",
    )
    torch.manual_seed(recipe.torch_seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


def _warmup_batch(tokenizer, task: ReverseTask, prompts, rng: random.Random, batch_size: int):
    """Right-padded prompt+target+EOS sequences with loss on target+EOS only."""
    import torch

    rows, labels = [], []
    for _ in range(batch_size):
        prompt = prompts[rng.randrange(len(prompts))]
        p_ids = tokenizer.encode(prompt.text, add_special_tokens=False)
        t_ids = tokenizer.encode(task.target(prompt), add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(p_ids + t_ids)
        labels.append([-100] * len(p_ids) + t_ids)
    width = max(len(r) for r in rows)
    ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch_size, width), dtype=torch.long)
    lab = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (r, row_labels) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(row_labels)] = torch.tensor(row_labels)
    return ids, mask, lab


def sample_accuracy(model, tokenizer, task: ReverseTask, n_prompts: int, seed: int, max_new_tokens: int) -> float:
    """Exact-match rate of one completion per prompt sampled at temperature 1.0 (no top-k/top-p)."""
    import torch

    rng = random.Random(seed)
    prompts = task.sample(rng, n_prompts)
    enc = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(task.reward(p, t) for p, t in zip(prompts, texts)) / len(prompts)


def build_default_model(
    out_dir: Path, recipe: DefaultModelRecipe = DEFAULT_MODEL_RECIPE, on_step: Callable[[int, int], None] | None = None
) -> BuildStats:
    """Build, warm up and save the default model into out_dir (created); on_step(done, total) reports progress."""
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    # One thread is the steadiest on a small shared machine and the model is too small to gain from more.
    torch.set_num_threads(1)
    try:
        tokenizer = build_tokenizer(recipe)
        model = build_model(recipe, tokenizer)
        warmup_task = ReverseTask(seed=recipe.warmup_task_seed)
        prompts = warmup_task.prompts()
        rng = random.Random(recipe.torch_seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
        model.train()
        for step in range(recipe.warmup_steps):
            ids, mask, labels = _warmup_batch(tokenizer, warmup_task, prompts, rng, recipe.batch_size)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if on_step is not None:
                on_step(step + 1, recipe.warmup_steps)
        model.eval()
        accuracy = sample_accuracy(
            model, tokenizer, ReverseTask(), recipe.eval_prompts, recipe.eval_seed, recipe.eval_max_new_tokens
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        save_quietly(model, tokenizer, out_dir)
    finally:
        torch.set_num_threads(threads)
    stats = BuildStats(
        params=sum(p.numel() for p in model.parameters()),
        build_seconds=time.perf_counter() - started,
        warmup_accuracy=accuracy,
        safetensors_bytes=sum(f.stat().st_size for f in out_dir.glob("*.safetensors")),
    )
    (out_dir / BUILD_STATS_FILE).write_text(
        json.dumps({"recipe": dataclasses.asdict(recipe), "stats": dataclasses.asdict(stats)}, indent=2)
    )
    return stats


def save_quietly(model, tokenizer, out_dir: Path) -> None:
    """save_pretrained without transformers' own shard progress bar, which would garble ours."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def ensure_default_model(
    cache_root: Path | None = None, progress: bool = True, recipe: EmbeddedRecipe = DEFAULT_MODEL_RECIPE
) -> Path:
    """An embedded model's directory (the default's unless `recipe` names another), built first if missing; safe to
    call from several processes at once."""
    final = default_model_dir(cache_root, recipe)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f"{final.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while this one waited for the lock.
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model cache
            if progress:
                _build_with_progress(tmp, recipe)
            else:
                recipe.build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _build_with_progress(out_dir: Path, recipe: EmbeddedRecipe) -> object:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn(f"[bold]building {recipe.label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task_id = bar.add_task("warm-up", total=recipe.warmup_steps)
        return recipe.build(out_dir, on_step=lambda done, total: bar.update(task_id, completed=done))
