"""Model variants for tests and benchmarks of the hub's audits."""

from __future__ import annotations

import random
from pathlib import Path


def nudged_model(model_dir: Path, steps: int = 3, lr: float = 3e-4):
    """The model after a few AdamW steps on reversal examples: a later policy version whose log-probs
    differ measurably from the base's. Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.tasks.reverse import ReverseTask

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(5)
    for _ in range(steps):
        texts = [p.text + p.text[::-1] for p in ReverseTask().sample(rng, 16)]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, tokenizer


ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")


def random_model_dir(
    out_dir: Path,
    arch: str = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    context: int = 256,
) -> Path:
    """A random-init causal LM of `arch` saved with save_pretrained (and the default model's tokenizer) in
    `out_dir`: what an operator's `--model DIR` holds, built locally from the config class, no download.

    The MLP is 8/3 x hidden (as Llama sizes it) and heads are 64 wide (2 KV heads: grouped-query
    attention), so parameters are about 12 x hidden^2 per layer plus the embedding. `context`: its positions.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from shared.default_model import ensure_default_model

    classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or ensure_default_model(progress=False))
    heads = max(1, hidden // 64)
    config = classes[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=min(2, heads),
        head_dim=hidden // heads,
        max_position_embeddings=context,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
