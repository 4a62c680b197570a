"""Batched sampling from a transformers causal LM with the exact per-token log-probs of what was sampled.

Used by the node's HF engine (rollouts) and by the hub's evaluator (held-out prompts); its own
decode loop rather than model.generate, so that the recorded log-probs come from exactly the
distribution sampled from (shared.logprobs.sampling_logprobs) and positions match
completion_logprobs: position ids count real tokens only.

A tool-using rollout's turns may keep one KV cache from turn to turn (TurnCache): each turn then prefills only what
its rows gained since (the turn's last token, the environment's answer), not the whole context again. Columns that
hold no real token of a row (padding, tokens sampled past its stop) stay masked, so a turn sees exactly the context
it would see re-encoded.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
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


def reusable_cache(model: torch.nn.Module) -> bool:
    """Whether `model`'s KV cache can be kept across turns: full attention in every layer. A sliding window counts
    columns, masked ones too, so a kept cache with masked columns would see less than a re-encoded context."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


@dataclass
class TurnCache:
    """One batch of rollouts' KV cache, kept from one turn to the next (Sampler.continue_ids(..., turns=, keys=)).
    Rows are named by the caller's keys; a row not named in a turn is dropped from the cache. A new one is empty."""

    keys: list[Hashable] = field(default_factory=list)
    cached: list[list[int]] = field(default_factory=list)  # per row: the real token ids the cache holds, in order
    kv: object | None = None  # the model's DynamicCache
    attention: torch.Tensor | None = None  # [rows, columns]: 1 where a column holds a real token of the row
    version: int = -1  # the weights the cache was computed with

    @property
    def rows(self) -> int:
        return len(self.keys)


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
        turns: TurnCache | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> list[Completion]:
        """One completion per context (token ids: a prompt, or a tool-using rollout so far), each of at most its
        budget of tokens (sampling.max_new_tokens is not read), ending on a stop id or at its budget. With `turns`
        (and a key per context), the rows it already holds prefill only what their context gained since."""
        if not contexts:
            return []
        rows_in = [list(c) for c in contexts]
        if turns is not None and (keys is None or len(keys) != len(contexts)):
            raise ValueError("a turn cache needs one key per context")
        with torch.inference_mode():
            tokens, logprobs = self._sample(rows_in, sampling, greedy, list(budgets), turns, keys, version)
        rows, kept_lengths = [], []
        stop = set(self.stop_ids.tolist())
        for row_tokens, row_logprobs, budget in zip(tokens.tolist(), logprobs.tolist(), budgets):
            row_tokens = row_tokens[:budget]
            end = next((i + 1 for i, t in enumerate(row_tokens) if t in stop), None)
            reason = "length" if end is None else "stop"
            end = len(row_tokens) if end is None else end
            kept = row_tokens[:end]
            kept_lengths.append(end)
            rows.append(
                Completion(
                    token_ids=tuple(kept),
                    logprobs=tuple(row_logprobs[:end]),
                    finish_reason=reason,
                    version=version,
                    text=self.tokenizer.decode(kept, skip_special_tokens=True),
                )
            )
        if turns is not None:
            with torch.inference_mode():  # its mask is an inference tensor
                _keep_turn(turns, rows_in, tokens, kept_lengths)
        return rows

    def _sample(
        self,
        contexts: list[list[int]],
        sampling: SamplingParams,
        greedy: bool,
        budgets: list[int],
        turns: TurnCache | None,
        keys: Sequence[Hashable] | None,
        version: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens [B, L] and their log-probs [B, L], L the largest of `budgets` at most; rows continue
        (ignored) after their stop token or past their budget."""
        batch = len(contexts)
        generator = None
        seed = lease_seed(sampling.seed, self.process_seed)
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        f = Filters() if greedy else Filters(sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        if turns is not None and turns.rows:
            assert keys is not None and turns.version == version, "a turn cache is kept for one version's rows"
            out, cache, attention, next_position = self._prefill_kept(contexts, turns, keys)
        else:
            out, cache, attention, next_position = self._prefill(contexts)
        if turns is not None:
            assert keys is not None
            turns.keys, turns.kv, turns.version = list(keys), cache, version
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
        if turns is not None:
            turns.attention = attention
        return torch.cat(sampled, dim=-1), torch.cat(sampled_logprobs, dim=-1)

    def _prefill(self, contexts: list[list[int]]):
        """The model run over `contexts`, left-padded, with a new cache: (its output, the cache, the attention mask,
        each row's next position [B, 1])."""
        from transformers import DynamicCache

        batch = len(contexts)
        width = max(len(p) for p in contexts)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(contexts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(ids, attention, positions, cache)
        return out, cache, attention, positions[:, -1:] + 1

    def _prefill_kept(self, contexts: list[list[int]], turns: TurnCache, keys: Sequence[Hashable]):
        """As _prefill, on `turns`' cache: its rows are reordered (and the rows not named dropped) to `keys`, and each
        row's context past what the cache holds is run, left-padded into one block of new columns."""
        rows = {key: row for row, key in enumerate(turns.keys)}
        index = [rows[key] for key in keys]  # a KeyError: a context the cache never held
        held = [turns.cached[row] for row in index]
        for context, prefix in zip(contexts, held):
            if context[: len(prefix)] != prefix or len(context) == len(prefix):
                raise ValueError("a context must extend the ids its row of the turn cache holds")
        cache, attention = turns.kv, turns.attention
        assert cache is not None and attention is not None
        selected = torch.tensor(index, device=self.device)
        cache.batch_select_indices(selected)  # type: ignore[attr-defined]
        attention = attention[selected]
        news = [context[len(prefix) :] for context, prefix in zip(contexts, held)]
        width = max(len(n) for n in news)
        ids = torch.full((len(news), width), self.pad_id, dtype=torch.long)
        block = torch.zeros((len(news), width), dtype=torch.long)
        for row, new in enumerate(news):
            ids[row, width - len(new) :] = torch.tensor(new, dtype=torch.long)
            block[row, width - len(new) :] = 1
        ids, block = ids.to(self.device), block.to(self.device)
        start = torch.tensor([len(prefix) for prefix in held], device=self.device).unsqueeze(-1)
        positions = (start + block.cumsum(dim=-1) - 1).clamp(min=0)
        attention = torch.cat([attention, block], dim=-1)
        out = self._forward(ids, attention, positions, cache)
        return out, cache, attention, positions[:, -1:] + 1

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache):
        return self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )


def _keep_turn(turns: TurnCache, contexts: list[list[int]], tokens: torch.Tensor, kept_lengths: list[int]) -> None:
    """Record what `turns`' cache holds after a turn: each row's context, then the sampled tokens it kept that were
    run through the model (all but the last sampled step's); the columns of tokens sampled past a row's stop or
    budget are masked for good."""
    assert turns.attention is not None
    fed = tokens.shape[1] - 1  # the last step's tokens were sampled, never run
    first = turns.attention.shape[1] - fed
    for row, kept in enumerate(kept_lengths):
        if kept < fed:
            turns.attention[row, first + kept :] = 0
    sampled = tokens.tolist()
    turns.cached = [context + sampled[row][: min(kept, fed)] for row, (context, kept) in enumerate(zip(contexts, kept_lengths))]
