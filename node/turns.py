"""A multi-turn lease's rollouts on the node (Lease.tools): the model generates a turn for every rollout not done,
the turns go to the hub (TURN_PROTOCOL, many rollouts' in one request), and each rollout appends the tokens the hub
answers with (its tools' or environment's reply, never sampled: log-prob 0.0) and generates again, until the hub
says it is done. The tools run on the hub: a volunteer runs no operator code.

Each turn continues the rollout's whole context (prompt, then its model and environment tokens so far; an engine
that keeps the batch's KV cache from turn to turn runs only what the context gained since) within what
is left of its budget (the lease's max_new_tokens: model and environment tokens together, TRL's
max_completion_length); every turn is sent, the last one too, which the hub answers done. The answer is then one
completion per rollout whose environment segments are marked (Completion.env_spans). A hub whose answers cannot be
followed (a refusal, answers to other rollouts, a token id past the model's, an answer leaving no room for a model
token) costs the lease: it is
not answered, and lapses.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence

import trio

from node.engine import Engine
from shared.messages import Lease, LeasePrompt, Reject, RolloutTurn, TurnReply, TurnRequest, printable_excerpt, turns_per_request
from shared.rollout import Completion, SamplingParams
from shared.turns import AnswerRefused, TurnedRollout

# Sends one request of turns to the hub: its reply or its refusal.
SendTurns = Callable[[TurnRequest], Awaitable[TurnReply | Reject]]
REFUSAL_CHARS = 200


class TurnsBroken(Exception):
    """The hub's answers to a lease's turns cannot be followed: the lease is not answered."""


async def multi_turn_groups(
    lease: Lease, prompts: Sequence[LeasePrompt], engine: Engine, send: SendTurns, sampling_of: Callable[[int], SamplingParams]
) -> list[list[Completion]]:
    """`prompts`' groups (of `lease`, in order) generated turn by turn with the hub; `sampling_of(turn)`: the
    sampling of each round of turns (a seeded lease's seed moves on each round). The caller holds the engine
    for the whole of it: a rollout's turns are one version's. TurnsBroken when the hub cannot be followed."""
    assert lease.tools is not None, "a multi-turn lease"
    budget = lease.sampling.max_new_tokens
    encoded = await trio.to_thread.run_sync(lambda: engine.tokenizer([p.text for p in prompts])["input_ids"])
    rollouts = [TurnedRollout(p.prompt_id, i, list(ids)) for p, ids in zip(prompts, encoded) for i in range(lease.group_size)]
    kept = engine.turn_cache()  # this batch's KV cache, from one turn to the next (an HF engine's)
    for turn in range(lease.tools.max_tool_calls + 1):  # the hub ends each rollout by then
        keys = [key for key, r in enumerate(rollouts) if not r.done]  # positions: a hub's prompt ids may repeat
        if not keys:
            break
        active = [rollouts[key] for key in keys]
        made = await trio.to_thread.run_sync(
            functools.partial(
                engine.generate_turns,
                [r.context() for r in active],
                [budget - len(r.ids) for r in active],
                sampling_of(turn),
                kept=kept,
                keys=keys,
            )
        )
        for rollout, made_turn in zip(active, made):
            rollout.add_turn(made_turn)
        await _exchange(lease.lease_id, active, send, budget, engine.vocab_size)
    if any(not r.done for r in rollouts):
        raise TurnsBroken(f"the hub did not end the rollouts within {lease.tools.max_tool_calls} tool calls")
    decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=True)
    completions = await trio.to_thread.run_sync(lambda: [r.completion(decode) for r in rollouts])  # decoding: off the loop
    n = lease.group_size
    return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


async def _exchange(lease_id: str, active: Sequence[TurnedRollout], send: SendTurns, budget: int, vocab_size: int) -> None:
    """Send the active rollouts' last turns, as many in one request as the hub takes, and follow its answers."""
    step = turns_per_request(budget)
    for start in range(0, len(active), step):
        batch = active[start : start + step]
        request = TurnRequest(
            lease_id=lease_id,
            turns=tuple(RolloutTurn(prompt_id=r.prompt_id, index=r.index, token_ids=r.last_turn) for r in batch),
        )
        reply = await send(request)
        if isinstance(reply, Reject):
            raise TurnsBroken(f"the hub refused the turns: {printable_excerpt(reply.reason, REFUSAL_CHARS)}")
        if [(a.prompt_id, a.index) for a in reply.answers] != [(r.prompt_id, r.index) for r in batch]:
            raise TurnsBroken("the hub answered other rollouts than the turns it was sent")
        for rollout, answer in zip(batch, reply.answers):
            if answer.done:
                rollout.done = True
            else:
                try:
                    rollout.add_environment(answer.env_ids, budget, vocab_size)
                except AnswerRefused as exc:
                    raise TurnsBroken(f"the hub's answer cannot be followed: {exc}") from None
