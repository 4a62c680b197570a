from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from node.engine import vllm_unavailable_reason
from shared.logprobs import completion_logprobs
from shared.rollout import SamplingParams
from shared.tasks.reverse import ReverseTask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(vllm_unavailable_reason() is not None, reason=f"{vllm_unavailable_reason()}"),
]

PROMPTS = [p.text for p in ReverseTask().prompts()[:16]]
# vLLM and transformers use different kernels; the same fp32 weights agree to about this much.
MAX_MEAN_LOGPROB_GAP = 2e-3


@pytest.fixture(scope="module")
def engines(default_model_dir):
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine

    vllm_engine = VLLMEngine(default_model_dir, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True)
    hf_engine = HFEngine(default_model_dir, device="cuda", dtype="float32")
    yield vllm_engine, hf_engine
    vllm_engine.close()


def perturbed_snapshot(model, noise: float, seed: int, path):
    """A snapshot file of `model`'s weights plus noise (tied names dropped, as the hub writes them)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: (v.cpu() + noise * torch.randn(v.shape, generator=gen)).clone() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)
    save_file(state, path)
    return path


def mean_gap(vllm_engine, hf_engine, sampling: SamplingParams, n: int = 4) -> float:
    out = vllm_engine.generate(PROMPTS, n, sampling)
    flat = [c for group in out for c in group]
    prompt_ids = [ids for ids in hf_engine.tokenizer(PROMPTS)["input_ids"] for _ in range(n)]
    with torch.no_grad():
        ref, mask = completion_logprobs(
            hf_engine.model, prompt_ids, [list(c.token_ids) for c in flat], hf_engine.pad_id,
            sampling.temperature, sampling.top_p,
        )
    reported = torch.zeros_like(ref)
    for row, c in enumerate(flat):
        reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    return (((ref - reported).abs() * mask).sum() / mask.sum()).item()


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
