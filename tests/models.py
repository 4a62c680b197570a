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
