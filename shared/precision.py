"""Snapshot and engine precision: the `--dtype` choice of the hub and of a node, resolved to a torch dtype.

The learner keeps fp32 master weights whatever this says; snapshots are published in this
dtype, and every engine must load them as they are (a node whose engine dtype differs from the
hub's is refused at join, so no snapshot is ever cast on install).
"""

from __future__ import annotations

from typing import Literal

DtypeChoice = Literal["auto", "float32", "bfloat16"]
EngineDtype = Literal["float32", "bfloat16"]


def resolve_dtype(choice: DtypeChoice, device: str | None) -> EngineDtype:
    """auto: bfloat16 on a CUDA device that supports it, float32 otherwise (CPU bf16 matmuls are slow)."""
    if choice != "auto":
        return choice
    import torch

    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return "bfloat16" if on_cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def engine_dtype(choice: DtypeChoice, device: str | None):
    """The torch dtype `choice` resolves to on `device`."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_dtype(choice, device)]
