"""Rollout data shared by nodes (which make it) and the hub (which checks and trains on it)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length"]
# vLLM clamps lower temperatures to this (greedy-like), so the log-probs it reports would not be those of
# the distribution asked for: sampling below it is refused everywhere.
MIN_TEMPERATURE = 0.01
SEED_LIMIT = 2**31  # seeds every engine accepts
# Versions are learner steps: far below SQLite's 64-bit INTEGER, which a hostile number must never reach.
MAX_VERSION = 2**53
# Environment segments one completion may hold: a tool-using rollout's answered rounds (hub.agents.loop caps them
# lower, at the run's max_tool_calls).
MAX_ENV_SEGMENTS = 256


class SamplingParams(BaseModel):
    """How completions are sampled; the recorded log-probs are under exactly this distribution."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10.0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept before sampling")
    top_k: int = Field(0, ge=0, le=1 << 20, description="keep only the k most likely tokens before sampling (0: off)")
    min_p: float = Field(
        0.0, ge=0.0, lt=1.0, description="drop tokens less likely than min_p x the most likely one before sampling (0: off)"
    )
    max_new_tokens: int = Field(
        10, ge=1, le=65536, description="completion length cap in tokens (10 suits the embedded model's task)"
    )
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="RNG seed for reproducible sampling")


class Completion(BaseModel):
    """One sampled completion with the per-token log-probs of the sampled tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_ids: tuple[int, ...] = Field(description="completion tokens, EOS included when finish_reason is stop")
    logprobs: tuple[float, ...] = Field(description="log-prob of each sampled token under the sampling distribution")
    finish_reason: FinishReason
    version: int = Field(ge=0, le=MAX_VERSION, description="policy version that produced it")
    text: str = Field(description="decoded completion without special tokens")
    env_spans: tuple[tuple[int, int], ...] = Field(
        (),
        max_length=MAX_ENV_SEGMENTS,
        description="(start, length) in token_ids of each environment segment: tool answers the hub sent, never sampled (log-prob 0.0); none: single-turn",
    )

    @model_validator(mode="after")
    def _spans_between_model_turns(self) -> Completion:
        """Each environment segment non-empty, inside token_ids, after a model turn and before the next: a rollout
        starts and ends with tokens the model sampled."""
        end = 0
        for start, length in self.env_spans:
            if start <= end or length < 1 or start + length >= len(self.token_ids):
                raise ValueError(f"environment segment ({start}, {length}) is not between two model turns")
            end = start + length
        return self

    def model_positions(self) -> list[bool]:
        """Per token: sampled by the model (True) or sent by the hub's environment (False)."""
        sampled = [True] * len(self.token_ids)
        for start, length in self.env_spans:
            sampled[start : start + length] = [False] * length
        return sampled

    def segments(self) -> list[tuple[int, ...]]:
        """Its model turns and environment segments, in the order a tool-using rollout exchanged them (model turn,
        tool answer, ..., model turn); a single-turn completion is one model turn."""
        cuts = [0, *(cut for start, length in self.env_spans for cut in (start, start + length)), len(self.token_ids)]
        return [self.token_ids[a:b] for a, b in zip(cuts, cuts[1:])]

    def env_segments(self) -> list[tuple[int, ...]]:
        """The environment segments' token ids, in order."""
        return self.segments()[1::2]

    def model_turns(self) -> list[tuple[int, int]]:
        """(start, stop) in token_ids of each model turn: the runs of sampled tokens before each environment
        segment, and the last one."""
        turns, start = [], 0
        for span_start, length in self.env_spans:
            turns.append((start, span_start))
            start = span_start + length
        turns.append((start, len(self.token_ids)))
        return turns

    def sampled_tokens(self) -> int:
        """How many of its tokens the model sampled (the environment's are the hub's, not the node's work)."""
        return len(self.token_ids) - sum(length for _, length in self.env_spans)

    def model_token_ids(self) -> tuple[int, ...]:
        """The sampled tokens alone, in order (token_ids itself for a single-turn completion)."""
        if not self.env_spans:
            return self.token_ids
        return tuple(token for start, stop in self.model_turns() for token in self.token_ids[start:stop])

    def model_logprobs(self) -> tuple[float, ...]:
        """The sampled tokens' log-probs alone, in order (logprobs itself for a single-turn completion)."""
        if not self.env_spans:
            return self.logprobs
        return tuple(lp for start, stop in self.model_turns() for lp in self.logprobs[start:stop])


class Group(BaseModel):
    """n completions of one prompt, all made with one policy version, scored by the hub."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str
    prompt_text: str
    version: int = Field(ge=0, le=MAX_VERSION)
    completions: tuple[Completion, ...]
    rewards: tuple[float, ...]
    node_id: str = Field("", description="peer id of the node that made it ('' for in-process)")
    logged_metrics: tuple[tuple[str, float], ...] = Field(
        (), description="what the task's reward functions logged with TRL's log_metric while scoring it, (name, value)"
    )
    logged_columns: tuple[tuple[str, tuple[str | float | None, ...]], ...] = Field(
        (), description="what they logged with TRL's log_extra: a column name and one value per completion"
    )
    reward_parts: tuple[tuple[str, tuple[float | None, ...]], ...] = Field(
        (),
        description="per reward function of the task: its name and values (None: it does not apply), then each number a verl dict held beside its score as <function>/<key>; the hub's own scores",
    )


def scored_positions(completions: Sequence[Completion]) -> list[list[bool] | None] | None:
    """Per completion, the positions whose log-probs are scored (its model tokens; None: all of them, a single-turn
    one), as shared.logprobs takes them; None when none holds environment tokens."""
    if not any(c.env_spans for c in completions):
        return None
    return [c.model_positions() if c.env_spans else None for c in completions]


def engine_seed(configured: int | None) -> int:
    """The seed an engine process starts with: the configured one, else a fresh random one, so that two
    nodes given the same prompts never sample the same completions (which copy detection would flag)."""
    return configured if configured is not None else secrets.randbelow(SEED_LIMIT)


def prompt_seeds(seed: int | None, prompts: Sequence[str]) -> list[int | None]:
    """Per-prompt seeds derived from a configured seed (None: unseeded): reproducible across runs, different
    for every prompt of a batch, equal texts included (the position is part of the derivation)."""
    if seed is None:
        return [None] * len(prompts)
    return [
        int.from_bytes(hashlib.blake2b(f"{seed}:{i}:{text}".encode(), digest_size=8).digest(), "big") % SEED_LIMIT
        for i, text in enumerate(prompts)
    ]


def lease_seed(seed: int | None, process_seed: int | None) -> int | None:
    """The seed a node samples a lease with: the lease's own (the hub's [sampling] seed) mixed with the
    node process's, so nodes given the same seeded lease still sample differently; None when the lease
    has no seed (the process's random state is used), the lease's seed alone when there is no process seed."""
    if seed is None or process_seed is None:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{process_seed}".encode(), digest_size=8).digest(), "big") % SEED_LIMIT
