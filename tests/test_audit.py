"""Log-prob audits against the real tiny model: honest work passes, another model or invented log-probs fail."""

from __future__ import annotations

import random
import time

import pytest
import torch
import trio

from hub.audit import (
    AuditJob,
    Auditor,
    AuditQueue,
    GapStats,
    audit_due,
    gap_stats,
    judge,
    penalize,
)
from hub.buffer import ReplayBuffer
from hub.config import TrustConfig
from hub.fleet import NodeRecord
from hub.snapshots import SnapshotShelf
from hub.store import Store
from hub.submissions import GroupVerdict
from shared.crypto import Identity
from shared.messages import SubmittedGroup
from shared.rollout import Group, SamplingParams
from shared.snapshot import build_snapshot, model_config_hash
from shared.tasks.reverse import ReverseTask
from tests.models import nudged_model

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10)
GROUPS = 20
N = 8
BASE_VERSION, TRAINED_VERSION = 0, 2


def trained_state_dict(model_dir):
    """The default model after three AdamW steps (lr 3e-4) on reversal examples: a later policy version."""
    model, _ = nudged_model(model_dir)
    return model.state_dict(), model_config_hash(model.config.to_dict())


@pytest.fixture(scope="module")
def world(default_model_dir):
    """A shelf holding the base model as v0 and a trained policy as v2, engines for both, an Auditor."""
    from transformers import AutoModelForCausalLM

    from node.hf_engine import HFEngine

    torch.set_num_threads(1)
    identity = Identity.generate()
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    trained, config_hash = trained_state_dict(default_model_dir)
    shelf = SnapshotShelf(keep=3)
    shelf.add(build_snapshot(base.state_dict(), BASE_VERSION, identity, config_hash))
    shelf.add(build_snapshot(trained, TRAINED_VERSION, identity, config_hash))
    base_engine = HFEngine(default_model_dir, version=BASE_VERSION)
    trained_engine = HFEngine(default_model_dir)
    trained_engine.install(shelf.get(TRAINED_VERSION).data, TRAINED_VERSION)
    auditor = Auditor(default_model_dir, shelf, SAMPLING, TrustConfig())
    prompts = ReverseTask().sample(random.Random(3), GROUPS)
    return {"auditor": auditor, "base": base_engine, "trained": trained_engine, "prompts": prompts, "shelf": shelf}


def generate(engine, prompts, node_id="nodeA", claim_version=None) -> list[Group]:
    torch.manual_seed(11)
    out = engine.generate([p.text for p in prompts], N, SAMPLING)
    groups = []
    for prompt, completions in zip(prompts, out):
        if claim_version is not None:
            completions = [c.model_copy(update={"version": claim_version}) for c in completions]
        version = completions[0].version
        groups.append(Group(prompt_id=prompt.id, prompt_text=prompt.text, version=version,
                            completions=tuple(completions), rewards=(0.0,) * N, node_id=node_id))
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


def test_audit_due_first_n_then_rate():
    rng = random.Random(0)
    assert all(audit_due(k, rng, 0.05, 10) for k in range(10) for _ in range(50))
    draws = sum(audit_due(10, rng, 0.05, 10) for _ in range(20_000))
    assert 0.04 < draws / 20_000 < 0.06
    assert not any(audit_due(99, rng, 0.0, 10) for _ in range(1000))


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
    assert min(r.mean_abs_gap for r in results) > TrustConfig().audit_mean_abs_gap


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


def record(peer_id: str, audits_passed: int = 0) -> NodeRecord:
    return NodeRecord(peer_id=peer_id, price_per_hour=0.35, link_bps=1e8, backend="hf", hardware="cpu",
                      listen_addrs=(), remote_ip="10.0.0.1", joined_at=0.0, last_seen=0.0, audits_passed=audits_passed)


@pytest.mark.trio
async def test_audit_queue_reports_pass_and_fail(world):
    honest = generate(world["trained"], world["prompts"][:3], node_id="honest")
    cheat = generate(world["base"], world["prompts"][3:6], node_id="cheat", claim_version=TRAINED_VERSION)
    passed: list[str] = []
    failed: list[tuple[str, str]] = []

    async def on_pass(node_id: str) -> None:
        passed.append(node_id)

    async def on_fail(node_id: str, reason: str) -> None:
        failed.append((node_id, reason))

    queue = AuditQueue(world["auditor"], on_pass, on_fail, capacity=5)
    rng = random.Random(0)
    # A new node is audited on every submission; the group is picked after the submission is in.
    assert queue.sample(record("honest"), "L-h1", [(honest[0], 1), (honest[1], 2)], rng)
    assert queue.offer(AuditJob("cheat", "L-c1", 3, cheat[0]))
    assert queue.offer(AuditJob("cheat", "L-c2", 4, cheat[1]))  # dropped: cheat is already failed by then
    assert queue.offer(AuditJob("honest", "L-h2", 5, honest[2]))
    gone = honest[2].model_copy(update={"version": 1, "completions": tuple(
        c.model_copy(update={"version": 1}) for c in honest[2].completions)})
    assert queue.offer(AuditJob("honest", "L-h3", 6, gone))  # v1 was never on the shelf
    assert not queue.offer(AuditJob("honest", "L-h4", 7, honest[0]))  # full
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        with trio.fail_after(30):
            while queue.counters().pending or queue.audited + queue.unavailable < 3:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert passed == ["honest", "honest"]
    assert [n for n, _ in failed] == ["cheat"] and failed[0][1].startswith(f"v{TRAINED_VERSION} group")
    assert queue.vouched_lease == {"honest": "L-h2"}
    c = queue.counters()
    assert (c.offered, c.skipped_full, c.audited, c.passed, c.failed, c.unavailable) == (6, 1, 3, 2, 1, 1)
    # A trusted node is audited at the configured rate only.
    trusted = record("t", audits_passed=10)
    picks = sum(queue.auditor.should_audit(trusted, rng) for _ in range(4000))
    assert 0.03 < picks / 4000 < 0.07


def verdict(group: Group) -> GroupVerdict:
    submitted = SubmittedGroup(prompt_id=group.prompt_id, completions=group.completions)
    return GroupVerdict(group.prompt_id, True, "", submitted, group)


@pytest.mark.trio
async def test_penalize_drops_unconsumed_work_and_voids_pay_after_last_pass(tmp_path, world):
    store = Store(tmp_path / "hub.db")
    buffer = ReplayBuffer(capacity_groups=100, staleness=4, skip_zero_variance=False)
    groups = generate(world["trained"], world["prompts"][:4], node_id="cheat")
    other = generate(world["trained"], world["prompts"][4:5], node_id="honest")[0]
    store.upsert_node("cheat", 0.35, "cpu", 1e8, "hf")
    store.upsert_node("honest", 0.35, "cpu", 1e8, "hf")
    row_ids = []
    for i, group in enumerate(groups):
        lease = f"L{i}"
        store.add_lease(lease, "cheat", [group.prompt_id], 0, time.time() + 60)
        row_ids += store.record_submission(lease, "cheat", [verdict(group)], usd=0.01, seconds=1.0, signed_bytes_hash="h")
        await trio.sleep(0.01)
    store.add_lease("LH", "honest", [other.prompt_id], 0, time.time() + 60)
    honest_row = store.record_submission("LH", "honest", [verdict(other)], usd=0.02, seconds=1.0, signed_bytes_hash="h")[0]
    for group, row_id in zip(groups[1:], row_ids[1:]):  # rows[0] was trained on already
        assert buffer.add(group, row_id).accepted
    assert buffer.add(other, honest_row).accepted

    penalty = await penalize(store, buffer, "cheat", vouched_lease_id="L1", reason="banned: audit failed")
    assert set(penalty.dropped_row_ids) == set(row_ids[1:])
    assert buffer.row_ids() == [honest_row]
    rows = {r.id: r for r in store.trajectories()}
    assert all(rows[i].discard_reason == "banned: audit failed" for i in row_ids[1:])
    assert rows[row_ids[0]].discard_reason is None and rows[honest_row].discard_reason is None
    # Pay for leases L0 and L1 (up to the audited one) stays; L2 and L3 are voided; others untouched.
    assert penalty.voided_ledger_rows == 2
    assert store.ledger_total_usd("cheat") == pytest.approx(0.02)
    assert store.ledger_total_usd("honest") == pytest.approx(0.02)
    assert store.ledger_by_node_usd() == pytest.approx({"cheat": 0.02, "honest": 0.02})
    # Never vouched: everything it was paid is voided.
    assert store.void_ledger_after("cheat", 0.0) == 2 and store.ledger_total_usd("cheat") == 0.0
    assert store.integrity_check() == "ok"
    with pytest.raises(ValueError, match="node_id"):
        buffer.drop_node("")
    store.close()
