"""A tool-using batch's KV cache kept from turn to turn (shared.generation.TurnCache) on a real transformers model:
each turn samples exactly what re-encoding the whole context would, while the model runs only the tokens each row
gained since its last turn; rows that stopped early, ran out of budget or left the batch are handled."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from node.hf_engine import HFEngine
from shared.generation import TurnCache, reusable_cache
from shared.rollout import SamplingParams
from testbed.tool_chat import random_tool_model

# Per row: its prompt, and its budget each turn (rows 0 and 2 differ so that budgets cut some turns short).
PROMPTS = {0: [5, 6, 7], 1: [8], 2: [9, 10, 11, 12, 13], 3: [14, 15]}
BUDGETS = {0: 6, 1: 3, 2: 9, 3: 5}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = HFEngine(random_tool_model(tmp_path_factory.mktemp("tool-model")), seed=3)
    engine.use_stop_ids(range(0, engine.vocab_size, 3))  # a third of the ids: some turns stop early, some run out
    return engine


def drive(engine: HFEngine, kept: TurnCache | None, greedy: bool) -> tuple[list, int]:
    """Three turns of the four rows (row 1 leaves after the first); between turns each row gains an environment
    answer of its own length. What each turn made, and how many token positions the model ran."""
    ran = 0

    def count(_module, args, kwargs):
        nonlocal ran
        ids = kwargs["input_ids"]
        ran += ids.shape[0] * ids.shape[1]

    contexts = {key: list(prompt) for key, prompt in PROMPTS.items()}
    made_by_turn = []
    hook = engine.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        for turn in range(3):
            keys = [key for key in contexts if not (key == 1 and turn > 0)]
            sampling = SamplingParams(max_new_tokens=1, temperature=0.7, top_p=0.9, seed=turn)
            made = engine.sampler.continue_ids(
                [contexts[k] for k in keys],
                [BUDGETS[k] for k in keys],
                sampling,
                0,
                greedy,
                turns=kept,
                keys=keys if kept is not None else None,
            )
            made_by_turn.append({k: m for k, m in zip(keys, made)})
            for key, m in zip(keys, made):
                contexts[key] += list(m.token_ids) + [40 + key] * (key + 1)  # the environment's answer
    finally:
        hook.remove()
    return made_by_turn, ran


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_kept_cache_samples_what_reencoding_samples_and_runs_only_the_new_tokens(engine, greedy):
    again, ran_again = drive(engine, None, greedy)
    kept, ran_kept = drive(engine, TurnCache(), greedy)
    first = again[0].values()
    # The case the masks are for: a turn stopped before its budget (columns past its stop), and one cut by its budget.
    assert any(m.finish_reason == "stop" and len(m.token_ids) < max(BUDGETS.values()) for m in first)
    assert any(m.finish_reason == "length" for m in first)
    for turn_again, turn_kept in zip(again, kept):
        assert turn_again.keys() == turn_kept.keys()
        for key in turn_again:
            assert turn_kept[key].token_ids == turn_again[key].token_ids, (key, turn_again[key], turn_kept[key])
            assert turn_kept[key].logprobs == pytest.approx(turn_again[key].logprobs, abs=1e-5)
            assert turn_kept[key].finish_reason == turn_again[key].finish_reason
    assert ran_kept < ran_again * 0.8, (ran_kept, ran_again)


def test_a_context_that_does_not_extend_its_row_is_refused(engine):
    kept = TurnCache()
    sampling = SamplingParams(max_new_tokens=1)
    made = engine.sampler.continue_ids([[5, 6, 7]], [2], sampling, 0, True, turns=kept, keys=["a"])
    with pytest.raises(ValueError, match="must extend"):
        engine.sampler.continue_ids([[5, 6, 8, *made[0].token_ids, 1]], [2], sampling, 0, True, turns=kept, keys=["a"])
    with pytest.raises(ValueError, match="one key per context"):
        engine.sampler.continue_ids([[5]], [2], sampling, 0, True, turns=TurnCache(), keys=None)


def test_a_sliding_window_model_reencodes_each_turn():
    """A sliding window counts masked columns too: such a model's engine keeps no cache (turn_cache() is None)."""
    from transformers import AutoModelForCausalLM

    def build(config):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1}
    assert reusable_cache(build(Qwen2Config(**small)))
    assert not reusable_cache(build(MistralConfig(**small, sliding_window=16)))


def test_the_engine_keeps_a_cache_for_a_full_attention_model(engine):
    assert isinstance(engine.turn_cache(), TurnCache)
