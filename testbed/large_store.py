"""A hub store with a long history, written through the store's own write methods (bench/resume.py, tests).

`build_large_store` appends what a small fleet and a learner write over `steps` learner steps and `leases`
answered leases, one every `lease_interval_s`: joins, leases, signed submissions (accepted, now and then a
rejected group), pay, passed audits, steps that train on most groups and drop one as stale, and retention
every RETAIN_EVERY_STEPS as the running hub does it. Timestamps are spread over the past so that the history
ends an hour ago (CLOSED_RETAINED_S): a hub started on it may retain all of it. Writes go in batches
(`Store.write_batch`), as the hub's group commit sends them.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hub.records.schema import CLOSED_RETAINED_S, StepRecord
from hub.records.store import Store
from hub.trust.submissions import GroupVerdict
from shared.layout import HUB_STORE_FILE
from shared.messages import GroupReason, SubmittedGroup
from shared.rollout import Completion, Group

LEASE_INTERVAL_S = 0.5
RETAIN_EVERY_STEPS = 1000
AUDIT_EVERY_LEASES = 50  # a node's pay is vouched for by a passed audit this often
REJECT_EVERY_LEASES = 97
STALENESS = 2
BATCH_WRITES = 4096
PROMPTS = 16  # distinct prompts: groups repeat, and are built once (`_verdict`)


@dataclass(frozen=True)
class LargeStore:
    path: Path
    steps: int  # learner steps in the store after the build
    leases: int  # leases written by the build


@functools.lru_cache(maxsize=4096)
def _verdict(prompt_id: str, version: int, group_size: int, accepted: bool) -> GroupVerdict:
    """A group of `group_size` short completions and the hub's verdict on it (the same prompt and version: the same
    group, built once)."""
    completions = tuple(
        Completion(token_ids=(5, 6, 7, 2), logprobs=(-0.1, -0.2, -0.3, -0.4), finish_reason="stop", version=version, text="abc")
        for _ in range(group_size)
    )
    rewards = tuple(float(i % 2) for i in range(group_size))
    group = Group(prompt_id=prompt_id, prompt_text="cba>", version=version, completions=completions, rewards=rewards)
    submitted = SubmittedGroup(prompt_id=prompt_id, completions=completions)
    return GroupVerdict(
        prompt_id,
        accepted,
        "" if accepted else "wrong reward",
        submitted,
        group if accepted else None,
        code=None if accepted else GroupReason.CLAIMED_REWARD,
    )


class _History:
    """The build's clock, pending groups and the writes queued for the next batch: each write is a closure run
    inside `Store.write_batch`, in order, so a step takes the ids of groups written before it in the same batch."""

    def __init__(
        self, store: Store, nodes: list[str], group_size: int, leases: int, lease_prefix: str, interval_s: float
    ) -> None:
        self.store = store
        self.lease_prefix = lease_prefix
        self.nodes = nodes
        self.group_size = group_size
        self.interval_s = interval_s
        self.start = time.time() - leases * interval_s - CLOSED_RETAINED_S
        self.leases = 0
        self.jobs: list[Callable[[], object]] = []
        self.pending: deque[int] = deque()

    def now(self) -> float:
        return self.start + self.leases * self.interval_s

    def queue(self, job: Callable[[], object]) -> None:
        self.jobs.append(job)
        if len(self.jobs) >= BATCH_WRITES:
            self.flush()

    def flush(self) -> None:
        for ok, value in self.store.write_batch(self.jobs):
            if not ok:
                raise value  # type: ignore[misc]
        self.jobs = []

    def lease(self, version: int) -> None:
        """One lease: issued, answered with one group (accepted, or now and then rejected), paid."""
        n, now = self.leases, self.now()
        node = self.nodes[n % len(self.nodes)]
        lease_id, prompt_id = f"{self.lease_prefix}{n}", f"p{n % PROMPTS}"
        accepted = n % REJECT_EVERY_LEASES != 0
        verdict = _verdict(prompt_id, version, self.group_size, accepted)

        def answer() -> None:
            self.store.leases.add_lease(lease_id, node, [prompt_id], version, now - 2.0, now + 60.0)
            ids = self.store.groups.record_submission(lease_id, node, [verdict], 0.0004, 2.0, f"h{n}", now=now)
            if accepted:
                self.pending.extend(ids)
            if (n // len(self.nodes)) % AUDIT_EVERY_LEASES == 0:
                self.store.members.record_audit_pass(node, now)

        self.queue(answer)
        self.leases += 1

    def step(self, step: int) -> None:
        """The learner's step: drops the oldest pending group as stale, trains on the others but the newest, which
        waits in the buffer for the next step."""
        record = StepRecord(
            step=step,
            version=step,
            reward_mean=0.5,
            reward_std=0.5,
            staleness_mean=1.0,
            staleness_max=STALENESS,
            dropped_stale=1,
            t_train_s=0.1,
            t_idle_s=0.0,
            bubble=0.0,
            tokens=64,
            clip_frac=0.0,
            staleness_budget=STALENESS,
            extra={"rollout_reward_mean": 0.5},
        )

        def commit() -> None:
            pending = list(self.pending)
            self.pending = deque(pending[-1:])
            self.store.training.commit_step(record, pending[1:-1], pending[:1])

        self.queue(commit)


def build_large_store(
    data_dir: Path,
    steps: int,
    leases: int,
    *,
    nodes: int = 32,
    group_size: int = 2,
    vouch_needed: bool = True,
    retained: bool = True,
    lease_interval_s: float = LEASE_INTERVAL_S,
) -> LargeStore:
    """Append `steps` steps and `leases` leases of history to DATA_DIR's store (created if missing). `retained`
    False: no retention at the end (tests of retention itself)."""
    store = Store(Path(data_dir) / HUB_STORE_FILE)
    try:
        first = (store.training.latest_step() or 0) + 1
        peers = [f"Synthetic{i + 1:04d}".replace("0", "z") for i in range(nodes)]  # base58, as peer ids are
        for peer in peers:
            store.members.upsert_node(peer, 0.4, "synthetic", 1e9, "hf", state="gone")
        history = _History(store, peers, group_size, leases, f"L{first}-", lease_interval_s)
        for i in range(steps):
            step = first + i
            while history.leases < (i + 1) * leases // steps:
                history.lease(step - 1)
            history.step(step)
            if step % RETAIN_EVERY_STEPS == 0:
                history.queue(functools.partial(store.retain, step - STALENESS, history.now() - CLOSED_RETAINED_S, vouch_needed))
        if retained:  # the hub retains every minute: a store it left behind has little left to retain
            history.queue(
                functools.partial(store.retain, first + steps - 1 - STALENESS, history.now() - CLOSED_RETAINED_S, vouch_needed)
            )
        history.flush()
        store.checkpoint()
        return LargeStore(store.path, first + steps - 1, leases)
    finally:
        store.close()
