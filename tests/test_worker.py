"""The node's worker against hub replies it must act on: scripted, and from a real hub service over libp2p."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from hub.config import HubConfig
from node.client import HubClient
from node.worker import LEASE_MAX_TOKENS, Worker, lease_tokens, prompt_slices
from shared.crypto import Identity
from shared.messages import Lease, LeasePrompt, Reject, RejectCode, SubmitReply
from shared.net import running_host
from shared.rollout import Completion, SamplingParams
from testbed.inproc import PERMISSIVE_TRUST, inproc_hub


class ForgottenBy:
    """A hub client whose hub no longer knows this node (it restarted, or dropped the node as silent)."""

    peer_id = "node"

    def __init__(self) -> None:
        self.asked = 0

    async def lease(self, version_held: int) -> Reject:
        self.asked += 1
        return Reject(code=RejectCode.UNKNOWN_NODE, reason="unknown node: join first")


async def run_until_nudged(client, timeout_s: float) -> Worker:
    """Run a worker on `client` until it nudges its hub link (fails after `timeout_s`)."""
    nudged = trio.Event()
    worker = Worker(
        client,
        engine=None,
        engine_lock=trio.Lock(),
        can_work=lambda: True,
        version_held=lambda: 0,
        max_rollouts_per_s=None,
        on_unknown=nudged.set,
    )
    with trio.fail_after(timeout_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            await nudged.wait()
            nursery.cancel_scope.cancel()
    return worker


@pytest.mark.trio
async def test_a_hub_that_forgot_the_node_makes_the_link_beat_at_once():
    client = ForgottenBy()
    await run_until_nudged(client, timeout_s=5)
    assert client.asked == 1


@pytest.mark.trio
async def test_a_real_hub_that_never_met_the_node_makes_the_link_beat_at_once(tmp_path, default_model_dir):
    async with inproc_hub(tmp_path, default_model_dir, HubConfig(trust=PERMISSIVE_TRUST)) as hub, AsyncExitStack() as stack:
        identity = Identity.generate()
        host, _ = await stack.enter_async_context(running_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
        client = HubClient(host, identity, hub.addr, timeout_s=10)
        await client.connect()  # connected, never joined: the hub answers its lease request UNKNOWN_NODE
        worker = await run_until_nudged(client, timeout_s=20)
    assert worker.stats.leases_done == 0


class InstantEngine:
    """Generates at once: the time a lease takes is the worker's throttle alone."""

    batch_rollouts = None  # a whole lease a call

    def generate(self, texts, n, sampling):
        completion = Completion(token_ids=(5, 6), logprobs=(-0.5, -0.5), finish_reason="stop", version=0, text="ab")
        return [[completion] * n for _ in texts]


class Recorder:
    """A hub client that records when (on trio's clock) each submission came, and with which deadline."""

    peer_id = "node"

    def __init__(self) -> None:
        self.submitted: list[tuple[float, float | None]] = []
        self.answers: list = []

    async def submit(self, submission, deadline=None):
        self.submitted.append((trio.current_time(), deadline))
        self.answers.append(submission)
        return SubmitReply(accepted=len(submission.groups))


@pytest.mark.trio
async def test_a_throttled_worker_takes_as_long_as_its_rate_says(autojump_clock):
    """--max-rollouts-per-s: 3 prompts x 4 completions at 2 rollouts/s take 6 s, on trio's clock (a mock one here,
    so the figure is exact however busy the machine is), and the submission's deadline is the lease's."""
    worker = Worker(
        Recorder(), InstantEngine(), trio.Lock(), can_work=lambda: True, version_held=lambda: 0, max_rollouts_per_s=2.0
    )
    lease = Lease(
        lease_id="l" * 24,
        prompts=tuple(LeasePrompt(prompt_id=f"p{i}", text="abc") for i in range(3)),
        group_size=4,
        sampling=SamplingParams(max_new_tokens=2),
        min_version=0,
        deadline_s=60.0,
    )
    started = trio.current_time()
    reply = await worker.work(lease)
    assert isinstance(reply, SubmitReply) and reply.accepted == 3
    ((at, deadline),) = worker.client.submitted
    assert at - started == 6.0 and deadline == started + 60.0
    assert worker.stats.rollouts_per_s == 2.0 and worker.stats.busy_s == 6.0


class BatchRecorder(InstantEngine):
    """Records the rollouts each engine call was asked for, and answers with each prompt's own text."""

    batch_rollouts = 64  # as HFEngine's

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.seeds: list[int | None] = []

    def generate(self, texts, n, sampling):
        self.batches.append(len(texts) * n)
        self.seeds.append(sampling.seed)
        return [[Completion(token_ids=(5,), logprobs=(-0.5,), finish_reason="stop", version=0, text=t)] * n for t in texts]


def lease_of(prompts: int, group_size: int, max_new_tokens: int, seed: int | None = None) -> Lease:
    return Lease(
        lease_id="l" * 24,
        prompts=tuple(LeasePrompt(prompt_id=f"p{i}", text=f"t{i}") for i in range(prompts)),
        group_size=group_size,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=seed),
        min_version=0,
        deadline_s=60.0,
    )


def test_prompt_slices_by_hand():
    assert prompt_slices(10, 8, 64) == [range(0, 8), range(8, 10)]
    assert prompt_slices(3, 256, 64) == [range(0, 1), range(1, 2), range(2, 3)]  # a group is never split
    assert prompt_slices(0, 8, 64) == []
    assert lease_tokens(lease_of(1024, 256, 256)) == 1024 * 256 * 256 > LEASE_MAX_TOKENS


@pytest.mark.trio
async def test_a_lease_is_generated_in_bounded_batches_in_prompt_order():
    """Issue 65: a lease ran as one batch, so a hub's large lease grew the node's memory with its size."""
    engine = BatchRecorder()
    worker = Worker(Recorder(), engine, trio.Lock(), can_work=lambda: True, version_held=lambda: 0, max_rollouts_per_s=None)
    lease = lease_of(20, 8, 16, seed=7)
    assert isinstance(await worker.work(lease), SubmitReply)
    assert engine.batches == [64, 64, 32]
    assert len(set(engine.seeds)) == 3  # a seeded lease: each slice draws its own numbers, reproducibly
    answered = [(g.prompt_id, g.completions[0].text) for g in worker.client.answers[0].groups]
    assert answered == [(f"p{i}", f"t{i}") for i in range(20)]


@pytest.mark.trio
async def test_a_lease_past_what_the_node_takes_is_not_answered(caplog, autojump_clock):
    """Issue 65: a hostile hub's lease of 1024 prompts x 256 completions x 256 tokens took a node from 446 MB to
    8.35 GB. The node lets such a lease lapse, says why, and generates nothing for it."""
    engine = BatchRecorder()
    worker = Worker(Recorder(), engine, trio.Lock(), can_work=lambda: True, version_held=lambda: 0, max_rollouts_per_s=None)
    assert await worker.work(lease_of(1024, 256, 256)) is None
    assert engine.batches == [] and worker.client.submitted == []
    assert any("more than this node takes" in r.getMessage() for r in caplog.records)
