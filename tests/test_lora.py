"""LoRA runs (shared/adapters.py): adapters injected the same way everywhere, snapshots that carry only them
(signed spec in the metadata), installs into engines and audits, the learner training adapters only
with checkpoints that restore them, the merged final policy, the peft directory vLLM loads, and a
real `echo-hub start --lora-rank 8` whose node installs the adapters bit-exact."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load as safetensors_load

from hub.config import LearnerConfig, TrustConfig
from hub.records.snapshots import SnapshotShelf
from hub.training.checkpoint import latest_checkpoint, save_checkpoint
from hub.training.learner import Learner
from hub.trust.audit import Auditor
from node.hf_engine import HFEngine
from shared.adapters import (
    LORA_METADATA_KEY,
    LoraSpec,
    adapter_state,
    add_adapters,
    install_snapshot,
    merged_state_dict,
    snapshot_metadata,
    snapshot_spec,
    write_peft_dir,
)
from shared.crypto import Identity
from shared.model_identity import load_model_identity
from shared.model_io import build_snapshot
from shared.rollout import SamplingParams
from shared.snapshot import SnapshotError, model_config_hash
from shared.tasks.reverse import ReverseTask
from testbed.harness import Proc, query, start_test_hub, start_test_node, stop_all, wait_until
from testbed.recording_node import weights_digest
from tests.test_audit import generate
from tests.test_learner import synthetic_groups

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10)
LORA = LearnerConfig(prompts_per_step=4, group_size=4, lr=1e-2, lora_rank=8, lora_alpha=16.0)


def logits(model, ids=((5, 9, 12, 7, 30),)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def base_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.fixture(scope="module")
def trained(default_model_dir):
    """A LoRA learner after two steps at a large lr (adapters far from their zero-B start), and its adapters
    as a signed snapshot."""
    torch.set_num_threads(1)
    learner = Learner(load_model_identity(default_model_dir), LORA, SAMPLING)
    for step in (1, 2):
        learner.train_step(synthetic_groups(seed=step), step)
    identity = Identity.generate()
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(prefix="echo2-lora-"))
    snapshot = build_snapshot(
        learner.state_dict(), 2, identity, learner.config_hash, directory, metadata=learner.snapshot_metadata
    )
    return learner, snapshot


def test_adapters_are_peft_defaults_resolved_and_alone_trainable(default_model_dir):
    model = base_model(default_model_dir)
    spec = add_adapters(model, 8, 16.0)
    assert spec == LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state(model)) and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # B starts at zero: a fresh adapter changes nothing.
    assert torch.equal(logits(model), logits(base_model(default_model_dir)))
    with pytest.raises(ValueError, match="already has adapters"):
        add_adapters(model, 8, 16.0)
    with pytest.raises(ValueError, match="not found|no module"):
        add_adapters(base_model(default_model_dir), 8, 16.0, ("nope_proj",))


def test_the_learner_trains_adapters_only_and_snapshots_carry_only_them(trained, default_model_dir):
    learner, snapshot = trained
    base = base_model(default_model_dir).state_dict()
    for name, tensor in learner.model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor, base[name.replace(".base_layer", "")]), name  # frozen
    assert any(t.abs().sum() > 0 for n, t in adapter_state(learner.model).items() if ".lora_B." in n)
    assert snapshot_spec(snapshot.path) == learner.lora == LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    full_bytes = sum(t.numel() * 4 for t in base.values())
    assert snapshot.manifest.total_bytes <= 0.05 * full_bytes, (snapshot.manifest.total_bytes, full_bytes)
    assert set(safetensors_load(snapshot.path.read_bytes())) == set(adapter_state(learner.model))


def test_engine_and_audit_install_the_adapters_and_score_like_the_learner(trained, default_model_dir):
    learner, snapshot = trained
    engine = HFEngine(default_model_dir)
    engine.install(snapshot.path, 2)
    assert torch.equal(logits(engine.model), logits(learner.model))
    engine.install(snapshot.path, 2)  # the adapters are injected once; a second install only copies
    other = base_model(default_model_dir)
    add_adapters(other, 4, 8.0)
    with pytest.raises(SnapshotError, match="differ"):
        install_snapshot(other, snapshot.path)

    shelf = SnapshotShelf(keep=2)
    shelf.add(snapshot)
    auditor = Auditor(load_model_identity(default_model_dir), shelf, SAMPLING, TrustConfig(), "float32")
    prompts = ReverseTask().sample(random.Random(3), 6)
    honest = [auditor.audit(g, 2) for g in generate(engine, prompts)]
    assert all(r.passed for r in honest), [r.reason for r in honest]
    base_engine = HFEngine(default_model_dir, version=2)  # claims v2, samples from the base model
    lying = [auditor.audit(g, 2) for g in generate(base_engine, prompts)]
    assert not any(r.passed for r in lying)


def test_a_full_snapshot_or_a_malformed_spec_is_refused_by_a_lora_model(trained, default_model_dir, tmp_path):
    learner, snapshot = trained
    engine = HFEngine(default_model_dir)
    engine.install(snapshot.path, 2)
    identity = Identity.generate()
    full = build_snapshot(base_model(default_model_dir).state_dict(), 5, identity, "0" * 64, tmp_path)
    with pytest.raises(SnapshotError, match="full snapshot for a model running LoRA"):
        install_snapshot(engine.model, full.path)
    bad = build_snapshot(
        learner.state_dict(),
        6,
        identity,
        "0" * 64,
        tmp_path / "bad",
        metadata={LORA_METADATA_KEY: json.dumps({"rank": 0, "alpha": 1, "targets": ["q_proj"]})},
    )
    with pytest.raises(SnapshotError, match="malformed LoRA spec"):
        install_snapshot(base_model(default_model_dir), bad.path)
    assert snapshot_metadata(None) == {}


def test_checkpoint_restores_adapters_and_optimizer_exactly(trained, default_model_dir, tmp_path):
    learner, _ = trained
    save_checkpoint(tmp_path, 2, 2, learner.model, learner.tokenizer, learner.optimizer, adapter=learner.state_dict())
    info = latest_checkpoint(tmp_path)
    assert info.adapter_path.exists() and not (info.model_dir / "model.safetensors").exists()
    resumed = Learner(load_model_identity(default_model_dir), LORA, SAMPLING, info)
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    assert len(resumed.optimizer.state_dict()["state"]) == len(adapter_state(learner.model))


def test_final_policy_is_the_merged_model_and_peft_dir_loads_the_same_adapters(trained, default_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner, snapshot = trained
    learner.save_final(tmp_path / "final")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    assert not any(".lora_" in n for n in final.state_dict())
    assert torch.allclose(logits(final), logits(learner.model), atol=1e-4)
    # What vLLM's LoRARequest loads: peft's own loader reads it into the base model, with the same logits.
    peft_dir = write_peft_dir(snapshot.path, snapshot_spec(snapshot.path), tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(base_model(default_model_dir), str(peft_dir)).eval()
    assert torch.equal(logits(peft_model), logits(learner.model))
    assert model_config_hash(final.config.to_dict()) == learner.config_hash
    assert set(merged_state_dict(learner.model)) == set(base_model(default_model_dir).state_dict())


@pytest.mark.slow
def test_a_real_lora_run_ships_adapters_that_a_real_node_installs_bit_exact(tmp_path, default_model_dir):
    hub_dir = tmp_path / "hub"
    # S = 3: the hub keeps its newest 4 snapshot files, so the newest one the node installed is still there
    # when the hub is stopped (first: it publishes no more while the node's installs are compared).
    hub = start_test_hub(
        hub_dir,
        "--lora-rank",
        "8",
        "--lr",
        "3e-3",
        "--kappa",
        "1",
        "--staleness",
        "3",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "4",
    )
    nodes: list[Proc] = []
    try:
        node_dir = tmp_path / "node"
        # A LoRA run's snapshots carry only the adapters: its nodes bring the base model.
        nodes = [start_test_node(hub.addr, node_dir, "--model", str(default_model_dir))]
        # Three installs, not v3: a node still fetching v0 when v1 and v2 are out skips v1.
        wait_until(lambda: len(list((node_dir / "installed").glob("v*.json"))) >= 3, 180, "the node's third install")
        stop_all([hub])
    finally:
        stop_all([hub, *nodes])
    hashes = dict(query(hub_dir, "SELECT version, manifest_hash FROM snapshots"))
    records = {r["version"]: r for r in (json.loads(p.read_text()) for p in (node_dir / "installed").glob("v*.json"))}
    assert len(records) >= 3 and all(r["bytes_blake3"] == hashes[v] for v, r in records.items())
    on_disk = sorted((hub_dir / "snapshots").glob("v*.safetensors"))
    newest = next(p for p in reversed(on_disk) if int(p.stem[1:]) in records)
    tensors = safetensors_load(newest.read_bytes())
    assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
    assert records[int(newest.stem[1:])]["model_digest"] == weights_digest(tensors, tensors)
    assert snapshot_spec(newest) == LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    accepted, rejected = query(hub_dir, "SELECT SUM(verdict = 'accepted'), SUM(verdict = 'rejected') FROM trajectories")[0]
    assert accepted > 0 and rejected == 0


def test_a_resume_must_match_the_checkpoints_kind_rank_and_alpha(trained, tmp_path):
    from hub.cli.preflight import check_checkpoint_fits
    from hub.config import HubConfig
    from shared.checks import UserError
    from shared.layout import CHECKPOINTS_DIR

    learner, _ = trained
    save_checkpoint(
        tmp_path / CHECKPOINTS_DIR,
        2,
        2,
        learner.model,
        learner.tokenizer,
        learner.optimizer,
        adapter=learner.state_dict(),
        adapter_metadata=learner.snapshot_metadata,
    )

    def config(**learner_fields) -> HubConfig:
        return HubConfig(data_dir=tmp_path, learner=LearnerConfig(**learner_fields))

    check_checkpoint_fits(config(lora_rank=8, lora_alpha=16.0))  # as it was started
    with pytest.raises(UserError, match="trains LoRA adapters of rank 8, alpha 16.*--lora-rank 8 --lora-alpha 16"):
        check_checkpoint_fits(config())
    with pytest.raises(UserError, match="rank 8"):
        check_checkpoint_fits(config(lora_rank=4))
    full = tmp_path / "full"
    save_checkpoint(full / CHECKPOINTS_DIR, 2, 2, learner.model, learner.tokenizer, learner.optimizer)
    with pytest.raises(UserError, match="--lora-rank 8: the run in .* trains full weights"):
        check_checkpoint_fits(HubConfig(data_dir=full, learner=LearnerConfig(lora_rank=8)))
