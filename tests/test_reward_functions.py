"""Rewards as TRL and verl users write them: TRL's full signature (completion_ids, trainer_state), several
functions with weights where None skips a function for a sample, numpy results, verl's compute_score on
verl's parquet layout with nested columns, and each function's mean logged apart; then real runs of both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hub.config import HubConfig
from hub.training.metrics import logged_metric_means, read_completions, read_metrics, reward_means, sample_completions
from shared.config import ConfigError, load_config
from shared.layout import METRICS_FILE
from shared.rollout import Completion, Group
from shared.tasks import DatasetOptions
from shared.tasks.base import GroupContext, RewardError, checked_scores
from shared.tasks.dataset import DatasetTask, column_value
from shared.tasks.rewards import combine_rewards, mean_applied, reward_weights
from tests.test_first_contact import assert_one_line_mistake, run

DATA = Path(__file__).parent / "data"
TRL = "tests.data.trl_rewards"
VERL = "tests.data.verl_score"
ROWS = [
    {"prompt": "abc>", "answer": "cba", "kind": "fixed"},
    {"prompt": "hello>", "answer": "olleh", "kind": "free"},
    {"prompt": "dog>", "answer": "god", "kind": "fixed"},
    {"prompt": "stone>", "answer": "enots", "kind": "free"},
]


def test_weighted_sum_skips_none_as_trl_nansum_does() -> None:
    # Two functions over three completions: weights 1 and 0.5; None contributes nothing.
    parts = [[1.0, None, 0.0], [0.5, 2.0, None]]
    assert combine_rewards(parts, (1.0, 0.5)) == (1.25, 1.0, 0.0)
    assert combine_rewards([[None, 0.25]], (2.0,)) == (0.0, 0.5)  # no function applies: 0.0, as nansum gives
    assert combine_rewards([[0.1] * 2, [0.2] * 2], (-1.0, 3.0)) == pytest.approx((0.5, 0.5))
    assert mean_applied([1.0, None, 0.0]) == 0.5 and mean_applied([None, None]) is None


def test_weights_are_one_each_or_one_per_function() -> None:
    assert reward_weights((), 3) == (1.0, 1.0, 1.0)
    assert reward_weights((0.5, 2), 2) == (0.5, 2.0)
    with pytest.raises(ValueError, match="--reward-weights gives 1 weight for 2 reward functions"):
        reward_weights((1.0,), 2)
    for bad in ("nan", "inf", "1e308"):  # the configuration bounds each weight
        with pytest.raises(ConfigError, match="dataset.reward_weights.0"):
            load_config(HubConfig, None, {"dataset.reward_weights": (float(bad),)})
    assert load_config(HubConfig, None, {"dataset.reward_weights": (-1e6, 1e6)}).dataset.reward_weights == (-1e6, 1e6)


def test_each_reward_mean_over_the_completions_it_applies_to() -> None:
    def group(parts) -> Group:
        completion = Completion(token_ids=(1,), logprobs=(-1.0,), finish_reason="stop", version=0, text="x")
        return Group(
            prompt_id="p", prompt_text="p", version=0, completions=(completion,) * 2, rewards=(0.0, 0.0), reward_parts=parts
        )

    groups = [group((("a", (1.0, None)), ("b", (None, None)))), group((("a", (0.0, 0.5)), ("b", (None, None))))]
    # a: (1 + 0 + 0.5) / 3, std with Bessel's correction as TRL's nanstd; b applied to none: not logged.
    assert reward_means(groups) == {"rewards/a/mean": 0.5, "rewards/a/std": 0.5}
    assert reward_means([group((("a", (1.0, None)),))]) == {"rewards/a/mean": 1.0}  # one value: no std
    assert reward_means([group(())]) == {}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trl_functions_get_token_ids_and_trainer_state_and_combine_by_weight(tmp_path: Path) -> None:
    opts = DatasetOptions(reward=f"{TRL}:reversed_chars,{TRL}:length_gap", reward_weights=(1.0, 0.5))
    task = DatasetTask(jsonl(tmp_path / "rows.jsonl", ROWS), opts)
    fixed, free = task.prompts()[:2]
    assert task.reward_names == ("reversed_chars", "length_gap")
    # "cbx" has 2 of 3 in place; 3 tokens for a 3-letter answer plus EOS is 1 short: -0.1, weighted 0.5.
    scores = checked_scores(task, fixed, ["cbx", "cba"], GroupContext(((5, 6, 7), (5, 6, 7, 8)), version=3))
    assert scores.rewards == pytest.approx((2 / 3 - 0.05, 1.0))
    assert scores.parts == (("reversed_chars", pytest.approx((2 / 3, 1.0))), ("length_gap", (-0.1, 0.0)))
    # On a "free" row length_gap returns None: only reversed_chars counts.
    free_scores = checked_scores(task, free, ["olleh", "oxxxx"], GroupContext(((1,), (1, 2)), version=0))
    assert free_scores.rewards == (1.0, 0.2) and free_scores.parts[1] == ("length_gap", (None, None))


def test_trl_functions_log_metrics_and_columns_and_may_be_async(tmp_path: Path) -> None:
    """TRL's log_metric and log_extra reach a function (an async one too, awaited) and stay with its group: a step
    averages the metric over its groups, and the sample completions carry the column; trainer_state.max_steps is the
    run's --steps."""
    from hub.config import HubConfig
    from hub.training.tasks import load_hub_task
    from hub.training.trackers import _markdown_table

    path = jsonl(tmp_path / "rows.jsonl", ROWS)
    config = HubConfig.model_validate({"steps": 7, "dataset": {"reward": f"{TRL}:reversed_chars,{TRL}:judged"}})
    task = load_hub_task(str(path), config, None)
    first, second = task.prompts()[:2]
    scores = checked_scores(task, first, ["cba", "c b a"], GroupContext(((1,), (2,)), version=1))
    assert scores.rewards == pytest.approx((2.0, 1 / 3)) and scores.parts[1] == ("judged", (1.0, 0.0))
    assert scores.metrics == (("judge/max_steps", 7.0),) and scores.columns == (("verdict", ("tidy", "spaced")),)
    other = checked_scores(task, second, ["x"], GroupContext(((1,),), version=1))
    groups = [
        Group(
            prompt_id=prompt.id,
            prompt_text=prompt.text,
            version=1,
            completions=tuple(
                Completion(token_ids=(1,), logprobs=(-1.0,), finish_reason="stop", version=1, text=text) for text in texts
            ),
            rewards=s.rewards,
            reward_parts=s.parts,
            logged_metrics=s.metrics + (("judge/seen", float(len(texts))),),
            logged_columns=s.columns,
        )
        for prompt, texts, s in ((first, ["cba", "c b a"], scores), (second, ["x"], other))
    ]
    assert logged_metric_means(groups) == {"judge/max_steps": 7.0, "judge/seen": 1.5}
    sampled = sample_completions(groups, 3)
    assert [c.extra for c in sampled] == [{"verdict": "tidy"}, {"verdict": "tidy"}, {"verdict": "spaced"}]
    table = _markdown_table(4, sampled).splitlines()
    assert table[0] == "| step | prompt | completion | reward | version | verdict |" and table[2].endswith("| tidy |")
    with pytest.raises(RewardError, match=r"logs_badly raised ValueError: log_extra\('verdict', ...\) takes one value per"):
        checked_scores(DatasetTask(path, DatasetOptions(reward=f"{TRL}:logs_badly")), first, ["a", "b"])


def test_an_async_judge_keeps_its_client_across_groups(tmp_path: Path) -> None:
    """A client the reward module made once stays usable for every group: the async rewards of a process share one
    living loop, where a loop per call left the client bound to a closed one (every other call failed)."""
    task = DatasetTask(jsonl(tmp_path / "rows.jsonl", ROWS), DatasetOptions(reward=f"{TRL}:pooled_judge"))
    prompt = task.prompts()[0]
    for _ in range(3):
        assert checked_scores(task, prompt, ["aba", "ab"]).rewards == (1.0, 0.0)


def test_reward_mistakes_name_the_function(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match="gives 1 weight for 2 reward functions"):
        DatasetTask(path, DatasetOptions(reward=f"{TRL}:reversed_chars,exact", reward_weights=(1.0,)))
    with pytest.raises(ValueError, match="two reward functions called 'reversed_chars'"):
        DatasetTask(path, DatasetOptions(reward=f"{TRL}:reversed_chars,{TRL}:reversed_chars"))
    with pytest.raises(ValueError, match=r"cannot be called as TRL calls .*completion_ids=, trainer_state="):
        DatasetTask(path, DatasetOptions(reward="tests.data.reward_funcs:no_kwargs"))
    with pytest.raises(ValueError, match=r"cannot be called as verl calls compute_score"):
        DatasetTask(path, DatasetOptions(reward=f"{VERL}:wrong_signature"))
    # A builtin beside a function: the builtin needs the answer column, the function does not.
    task = DatasetTask(path, DatasetOptions(reward=f"exact,{TRL}:never_applies"))
    prompt = task.prompts()[0]
    assert checked_scores(task, prompt, ["cba", "abc"]).rewards == (1.0, 0.0)
    broken = DatasetTask(path, DatasetOptions(reward=f"{TRL}:reversed_chars"))
    with pytest.raises(RewardError, match=f"reward {TRL}:reversed_chars raised AssertionError"):
        checked_scores(broken, prompt, ["x"], GroupContext(((1,),), version=-1))  # a negative step fails its check


VERL_ROWS = [
    {
        "data_source": "reverse/exact",
        "prompt": [{"role": "user", "content": "abc>"}],
        "ability": "reverse",
        "reward_model": {"style": "rule", "ground_truth": "cba"},
        "extra_info": {"index": 0, "split": "train"},
    },
    {
        "data_source": "reverse/partial",
        "prompt": [{"role": "user", "content": "hello>"}],
        "ability": "reverse",
        "reward_model": {"style": "rule", "ground_truth": "olleh"},
        "extra_info": {"index": 1, "split": "train"},
    },
    {
        "data_source": "reverse/partial",
        "prompt": [{"role": "user", "content": "stone>"}],
        "ability": "reverse",
        "reward_model": {"style": "rule", "ground_truth": "enots"},
        "extra_info": {"index": 2, "split": "train"},
    },
    {
        "data_source": "reverse/exact",
        "prompt": [{"role": "user", "content": "dog>"}],
        "ability": "reverse",
        "reward_model": {"style": "rule", "ground_truth": "god"},
        "extra_info": {"index": 3, "split": "train"},
    },
]


def verl_parquet(path: Path) -> Path:
    pa = pytest.importorskip("pyarrow", reason="pyarrow comes with the data extra (pip install 'echo2[data]')")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    return path


def content_only() -> object:
    return lambda messages: messages[-1]["content"]


def test_verl_compute_score_on_verl_layout_with_a_dotted_answer_column(tmp_path: Path) -> None:
    path = verl_parquet(tmp_path / "train.parquet")
    opts = DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{VERL}:compute_score")
    task = DatasetTask(path, opts, render_chat=content_only)
    exact, partial = task.prompts()[:2]
    assert exact.text == "abc>" and task.reward_names == ("compute_score",)
    assert checked_scores(task, exact, ["cba", "cbx"]).rewards == (1.0, 0.0)
    assert checked_scores(task, partial, ["ollxx", "olleh"]).rewards == (0.6, 1.0)  # its dict's "score"
    # The style can be named; a builtin scores the same nested answer.
    forced = DatasetTask(
        path,
        DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{VERL}:compute_score", reward_style="verl"),
        render_chat=content_only,
    )
    assert checked_scores(forced, exact, ["cba"]).rewards == (1.0,)
    builtin = DatasetTask(
        path, DatasetOptions(answer_column="reward_model.ground_truth", reward="exact"), render_chat=content_only
    )
    assert builtin.prompts()[1].answer == "olleh"
    with pytest.raises(
        ValueError,
        match=r"no column 'answer' \(the .*compute_score reward needs it; verl's layout "
        r"keeps it in reward_model.ground_truth\)",
    ):
        DatasetTask(path, DatasetOptions(reward=f"{VERL}:compute_score"), render_chat=content_only)


def test_a_verl_dict_without_score_is_a_reward_error_naming_the_function(tmp_path: Path) -> None:
    path = verl_parquet(tmp_path / "train.parquet")
    task = DatasetTask(
        path, DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{VERL}:no_score"), render_chat=content_only
    )
    with pytest.raises(RewardError, match=f"reward {VERL}:no_score raised KeyError: 'score'"):
        checked_scores(task, task.prompts()[0], ["cba"])


def test_a_column_named_as_a_trl_keyword_is_refused_at_load(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", [{"prompt": "abc>", "answer": "cba", "completions": "x"}])
    with pytest.raises(
        ValueError, match="column 'completions' collides with TRL's keyword argument of the same name; rename the column"
    ):
        DatasetTask(path, DatasetOptions(reward=f"{TRL}:reversed_chars"))
    assert DatasetTask(path, DatasetOptions(reward="exact")).prompts()  # a builtin passes no columns
    result = run(
        "hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--task", str(path), "--reward", f"{TRL}:reversed_chars"
    )
    assert_one_line_mistake(result, "--task", "column 'completions' collides")


def test_column_paths_reach_into_nested_columns() -> None:
    row = {"a": {"b": {"c": 3}}, "x.y": 1}
    assert column_value(row, "a.b.c") == 3 and column_value(row, "x.y") == 1  # a column named with a dot wins
    assert column_value(row, "a.z") is column_value(row, "q")  # both absent


def test_reward_weights_mistake_through_the_cli_is_one_line(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", ROWS)
    # --reward repeated adds up as comma-separated specs do: two functions, one weight.
    for rewards in (
        ["--reward", f"{TRL}:reversed_chars,{TRL}:length_gap"],
        ["--reward", f"{TRL}:reversed_chars", "--reward", f"{TRL}:length_gap"],
    ):
        result = run(
            "hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--task", str(path), *rewards, "--reward-weights", "1"
        )
        assert_one_line_mistake(result, "--task", "--reward-weights gives 1 weight for 2 reward functions")
    # --reward-weights repeated adds up too: three weights for two functions, not the last one alone.
    result = run(
        "hub.cli",
        "start",
        "--data-dir",
        str(tmp_path / "data"),
        "--task",
        str(path),
        "--reward",
        f"{TRL}:reversed_chars,{TRL}:length_gap",
        "--reward-weights",
        "1,0.5",
        "--reward-weights",
        "2",
    )
    assert_one_line_mistake(result, "--task", "--reward-weights gives 3 weights for 2 reward functions")


def train(data: Path, *args: str) -> list[dict]:
    """A real `echo-hub start` with one local node for 2 steps; its metrics rows."""
    result = run(
        "hub.cli",
        "start",
        "--data-dir",
        str(data),
        "--local-nodes",
        "1",
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--eval-every",
        "0",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--no-progress",
        *args,
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = read_metrics(data / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2]
    return rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trl_reward_file_with_two_weighted_functions_trains(tmp_path: Path) -> None:
    # Every row "fixed", so length_gap applies to each step's prompts (on "free" rows it returns None, and a step
    # that drew only those had no length_gap metric at all; the skip is checked in the unit test above).
    path = jsonl(tmp_path / "rows.jsonl", [{**row, "kind": "fixed"} for row in ROWS] * 4)
    rewards = f"{TRL}:reversed_chars,{TRL}:length_gap,{TRL}:judged"
    data = tmp_path / "data"
    rows = train(data, "--task", str(path), "--reward", rewards, "--reward-weights", "1,0.5,0", "--log-completions", "2")
    for row in rows:
        assert 0.0 <= row["rewards/reversed_chars/mean"] <= 1.0
        assert row["rewards/length_gap/mean"] <= 0.0
        assert row["judge/max_steps"] == 2.0 and 0.0 <= row["rewards/judged/mean"] <= 1.0  # the async judge's log_metric
    logged = read_completions(data / METRICS_FILE)
    assert [len(r["completions"]) for r in logged] == [2, 2]
    assert all(c["extra"]["verdict"] in ("tidy", "spaced") for r in logged for c in r["completions"])  # its log_extra


def test_a_verl_dicts_other_numbers_are_logged_and_the_rest_named_at_start(tmp_path: Path) -> None:
    """verl's reward_extra_info: numbers beside "score" become rewards/<function>/<key>/mean (None where a result
    holds none); keys holding text cannot be logged, and the start says so in one line."""
    from hub.training.tasks import check_reward, unlogged_note

    path = verl_parquet(tmp_path / "train.parquet")
    opts = DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{VERL}:compute_score")
    task = DatasetTask(path, opts, render_chat=content_only)
    exact, partial = task.prompts()[:2]
    scores = checked_scores(task, partial, ["ollxx", "olleh"])
    assert scores.parts == (("compute_score", (0.6, 1.0)), ("compute_score/acc", (0.0, 1.0)))
    assert checked_scores(task, exact, ["cba"]).parts == (("compute_score", (1.0,)),)  # a plain number: nothing more
    made = Completion(token_ids=(1,), logprobs=(-1.0,), finish_reason="stop", version=0, text="x")
    groups = [
        Group(
            prompt_id=partial.id,
            prompt_text=partial.text,
            version=0,
            completions=(made, made),
            rewards=scores.rewards,
            reward_parts=scores.parts,
        )
    ]
    means = reward_means(groups)
    assert means["rewards/compute_score/mean"] == pytest.approx(0.8) and means["rewards/compute_score/acc/mean"] == 0.5
    assert unlogged_note(task) is None
    opts = DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{VERL}:with_prediction")
    task = DatasetTask(path, opts, render_chat=content_only)
    check_reward(task, 4)
    assert task.unlogged == {"with_prediction/pred"}
    assert checked_scores(task, task.prompts()[0], ["cba"]).parts[1] == ("with_prediction/hit", (1.0,))
    assert unlogged_note(task) == (
        "reward with_prediction/pred (beside the score of its dict) is not a number, so no metric logs it; the numbers "
        "a dict holds are logged as rewards/<function>/<key>/mean"
    )


def test_a_reward_named_by_its_file_as_verl_names_it(tmp_path: Path) -> None:
    """verl's custom_reward_function path and name as `FILE.py:function`: loaded from the file wherever it is; a
    missing file, a missing function or a file that fails as it runs is one line."""
    path = verl_parquet(tmp_path / "train.parquet")
    scorer = tmp_path / "elsewhere" / "my_score.py"
    scorer.parent.mkdir()
    shutil.copy(DATA / "verl_score.py", scorer)
    opts = DatasetOptions(answer_column="reward_model.ground_truth", reward=f"{scorer}:compute_score")
    task = DatasetTask(path, opts, render_chat=content_only)
    assert task.reward_names == ("compute_score",)
    assert checked_scores(task, task.prompts()[1], ["ollxx"]).rewards == (0.6,)
    for reward, message in (
        (f"{tmp_path / 'none.py'}:compute_score", "no such file"),
        (f"{scorer}:missing", "has no attribute 'missing'"),
    ):
        with pytest.raises(ValueError, match=message):
            DatasetTask(path, DatasetOptions(answer_column="reward_model.ground_truth", reward=reward))
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_package_here\n")
    result = run(
        "hub.cli",
        "start",
        "--data-dir",
        str(tmp_path / "data"),
        "--task",
        str(path),
        "--answer-column",
        "reward_model.ground_truth",
        "--reward",
        f"{broken}:compute_score",
    )
    assert_one_line_mistake(result, f"importing {broken} raised ModuleNotFoundError: No module named 'no_such_package_here'")
    assert not (tmp_path / "data").exists()
