"""What both engines (HF here, vLLM on a GPU) and the hub must agree on, tested on the CPU: the set of stop
tokens, sampling bounds, the seed policy, tied copies in a snapshot, and an engine whose swap failed half way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from node.engine import EngineBroken
from node.hf_engine import HFEngine
from shared.model_identity import load_model_identity, stop_token_ids
from shared.model_io import tied_duplicates, tied_groups
from shared.rollout import MIN_TEMPERATURE, SamplingParams, engine_seed, prompt_seeds
from shared.snapshot import SnapshotError


def test_stop_tokens_are_the_union_of_every_eos_declaration() -> None:
    assert stop_token_ids(2, [2, 7], 5, None) == (2, 5, 7)
    assert stop_token_ids(None, None, 3) == (3,)
    with pytest.raises(ValueError, match="no EOS token"):
        stop_token_ids(None, None, None)


def test_a_model_dir_with_several_eos_ids_stops_on_each(tmp_path: Path, default_model_dir: Path) -> None:
    """Qwen3 and Llama 3 declare several EOS ids in generation_config.json: the hub accepts a completion
    ending in any of them and both engines stop on each."""
    from transformers import AutoTokenizer, GenerationConfig

    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = [eos, 5]
    config.save_pretrained(model)
    assert load_model_identity(model).stop_ids == {eos, 5}
    assert set(HFEngine(model).sampler.stop_ids.tolist()) == {eos, 5}


def test_an_engine_without_weights_stops_on_generation_configs_eos_and_then_on_the_hubs(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """A node without --model builds its model from config.json alone, whose generation config never reads
    generation_config.json: the engine still stops on its EOS ids, then on exactly the set the hub names."""
    from transformers import AutoTokenizer, GenerationConfig

    model = tmp_path / "model"
    model.mkdir()
    for path in default_model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, model / path.name)
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos, vowels = tokenizer.eos_token_id, [tokenizer.convert_tokens_to_ids(v) for v in "aeiou"]
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = [eos, *vowels]
    config.save_pretrained(model)
    engine = HFEngine(model)
    assert engine.model.generation_config.eos_token_id == eos  # what transformers alone would have stopped on
    assert engine.stop_ids == {eos, *vowels}
    engine.install(next(default_model_dir.glob("*.safetensors")), 0)  # the weights a first snapshot brings
    torch.manual_seed(0)
    rows = engine.generate(["abc>"], 16, SamplingParams(temperature=1.0, max_new_tokens=12))[0]
    assert any(c.token_ids[-1] in vowels for c in rows)
    assert all(not set(c.token_ids[:-1]) & {eos, *vowels} for c in rows)
    engine.use_stop_ids([eos])
    assert engine.stop_ids == {eos}
    with pytest.raises(ValueError, match="no stop ids"):
        engine.use_stop_ids([])


def test_sampling_bounds() -> None:
    assert MIN_TEMPERATURE == 0.01  # vLLM clamps anything lower: the recorded log-probs would be wrong
    SamplingParams(temperature=0.01)
    with pytest.raises(ValidationError):
        SamplingParams(temperature=0.009)


def test_seed_policy() -> None:
    # No seed configured: every process draws its own, so two nodes never sample the same completions.
    assert len({engine_seed(None) for _ in range(20)}) > 15
    assert engine_seed(7) == 7
    # A configured seed gives each prompt of a batch its own seed, the same on every run.
    seeds = prompt_seeds(3, ["abc>", "abc>", "xyz>"])
    assert len(set(seeds)) == 3 and seeds == prompt_seeds(3, ["abc>", "abc>", "xyz>"])
    assert seeds != prompt_seeds(4, ["abc>", "abc>", "xyz>"])
    assert all(0 <= s < 2**31 for s in seeds)
    assert prompt_seeds(None, ["a", "b"]) == [None, None]


def test_a_snapshot_with_differing_tied_copies_is_refused(tmp_path: Path, default_model_dir: Path) -> None:
    engine = HFEngine(default_model_dir)
    groups = tied_groups(engine.model)
    assert {"lm_head.weight", "model.embed_tokens.weight"} in groups
    assert tied_duplicates(engine.model) == {"lm_head.weight"}  # what the hub's snapshots leave out
    state = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.1
    save_file(state, tmp_path / "tied.safetensors")
    before = engine.model.get_input_embeddings().weight.clone()
    with pytest.raises(SnapshotError, match="ties"):
        engine.install(tmp_path / "tied.safetensors", 1)
    assert torch.equal(engine.model.get_input_embeddings().weight, before) and engine.version == 0
    engine.generate(["abc>"], 1, SamplingParams(max_new_tokens=2))  # refused before any copy: still usable


def test_an_engine_whose_swap_failed_half_way_refuses_to_generate(tmp_path: Path, default_model_dir: Path, monkeypatch) -> None:
    import shared.model_io

    engine = HFEngine(default_model_dir)
    state = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "snap.safetensors"
    save_file(state, path)
    engine.install(path, 1)
    # A read error after the first tensor (a disk failing, a file replaced under us): every check passed,
    # some weights are copied, the rest are not.
    real, copied = shared.model_io.copy_into, []

    def failing(f, entry, target, staging):
        if copied:
            raise OSError(5, "Input/output error")
        copied.append(entry.name)
        real(f, entry, target, staging)

    monkeypatch.setattr(shared.model_io, "copy_into", failing)
    with pytest.raises(EngineBroken, match="swap to v2 failed part way"):
        engine.install(path, 2)
    assert engine.version == 1
    with pytest.raises(EngineBroken, match="v2"):
        engine.generate(["abc>"], 1, SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineBroken):
        engine.install(path, 3)


def test_the_hub_accepts_a_completion_ending_in_any_declared_eos() -> None:
    from hub.trust.submissions import _check_completion
    from shared.rollout import Completion

    sampling = SamplingParams(max_new_tokens=4)
    stops = frozenset({2, 9})

    def completion(tokens, reason="stop"):
        return Completion(token_ids=tokens, logprobs=(-0.5,) * len(tokens), finish_reason=reason, version=0, text="")

    assert _check_completion(completion((5, 9)), sampling, stops) is None
    assert _check_completion(completion((5, 2)), sampling, stops) is None
    assert _check_completion(completion((5, 6)), sampling, stops) == "finish_reason stop without EOS"
    assert _check_completion(completion((9, 5, 2)), sampling, stops) == "tokens after EOS"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_vllm_check_says_in_one_line_why_it_cannot_run_here(device: str) -> None:
    import subprocess
    import sys

    from node.backends import vllm_unavailable_reason

    reason = vllm_unavailable_reason(device)
    if reason is None:
        pytest.skip(f"vLLM can run on {device} here: .ci/run runs the check itself")
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "bench/vllm_check.py", "--device", device, "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"vllm_check: cannot run on {device}: {reason}"]


def test_a_seeded_lease_samples_differently_on_each_node(default_model_dir: Path) -> None:
    """The hub's [sampling] seed reaches every node in its leases: mixed with each process's own seed, two
    nodes answer the same seeded lease differently, and one node answers it the same way twice."""
    from shared.rollout import lease_seed

    assert lease_seed(None, 5) is None and lease_seed(3, None) == 3
    assert lease_seed(3, 5) != lease_seed(3, 6) and lease_seed(3, 5) == lease_seed(3, 5)
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    prompts = ["abcdefg>"] * 4
    node_a, node_b = HFEngine(default_model_dir, seed=1), HFEngine(default_model_dir, seed=2)
    first = [c.token_ids for g in node_a.generate(prompts, 4, sampling) for c in g]
    assert first == [c.token_ids for g in node_a.generate(prompts, 4, sampling) for c in g]
    assert first != [c.token_ids for g in node_b.generate(prompts, 4, sampling) for c in g]
