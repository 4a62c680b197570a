"""Data checks at load: a prompt the tokenizer loses characters of, a prompt that leaves no room in the model's
context for max_new_tokens, or a max_new_tokens past the context is one line with the numbers, exit 2,
before anything is written; --allow-lossy-prompts turns the first into one warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hub.training.tasks import lossy_prompts, max_new_tokens_past_context, overlong_prompts, prompt_readings, prompts_past
from shared.default_model import DEFAULT_MODEL_RECIPE, build_tokenizer
from shared.tasks.base import Prompt
from testbed.harness import start_hub
from tests.test_first_contact import assert_one_line_mistake, run, snapshot_of

LOSSY = "What is 12 + 13? Answer:"  # W, ?, A and : are outside the default model's vocabulary
CONTEXT = DEFAULT_MODEL_RECIPE.max_position_embeddings  # 64
DEFAULT_MAX_NEW_TOKENS = 10


def dataset(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def prompts_of(*texts: str) -> list[Prompt]:
    return [Prompt(id=f"row-{i}", text=t) for i, t in enumerate(texts, start=1)]


# -- the check functions ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_prompt_readings_count_tokens_as_engines_do_and_decode_what_the_model_sees(tokenizer) -> None:
    texts = ["what is 1 + 1 =", LOSSY, "a\nb"]
    lengths, seen = prompt_readings(texts, tokenizer)
    assert lengths == [len(ids) for ids in tokenizer(texts)["input_ids"]] == [15, 20, 2]
    assert seen == ["what is 1 + 1 =", "hat is 12 + 13 nswer", "ab"]
    assert prompt_readings([], tokenizer) == ([], [])


def test_lossy_prompts_name_the_count_the_characters_and_an_example() -> None:
    prompts = prompts_of("fine", LOSSY, "also fine", "a\nb")
    assert lossy_prompts(prompts, ["fine", "hat is 12 + 13 nswer", "also fine", "a\nb"]) == (
        "1 of 4 prompts lose characters to the tokenizer (lost: 'W', '?', 'A', ':'), "
        "e.g. row-2 'What is 12 + 13? Answer:' -> 'hat is 12 + 13 nswer'"
    )
    assert lossy_prompts(prompts[:1], ["fine"]) is None
    # A long prompt is shown around its first lost character; a newline is shown escaped (one line).
    long = "x" * 100 + "\nY" + "z" * 100
    line = lossy_prompts(prompts_of(long), ["x" * 100 + "z" * 100])
    assert "'\\n', 'Y'" in line and "'…" + "x" * 20 + "\\nYzzz" in line and "\n" not in line and len(line) < 300


def test_overlong_prompts_name_the_longest_its_length_the_context_and_max_new_tokens() -> None:
    prompts = prompts_of("a", "b", "c")
    assert overlong_prompts(prompts, [10, 54, 20], context=64, max_new_tokens=10) is None  # 54 + 10 fits exactly
    assert overlong_prompts(prompts, [60, 55, 3], context=64, max_new_tokens=10) == (
        "2 of 3 prompts leave no room for --max-new-tokens 10 in the model's context of 64 tokens (at most 54 prompt "
        "tokens), e.g. row-1 with 60 tokens: shorten or drop them, or lower --max-new-tokens"
    )


def test_prompts_past_max_prompt_length_name_the_count_and_the_longest() -> None:
    prompts = prompts_of("a", "b", "c")
    assert prompts_past(prompts, [10, 12, 3], 12) is None
    assert prompts_past(prompts, [13, 20, 3], 12) == (
        "2 of 3 prompts are longer than --max-prompt-length 12 tokens, e.g. row-2 with 20 tokens: shorten or drop "
        "them, or raise --max-prompt-length"
    )


def test_a_prompt_past_max_prompt_length_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = dataset(tmp_path / "rows.jsonl", ["what is 1 + 1 =", "a" * 30])
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        start(tmp_path, "--task", str(path), "--max-prompt-length", "20"),
        f"--task {path}",
        "1 of 2 prompts are longer than --max-prompt-length 20 tokens",
        "row-2 with 3",
    )
    assert snapshot_of(tmp_path) == before


def test_max_new_tokens_past_the_context_names_what_would_fit() -> None:
    assert max_new_tokens_past_context(63, context=64, longest=8) is None  # the prompts' own check covers 8 + 63
    assert max_new_tokens_past_context(100, context=64, longest=8) == (
        "--max-new-tokens 100 is past the model's context of 64 tokens (max_position_embeddings), which holds the "
        "prompt and the completion together; pass at most 56 (the longest prompt has 8 tokens)"
    )
    assert max_new_tokens_past_context(64, context=64, longest=70).endswith(
        "; the longest prompt alone has 70 tokens: shorten the prompts too"
    )


# -- through `echo-hub start` -----------------------------------------------------------------------------


def start(tmp_path: Path, *args: str):
    return run("hub.cli", "start", "--local-nodes", "0", "--data-dir", str(tmp_path / "data"), "--reward", "exact", *args)


def test_a_prompt_the_tokenizer_loses_characters_of_is_refused_with_the_count_and_an_example(tmp_path: Path) -> None:
    path = dataset(tmp_path / "rows.jsonl", ["what is 1 + 1 =", LOSSY, "what is 2 + 2 ="])
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        start(tmp_path, "--task", str(path)),
        f"--task {path}",
        "1 of 3 prompts lose characters to the tokenizer",
        "row-2 'What is 12 + 13? Answer:' -> 'hat is 12 + 13 nswer'",
        "fix the data or pass --allow-lossy-prompts",
    )
    assert snapshot_of(tmp_path) == before


def test_a_lossy_held_out_task_is_refused_too(tmp_path: Path) -> None:
    train = dataset(tmp_path / "train.jsonl", ["what is 1 + 1 =", "what is 2 + 2 ="])
    held = dataset(tmp_path / "held.jsonl", [LOSSY])
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        start(tmp_path, "--task", str(train), "--eval-every", "5", "--eval-task", str(held)),
        f"--eval-task {held}",
        "1 of 1 prompts lose characters",
        "--allow-lossy-prompts",
    )
    assert snapshot_of(tmp_path) == before


def test_a_prompt_longer_than_the_context_minus_max_new_tokens_is_refused_with_the_numbers(tmp_path: Path) -> None:
    path = dataset(tmp_path / "rows.jsonl", ["what is 1 + 1 =", "a" * 60])
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        start(tmp_path, "--task", str(path)),
        f"--task {path}",
        "1 of 2 prompts",
        f"--max-new-tokens {DEFAULT_MAX_NEW_TOKENS}",
        f"context of {CONTEXT} tokens",
        "row-2 with 60 tokens",
    )
    assert snapshot_of(tmp_path) == before


def test_max_new_tokens_past_the_context_is_refused_with_the_numbers(tmp_path: Path) -> None:
    before = snapshot_of(tmp_path)
    line = assert_one_line_mistake(
        start(tmp_path, "--max-new-tokens", "100"), "--max-new-tokens 100", f"context of {CONTEXT} tokens", "pass at most"
    )
    assert "--task" not in line and snapshot_of(tmp_path) == before


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_allow_lossy_prompts_warns_once_and_the_run_goes_on(tmp_path: Path) -> None:
    path = dataset(tmp_path / "rows.jsonl", ["what is 1 + 1 =", LOSSY, "what is 2 + 2 ="])
    hub = start_hub(
        tmp_path / "data", "--local-nodes", "0", "--steps", "0", "--task", str(path), "--reward", "exact", "--allow-lossy-prompts"
    )
    try:
        output = hub.output()
        assert output.count("lose characters to the tokenizer") == 1, output
        assert "warning" in output and "'What is 12 + 13? Answer:' -> 'hat is 12 + 13 nswer'" in output
    finally:
        code = hub.stop()
        assert code in (0, 130), hub.output()[-8000:]  # a hung stop dumps its threads' stacks there
