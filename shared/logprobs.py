"""Per-token log-probs of given completions under a model's sampling distribution (temperature, top-p).

The hub learner backprops through these and the hub's audits compare them with what nodes
report, so the filtering here is the one the engines sample with (shared/generation.py imports it).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Tokens whose entropy is computed at once: its temporaries are this many rows of the vocabulary (about 77 MB of
# float32 at a 151k vocabulary), never the whole [B, T, V] again, as TRL's entropy_from_logits(chunk_size=...).
ENTROPY_CHUNK_TOKENS = 128


def nucleus_removed(scaled_logits: Tensor, top_p: float) -> Tensor:
    """Bool mask of tokens outside the top-p nucleus, with transformers' and vLLM's tie rules.

    Tokens sorted by ascending probability are dropped while their cumulative mass is <= 1 - top_p;
    the most likely token is always kept.
    """
    sorted_logits, sorted_index = torch.sort(scaled_logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    removed_sorted = cumulative <= (1.0 - top_p)
    removed_sorted[..., -1] = False
    return removed_sorted.scatter(-1, sorted_index, removed_sorted)


def sampling_logprobs(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0) -> Tensor:
    """Log-softmax of logits / temperature restricted to the top-p nucleus (-inf outside it), in fp32."""
    scaled = logits.float() / temperature
    if top_p < 1.0:
        # The nucleus membership is a discrete choice: no gradient flows through it.
        scaled = scaled.masked_fill(nucleus_removed(scaled.detach(), top_p), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def completion_logprobs(
    model,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Log-probs [B, T] of each completion token given its prompt, and a float mask [B, T] of real tokens.

    One forward pass over [left-padded prompt | right-padded completion]; position ids count real
    tokens only, so each row sees the positions it would see alone (as during generation).
    Differentiable with respect to the model's parameters.
    """
    logprobs, targets, mask = _completion_distributions(model, prompt_ids, completion_ids, pad_id, temperature, top_p)
    return _token_logprobs(logprobs, targets, mask), mask


def completion_logprobs_and_entropy(
    model,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """completion_logprobs' log-probs and mask, and the entropy [B, T] (nats, no gradient) of the sampling
    distribution at each completion token, from the same forward pass (0 at padding)."""
    logprobs, targets, mask = _completion_distributions(model, prompt_ids, completion_ids, pad_id, temperature, top_p)
    return _token_logprobs(logprobs, targets, mask), mask, sampling_entropy(logprobs) * mask


def sampling_entropy(logprobs: Tensor) -> Tensor:
    """The entropy (nats, no gradient) of each distribution of log-probs [..., V], ENTROPY_CHUNK_TOKENS at a time.
    Tokens outside the nucleus have log-prob -inf and probability 0: entr(0) = 0, they add nothing."""
    with torch.no_grad():
        rows = logprobs.detach().reshape(-1, logprobs.shape[-1])
        parts = [torch.special.entr(chunk.exp()).sum(-1) for chunk in rows.split(ENTROPY_CHUNK_TOKENS)]
        return torch.cat(parts).reshape(logprobs.shape[:-1])


def _token_logprobs(logprobs: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """The log-prob of each target token, 0 at padding."""
    token_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Padding slots may sit outside the nucleus (-inf); zero them so sums and grads stay finite.
    return token_logprobs.masked_fill(mask == 0, 0.0)


def _completion_distributions(
    model, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, temperature: float, top_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One forward pass: the sampling log-distribution [B, T, V] before each completion token, the tokens [B, T]
    and the mask [B, T] of real ones."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    prompt_width = max(len(p) for p in prompt_ids)
    completion_width = max((len(c) for c in completion_ids), default=0)
    ids = torch.full((batch, prompt_width + completion_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        start = prompt_width - len(prompt)
        ids[row, start:prompt_width] = torch.tensor(prompt, dtype=torch.long)
        attention[row, start:prompt_width] = 1
        if completion:
            ids[row, prompt_width : prompt_width + len(completion)] = torch.tensor(completion, dtype=torch.long)
            attention[row, prompt_width : prompt_width + len(completion)] = 1
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    # Logits at positions prompt_width-1 .. end-1 predict the completion tokens.
    logits = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=False,
        logits_to_keep=completion_width + 1,
    ).logits[:, :-1, :]
    logprobs = sampling_logprobs(logits, temperature, top_p)
    return logprobs, ids[:, prompt_width:], attention[:, prompt_width:].float()
