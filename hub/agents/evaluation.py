"""A tool-using run's held-out rollouts: the same loop as a lease's, with the hub's evaluation model in the node's
place. Each round, the evaluator's own model (hub/training/evaluation.py, in its worker thread) generates a turn for
every rollout not done; the hub's tool loop answers them as it answers a node's (hub/agents/rollouts.py: the sandbox,
its limits, the tools' answers rendered by the chat template), reached from the worker thread through trio; the
environments' rewards are asked at the end. Nothing leaves the hub.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from hub.agents.rollouts import AgentRollouts
from shared.generation import Sampler, TurnCache, reusable_cache
from shared.rollout import Completion, SamplingParams
from shared.tasks.base import Prompt
from shared.tools import rollout_key
from shared.turns import TurnedRollout

_names = itertools.count()


@dataclass(frozen=True)
class HeldOutGroup:
    """One held-out prompt's completions, and each one's environment reward (None: none, or it ended early)."""

    completions: list[Completion]
    environment_rewards: list[float | None]


def tool_groups(
    agents: AgentRollouts,
    sampler: Sampler,
    prompts: Sequence[Prompt],
    n: int,
    sampling: SamplingParams,
    version: int,
    greedy: bool = False,
) -> list[HeldOutGroup]:
    """`n` tool-using rollouts of each of `prompts` by `sampler`'s model at `version`, in prompt order. Blocking: call
    from a worker thread of the hub's trio run."""
    name = f"eval-{version}-{next(_names)}"
    budget = sampling.max_new_tokens
    vocab_size = sampler.model.get_input_embeddings().num_embeddings
    try:
        shown = trio.from_thread.run(agents.open_evaluation, name, prompts, n)
        encoded = sampler.tokenizer([p.text for p in shown])["input_ids"]
        rollouts = [TurnedRollout(p.id, i, list(ids)) for p, ids in zip(prompts, encoded) for i in range(n)]
        kept = TurnCache() if reusable_cache(sampler.model) else None
        for turn in range(agents.tool_use.max_tool_calls + 1):  # the loop ends each rollout by then
            keys = [key for key, r in enumerate(rollouts) if not r.done]
            if not keys:
                break
            active = [rollouts[key] for key in keys]
            seeded = sampling if sampling.seed is None else sampling.model_copy(update={"seed": sampling.seed + turn})
            contexts, budgets = [r.context() for r in active], [budget - len(r.ids) for r in active]
            made = sampler.continue_ids(contexts, budgets, seeded, version, greedy, turns=kept, keys=keys)
            for rollout, made_turn in zip(active, made):
                rollout.add_turn(made_turn)
            turns = [(rollout_key(name, r.prompt_id, r.index), r.last_turn) for r in active]
            for rollout, answer in zip(active, trio.from_thread.run(agents.answer_evaluation, turns)):
                if answer.done:
                    rollout.done = True
                else:
                    rollout.add_environment(answer.env_ids, budget, vocab_size)  # the hub's own answers fit
    finally:
        rewards = trio.from_thread.run(agents.close_evaluation, name)
    decode = functools.partial(sampler.tokenizer.decode, skip_special_tokens=True)
    completions = [r.completion(decode) for r in rollouts]
    keyed = [rewards.get(rollout_key(name, r.prompt_id, r.index)) for r in rollouts]
    return [HeldOutGroup(completions[i * n : (i + 1) * n], keyed[i * n : (i + 1) * n]) for i in range(len(prompts))]
