"""LoRA adapters (peft) on a Hugging Face causal LM, one spec shared by the learner, the engines, audits and eval.

A run with `--lora-rank R` trains adapters only (the base weights stay frozen), so each snapshot
carries only the adapter's tensors (megabytes), with the adapter's spec in the safetensors header's
metadata: hub-signed like every byte of the file. Whoever installs a snapshot (a node's engine,
the hub's auditor) injects the same adapters into its base model once (peft's
inject_adapter_in_model, in place: the model object and its generate() stay the same) and copies
the adapter tensors in; a full snapshot installs as before. The adapters are unmerged: the
engine computes W x + (alpha / r) B A x, exactly what the learner trained.

vLLM takes adapters as a LoRARequest naming a directory in peft's format: `write_peft_dir`
writes one from a snapshot (renamed keys, adapter_config.json).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.model_io import load_into
from shared.snapshot import SnapshotError
from shared.weights_file import read_metadata

LORA_METADATA_KEY = "echo2_lora"
_ADAPTER_NAME = "default"
_SPEC_ATTR = "_echo2_lora_spec"


class LoraSpec(BaseModel):
    """The adapters of a LoRA run: enough for any process to build the same ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=1, le=1024, description="r")
    alpha: float = Field(gt=0.0, le=1e4, description="scale numerator: the update is alpha / r x B A")
    targets: tuple[str, ...] = Field(max_length=64, description="names of the Linear modules adapted (empty: peft's default)")


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = ()) -> LoraSpec:
    """Inject zero-initialised-B LoRA adapters into `model` in place and freeze everything else; `targets`
    empty: peft's default modules for the architecture (q_proj and v_proj for Llama and Qwen). Returns the
    resolved spec (explicit module names), which the snapshots carry."""
    from peft import LoraConfig, inject_adapter_in_model

    if getattr(model, _SPEC_ATTR, None) is not None:
        raise ValueError("the model already has adapters")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets) or None)
    # inject_adapter_in_model needs a model type to pick default targets; it reads it off the config.
    inject_adapter_in_model(config, model, adapter_name=_ADAPTER_NAME)
    adapted = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")})
    if not adapted:
        raise ValueError(f"no module of this model matches the LoRA targets {list(targets) or 'default'}")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    spec = LoraSpec(rank=rank, alpha=alpha, targets=tuple(adapted))
    setattr(model, _SPEC_ATTR, spec)
    return spec


def model_spec(model: torch.nn.Module) -> LoraSpec | None:
    return getattr(model, _SPEC_ATTR, None)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of `model` (live, not copies), in state-dict order."""
    return {name: tensor for name, tensor in model.state_dict().items() if is_adapter_key(name)}


def snapshot_metadata(spec: LoraSpec | None) -> dict[str, str]:
    """What a snapshot's safetensors metadata says of its adapters (nothing for a full snapshot)."""
    return {} if spec is None else {LORA_METADATA_KEY: spec.model_dump_json()}


def snapshot_spec(path: Path) -> LoraSpec | None:
    """The adapters a snapshot file carries (None: a full snapshot); SnapshotError for a malformed spec."""
    raw = read_metadata(path).get(LORA_METADATA_KEY)
    if raw is None:
        return None
    try:
        return LoraSpec.model_validate_json(raw)
    except ValidationError as exc:
        raise SnapshotError(f"{path}: malformed LoRA spec in its metadata: {exc}") from exc


def prepare_for(model: torch.nn.Module, spec: LoraSpec | None) -> None:
    """Give `model` the adapters `spec` names (once); SnapshotError when it already has others."""
    current = model_spec(model)
    if spec is None:
        if current is not None:
            raise SnapshotError("a full snapshot for a model running LoRA adapters")
        return
    if current is None:
        add_adapters(model, spec.rank, spec.alpha, spec.targets)
        if model_spec(model) != spec:
            raise SnapshotError(f"adapters {spec} do not fit this model (got {model_spec(model)})")
    elif current != spec:
        raise SnapshotError(f"snapshot adapters {spec} differ from the model's {current}")


def install_snapshot(model: torch.nn.Module, path: Path) -> None:
    """Copy a snapshot file into `model` in place: all weights, or (an adapter snapshot) the adapters,
    injected first if the model has none. Same guarantees as shared.model_io.load_into."""
    prepare_for(model, snapshot_spec(path))
    load_into(model, path, keys=is_adapter_key if model_spec(model) is not None else None)


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy another model's adapter tensors (adapter_state) into `model`'s, which must have the same ones."""
    mine = adapter_state(model)
    if set(mine) != set(state):
        raise ValueError(f"adapter keys differ: {sorted(set(mine) ^ set(state))[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            mine[name].copy_(tensor)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights with the adapters merged in (W + alpha / r B A), adapter keys left out: a plain
    checkpoint from_pretrained loads. Copies only the adapted weights."""
    spec = model_spec(model)
    state = {name: t for name, t in model.state_dict().items() if not is_adapter_key(name)}
    if spec is None:
        return state
    scale = spec.alpha / spec.rank
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and _ADAPTER_NAME in module.lora_A:
            a = module.lora_A[_ADAPTER_NAME].weight.float()
            b = module.lora_B[_ADAPTER_NAME].weight.float()
            key = f"{name}.base_layer.weight"
            base = state.pop(key)
            state[f"{name}.weight"] = (base.float() + scale * (b @ a)).to(base.dtype)
            if f"{name}.base_layer.bias" in state:
                state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return state


def write_peft_dir(snapshot_path: Path, spec: LoraSpec, out_dir: Path) -> Path:
    """A peft-format adapter directory (adapter_config.json, adapter_model.safetensors) holding a snapshot's
    adapters: what vLLM's LoRARequest and peft's PeftModel.from_pretrained load."""
    from safetensors.torch import save_file

    from shared.weights_file import iter_tensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        "base_model.model." + name.replace(f".{_ADAPTER_NAME}.", "."): tensor.contiguous()
        for name, tensor in iter_tensors(snapshot_path)
    }
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
