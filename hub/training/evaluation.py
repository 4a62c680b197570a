"""Held-out evaluation: the policy of a learner step scored on prompts it never trained on.

`Evaluator` (blocking) holds its own copy of the model in the snapshot dtype (what the nodes
run), generates k completions per held-out prompt with the shared sampler and scores them with
the task's reward. `EvalRunner` (trio) copies the learner's weights between two steps, then
evaluates in a worker thread while the learner goes on: evaluation costs the learner one
weight copy per evaluation, not the generation. At most one evaluation runs at a time; one
that falls due while another runs is skipped and said so in the events.

The hub evaluates itself rather than leasing the work to a volunteer: results must be
trustworthy without audits, and the held-out prompts never leave the hub.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import torch
import trio

from hub.config import EvalConfig
from shared.adapters import LoraSpec, add_adapters, load_adapter_state, model_spec
from shared.generation import Sampler
from shared.logs import for_operator
from shared.messages import EvalPoint
from shared.model_identity import ModelIdentity
from shared.model_io import tied_duplicates
from shared.rollout import Completion, SamplingParams
from shared.tasks.base import GroupContext, Prompt, Task, checked_scores

if TYPE_CHECKING:
    from hub.agents.evaluation import HeldOutGroup

# A tool-using run's held-out rollouts: (sampler, prompts, completions per prompt, sampling, version, greedy) -> one
# group per prompt (hub/agents/evaluation.py).
ToolGroups = Callable[[Sampler, Sequence[Prompt], int, SamplingParams, int, bool], "list[HeldOutGroup]"]

log = logging.getLogger("echo2.hub.eval")

EVAL_BATCH_PROMPTS = 16  # prompts generated per batch (times k completions each)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` solve the prompt: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n} correct={correct} k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def summarize(step: int, rewards: Sequence[Sequence[float]], success_reward: float, seconds: float) -> EvalPoint:
    """Mean reward, pass@1 and pass@k (k = completions per prompt) over per-prompt reward lists."""
    if not rewards or any(len(r) != len(rewards[0]) or not r for r in rewards):
        raise ValueError("every prompt needs the same, non-zero number of rewards")
    k = len(rewards[0])
    solved = [sum(1 for r in row if r >= success_reward) for row in rewards]
    return EvalPoint(
        step=step,
        reward=sum(sum(row) for row in rewards) / (len(rewards) * k),
        pass_at_1=sum(pass_at_k(k, c, 1) for c in solved) / len(rewards),
        pass_at_k=sum(pass_at_k(k, c, k) for c in solved) / len(rewards),
        k=k,
        prompts=len(rewards),
        seconds=seconds,
    )


class Evaluator:
    """A model of its own, the held-out prompts and how to sample them; blocking."""

    def __init__(
        self,
        model_identity: ModelIdentity,
        task: Task,
        cfg: EvalConfig,
        sampling: SamplingParams,
        dtype: str,
        device: str,
        seed: int,
        lora: LoraSpec | None = None,
        tools: ToolGroups | None = None,
    ) -> None:
        """`tools`: a tool-using run's held-out rollouts (hub/agents/evaluation.py's tool_groups, bound to the hub's
        tool loop); None: single-turn."""
        from transformers import AutoModelForCausalLM

        self.task = task
        self.tools = tools
        self.cfg = cfg
        self.prompts = task.prompts()[: cfg.prompts]
        self.greedy = cfg.temperature == 0.0
        update: dict[str, float | int] = {"seed": seed}
        if cfg.temperature:
            update["temperature"] = cfg.temperature
        self.sampling = sampling.model_copy(update=update)
        self.device = torch.device(device)
        model_dir = model_identity.model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        if lora is not None:  # the learner's adapters, the same ones (shared/adapters.py resolves the same targets)
            add_adapters(self.model, lora.rank, lora.alpha, lora.targets)
        # Its own tokenizer: it generates in a worker thread while the learner tokenizes in its own.
        self.sampler = Sampler(self.model, model_identity.tokenizer_copy(), self.device, stop_ids=sorted(model_identity.stop_ids))

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the learner's weights in (a LoRA run's: its adapters; cast to this model's dtype); call between
        learner steps."""
        with torch.no_grad():
            if model_spec(self.model) is not None:
                load_adapter_state(self.model, state)
                return
            # A sharded learner's gathered weights name one of each tied pair, as snapshots do.
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            untied = set(missing) - tied_duplicates(self.model)
            if unexpected or untied:
                raise ValueError(
                    f"learner weights do not fit the evaluation model: missing {sorted(untied)[:5]}, "
                    f"unexpected {sorted(unexpected)[:5]}"
                )

    def evaluate(self, step: int, stop: threading.Event | None = None) -> EvalPoint | None:
        """The evaluation of the weights loaded last; None when `stop` was set (checked between batches)."""
        started = time.perf_counter()
        rewards: list[list[float]] = []
        for i in range(0, len(self.prompts), EVAL_BATCH_PROMPTS):
            if stop is not None and stop.is_set():
                return None
            batch = self.prompts[i : i + EVAL_BATCH_PROMPTS]
            if self.tools is None:
                groups = self.sampler.generate([p.text for p in batch], self.cfg.samples, self.sampling, step, self.greedy)
                extra: list[list[float | None]] = [[None] * len(g) for g in groups]
            else:
                held = self.tools(self.sampler, batch, self.cfg.samples, self.sampling, step, self.greedy)
                groups, extra = [h.completions for h in held], [h.environment_rewards for h in held]
            rewards += [self._scored(step, p, group, more) for p, group, more in zip(batch, groups, extra)]
        return summarize(step, rewards, self.cfg.success_reward, time.perf_counter() - started)

    def _scored(self, step: int, prompt: Prompt, group: list[Completion], environment: list[float | None]) -> list[float]:
        """A group's rewards as the hub scores a node's: the task's, plus each rollout's environment reward (weight 1,
        as TRL adds it; none for a rollout ended early)."""
        context = GroupContext(tuple(c.token_ids for c in group), step, tuple(c.env_spans for c in group))
        scores = checked_scores(self.task, prompt, [c.text for c in group], context).rewards
        return [r + (e or 0.0) for r, e in zip(scores, environment)]


class EvalRunner:
    """Evaluates every `every` steps without stalling the learner; `record` keeps each result.

    Evaluation is optional: one that fails (a reward function raising, memory running out) is logged
    and recorded as an `eval_failed` event, and training goes on. On cancellation (Ctrl-C) the
    evaluation in progress stops at its next batch instead of holding the hub's exit."""

    def __init__(
        self,
        evaluator: Evaluator,
        every: int,
        record: Callable[[EvalPoint], Awaitable[None]],
        event: Callable[[str, str | None, str], Awaitable[None]],
    ) -> None:
        self.evaluator = evaluator
        self.every = every
        self.record = record
        self.event = event
        self.running: int | None = None  # the step being evaluated
        self.done: set[int] = set()  # steps evaluated (or failed): the final one is not repeated
        self._idle = trio.Event()
        self._idle.set()
        self._nursery: trio.Nursery | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[name-defined]
        """Start with `await nursery.start(runner.run)`: start() needs the nursery this opens."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def start(self, step: int, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Evaluate the policy of `step`: `weights` is read now, in a worker thread, before the next step."""
        if self.running is not None:
            await self.event("eval_skipped", None, f"eval of step {step} skipped: the one of step {self.running} still runs")
            return
        try:
            await trio.to_thread.run_sync(lambda: self.evaluator.load_weights(weights()))
        except Exception as exc:  # noqa: BLE001 -- an optional evaluation must not end the run
            await self._failed(step, exc)
            return
        self.running = step
        self._idle = trio.Event()
        assert self._nursery is not None, "start() before run() started"
        self._nursery.start_soon(self._evaluate, step)

    async def _failed(self, step: int, exc: Exception) -> None:
        self.done.add(step)
        log.error("eval of step %d failed", step, exc_info=exc)
        log.warning("the evaluation of step %d failed (%r); training goes on", step, exc, extra=for_operator("eval_failed"))
        await self.event("eval_failed", None, f"step {step}: {exc!r}"[:500])

    async def _evaluate(self, step: int) -> None:
        stop = threading.Event()
        try:
            try:
                # Abandoned on cancel: the thread sees `stop` at its next batch and ends on its own.
                result = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                    self.evaluator.evaluate, step, stop, abandon_on_cancel=True
                )
            except trio.Cancelled:
                stop.set()
                raise
            except Exception as exc:  # noqa: BLE001 -- an optional evaluation must not end the run
                await self._failed(step, exc)
                return
            if result is None:
                return
            log.info(
                "eval step %d: reward %.3f pass@1 %.3f pass@%d %.3f over %d prompts in %.1fs",
                step,
                result.reward,
                result.pass_at_1,
                result.k,
                result.pass_at_k,
                result.prompts,
                result.seconds,
            )
            self.done.add(step)
            with trio.CancelScope(shield=True):  # the store row and the metrics line go together
                await self.record(result)
        finally:
            self.running = None
            self._idle.set()

    async def drain(self) -> None:
        """Wait for the evaluation in progress."""
        await self._idle.wait()

    async def finish(self, step: int, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """At the end of a run: the final policy is evaluated too (when its step was not due, or its
        evaluation was skipped because an earlier one still ran), and the run waits for it."""
        await self.drain()
        if step > 0 and step not in self.done:
            await self.start(step, weights)
            await self.drain()
