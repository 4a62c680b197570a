"""Devices and precision: the `--device` and `--dtype` choices of the hub and of a node, resolved on this machine.

The learner keeps fp32 master weights whatever this says; snapshots are published in this
dtype, and every engine must load them as they are (a node whose engine dtype differs from the
hub's is refused at join, so no snapshot is ever cast on install).
"""

from __future__ import annotations

from typing import Literal

from shared.checks import UserError

DeviceChoice = Literal["auto", "cpu", "cuda"]
DtypeChoice = Literal["auto", "float32", "bfloat16"]
EngineDtype = Literal["float32", "bfloat16"]
# Bytes one weight takes in each dtype a snapshot may carry.
ENGINE_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}


def pick_device(choice: str, cuda_available: bool) -> str:
    """The torch device `choice` names: auto is cuda when torch sees a GPU, else cpu; any other stays as given."""
    if choice == "auto":
        return "cuda" if cuda_available else "cpu"
    return choice


def pick_dtype(choice: DtypeChoice, device: str, bf16_supported: bool) -> EngineDtype:
    """auto: bfloat16 on a CUDA device that supports it, float32 otherwise (CPU bf16 matmuls are slow)."""
    if choice != "auto":
        return choice
    return "bfloat16" if device.startswith("cuda") and bf16_supported else "float32"


def device_phrase(device: str, cuda_available: bool, gpu_name: str) -> str:
    """Where a resolved `device` runs, as the start line says it: the GPU's index and name, or why the CPU."""
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        return f"cuda:{index} ({gpu_name})"
    return "cpu (--device cpu; CUDA is here)" if cuda_available else "cpu (no CUDA)"


def resolve_device(choice: str, flag: str) -> str:
    """`choice` on this machine (pick_device); UserError naming `flag` when it asks for CUDA this torch lacks."""
    import torch

    available = torch.cuda.is_available()
    if choice.startswith("cuda") and not available:
        raise UserError(f"{flag} {choice}: torch here has no CUDA ({torch.__version__}); use {flag} cpu or auto")
    return pick_device(choice, available)


def check_device(choice: str, flag: str) -> None:
    """UserError when `choice` asks for CUDA this torch lacks; torch is imported only to check a cuda choice."""
    if choice.startswith("cuda"):
        resolve_device(choice, flag)


def resolve_dtype(choice: DtypeChoice, device: str | None) -> EngineDtype:
    """`choice` on `device` (None or auto: this machine's, as pick_device picks it); see pick_dtype."""
    if choice != "auto":
        return choice
    import torch

    available = torch.cuda.is_available()
    on = pick_device(device or "auto", available)
    return pick_dtype(choice, on, on.startswith("cuda") and available and torch.cuda.is_bf16_supported())


def engine_dtype(choice: DtypeChoice, device: str | None):
    """The torch dtype `choice` resolves to on `device`."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_dtype(choice, device)]
