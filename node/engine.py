"""The rollout engine interface (sample completions with log-probs, hot-swap weights) and its factory."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from shared.rollout import Completion, SamplingParams

BACKENDS = ("auto", "hf", "vllm")


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
    version: int
    tokenizer: object
    dtype: str  # "float32" or "bfloat16": the weights' dtype, which snapshots must carry
    broken: str | None = None  # why the engine must not generate, once a swap failed half way

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

    def close(self) -> None:
        """Release the backend's resources (processes, GPU memory, temp files)."""


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (install the 'gpu' extra: pip install 'echo2[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def make_engine(
    backend: str, model_dir: Path, device: str | None = None, version: int = 0, dtype: str = "auto",
    seed: int | None = None, gpu_memory_fraction: float = 0.85, max_lora_rank: int = 0,
) -> Engine:
    """An engine for model_dir. backend "auto" picks vLLM when it can run (and device is not "cpu"), else "hf".

    device None means "cuda" when CUDA is available, else "cpu"; dtype as shared.precision resolves it there.
    """
    from shared.precision import resolve_dtype

    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "vllm" if device != "cpu" and vllm_unavailable_reason() is None else "hf"
    if backend == "vllm":
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(f"vllm backend unavailable: {reason}")
        if device is not None and not device.startswith("cuda"):
            raise EngineUnavailable(f"vllm backend runs on CUDA only, got device {device!r}")
        from node.vllm_engine import VLLMEngine

        return VLLMEngine(Path(model_dir), version=version, dtype=resolve_dtype(dtype, "cuda"), seed=seed,
                          gpu_memory_utilization=gpu_memory_fraction, max_lora_rank=max_lora_rank)
    import torch

    from node.hf_engine import HFEngine

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFEngine(Path(model_dir), device=device, version=version, dtype=resolve_dtype(dtype, device), seed=seed)
