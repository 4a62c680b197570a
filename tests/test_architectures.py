"""Qwen2, Qwen3, Llama and Mistral, each a tiny random-init model built from its config class: snapshots
(fp32 and bf16) stream to a file, install into the transformers engine from it, and the engine's
completions pass the hub's audit against the same file."""

from __future__ import annotations

import random

import pytest
import torch

from hub.config import TrustConfig
from hub.records.snapshots import SnapshotShelf
from hub.trust.audit import Auditor
from node.hf_engine import HFEngine
from shared.crypto import Identity
from shared.model_identity import load_model_identity
from shared.model_io import build_snapshot, model_dir_config_hash
from shared.rollout import Group, SamplingParams
from shared.tasks.reverse import ReverseTask
from testbed.models import ARCHITECTURES, random_model_dir

SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, seed=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_snapshot_install_and_audit_for_each_architecture(tmp_path, arch, dtype):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = random_model_dir(tmp_path / "model", arch, tie_word_embeddings=arch in ("qwen2", "qwen3"))
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # a later policy: every weight moved, so an install that missed one shows
        for p in trained.parameters():
            p.add_(0.02 * torch.randn_like(p))
    shelf = SnapshotShelf(keep=2, directory=tmp_path / "snapshots")
    snapshot = build_snapshot(
        trained.state_dict(),
        3,
        Identity.generate(),
        model_dir_config_hash(model_dir),
        tmp_path / "snapshots",
        dtype=getattr(torch, dtype),
    )
    shelf.add(snapshot)

    engine = HFEngine(model_dir, dtype=dtype)
    engine.install(snapshot.path, 3)
    expected = {k: v.to(getattr(torch, dtype)) for k, v in trained.state_dict().items()}
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    prompts = ReverseTask().sample(random.Random(1), 3)
    outputs = engine.generate([p.text for p in prompts], 4, SAMPLING)
    auditor = Auditor(load_model_identity(model_dir), shelf, SAMPLING, TrustConfig(), dtype)
    for prompt, completions in zip(prompts, outputs):
        group = Group(
            prompt_id=prompt.id,
            prompt_text=prompt.text,
            version=3,
            completions=tuple(completions),
            rewards=(0.0,) * len(completions),
        )
        result = auditor.audit(group, 3)
        assert result.passed, (arch, dtype, result)
        if dtype == "float32":
            assert result.mean_abs_gap < 1e-4  # the same weights and kernels: equal up to batching noise
