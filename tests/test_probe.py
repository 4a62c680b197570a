"""The install probe (shared/probe.py): hostile manifests are refused at the schema, the hub computes the
reference with its audit model in the snapshot's dtype, and an engine that does not compute the snapshot it
installed (one corrupted tensor) stops before generating. The vLLM side is in tests/test_vllm.py."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from hub.config import TrustConfig
from hub.records.snapshots import SnapshotShelf
from hub.trust.audit import Auditor
from node.engine import EngineBroken
from node.hf_engine import HFEngine
from shared.crypto import Identity
from shared.model_identity import load_model_identity
from shared.model_io import build_snapshot, model_dir_config_hash, tied_duplicates
from shared.probe import PROBE_COMPLETION_TOKENS, PROBE_ROWS, InstallProbe, ProbeMismatch, probe_gap, probe_rows
from shared.rollout import SamplingParams
from shared.snapshot import Manifest, read_snapshot_files
from shared.tasks.reverse import ReverseTask

ROW = {"prompt_ids": ((1, 2, 3),), "completion_ids": ((4, 5),), "logprobs": ((-1.0, -2.0),), "max_mean_abs_gap": 0.01}


@pytest.mark.parametrize(
    "what,change",
    [
        ("a NaN log-prob", {"logprobs": ((float("nan"), -2.0),)}),
        ("a positive log-prob", {"logprobs": ((0.5, -2.0),)}),
        ("a log-prob of -1e308", {"logprobs": ((-1e308, -2.0),)}),
        ("an infinite tolerance", {"max_mean_abs_gap": float("inf")}),
        ("a zero tolerance", {"max_mean_abs_gap": 0.0}),
        ("a tolerance of 5e-324 less than zero", {"max_mean_abs_gap": -5e-324}),
        ("a negative token id", {"completion_ids": ((-1, 5),)}),
        ("a token id past 2**31", {"prompt_ids": ((2**40,),)}),
        ("an empty prompt", {"prompt_ids": ((),)}),
        ("a completion longer than its log-probs", {"completion_ids": ((4, 5, 6),)}),
        ("rows that differ in number", {"prompt_ids": ((1,), (2,))}),
        ("17 rows", {k: v * 17 for k, v in ROW.items() if k != "max_mean_abs_gap"}),
        ("a 65-token completion", {"completion_ids": ((1,) * 65,), "logprobs": ((-1.0,) * 65,)}),
    ],
)
def test_a_hostile_probe_fails_the_schema(what, change):
    InstallProbe.model_validate_json(InstallProbe(**ROW).model_dump_json())  # the unchanged row parses
    with pytest.raises(ValidationError):
        InstallProbe.model_validate({**ROW, **change})


def test_the_gap_is_the_mean_over_tokens_and_infinite_on_any_mismatch():
    assert probe_gap(((-1.0, -2.0), (-3.0,)), ((-1.5, -2.0), (-2.0,))) == pytest.approx(0.5)
    assert probe_gap(((-1.0,),), ((-1.0, -2.0),)) == math.inf
    assert probe_gap(((-1.0,),), ((float("nan"),),)) == math.inf
    assert probe_gap(((-1.0,),), ()) == math.inf
    probe = InstallProbe(**ROW)
    assert probe.check(((-1.005, -2.005),), vocab_size=6) == pytest.approx(0.005)
    with pytest.raises(ProbeMismatch, match="0.5 nats"):
        probe.check(((-1.5, -2.5),), vocab_size=6)
    with pytest.raises(ProbeMismatch, match="vocabulary of 5"):
        probe.check(((-1.0, -2.0),), vocab_size=5)


def test_probe_rows_are_the_tasks_text_without_stop_tokens(default_model_dir):
    model = load_model_identity(default_model_dir)
    tokenizer, stops = model.tokenizer, model.stop_ids
    texts = [p.text for p in ReverseTask().prompts()[: PROBE_ROWS + 1]]
    prompts, completions = probe_rows(texts, tokenizer, stops)
    assert len(prompts) == len(completions) == PROBE_ROWS
    assert completions[0] == tuple(tokenizer(texts[1])["input_ids"][:PROBE_COMPLETION_TOKENS])
    assert not stops & {t for row in (*prompts, *completions) for t in row}
    assert (prompts, completions) == probe_rows(texts, tokenizer, stops)  # fixed for the run


def perturbed_state(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dropped = tied_duplicates(model)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items() if k not in dropped}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_reproduces_the_hubs_probe_and_a_corrupted_tensor_stops_it(tmp_path, default_model_dir, dtype):
    """The hub's reference is its audit model's computation on the written file, in the snapshot's dtype; the
    engine that installed the same file reproduces it. One tensor changed after the install (a stale head, a
    half-applied delta) is caught before anything is generated, and the engine stays refused."""
    from transformers import AutoModelForCausalLM

    engine = HFEngine(default_model_dir, device="cpu", dtype=dtype)
    model = load_model_identity(default_model_dir)
    rows = probe_rows([p.text for p in ReverseTask().prompts()[:5]], model.tokenizer, model.stop_ids)
    shelf = SnapshotShelf(keep=2, directory=tmp_path / "shelf")
    auditor = Auditor(model, shelf, SamplingParams(), TrustConfig(), dtype)
    snapshot = build_snapshot(
        perturbed_state(AutoModelForCausalLM.from_pretrained(default_model_dir), seed=1),
        3,
        Identity.generate(),
        model_dir_config_hash(default_model_dir),
        tmp_path / "snapshots",
        dtype=getattr(torch, dtype),
        probe=lambda path, whole: auditor.install_probe(path, whole, rows),
    )
    # What a node reads back: the probe signed in the manifest, within the audit tolerance of this dtype.
    manifest = read_snapshot_files(tmp_path / "snapshots", 3, snapshot.manifest.signer).manifest
    assert isinstance(manifest, Manifest) and manifest.probe == snapshot.manifest.probe
    assert manifest.probe.max_mean_abs_gap == TrustConfig().mean_abs_gap(dtype)
    assert auditor.loaded_hash == manifest.whole_hash  # an audit of v3 right after needs no second load
    engine.install(snapshot.path, 3)
    assert engine.check_install(manifest.probe, 3) <= 1e-6  # the same computation on the same weights
    with torch.no_grad():
        engine.model.get_output_embeddings().weight.mul_(1.5)  # a head that no longer matches the snapshot
    with pytest.raises(EngineBroken, match="v3 installed, but this hf engine does not compute it"):
        engine.check_install(manifest.probe, 3)
    with pytest.raises(EngineBroken):
        engine.generate(["abc>"], 1, SamplingParams(max_new_tokens=2))


def test_a_snapshot_without_a_probe_is_installed_unchecked(tmp_path, default_model_dir):
    engine = HFEngine(default_model_dir, device="cpu")
    assert engine.check_install(None, 0) is None
    assert engine.generate(["abc>"], 1, SamplingParams(max_new_tokens=2))
