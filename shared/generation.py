"""Batched sampling from a transformers causal LM with the exact per-token log-probs of what was sampled.

Used by the node's HF engine (rollouts) and by the hub's evaluator (held-out prompts); its own
decode loop rather than model.generate, so that the recorded log-probs come from exactly the
distribution sampled from (shared.logprobs.sampling_logprobs) and positions match
completion_logprobs: position ids count real tokens only.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shared.logprobs import Filters, sampling_logprobs
from shared.model_identity import stop_token_ids
from shared.rollout import Completion, SamplingParams, lease_seed

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: `cache` from transformers 5.2x on, `past_key_values` before
    (vLLM 0.33 pins transformers < 5.21, so both worlds must work)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Sampler:
    """Samples n completions per prompt in one left-padded batch with a KV cache. Not thread-safe: callers
    serialise generate() against weight changes."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        device: torch.device,
        process_seed: int | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        # Mixed into a seeded request's seed (shared.rollout.lease_seed): None keeps the request's seed as is.
        self.process_seed = process_seed
        self.tokenizer = tokenizer
        self.device = device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # None: what the loaded model declares. A model built from config.json alone (no weights on disk) never
        # read generation_config.json: an engine passes its model identity's stop ids, then the hub's set.
        if stop_ids is None:
            stop_ids = stop_token_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id, model.config.eos_token_id)
        self.use_stop_ids(stop_ids)
        self._cache_kwarg = cache_kwarg(model)

    def use_stop_ids(self, stop_ids: Sequence[int]) -> None:
        """Stop on exactly `stop_ids` from the next generate on (callers serialise it against generate)."""
        if not stop_ids:
            raise ValueError("no stop ids: a completion could never end on EOS")
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device)

    def generate(
        self, prompts: Sequence[str], n: int, sampling: SamplingParams, version: int, greedy: bool = False
    ) -> list[list[Completion]]:
        """n completions per prompt, in prompt order. greedy: the most likely token each step (log-probs
        then under temperature 1, no filter)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            return []
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        contexts = [ids for ids in prompt_ids for _ in range(n)]
        rows = self.continue_ids(contexts, [sampling.max_new_tokens] * len(contexts), sampling, version, greedy)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def continue_ids(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        sampling: SamplingParams,
        version: int,
        greedy: bool = False,
    ) -> list[Completion]:
        """One completion per context (token ids: a prompt, or a tool-using rollout so far), each of at most its
        budget of tokens (sampling.max_new_tokens is not read), ending on a stop id or at its budget."""
        if not contexts:
            return []
        with torch.inference_mode():
            tokens, logprobs = self._sample([list(c) for c in contexts], sampling, greedy, list(budgets))
        rows = []
        stop = set(self.stop_ids.tolist())
        for row_tokens, row_logprobs, budget in zip(tokens.tolist(), logprobs.tolist(), budgets):
            row_tokens = row_tokens[:budget]
            end = next((i + 1 for i, t in enumerate(row_tokens) if t in stop), None)
            reason = "length" if end is None else "stop"
            end = len(row_tokens) if end is None else end
            kept = row_tokens[:end]
            rows.append(
                Completion(
                    token_ids=tuple(kept),
                    logprobs=tuple(row_logprobs[:end]),
                    finish_reason=reason,
                    version=version,
                    text=self.tokenizer.decode(kept, skip_special_tokens=True),
                )
            )
        return rows

    def _sample(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, greedy: bool, budgets: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens [B, L] and their log-probs [B, L], L the largest of `budgets` at most; rows continue
        (ignored) after their stop token or past their budget."""
        from transformers import DynamicCache

        batch = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
        generator = None
        seed = lease_seed(sampling.seed, self.process_seed)
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        f = Filters() if greedy else Filters(sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        next_position = positions[:, -1:] + 1
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        ones = torch.ones((batch, 1), dtype=attention.dtype, device=self.device)
        budget = torch.tensor(budgets, device=self.device)
        steps = max(budgets)
        sampled, sampled_logprobs = [], []
        for step in range(steps):
            logprobs = sampling_logprobs(out.logits[:, -1, :], f.temperature, f.top_p, f.top_k, f.min_p)
            if greedy:
                token = logprobs.argmax(dim=-1, keepdim=True)
            else:
                token = torch.multinomial(logprobs.exp(), 1, generator=generator)
            sampled.append(token)
            sampled_logprobs.append(logprobs.gather(-1, token))
            done |= torch.isin(token.squeeze(-1), self.stop_ids) | (budget <= step + 1)
            if step + 1 == steps or bool(done.all()):
                break
            attention = torch.cat([attention, ones], dim=-1)
            out = self.model(
                input_ids=token,
                attention_mask=attention,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            next_position = next_position + 1
        return torch.cat(sampled, dim=-1), torch.cat(sampled_logprobs, dim=-1)
