"""The install probe: reference log-probs the hub signs with each snapshot, which every engine reproduces
after installing it, before it generates one token with that version.

A swap can leave an engine computing something other than the snapshot it was given while every file
hash checks out: a tied head that kept its packed copy of the old embedding (vLLM on CPU), a delta
applied half way, a CUDA graph that captured the old weights' pointers, an adapter injected into the
wrong modules. The hub's audits would catch such a node only after it had spent its work, and then ban
an honest volunteer. The probe catches it at install: a few fixed (prompt, completion) token rows, and
their per-token log-probs at temperature 1 without top-p, computed by the hub on the snapshot's weights
in the snapshot's dtype (the audit's own computation, hub/trust/audit.py). The node scores the same rows with
its engine and refuses the version if the mean |gap| passes the audit tolerance the hub signs beside
them. Temperature 1 without top-p keeps nucleus boundaries, where two honest engines may disagree on a
token's membership, out of the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROBE_ROWS = 4
PROBE_PROMPT_TOKENS = 48  # at most, per row: the probe scores a model, it does not exercise long contexts
PROBE_COMPLETION_TOKENS = 16
MAX_PROBE_ROWS = 16
MAX_PROBE_PROMPT_TOKENS = 512
MAX_PROBE_COMPLETION_TOKENS = 64
MAX_TOKEN_ID = 2**31 - 1
# A log-prob this far below zero means the row's token is one the model all but rules out: an honest
# reference never holds one, and a bound keeps a hostile float out of the arithmetic.
MIN_LOGPROB = -1e4

TokenRow = tuple[int, ...]


class ProbeMismatch(ValueError):
    """The engine does not compute the snapshot it installed (str() says by how much)."""


class InstallProbe(BaseModel):
    """Rows of prompt and completion token ids, and the hub's log-prob of each completion token."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    prompt_ids: tuple[TokenRow, ...] = Field(
        min_length=1, max_length=MAX_PROBE_ROWS, description="token ids of each row's prompt"
    )
    completion_ids: tuple[TokenRow, ...] = Field(
        min_length=1, max_length=MAX_PROBE_ROWS, description="token ids of each row's completion"
    )
    logprobs: tuple[tuple[float, ...], ...] = Field(
        min_length=1, max_length=MAX_PROBE_ROWS, description="the hub's log-prob of each completion token"
    )
    max_mean_abs_gap: float = Field(gt=0.0, le=10.0, allow_inf_nan=False, description="the audit tolerance, nats per token")

    @field_validator("prompt_ids", "completion_ids")
    @classmethod
    def _token_rows(cls, rows: tuple[TokenRow, ...], info) -> tuple[TokenRow, ...]:
        cap = MAX_PROBE_PROMPT_TOKENS if info.field_name == "prompt_ids" else MAX_PROBE_COMPLETION_TOKENS
        for row in rows:
            if not 1 <= len(row) <= cap:
                raise ValueError(f"a probe row of {len(row)} tokens (1..{cap})")
            if not all(0 <= t <= MAX_TOKEN_ID for t in row):
                raise ValueError("a probe token id out of range")
        return rows

    @field_validator("logprobs")
    @classmethod
    def _finite(cls, rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        if not all(MIN_LOGPROB <= x <= 0.0 for row in rows for x in row):  # NaN fails both comparisons
            raise ValueError(f"probe log-probs must lie in [{MIN_LOGPROB:g}, 0]")
        return rows

    @model_validator(mode="after")
    def _shapes(self) -> InstallProbe:
        if not len(self.prompt_ids) == len(self.completion_ids) == len(self.logprobs):
            raise ValueError("probe rows differ in number")
        if any(len(c) != len(lp) for c, lp in zip(self.completion_ids, self.logprobs)):
            raise ValueError("a probe row's log-probs do not match its completion")
        return self

    def check_tokens(self, vocab_size: int) -> None:
        """ProbeMismatch when a row names a token past the model's vocabulary: checked before an engine scores
        the rows (an embedding lookup past its table would fail inside the engine, not as a mismatch)."""
        if any(t >= vocab_size for row in (*self.prompt_ids, *self.completion_ids) for t in row):
            raise ProbeMismatch(f"the probe names tokens past this model's vocabulary of {vocab_size}")

    def check(self, scored: Sequence[Sequence[float]], vocab_size: int) -> float:
        """The mean |gap| of an engine's `scored` log-probs of these rows; ProbeMismatch past the tolerance."""
        self.check_tokens(vocab_size)
        gap = probe_gap(self.logprobs, scored)
        if not gap <= self.max_mean_abs_gap:
            raise ProbeMismatch(
                f"its log-probs of the hub's probe differ by {gap:.4g} nats per token on average "
                f"(tolerance {self.max_mean_abs_gap:g})"
            )
        return gap


def probe_gap(reference: Sequence[Sequence[float]], scored: Sequence[Sequence[float]]) -> float:
    """Mean |reference - scored| over every token; inf when the shapes differ or a score is not finite."""
    if len(reference) != len(scored) or any(len(a) != len(b) for a, b in zip(reference, scored)):
        return math.inf
    gaps = [abs(a - b) for ref_row, row in zip(reference, scored) for a, b in zip(ref_row, row)]
    return sum(gaps) / len(gaps) if all(math.isfinite(g) for g in gaps) else math.inf


def probe_rows(texts: Sequence[str], tokenizer, stop_ids: frozenset[int]) -> tuple[tuple[TokenRow, ...], tuple[TokenRow, ...]]:
    """PROBE_ROWS (prompt, completion) rows from a task's prompt texts: each prompt scored on the tokens of the
    next prompt, so the completions are real text of the task, fixed for the run, with no stop token in them."""
    encoded = [[t for t in tokenizer(text)["input_ids"] if t not in stop_ids] for text in texts[: PROBE_ROWS + 1]]
    encoded = [ids for ids in encoded if ids]
    if len(encoded) < 2:
        raise ValueError("the probe needs two prompts with tokens")
    prompts, completions = [], []
    for i in range(min(PROBE_ROWS, len(encoded))):
        prompts.append(tuple(encoded[i][-PROBE_PROMPT_TOKENS:]))
        completions.append(tuple(encoded[(i + 1) % len(encoded)][:PROBE_COMPLETION_TOKENS]))
    return tuple(prompts), tuple(completions)
