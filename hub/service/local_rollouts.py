"""In-process stand-in for remote rollout nodes: installs published snapshots, generates, scores, buffers.

It behaves like a node seen from the hub: it only ever holds a published snapshot (optionally
delivered `install_delay_s` late, to emulate broadcast time T_bcast and so staleness), it
makes no group older than the learner can use (like a lease's min_version), and its groups
go through the same path as submissions: hub-side reward, a committed accepted store row,
then the buffer (a buffer refusal is recorded on the row, never silent), all by the intake. A reward that
fails (shared.tasks.base.RewardError) ends it, and the run with it.

The engine is passed in (hub/ does not import node/): anything with
install(path: Path, version: int) and generate(prompts, n, sampling) -> list[list[Completion]].
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import trio

from hub.service.state import HubState
from hub.training.loop import SnapshotPublished
from shared.rollout import Completion, Group, SamplingParams
from shared.tasks.base import GroupContext, Prompt, Task, checked_scores


class RolloutEngine(Protocol):
    def install(self, path: Path, version: int) -> None: ...

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[list[Completion]]: ...


class LocalRollouts:
    """Generates groups of `group_size` completions, `prompts_per_batch` prompts per engine call."""

    def __init__(
        self,
        engine: RolloutEngine,
        task: Task,
        sampling: SamplingParams,
        group_size: int,
        state: HubState,
        snapshots: trio.MemoryReceiveChannel[SnapshotPublished],
        min_version: Callable[[], int],
        prompts_per_batch: int = 8,
        max_pending_groups: int = 32,
        install_delay_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.engine = engine
        self.task = task
        self.sampling = sampling
        self.group_size = group_size
        self.state = state
        self.buffer = state.buffer
        self.signal = state.signal
        self.snapshots = snapshots
        self.min_version = min_version
        self.prompts_per_batch = prompts_per_batch
        self.max_pending_groups = max_pending_groups
        self.install_delay_s = install_delay_s
        self.rng = random.Random(seed)
        self._delivered: SnapshotPublished | None = None
        self.installed_version: int | None = None
        self.generated_groups = 0

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive, nursery)
            await self._generate_forever()

    async def _receive(self, nursery: trio.Nursery) -> None:
        async for message in self.snapshots:
            nursery.start_soon(self._deliver_after_delay, message)

    async def _deliver_after_delay(self, message: SnapshotPublished) -> None:
        await trio.sleep(self.install_delay_s)
        if self._delivered is None or message.version > self._delivered.version:
            self._delivered = message
            self.signal.notify()

    def _can_generate(self) -> bool:
        if self._delivered is None or len(self.buffer) >= self.max_pending_groups:
            return False
        return self._delivered.version >= self.min_version()

    async def _generate_forever(self) -> None:
        while True:
            while not self._can_generate():
                await self.signal.wait()
            message = self._delivered
            assert message is not None  # _can_generate says so
            if message.version != self.installed_version:
                await trio.to_thread.run_sync(self.engine.install, message.snapshot.path, message.version)
                self.installed_version = message.version
            prompts = self.task.sample(self.rng, self.prompts_per_batch)
            groups = await trio.to_thread.run_sync(self._generate_and_score, prompts, message.version)
            for group in groups:
                await self.state.intake.record_local_group(group)
                self.generated_groups += 1

    def _generate_and_score(self, prompts: list[Prompt], version: int) -> list[Group]:
        outputs = self.engine.generate([p.text for p in prompts], self.group_size, self.sampling)
        groups = []
        for prompt, completions in zip(prompts, outputs, strict=True):
            if any(c.version != version for c in completions):
                raise RuntimeError(f"engine produced completions of another version than the installed {version}")
            context = GroupContext(tuple(c.token_ids for c in completions), version)
            scores = checked_scores(self.task, prompt, [c.text for c in completions], context)
            groups.append(
                Group(
                    prompt_id=prompt.id,
                    prompt_text=prompt.text,
                    version=version,
                    completions=tuple(completions),
                    rewards=scores.rewards,
                    reward_parts=scores.parts,
                    logged_metrics=scores.metrics,
                    logged_columns=scores.columns,
                )
            )
        return groups
