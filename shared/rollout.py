"""Rollout data shared by nodes (which make it) and the hub (which checks and trains on it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]
# Versions are learner steps: far below SQLite's 64-bit INTEGER, which a hostile number must never reach.
MAX_VERSION = 2**53


class SamplingParams(BaseModel):
    """How completions are sampled; the recorded log-probs are under exactly this distribution."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0.0, le=10.0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept before sampling")
    max_new_tokens: int = Field(16, ge=1, le=65536, description="completion length cap in tokens")
    seed: int | None = Field(None, ge=0, description="RNG seed for reproducible sampling")


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
