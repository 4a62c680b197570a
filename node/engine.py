"""The rollout engine interface (sample completions with log-probs, hot-swap weights), its errors and vLLM's
resource settings; node/backends.py picks and builds an engine."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from shared.model_identity import ModelIdentity
from shared.probe import InstallProbe, ProbeMismatch
from shared.rollout import Completion, SamplingParams


class EngineUnavailable(RuntimeError):
    """The requested backend cannot run on this machine; the message says why."""


class InstallFailed(RuntimeError):
    """A verified snapshot that this engine cannot take: the node cannot go on (the message says why)."""


class EngineBroken(InstallFailed):
    """A weight swap failed after it began: the model holds a mix of versions and must not generate."""


class Engine(ABC):
    """Samples completions from the current policy; `install` swaps the policy in place.

    Prompts are tokenized with `tokenizer(text)["input_ids"]` (the tokenizer's default special
    tokens), which is what a verifier must feed to shared.logprobs.completion_logprobs.
    """

    backend: ClassVar[str]
    # The most rollouts one `generate` call is given (None: a whole lease, for an engine that schedules its own memory,
    # as vLLM's does): the worker cuts a lease into slices of this size, so a hub's large lease cannot grow the
    # engine's memory (docs/volunteers.md).
    batch_rollouts: ClassVar[int | None] = None
    version: int
    model_identity: ModelIdentity  # the node's model, read once (shared/model_identity.py): the engine builds it
    tokenizer: Any  # a Hugging Face tokenizer: model_identity's
    dtype: str  # "float32" or "bfloat16": the weights' dtype, which snapshots must carry
    broken: str | None = None  # why the engine must not generate, once a swap failed half way
    model_context: int | None = None  # the model's positions (max_position_embeddings): the most a lease may need
    _lock: threading.Lock  # held by install, generate and scoring: none of them interleave

    def _usable(self) -> None:
        if self.broken is not None:
            raise EngineBroken(self.broken)

    def _swap_failed(self, version: int, exc: BaseException) -> EngineBroken:
        self.broken = f"the swap to v{version} failed part way ({exc}): the weights are a mix of versions; restart the node"
        return EngineBroken(self.broken)

    @abstractmethod
    def install(self, path: Path, version: int) -> None:
        """Load a verified snapshot file (safetensors of a state dict) into the running model, in place."""

    @abstractmethod
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        """n completions per prompt, in prompt order, each with its sampled tokens' log-probs."""

    def turn_cache(self) -> object | None:
        """What a batch of tool-using rollouts keeps from one turn to the next (`generate_turns(..., kept=)`), made
        anew for each batch; None where the engine finds a context's computed prefix itself (vLLM's prefix caching)."""
        return None

    @abstractmethod
    def generate_turns(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        sampling: SamplingParams,
        kept: object | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> list[Completion]:
        """A tool-using rollout's next model turn per row: each context (its prompt's ids, then the rollout's
        model and environment tokens so far) continued by at most its budget of tokens, ending on a stop id;
        sampling.max_new_tokens is not read. `kept` (from turn_cache) and a key per row, each naming one rollout
        for the batch's whole life: the rows prefill only what they gained since their last turn."""

    @abstractmethod
    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-prob of each completion token given its prompt at temperature 1, without top-p, as this engine
        computes it with the weights it holds now."""

    def fit_context(self, tokens: int) -> None:
        """The hub's leases need `tokens` of context (its join reply): EngineUnavailable when this engine cannot
        give them. An engine with a fixed context (vLLM's max_model_len) sizes itself by it."""
        if self.model_context is not None and tokens > self.model_context:
            raise EngineUnavailable(
                f"this hub's leases need {tokens} tokens of context (longest prompt plus "
                f"max_new_tokens) and the model has {self.model_context}"
            )

    @abstractmethod
    def use_stop_ids(self, stop_ids: Sequence[int]) -> None:
        """End completions on exactly `stop_ids` (the hub's set, from its join reply: what it checks submissions
        against, the stop ids of its model's identity) from the next generate on."""

    @property
    @abstractmethod
    def stop_ids(self) -> frozenset[int]:
        """The ids a completion ends on now."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the model's embedding: token ids at or past it are not this model's."""

    def check_install(self, probe: InstallProbe | None, version: int) -> float | None:
        """After installing `version`: reproduce the hub's install probe (shared/probe.py), or mark the engine
        broken and raise EngineBroken, before anything is generated with it. The mean |gap|, or None when the
        snapshot carries no probe (its learner was built without one: tests and benches)."""
        if probe is None:
            return None
        try:
            with self._lock:
                self._usable()
                vocab_size = self.vocab_size
                probe.check_tokens(vocab_size)
                scored = self.score(probe.prompt_ids, probe.completion_ids)
            return probe.check(scored, vocab_size)
        except ProbeMismatch as exc:
            self.broken = (
                f"v{version} installed, but this {self.backend} engine does not compute it: {exc}. The node "
                "stops before generating with it (nothing was submitted, so nothing counts against it); "
                "restart it, and report it if it happens again"
            )
            raise EngineBroken(self.broken) from exc

    def close(self) -> None:
        """Release the backend's resources (processes, GPU memory, temp files)."""


@dataclass(frozen=True)
class VLLMResources:
    """What a vLLM engine may take of its machine, each in the unit of the device it runs on."""

    gpu_memory_fraction: float | None = None  # CUDA: share of the GPU's memory (None: DEFAULT_GPU_MEMORY_FRACTION)
    kv_cache_gib: int | None = None  # CPU: GiB of host memory for the KV cache (None: DEFAULT_KV_CACHE_GIB)
    cpu_cores: str | None = None  # CPU: cores its threads are bound to, e.g. "2-3" (None: `threads` threads, unbound)
    threads: int = 1  # CPU: threads when no cores are named


DEFAULT_GPU_MEMORY_FRACTION = 0.85
DEFAULT_KV_CACHE_GIB = 1
