"""The packed, chunked log-probs (shared/logprobs.py) against the padded, whole-vocabulary reference they replaced:
equal values, gradients and entropies on every architecture the project builds, a head that never sees more than a
chunk of tokens, and models whose forward rewrites the head's output refused."""

from __future__ import annotations

import random

import pytest
import torch

import shared.logprobs
from shared.logprobs import completion_logprobs, completion_logprobs_and_entropy, pack_rows, sampling_logprobs
from testbed.models import ARCHITECTURES, random_model_dir


def reference_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0):
    """The path shared/logprobs.py had before packing: one padded forward over [left-padded prompt |
    right-padded completion], the whole [B, T, V] log-softmax, then a gather. Kept here as the reference."""
    batch = len(prompt_ids)
    prompt_width = max(len(p) for p in prompt_ids)
    completion_width = max((len(c) for c in completion_ids), default=0)
    ids = torch.full((batch, prompt_width + completion_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        ids[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        attention[row, prompt_width - len(prompt) : prompt_width] = 1
        if completion:
            ids[row, prompt_width : prompt_width + len(completion)] = torch.tensor(completion)
            attention[row, prompt_width : prompt_width + len(completion)] = 1
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=completion_width + 1
    ).logits[:, :-1, :]
    logprobs = sampling_logprobs(logits, temperature, top_p, top_k, min_p)
    mask = attention[:, prompt_width:].float()
    token = logprobs.gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1).masked_fill(mask == 0, 0.0)
    with torch.no_grad():
        entropy = torch.special.entr(logprobs.exp()).sum(-1) * mask
    return token, mask, entropy


def rows(vocab: int, seed: int = 0):
    """Prompts and completions of uneven lengths, one completion empty and one a single token."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    lengths = [7, 0, 1, 12, 3, 9]
    completions = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    return prompts, completions


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    out = {}
    for arch in ARCHITECTURES:
        directory = random_model_dir(tmp_path_factory.mktemp(arch), arch, tie_word_embeddings=arch == "qwen3")
        out[arch] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return out


@pytest.mark.parametrize("one_bin", [False, True])
@pytest.mark.parametrize("sampling", [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (0.8, 0.95, 7, 0.02)])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_chunked_logprobs_equal_the_padded_reference(models, arch, sampling, one_bin, monkeypatch):
    model = models[arch]
    if one_bin:  # as for a varlen kernel: every row in one sequence, told apart by the position ids alone
        monkeypatch.setattr(shared.logprobs, "VARLEN_ATTENTION", {model.config._attn_implementation})
    # A chunk of 4 tokens: the rows cross chunk boundaries everywhere.
    monkeypatch.setattr(shared.logprobs, "HEAD_CHUNK_BYTES", 4 * 4 * model.config.vocab_size)
    prompts, completions = rows(model.config.vocab_size)
    temperature, top_p, top_k, min_p = sampling
    weights = torch.randn(len(prompts), max(len(c) for c in completions), generator=torch.Generator().manual_seed(1))

    model.zero_grad()
    ref, ref_mask, ref_entropy = reference_logprobs(model, prompts, completions, 0, temperature, top_p, top_k, min_p)
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    got, mask, entropy = completion_logprobs_and_entropy(model, prompts, completions, temperature, top_p, top_k, min_p)
    (got * weights).sum().backward()

    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=2e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not entropy.requires_grad
    # The head is the model's own again.
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)


def test_the_head_sees_one_chunk_of_tokens_at_a_time(models, monkeypatch):
    model = models["qwen2"]
    vocab = model.config.vocab_size
    monkeypatch.setattr(shared.logprobs, "HEAD_CHUNK_BYTES", 5 * 4 * vocab)
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    try:
        prompts, completions = rows(vocab)
        logprobs, mask = completion_logprobs(model, prompts, completions)
        logprobs.sum().backward()
    finally:
        hook.remove()
    tokens = sum(len(c) for c in completions)
    assert max(seen) == 5
    # Forward once and once more in backward: the logits were not kept.
    assert sum(seen) == 2 * tokens
    assert int(mask.sum()) == tokens


def test_packing_puts_each_row_at_its_own_positions():
    prompts, completions = [[5, 6], [7], [8, 9, 10], [11]], [[1, 2, 3], [], [4], [12, 13]]
    one = pack_rows(prompts, completions)
    # Longest first: row 0 (5 tokens), row 2 (3), row 3 (2); the last completion token of each is left out.
    assert one.input_ids.tolist() == [[5, 6, 1, 2, 8, 9, 10, 11, 12]]
    assert one.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    # The last prompt token predicts the first completion token.
    assert one.keep.tolist() == [1, 2, 3, 6, 7, 8]
    assert one.targets.tolist() == [1, 2, 3, 4, 12, 13]
    assert one.slots.tolist() == [0, 1, 2, 6, 9, 10]
    assert (one.rows, one.width) == (4, 3)
    # Bins of the longest row (4 tokens): rows 2 (3 tokens) and 3 (2) do not fit one; tails padded from 0.
    binned = pack_rows(prompts, completions, 0)
    assert binned.input_ids.tolist() == [[5, 6, 1, 2], [8, 9, 10, 0], [11, 12, 0, 0]]
    assert binned.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert binned.keep.tolist() == [1, 2, 3, 6, 8, 9]
    assert binned.targets.tolist() == [1, 2, 3, 4, 12, 13]
    # Bins of 6: row 3 fills the room row 0 left.
    wide = pack_rows(prompts, completions, 6)
    assert wide.input_ids.tolist() == [[5, 6, 1, 2, 11, 12], [8, 9, 10, 0, 0, 0]]
    assert wide.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert wide.keep.tolist() == [1, 2, 3, 4, 5, 8]
    assert wide.targets.tolist() == [1, 2, 3, 12, 13, 4]
    assert wide.slots.tolist() == [0, 1, 2, 9, 10, 6]
    with pytest.raises(ValueError, match="empty prompt"):
        pack_rows([[]], [[1]])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack_rows([[1], [2]], [[1]])


def test_unscored_tokens_are_context_only():
    """A tool-using row's environment tokens stay in the sequence (later tokens attend to them) but are no target."""
    prompts, completions = [[5, 6], [7]], [[1, 2, 3, 4], [8, 9]]
    scored = [[True, False, False, True], None]
    packed = pack_rows(prompts, completions, None, scored)
    assert packed.input_ids.tolist() == pack_rows(prompts, completions).input_ids.tolist()
    assert packed.input_ids.tolist() == [[5, 6, 1, 2, 3, 7, 8]]
    assert packed.keep.tolist() == [1, 4, 5, 6]  # 6 predicts 1 and 3 predicts 4; row 1 whole
    assert packed.targets.tolist() == [1, 4, 8, 9]
    assert packed.slots.tolist() == [0, 3, 4, 5]
    with pytest.raises(ValueError, match="each row's completion positions"):
        pack_rows(prompts, completions, None, [[True], None])


@pytest.mark.parametrize("arch", ["qwen2"])
def test_scored_positions_are_the_reference_on_the_whole_sequence(models, arch):
    """Log-probs, power sums and entropy at the scored positions are those of the whole sequence; the others are 0
    and out of the mask, with no -inf (top-p puts unlikely environment tokens outside the nucleus)."""
    from shared.logprobs import completion_logprobs_and_power_sums

    model = models[arch]
    prompts, completions = rows(model.config.vocab_size, seed=3)
    rng = random.Random(4)
    scored = [[rng.random() < 0.6 for _ in c] if i % 2 else None for i, c in enumerate(completions)]
    ref, ref_mask, ref_entropy = reference_logprobs(model, prompts, completions, 0, 0.8, 0.5)
    want = ref_mask.clone()
    for row, picks in enumerate(scored):
        if picks is not None:
            want[row, : len(picks)] = torch.tensor(picks, dtype=torch.float32)
    with torch.no_grad():
        got, mask, entropy = completion_logprobs_and_entropy(model, prompts, completions, 0.8, 0.5, scored=scored)
        sums_lp, sums_mask, sums = completion_logprobs_and_power_sums(
            model, prompts, completions, (2.0,), 0.8, 0.5, scored=scored
        )
        whole, _, whole_sums = completion_logprobs_and_power_sums(model, prompts, completions, (2.0,), 0.8, 0.5)
    assert torch.equal(mask, want) and torch.equal(sums_mask, want) and 0 < want.sum() < ref_mask.sum()
    on = want > 0
    torch.testing.assert_close(got, torch.where(on, ref, 0.0), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, torch.where(on, ref_entropy, 0.0), rtol=0, atol=2e-5)
    torch.testing.assert_close(sums_lp, got, rtol=0, atol=0)
    torch.testing.assert_close(sums, torch.where(on.unsqueeze(-1), whole_sums, 0.0), rtol=0, atol=2e-5)
    assert (got[~on] == 0.0).all() and not torch.isfinite(whole[(ref_mask > 0) & ~on]).all()


def test_only_empty_completions_need_no_forward(models):
    logprobs, mask = completion_logprobs(models["llama"], [[1, 2], [3]], [[], []])
    assert logprobs.shape == mask.shape == (2, 0)


def test_a_model_that_rewrites_its_logits_is_refused(models):
    model = models["qwen2"]
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            completion_logprobs(model, [[1, 2]], [[3]])
    finally:
        model.config.final_logit_softcapping = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_bf16_logprobs_on_a_gpu_are_within_the_audit_tolerance(models):
    from hub.config import TrustConfig

    model = models["qwen3"].to("cuda")
    prompts, completions = rows(model.config.vocab_size)
    with torch.no_grad():
        ref, mask, _ = reference_logprobs(model, prompts, completions, 0, 0.7, 0.9)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, got_mask = completion_logprobs(model, prompts, completions, 0.7, 0.9)
    model.to("cpu")
    assert torch.equal(got_mask.cpu(), mask.cpu())
    gap = ((got - ref).abs() * mask).sum() / mask.sum()
    assert float(gap) <= TrustConfig().mean_abs_gap("bfloat16")
