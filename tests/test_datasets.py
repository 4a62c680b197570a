"""Datasets as RL users bring them: JSONL, Parquet and save_to_disk directories, chosen columns, chat prompts
rendered with the tokenizer's chat template, and rewards as builtins or TRL-style `module:function`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.model_identity import load_model_identity
from shared.tasks import DatasetOptions, load_task
from shared.tasks.base import RewardError, checked_rewards
from shared.tasks.dataset import DatasetTask
from tests.test_first_contact import assert_one_line_mistake, run, snapshot_of

DATA = Path(__file__).parent / "data"
ROWS = [
    {"question": "What is 2+2?", "solution": "4", "target_len": 3},
    {"question": "What is 3*3?", "solution": "9", "target_len": 5},
    {"question": "Half of 1?", "solution": "\\frac{1}{2}", "target_len": 2},
]
COLUMNS = DatasetOptions(prompt_column="question", answer_column="solution")


@pytest.fixture(autouse=True)
def reward_module(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="pyarrow comes with the data extra (pip install 'echo2[data]')")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_file_with_chosen_columns_and_math_reward(tmp_path: Path) -> None:
    task = load_task(str(write_parquet(tmp_path / "train.parquet", ROWS)), COLUMNS)
    prompts = task.prompts()
    assert [p.id for p in prompts] == ["row-0", "row-1", "row-2"]
    assert [p.text for p in prompts] == [r["question"] for r in ROWS]
    assert task.reward(prompts[0], "so it is \\boxed{4}") == 1.0
    assert task.reward(prompts[2], "the answer is 0.5") == 1.0
    assert task.reward(prompts[1], "\\boxed{8}") == 0.0


def test_numeric_answers_from_parquet(tmp_path: Path) -> None:
    rows = [{"prompt": "2+1?", "answer": 3.0}, {"prompt": "half?", "answer": 0.5}]
    task = load_task(str(write_parquet(tmp_path / "n.parquet", rows)), DatasetOptions(reward="exact"))
    assert [p.answer for p in task.prompts()] == ["3", "0.5"]  # a whole float is its integer
    assert task.reward(task.prompts()[0], "3") == 1.0
    with pytest.raises(ValueError, match="is nan, not an answer"):
        load_task(str(write_parquet(tmp_path / "nan.parquet", [{"prompt": "?", "answer": float("nan")}])))


def test_save_to_disk_directory_and_its_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the datasets package comes with the data extra")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    ds.save_to_disk(str(tmp_path / "ds"))
    task = load_task(str(tmp_path / "ds"), DatasetOptions(prompt_column="question", answer_column="solution", reward="exact"))
    assert len(task.prompts()) == 3 and task.reward(task.prompts()[1], " 9 ") == 1.0
    test = load_task(str(tmp_path / "ds"), DatasetOptions("question", "solution", "exact", split="test"))
    assert [p.text for p in test.prompts()] == ["What is 2+2?"]
    with pytest.raises(ValueError, match="no split 'validation' .*train, test"):
        load_task(str(tmp_path / "ds"), DatasetOptions("question", "solution", "exact", split="validation"))
    # A single Dataset (no splits) works too.
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert len(load_task(str(tmp_path / "single"), COLUMNS).prompts()) == 3


def test_a_split_named_in_the_spec_is_read_for_training_and_for_evaluation(tmp_path: Path, monkeypatch) -> None:
    """`DIR:SPLIT` (`conv_ds:test`) picks a DatasetDict's split wherever a task is named: --task and --eval-task."""
    datasets = pytest.importorskip("datasets", reason="the datasets package comes with the data extra")
    from hub.cli.preflight import checked_tasks
    from hub.config import HubConfig

    ds = tmp_path / "conv_ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(ds)
    )
    options = DatasetOptions("question", "solution", "exact")
    assert [p.text for p in load_task(f"{ds}:test", options).prompts()] == ["What is 2+2?"]
    with pytest.raises(ValueError, match=f"no split 'validation' .*train, test.*or as {ds}:train"):
        load_task(f"{ds}:validation", options)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(ValueError, match="single holds one Dataset .no splits.: it has no split 'test'; name the directory"):
        load_task(f"{tmp_path / 'single'}:test", options)
    # A package directory before the ":" is a module:Class spec, not a dataset and its split.
    package = tmp_path / "pkg_tasks"
    package.mkdir()
    (package / "__init__.py").write_text("from shared.tasks.reverse import ReverseTask as MyTask\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_task("pkg_tasks:MyTask", options)).__name__ == "ReverseTask"
    ds = tmp_path / "disjoint"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[1:]), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(ds))
    config = HubConfig.model_validate(
        {
            "task": f"{ds}:train",
            "dataset": {"prompt_column": "question", "answer_column": "solution", "reward": "exact"},
            "eval": {"every": 1, "task": f"{ds}:test"},
        }
    )
    train, held = checked_tasks(config, None, evaluate=True)
    assert len(train.prompts()) == 2 and held is not None and [p.text for p in held.prompts()] == ["What is 2+2?"]


def test_trl_reward_function_gets_the_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = load_task(str(path), DatasetOptions(prompt_column="question", reward="reward_funcs:length_match"))
    first, second = task.prompts()[:2]
    assert task.reward(first, "abc") == 1.0 and task.reward(first, "abcd") == 0.0
    assert task.reward(second, "abcde") == 1.0
    assert first.id == "row-1"  # JSONL ids are line numbers
    # One call per group, the prompt and the row's columns repeated per completion, as TRL repeats them.
    assert list(task.rewards(second, ["abcde", "ab", "12345"])) == [1.0, 0.0, 1.0]
    assert task.reward_name == "reward_funcs:length_match"


def test_a_trl_reward_function_sees_the_whole_group(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "n": 7}\n')
    task = DatasetTask(path, DatasetOptions(reward="reward_funcs:group_echo"))
    prompt = task.prompts()[0]
    assert checked_rewards(task, prompt, ["x", "yy", "zzz"]) == (3.0, 3.0, 3.0)
    with pytest.raises(RewardError, match="reward reward_funcs:first_only returned 1 value for 3 completions"):
        checked_rewards(DatasetTask(path, DatasetOptions(reward="reward_funcs:first_only")), prompt, ["x", "yy", "zzz"])


def test_chat_prompts_are_rendered_with_the_chat_template(tmp_path: Path, default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tokenizer.save_pretrained(model)
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]}, {"prompt": "plain"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(
        str(path), DatasetOptions(reward="reward_funcs:chat_echo", chat=True), load_model_identity(model).chat_renderer
    )
    chat, plain = task.prompts()
    assert chat.text == "[system]be brief[user]abc[assistant]"
    assert plain.text == "[user]plain[assistant]"  # chat=True renders a string prompt as one user message
    assert task.reward(chat, "abc") == 1.0 and task.reward(chat, "abd") == 0.0
    # A held-out split goes by the messages, not the rendered text (a template may print today's date).
    assert chat.identity != chat.text and json.loads(chat.identity)[1] == {"role": "user", "content": "abc"}
    with pytest.raises(ValueError, match="has no chat template"):
        load_task(
            str(path), DatasetOptions(reward="reward_funcs:chat_echo"), load_model_identity(default_model_dir).chat_renderer
        )


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ([{"q": "a"}], DatasetOptions(), "no column 'prompt' (columns: q); choose one with --prompt-column"),
        ([{"prompt": "a"}], DatasetOptions(), "no column 'answer' (the math reward needs it)"),
        ([{"prompt": "a", "answer": True}], DatasetOptions(), "'answer' must be a non-empty string or a number"),
        ([{"prompt": ["not", "messages"], "answer": "1"}], DatasetOptions(), "list of {'role', 'content'} messages"),
        ([{"prompt": "a", "answer": "1"}], DatasetOptions(reward="reward_funcs:no_kwargs"), "cannot be called as TRL calls"),
        ([{"prompt": "a"}], DatasetOptions(reward="reward_funcs:missing"), "has no attribute 'missing'"),
        ([{"prompt": "a"}], DatasetOptions(reward="reward_funcs"), "expected 'module.path:function'"),
    ],
)
def test_dataset_mistakes_name_the_row_and_the_fix(tmp_path: Path, rows, options, message) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as info:
        DatasetTask(path, options)
    assert message in str(info.value)


def test_a_reward_that_is_not_a_finite_number_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n')
    task = DatasetTask(path, DatasetOptions(reward="reward_funcs:not_finite"))
    with pytest.raises(
        RewardError, match="reward reward_funcs:not_finite returned nan for completion 1 of 2; rewards must be finite numbers"
    ):
        checked_rewards(task, task.prompts()[0], ["x", "y"])


def test_dataset_mistakes_through_the_cli_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "a", "solution": "1"}\n')
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "abc"}], "answer": "cba"}) + "\n")
    before = snapshot_of(tmp_path)
    data = str(tmp_path / "data")
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--task", str(path)), "--task", "no column 'prompt'", "--prompt-column"
    )
    assert_one_line_mistake(
        run(
            "hub.cli",
            "start",
            "--data-dir",
            data,
            "--task",
            str(path),
            "--prompt-column",
            "question",
            "--answer-column",
            "solution",
            "--reward",
            "nosuchmod:f",
        ),
        "--task",
        "cannot import module 'nosuchmod'",
    )
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--task", str(tmp_path / "missing.parquet")), "--task", "no such file"
    )
    # A chat prompt (verl's) with no --model: the embedded default's tokenizer has no chat template, and the line says so.
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--task", str(chat), "--reward", "exact"),
        "the embedded default model's tokenizer",
        "has no chat template",
        "pass --model",
    )
    assert snapshot_of(tmp_path) == before
