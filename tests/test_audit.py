"""Log-prob audits against the real tiny model: honest work passes, another model or invented log-probs fail."""

from __future__ import annotations

import random

import pytest
import torch
import trio

from hub.config import AUDIT_GAP_BY_DTYPE, TrustConfig
from hub.records.snapshots import SnapshotShelf
from hub.trust.audit import AuditJob, Auditor, AuditQueue, GapStats, gap_stats, judge
from shared.crypto import Identity
from shared.model_identity import load_model_identity
from shared.model_io import build_snapshot
from shared.rollout import Group, SamplingParams
from shared.snapshot import model_config_hash
from shared.tasks.reverse import ReverseTask
from testbed.models import nudged_model

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10)
GROUPS = 20
N = 8
BASE_VERSION, TRAINED_VERSION = 0, 2


def trained_state_dict(model_dir):
    """The default model after three AdamW steps (lr 3e-4) on reversal examples: a later policy version."""
    model, _ = nudged_model(model_dir)
    return model.state_dict(), model_config_hash(model.config.to_dict())


@pytest.fixture(scope="module")
def world(default_model_dir, tmp_path_factory):
    """A shelf holding the base model as v0 and a trained policy as v2, engines for both, an Auditor."""
    from transformers import AutoModelForCausalLM

    from node.hf_engine import HFEngine

    torch.set_num_threads(1)
    identity = Identity.generate()
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    trained, config_hash = trained_state_dict(default_model_dir)
    shelf = SnapshotShelf(keep=3)
    where = tmp_path_factory.mktemp("snapshots")
    shelf.add(build_snapshot(base.state_dict(), BASE_VERSION, identity, config_hash, where))
    shelf.add(build_snapshot(trained, TRAINED_VERSION, identity, config_hash, where))
    base_engine = HFEngine(default_model_dir, version=BASE_VERSION)
    trained_engine = HFEngine(default_model_dir)
    trained_engine.install(shelf.get(TRAINED_VERSION).path, TRAINED_VERSION)
    auditor = Auditor(load_model_identity(default_model_dir), shelf, SAMPLING, TrustConfig(), "float32")
    prompts = ReverseTask().sample(random.Random(3), GROUPS)
    return {"auditor": auditor, "base": base_engine, "trained": trained_engine, "prompts": prompts, "shelf": shelf}


def generate(engine, prompts, node_id="nodeA", claim_version=None, sampling=SAMPLING) -> list[Group]:
    torch.manual_seed(11)
    out = engine.generate([p.text for p in prompts], N, sampling)
    groups = []
    for prompt, completions in zip(prompts, out):
        if claim_version is not None:
            completions = [c.model_copy(update={"version": claim_version}) for c in completions]
        version = completions[0].version
        groups.append(
            Group(
                prompt_id=prompt.id,
                prompt_text=prompt.text,
                version=version,
                completions=tuple(completions),
                rewards=(0.0,) * N,
                node_id=node_id,
            )
        )
    return groups


def test_gap_stats_and_judge_by_hand():
    reported = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])
    recomputed = torch.tensor([[-0.4, -1.3, -9.0], [-0.1, float("-inf"), float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    stats = gap_stats(reported, recomputed, mask)
    # Real tokens: 4; one (row 1, col 1) outside the nucleus; gaps of the other three: 0.1, 0.3, 0.0.
    assert stats.tokens == 4 and stats.outside_nucleus == 1
    assert stats.mean_abs_gap == pytest.approx(0.4 / 3) and stats.max_abs_gap == pytest.approx(0.3)
    assert not judge(stats, 0.05, 0.5).passed
    assert judge(stats, 0.2, 0.5).passed
    outside = judge(stats, 0.2, 0.2)
    assert not outside.passed and "nucleus" in outside.reason
    assert not judge(GapStats(0.0, 0.0, 0, 0), 0.05, 0.05).passed
    assert not judge(GapStats(float("nan"), 0.0, 3, 0), 0.05, 0.05).passed


def test_honest_groups_pass_with_no_false_rejections(world):
    auditor = world["auditor"]
    for engine, version in ((world["trained"], TRAINED_VERSION), (world["base"], BASE_VERSION)):
        results = [auditor.audit(g, version) for g in generate(engine, world["prompts"])]
        assert [r.reason for r in results if not r.passed] == []
        worst = max(r.mean_abs_gap for r in results)
        assert worst < 1e-4, worst
        assert sum(r.tokens for r in results) > GROUPS * N


def test_wrong_model_fails(world):
    """A node that generates with the base model but claims the trained version is caught on every group."""
    auditor = world["auditor"]
    groups = generate(world["base"], world["prompts"], claim_version=TRAINED_VERSION)
    results = [auditor.audit(g, TRAINED_VERSION) for g in groups]
    assert all(not r.passed for r in results), [r.mean_abs_gap for r in results]
    assert min(r.mean_abs_gap for r in results) > AUDIT_GAP_BY_DTYPE["bfloat16"]


def test_top_k_and_min_p_are_audited_exactly(world, default_model_dir):
    """A hub sampling with top-k and min-p: an honest node's groups pass with fp32-exact log-probs; a node that
    ignores the filters (sampling the wider distribution, reporting its log-probs) is caught on its tokens
    outside them and on its gaps."""
    filtered = SAMPLING.model_copy(update={"top_k": 3, "min_p": 0.1})
    auditor = Auditor(load_model_identity(default_model_dir), world["shelf"], filtered, TrustConfig(), "float32")
    honest = [auditor.audit(g, TRAINED_VERSION) for g in generate(world["trained"], world["prompts"], sampling=filtered)]
    assert [r.reason for r in honest if not r.passed] == [] and max(r.mean_abs_gap for r in honest) < 1e-4
    unfiltered = [auditor.audit(g, TRAINED_VERSION) for g in generate(world["trained"], world["prompts"])]
    assert sum(not r.passed for r in unfiltered) > GROUPS // 2, [r.reason for r in unfiltered]


def test_invented_logprobs_fail(world):
    auditor = world["auditor"]
    rng = random.Random(1)
    honest = generate(world["trained"], world["prompts"][:5])
    for group in honest:
        faked = tuple(
            c.model_copy(update={"logprobs": tuple(min(0.0, lp + rng.uniform(-0.5, 0.5)) for lp in c.logprobs)})
            for c in group.completions
        )
        result = auditor.audit(group.model_copy(update={"completions": faked}), TRAINED_VERSION)
        assert not result.passed and result.mean_abs_gap > 0.05
        # "Every token was certain": the cheapest lie that inflates importance ratios.
        certain = tuple(c.model_copy(update={"logprobs": (0.0,) * len(c.logprobs)}) for c in group.completions)
        assert not auditor.audit(group.model_copy(update={"completions": certain}), TRAINED_VERSION).passed


@pytest.mark.trio
async def test_audit_queue_judges_in_order_and_skips_when_full(world):
    honest = generate(world["trained"], world["prompts"][:2], node_id="honest")
    cheat = generate(world["base"], world["prompts"][2:3], node_id="cheat", claim_version=TRAINED_VERSION)[0]
    gone = honest[1].model_copy(
        update={"version": 1, "completions": tuple(c.model_copy(update={"version": 1}) for c in honest[1].completions)}
    )  # v1 was never on the shelf
    queue = AuditQueue(world["auditor"], capacity=3)
    jobs = [
        AuditJob("honest", "L-h", 1, honest[0], 1.0),
        AuditJob("cheat", "L-c", 2, cheat, 2.0),
        AuditJob("honest", "L-g", 3, gone, 3.0),
    ]
    assert all(queue.offer(job) for job in jobs)
    assert not queue.offer(AuditJob("honest", "L-x", 4, honest[0], 4.0)) and len(queue) == 3  # full: skipped
    with trio.fail_after(30):
        results = [await queue.judge(await queue.next_job()) for _ in jobs]
    assert results[0].passed and not results[1].passed and results[2] is None
    assert results[1].mean_abs_gap > AUDIT_GAP_BY_DTYPE["bfloat16"] and len(queue) == 0


# --- tool-using (multi-turn) completions ------------------------------------------------------------------------------


def sample_tool_group(model, tokenizer, prompt, answer: tuple[int, ...], seed: int) -> Group:
    """N honest tool-using rollouts of v0 (`model`), sampled token by token over the whole sequence as an engine that
    keeps its cache across turns would: three model turns, the tool's `answer` (never sampled, log-prob 0.0) between
    them."""
    from shared.logprobs import sampling_logprobs
    from shared.rollout import Completion

    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    context = tokenizer(prompt.text)["input_ids"]
    completions = []
    with torch.no_grad():
        for _ in range(N):
            ids: list[int] = []
            logprobs: list[float] = []
            spans = []
            for turn in range(3):
                if turn:
                    spans.append((len(ids), len(answer)))
                    ids += answer
                    logprobs += [0.0] * len(answer)
                for _ in range(SAMPLING.max_new_tokens):
                    logits = model(torch.tensor([context + ids])).logits[0, -1:]
                    q = sampling_logprobs(logits, SAMPLING.temperature, SAMPLING.top_p)[0]
                    token = int(torch.multinomial(q.exp(), 1, generator=generator))
                    ids.append(token)
                    logprobs.append(float(q[token]))
                    if token == eos:
                        break
            completions.append(
                Completion(
                    token_ids=tuple(ids),
                    logprobs=tuple(logprobs),
                    finish_reason="stop" if ids[-1] == eos else "length",
                    version=BASE_VERSION,
                    text="",
                    env_spans=tuple(spans),
                )
            )
    return Group(
        prompt_id=prompt.id, prompt_text=prompt.text, version=BASE_VERSION, completions=tuple(completions), rewards=(0.0,) * N
    )


def test_a_tool_using_group_is_audited_on_its_model_tokens_with_the_environment_as_context(world, default_model_dir):
    """The real model re-scores whole multi-turn sequences: honest rollouts pass at fp32 exactness, on their model
    tokens only (whatever their environment positions report); the tool answers are context (audited as if the hub had
    sent other ones, the later turns' log-probs no longer match); a lie on a later turn fails."""
    from transformers import AutoModelForCausalLM

    auditor = world["auditor"]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    answer = tuple(auditor.tokenizer.encode("=42;"))
    groups = [sample_tool_group(model, auditor.tokenizer, p, answer, seed) for seed, p in enumerate(world["prompts"][:2])]
    model_tokens = [sum(len(c.model_token_ids()) for c in g.completions) for g in groups]
    for group, tokens in zip(groups, model_tokens):
        honest = auditor.audit(group, BASE_VERSION)
        assert honest.passed and honest.mean_abs_gap < 1e-4, honest
        assert honest.tokens == tokens < sum(len(c.token_ids) for c in group.completions)
        assert honest.evidence is not None and 0 < honest.evidence.tokens <= tokens
        assert auditor.logprob_sums(group) == pytest.approx([sum(c.logprobs) for c in group.completions], abs=1e-3)

        def at_env(c, value):
            sampled = c.model_positions()
            return c.model_copy(update={"logprobs": tuple(lp if s else value for lp, s in zip(c.logprobs, sampled))})

        garbage = group.model_copy(update={"completions": tuple(at_env(c, -7.5) for c in group.completions)})
        assert auditor.audit(garbage, BASE_VERSION) == honest

        other = tuple(auditor.tokenizer.encode("=17;"))
        elsewhere = group.model_copy(
            update={
                "completions": tuple(
                    c.model_copy(update={"token_ids": tuple(_swap(c.token_ids, c.env_spans, other))}) for c in group.completions
                )
            }
        )
        moved = auditor.audit(elsewhere, BASE_VERSION)
        assert moved.tokens == honest.tokens and moved.mean_abs_gap > 100 * max(honest.mean_abs_gap, 1e-7), moved

        def lie_after_first_turn(c):
            later = [s and i > c.env_spans[0][0] for i, s in enumerate(c.model_positions())]
            return c.model_copy(update={"logprobs": tuple(lp - 0.5 if m else lp for lp, m in zip(c.logprobs, later))})

        lied = group.model_copy(update={"completions": tuple(lie_after_first_turn(c) for c in group.completions)})
        assert not auditor.audit(lied, BASE_VERSION).passed


def _swap(token_ids: tuple[int, ...], spans, replacement: tuple[int, ...]) -> list[int]:
    """token_ids with each environment segment replaced by `replacement` (of the same length)."""
    out = list(token_ids)
    for start, length in spans:
        out[start : start + length] = replacement
    return out
