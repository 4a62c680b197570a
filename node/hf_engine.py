"""transformers rollout engine: batched KV-cache sampling with exact per-token log-probs, in-place weight swaps."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from node.engine import Engine
from shared.adapters import install_snapshot
from shared.generation import Sampler, TurnCache, reusable_cache
from shared.logprobs import completion_logprobs
from shared.model_identity import ModelIdentity, load_model_identity
from shared.model_io import PartialCopy
from shared.rollout import Completion, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _load_model(model_identity: ModelIdentity, dtype: torch.dtype) -> PreTrainedModel:
    """The model of `model_identity`; without weight files (the hub's config and tokenizer only, shared/model_files.py)
    its tensors are left unset: the first snapshot, installed before any generation, fills every one of them."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from shared.model_files import has_weights

    if has_weights(model_identity.model_dir):
        return AutoModelForCausalLM.from_pretrained(model_identity.model_dir, dtype=dtype)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(model_identity.config_copy(), dtype=dtype)
    model.tie_weights()  # tying runs with the initialisation skipped above; snapshots carry one of a tied pair
    return model


class HFEngine(Engine):
    """A transformers model behind shared.generation.Sampler; snapshots are copied into it in place."""

    backend = "hf"
    # Its KV cache and logits grow with the batch: 64 rollouts hold a default lease (4 prompts x 8) in one call.
    batch_rollouts = 64

    def __init__(self, model_dir: Path, device: str = "cpu", version: int = 0, dtype: str = "float32", seed: int | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.model_identity = load_model_identity(model_dir)
        self.tokenizer = self.model_identity.tokenizer
        self.model = _load_model(self.model_identity, getattr(torch, dtype)).to(self.device).eval()
        self.model_context = getattr(self.model.config, "max_position_embeddings", None)
        self.version = version
        # The directory's declared set (generation_config.json too, which a model built from config.json alone never
        # reads), until the hub's join reply names the set it checks submissions against (use_stop_ids).
        self.sampler = Sampler(
            self.model, self.tokenizer, self.device, process_seed=seed, stop_ids=sorted(self.model_identity.stop_ids)
        )
        # A tool-using rollout's turns keep their KV cache, but for a sliding window (shared.generation.reusable_cache).
        self.keeps_turns = reusable_cache(self.model)
        # install and generate must not interleave (a node may call them from different threads).
        self._lock = threading.Lock()

    @property
    def pad_id(self) -> int:
        return self.sampler.pad_id

    def install(self, path: Path, version: int) -> None:
        with self._lock:
            self._usable()
            try:
                # Checks every key, shape, dtype and tie before copying anything; an adapter snapshot (a LoRA
                # run) injects the adapters once and copies only them.
                install_snapshot(self.model, path)
            except PartialCopy as exc:
                raise self._swap_failed(version, exc) from exc
            self.version = version

    def use_stop_ids(self, stop_ids: Sequence[int]) -> None:
        with self._lock:
            self.sampler.use_stop_ids(stop_ids)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.sampler.stop_ids.tolist())

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        with torch.inference_mode():
            logprobs, _ = completion_logprobs(self.model, [list(p) for p in prompt_ids], [list(c) for c in completion_ids])
        return [row[: len(c)] for row, c in zip(logprobs.float().tolist(), completion_ids)]

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        with self._lock:
            self._usable()
            return self.sampler.generate(prompts, n, sampling, self.version)

    def turn_cache(self) -> TurnCache | None:
        return TurnCache() if self.keeps_turns else None

    def generate_turns(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        sampling: SamplingParams,
        kept: object | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> list[Completion]:
        assert kept is None or isinstance(kept, TurnCache), "a turn cache of this engine's"
        with self._lock:
            self._usable()
            return self.sampler.continue_ids(contexts, budgets, sampling, self.version, turns=kept, keys=keys)
