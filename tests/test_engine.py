from __future__ import annotations

import itertools
import os
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from node.backends import make_engine, vllm_unavailable_reason
from node.engine import EngineUnavailable
from node.hf_engine import HFEngine
from shared.logprobs import completion_logprobs, nucleus_removed, sampling_logprobs
from shared.model_io import tied_duplicates
from shared.rollout import SamplingParams
from shared.tasks.reverse import ReverseTask

PROMPTS = [p.text for p in ReverseTask().prompts()[:16]]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    torch.set_num_threads(1)
    return HFEngine(default_model_dir)


_names = itertools.count()


def save(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """A weights file written by the safetensors library itself (the engine must read what others write)."""
    path = directory / f"w{next(_names)}.safetensors"
    save_file(state, path)
    return path


def snapshot_file(directory: Path, model, noise: float = 0.0, seed: int = 0) -> Path:
    """The model's weights plus noise, one name per tied group as the hub writes them (two copies of a tied
    weight with different noise would be refused)."""
    gen = torch.Generator().manual_seed(seed)
    dropped = tied_duplicates(model)
    state = {
        k: (v + noise * torch.randn(v.shape, generator=gen)).clone() for k, v in model.state_dict().items() if k not in dropped
    }
    return save(directory, state)


def test_nucleus_keeps_smallest_prefix_with_mass_at_least_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert nucleus_removed(logits, 0.8).tolist() == [[False, False, True, True]]
    assert nucleus_removed(logits, 0.79).tolist() == [[False, False, True, True]]
    assert nucleus_removed(logits, 0.81).tolist() == [[False, False, False, True]]
    assert nucleus_removed(logits, 0.01).tolist() == [[False, True, True, True]]
    lp = sampling_logprobs(logits, temperature=1.0, top_p=0.8)
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    assert torch.isinf(lp[0, 2:]).all()
    scaled = sampling_logprobs(logits, temperature=0.5).exp()
    assert torch.allclose(scaled, probs**2 / (probs**2).sum())


def test_top_k_and_min_p_drop_below_a_threshold_then_top_p_takes_its_nucleus_of_the_rest():
    """Probabilities 0.5, 0.25, 0.125, 0.125: top-k 2 keeps two (2/3, 1/3); top-k 3 keeps the tie at the third too;
    min-p 0.3 keeps p >= 0.15 (two); top-k 3 then top-p 0.7 renormalises all four and takes 0.5 + 0.25."""
    from shared.logprobs import below_threshold

    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert below_threshold(logits, 2, 0.0).tolist() == [[False, False, True, True]]
    assert below_threshold(logits, 3, 0.0).tolist() == [[False, False, False, False]]
    assert below_threshold(logits, 0, 0.3).tolist() == [[False, False, True, True]]
    assert below_threshold(logits, 1, 0.1).tolist() == [[False, True, True, True]]  # the stricter of the two
    for kwargs in ({"top_k": 2}, {"min_p": 0.3}, {"top_k": 3, "top_p": 0.7}):
        lp = sampling_logprobs(logits, **kwargs)
        assert torch.allclose(lp[0, :2].exp(), torch.tensor([2 / 3, 1 / 3])) and torch.isinf(lp[0, 2:]).all(), kwargs
    assert torch.allclose(sampling_logprobs(logits, top_k=3).exp(), torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    # Temperature first: at 0.5 the probabilities are 16/22, 4/22, 1/22, 1/22, and min-p 0.1 drops the last two.
    assert torch.isinf(sampling_logprobs(logits, temperature=0.5, min_p=0.1)[0, 2:]).all()


def test_generate_shapes_finish_reasons_and_versions(engine):
    sampling = SamplingParams(max_new_tokens=4, seed=0)
    out = engine.generate(PROMPTS, 3, sampling)
    assert len(out) == len(PROMPTS) and all(len(g) == 3 for g in out)
    eos = engine.tokenizer.eos_token_id
    reasons = set()
    for group in out:
        for c in group:
            reasons.add(c.finish_reason)
            assert len(c.token_ids) == len(c.logprobs) <= 4
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.version == 0
            assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
            else:
                assert len(c.token_ids) == 4 and eos not in c.token_ids
    assert reasons == {"stop", "length"}


def test_same_seed_same_outputs(engine):
    sampling = SamplingParams(max_new_tokens=8, seed=7)
    first = engine.generate(PROMPTS[:4], 4, sampling)
    assert engine.generate(PROMPTS[:4], 4, sampling) == first
    assert engine.generate(PROMPTS[:4], 4, sampling.model_copy(update={"seed": 8})) != first


@pytest.mark.parametrize(
    "temperature,top_p,top_k,min_p",
    [(1.0, 1.0, 0, 0.0), (0.7, 1.0, 0, 0.0), (1.0, 0.9, 0, 0.0), (0.7, 0.9, 0, 0.0), (0.7, 0.9, 5, 0.05)],
)
def test_engine_logprobs_match_completion_logprobs(engine, temperature, top_p, top_k, min_p):
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_new_tokens=8, seed=1)
    n = 4
    out = engine.generate(PROMPTS, n, sampling)
    flat = [c for group in out for c in group]
    prompt_ids = [ids for ids in engine.tokenizer(PROMPTS)["input_ids"] for _ in range(n)]
    with torch.no_grad():
        ref, mask = completion_logprobs(
            engine.model, prompt_ids, [list(c.token_ids) for c in flat], temperature, top_p, top_k, min_p
        )
    reported = torch.zeros_like(ref)
    for row, c in enumerate(flat):
        reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    assert mask.sum().item() == sum(len(c.token_ids) for c in flat)
    gap = ((ref - reported).abs() * mask).sum() / mask.sum()
    assert gap.item() < 1e-4, f"mean |engine - completion_logprobs| = {gap.item():.3g}"


def test_completion_logprobs_is_differentiable_and_padding_invariant(engine):
    prompt_ids = engine.tokenizer(["abc>", "qwerty>"])["input_ids"]
    completions = [[6, 5, 4, 1], [28]]
    batched, mask = completion_logprobs(engine.model, prompt_ids, completions, 0.7, 0.9)
    assert mask.tolist() == [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    assert torch.isfinite(batched).all()
    alone, _ = completion_logprobs(engine.model, prompt_ids[1:], completions[1:], 0.7, 0.9)
    assert torch.allclose(batched[1, :1], alone[0], atol=1e-5)
    engine.model.zero_grad(set_to_none=True)
    (batched * mask).sum().backward()
    grad = engine.model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    engine.model.zero_grad(set_to_none=True)


def test_install_swaps_weights_and_version(engine, tmp_path):
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    original = snapshot_file(tmp_path, engine.model)
    before = engine.generate(PROMPTS[:8], 2, sampling)
    engine.install(snapshot_file(tmp_path, engine.model, noise=0.05), version=1)
    after = engine.generate(PROMPTS[:8], 2, sampling)
    assert engine.version == 1 and all(c.version == 1 for g in after for c in g)
    assert [c.token_ids for g in after for c in g] != [c.token_ids for g in before for c in g]
    engine.install(original, version=2)
    restored = engine.generate(PROMPTS[:8], 2, sampling)
    assert [c.token_ids for g in restored for c in g] == [c.token_ids for g in before for c in g]


def test_install_accepts_tied_snapshot_and_rejects_bad_ones(engine, tmp_path):
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    del state["lm_head.weight"]  # tied to the embedding, as save_pretrained writes it
    engine.install(save(tmp_path, state), version=3)
    assert engine.version == 3
    del state["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="lacks"):
        engine.install(save(tmp_path, state), version=4)
    with pytest.raises(ValueError, match="lacks"):
        engine.install(save(tmp_path, {"model.norm.weight": torch.ones(128)}), version=4)
    full = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="keys the model lacks"):
        engine.install(save(tmp_path, {**full, "extra.weight": torch.ones(1)}), version=4)
    poisoned = {**full, "model.embed_tokens.weight": full["model.embed_tokens.weight"] + 1.0}
    poisoned["model.norm.weight"] = torch.ones(3)
    del poisoned["lm_head.weight"]
    with pytest.raises(ValueError, match=r"snapshot has \(3,\)"):
        engine.install(save(tmp_path, poisoned), version=4)
    assert engine.version == 3
    assert torch.equal(engine.model.model.embed_tokens.weight, full["model.embed_tokens.weight"])  # untouched


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_fifty_swaps_do_not_grow_memory(engine, tmp_path):
    snapshots = [snapshot_file(tmp_path, engine.model, noise=0.01, seed=s) for s in range(2)]
    for i in range(5):
        engine.install(snapshots[i % 2], version=10 + i)
    rss_before = _rss_bytes()
    tracemalloc.start()
    python_before = tracemalloc.get_traced_memory()[0]
    for i in range(50):
        engine.install(snapshots[i % 2], version=20 + i)
    python_growth = tracemalloc.get_traced_memory()[0] - python_before
    tracemalloc.stop()
    rss_growth = _rss_bytes() - rss_before
    assert engine.version == 69
    assert python_growth < 256 * 1024
    assert rss_growth < 2 * snapshots[0].stat().st_size, f"RSS grew {rss_growth} bytes over 50 swaps"


def test_make_engine_backends(default_model_dir):
    assert isinstance(make_engine("hf", default_model_dir, device="cpu"), HFEngine)
    with pytest.raises(ValueError, match="unknown engine backend"):
        make_engine("tpu", default_model_dir)
    assert isinstance(make_engine("auto", default_model_dir, device="cpu"), HFEngine)
    reason = vllm_unavailable_reason()
    if reason is None:
        pytest.skip("vLLM can run here; its backend is covered by tests/test_vllm.py")
    assert isinstance(make_engine("auto", default_model_dir), HFEngine)
    with pytest.raises(EngineUnavailable, match="the vllm backend is unavailable"):
        make_engine("vllm", default_model_dir)


def test_vllm_memory_and_threads_are_set_in_the_unit_of_the_device(monkeypatch):
    """On a CPU the KV cache is GiB of host memory and the engine's threads are left to the OS unless cores are
    named (vLLM's own "auto" binding pins every engine on a machine to the same first core); on CUDA a share of
    the GPU. A setting of the other device is refused in one line."""
    from node.backends import check_vllm_resources
    from node.engine import VLLMResources
    from node.vllm_engine import _configure_platform

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert _configure_platform("cpu", VLLMResources(threads=3)) == {}
    assert (os.environ["VLLM_CPU_KVCACHE_SPACE"], os.environ["VLLM_CPU_OMP_THREADS_BIND"], os.environ["OMP_NUM_THREADS"]) == (
        "1",
        "nobind",
        "3",
    )
    _configure_platform("cpu", VLLMResources(kv_cache_gib=4, cpu_cores="2-3"))
    assert (os.environ["VLLM_CPU_KVCACHE_SPACE"], os.environ["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "2-3")
    assert _configure_platform("cuda", VLLMResources()) == {"gpu_memory_utilization": 0.85}
    assert _configure_platform("cuda", VLLMResources(gpu_memory_fraction=0.4)) == {"gpu_memory_utilization": 0.4}
    with pytest.raises(EngineUnavailable, match="--gpu-memory-fraction sets a share of a GPU's memory.*--kv-cache-gib"):
        check_vllm_resources("cpu", VLLMResources(gpu_memory_fraction=0.5))
    for flag, resources in (("--kv-cache-gib", VLLMResources(kv_cache_gib=2)), ("--cpu-cores", VLLMResources(cpu_cores="0"))):
        with pytest.raises(EngineUnavailable, match=f"{flag} is for vLLM on a CPU"):
            check_vllm_resources("cuda", resources)
    check_vllm_resources("cpu", VLLMResources(kv_cache_gib=2, cpu_cores="0-1"))
    check_vllm_resources("cuda", VLLMResources(gpu_memory_fraction=0.5))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cpu-cores", "0-1;rm"], "cpu_cores"),
        (["--kv-cache-gib", "0"], "kv_cache_gib"),
        (["--gpu-memory-fraction", "1.5"], "gpu_memory_fraction"),
    ],
)
def test_vllm_flags_out_of_bounds_are_one_line(tmp_path, capsys, flags, message):
    from node.cli import main

    hub = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWQMibLEAhHEXGXzsNXUzih2693chjq9xjpCFATrsuGtxH"
    assert main(["join", "--hub", hub, "--data-dir", str(tmp_path / "node"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "node").exists()


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM can run here")
def test_a_vllm_node_without_vllm_is_one_line_and_writes_no_key(tmp_path, capsys):
    from node.cli import main

    hub = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWQMibLEAhHEXGXzsNXUzih2693chjq9xjpCFATrsuGtxH"
    assert main(["join", "--hub", hub, "--data-dir", str(tmp_path / "node"), "--backend", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"echo-node: --backend vllm: {vllm_unavailable_reason()}"]
    assert not (tmp_path / "node").exists()


def test_the_hub_tells_the_context_its_leases_need_and_an_engine_refuses_more_than_its_model_has(default_model_dir):
    """max_model_len sized from the lease: the hub's join reply carries its task's longest prompt (as engines
    tokenize it) plus max_new_tokens; an engine whose model has less refuses in one line."""
    from transformers import AutoTokenizer

    from hub.training.tasks import context_tokens

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    task = ReverseTask()
    longest = max(len(tokenizer(p.text)["input_ids"]) for p in task.prompts())
    assert context_tokens(task, tokenizer, 16) == longest + 16
    engine = HFEngine(default_model_dir, device="cpu")
    limit = engine.model.config.max_position_embeddings
    engine.fit_context(limit)
    with pytest.raises(EngineUnavailable, match=f"need {limit + 1} tokens of context .* the model has {limit}"):
        engine.fit_context(limit + 1)
