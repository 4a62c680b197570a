"""Rollout data shared by nodes (which make it) and the hub (which checks and trains on it)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]
# vLLM clamps lower temperatures to this (greedy-like), so the log-probs it reports would not be those of
# the distribution asked for: sampling below it is refused everywhere.
MIN_TEMPERATURE = 0.01
SEED_LIMIT = 2**31  # seeds every engine accepts
# Versions are learner steps: far below SQLite's 64-bit INTEGER, which a hostile number must never reach.
MAX_VERSION = 2**53


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
