"""The embedded tool task (`echo-hub start --task calc`): its prompts, tool and reward, the settings it brings, the
embedded tool model it trains without --model, and a real run of it with a local node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from hub.agents.conversation import check_tool_template
from hub.agents.toolset import load_toolset
from hub.cli.preflight import check_agents
from hub.cli.progress import progress_line
from hub.cli.status import render
from hub.config import CALC_LR, CALC_MAX_NEW_TOKENS, CALC_STEPS, HubConfig, with_task_defaults
from hub.service.web import status_metrics
from hub.training.metrics import read_evals
from hub.training.tasks import load_hub_task
from shared.chat import tool_suffix_ids
from shared.default_model import DEFAULT_MODEL_RECIPE, default_model_dir
from shared.layout import HUB_STATUS_FILE, METRICS_FILE
from shared.messages import HubStatus, tool_totals_text
from shared.model_identity import load_model_identity
from shared.tasks import load_task
from shared.tasks.calc import CALC_REWARD, CALC_TOOL, CalcTask, correct, mul, problems
from shared.tool_model import TOOL_MODEL_RECIPE, ToolModelRecipe, build_tool_model, embedded_recipe
from shared.tools import TOOL_CALLS_METRIC, RolloutEnd
from testbed.harness import query, start_hub
from tests.test_first_contact import assert_one_line_mistake, run

CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 37, "b": 48}}\n</tool_call><|im_end|>'
RUN_TIMEOUT_S = 240


def test_the_reward_is_the_last_turn_saying_the_product_exactly():
    said = [
        [{"role": "assistant", "content": "1776"}],
        [
            {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "1776"},
            {"role": "assistant", "content": " 1776\n"},
        ],
        [{"role": "assistant", "content": "1776 I think"}],
        [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "name": "mul", "content": "1776"}],
        [],
    ]
    assert correct(said, ["1776"] * len(said)) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert mul(37, 48) == 1776


def test_the_task_is_distinct_chat_problems_rendered_with_the_tool():
    assert len(set(problems(1234, 4096))) == 4096 and problems(1, 8) == problems(1, 8)
    with pytest.raises(ValueError, match="within 1..8100"):
        problems(1, 8101)
    tokenizer = TOOL_MODEL_RECIPE.tokenizer()
    schemas = load_toolset((CALC_TOOL,), None).schemas
    task = load_task(
        "calc",
        render_chat=lambda: (
            lambda m: tokenizer.apply_chat_template(list(m), tools=schemas, tokenize=False, add_generation_prompt=True)
        ),
    )
    assert isinstance(task, CalcTask) and len(task.prompts()) == 4096
    first = task.prompts()[0]
    (message,) = task.messages_of(first.id)
    a, b = map(int, message["content"].split("*"))
    assert (
        first.text
        == f"<|im_start|>system\n<tools>mul;</tools><|im_end|>\n<|im_start|>user\n{a}*{b}<|im_end|>\n<|im_start|>assistant\n"
    )
    # Scored by `correct` (math's would take the last two too), the answer hub-side.
    said = [str(a * b), str(a * b + 1), f"{a * b}.0", f"the answer is {a * b}"]
    assert tuple(task.rewards(first, said)) == (1.0, 0.0, 0.0, 0.0)


def test_calc_brings_its_tool_reward_and_lengths_unless_the_toml_or_a_flag_set_them():
    plain = with_task_defaults(HubConfig(task="calc"))
    assert plain.agents.tools == (CALC_TOOL,) and plain.agents.max_tool_calls == 1 and plain.dataset.reward == CALC_REWARD
    assert plain.sampling.max_new_tokens == CALC_MAX_NEW_TOKENS and plain.learner.lr == CALC_LR and plain.steps == CALC_STEPS
    asked = HubConfig.model_validate({"task": "calc", "steps": 7, "learner": {"lr": 1e-4}, "agents": {"max_tool_calls": 3}})
    given = with_task_defaults(asked)
    assert given.learner.lr == 1e-4 and given.agents.max_tool_calls == 3 and given.agents.tools == (CALC_TOOL,)
    assert given.steps == 7 and given.sampling.max_new_tokens == CALC_MAX_NEW_TOKENS
    assert with_task_defaults(HubConfig()) == HubConfig()


def test_calc_trains_the_embedded_tool_model_whose_template_carries_its_calls():
    assert embedded_recipe("calc") is TOOL_MODEL_RECIPE and embedded_recipe("reverse") is DEFAULT_MODEL_RECIPE
    assert default_model_dir(recipe=TOOL_MODEL_RECIPE).name.startswith("default-calc-qwen2-")
    tokenizer = TOOL_MODEL_RECIPE.tokenizer()
    call = tokenizer.encode(CALL, add_special_tokens=False)
    assert len(call) == 10 and tokenizer.decode(call) == CALL  # the call's fixed JSON and each operand: one token
    reply = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "mul", "content": "1776"}])
    assert (
        tokenizer.decode(reply)
        == "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    check_tool_template(tokenizer, load_toolset((CALC_TOOL,), None).schemas)
    check_agents(with_task_defaults(HubConfig(task="calc")), None)  # no --model needed


@pytest.fixture(scope="module")
def small_tool_model(tmp_path_factory) -> Path:
    """The tool model by a recipe of a few warm-up steps: the real build, not the real policy."""
    out = tmp_path_factory.mktemp("tool-model") / "model"
    stats = build_tool_model(out, ToolModelRecipe(phases=((6, 0.5, 1e-3), (2, 0.05, 1e-4)), eval_prompts=8))
    assert set(stats) >= {"params", "build_seconds", "tool_calls_first_turn", "exact_calls_when_calling"}
    return out


def test_the_built_tool_model_loads_like_any_checkpoint_and_reads_its_prompts(small_tool_model):
    model = load_model_identity(small_tool_model)
    assert model.context == TOOL_MODEL_RECIPE.max_position_embeddings
    config = with_task_defaults(HubConfig(task="calc", model=small_tool_model))
    task = load_hub_task("calc", config, model)
    prompt = task.prompts()[0]
    assert prompt.text.startswith("<|im_start|>system\n<tools>mul;</tools>")
    assert len(model.tokenizer(prompt.text)["input_ids"]) + CALC_MAX_NEW_TOKENS <= model.context
    assert json.loads((small_tool_model / "build_stats.json").read_text())["recipe"]["phases"][0] == [6, 0.5, 1e-3]


def test_echo_hub_start_task_calc_runs_the_tool_loop_evaluates_through_it_and_logs_its_call_frequency(tmp_path, small_tool_model):
    (tmp_path / "hub.toml").write_text("[learner]\nskip_zero_variance = false\n")  # a barely warmed-up policy
    hub = start_hub(
        tmp_path / "data",
        *("--task", "calc", "--model", str(small_tool_model), "--config", str(tmp_path / "hub.toml")),
        *("--steps", "2", "--local-nodes", "1", "--group-size", "4", "--prompts-per-step", "2", "--lr", "1e-4"),
        *("--max-new-tokens", "40", "--eval-every", "2", "--eval-prompts", "4", "--eval-samples", "2"),  # held out too
    )
    assert hub.wait_or_kill(RUN_TIMEOUT_S) == 0, hub.output()[-3000:]
    verdicts = dict(query(tmp_path / "data", "SELECT verdict, count(*) FROM trajectories GROUP BY verdict"))
    assert verdicts.get("accepted", 0) >= 4 and "rejected" not in verdicts, (verdicts, hub.output()[-3000:])
    rows = [json.loads(line) for line in (tmp_path / "data" / METRICS_FILE).read_text().splitlines()]
    steps = [r for r in rows if "step" in r and TOOL_CALLS_METRIC in r]
    assert [r["step"] for r in steps] == [1, 2] and all(0.0 <= r[TOOL_CALLS_METRIC] <= 1.0 for r in steps)
    assert all("rewards/correct/mean" in r for r in steps)
    (held_out,) = read_evals(tmp_path / "data" / METRICS_FILE)  # through the tool loop, as the rollouts were
    assert held_out["eval_step"] == 2 and held_out["eval_prompts"] == 4 and 0.0 <= held_out["eval_reward"] <= 1.0
    # The status the dashboard, `echo-hub status` and /metrics read carries them, as the progress line shows them.
    status = HubStatus.model_validate_json((tmp_path / "data" / HUB_STATUS_FILE).read_text())
    assert [p.tool_calls for p in status.history] == [r[TOOL_CALLS_METRIC] for r in steps]
    assert f"tool calls {status.recent_tool_calls():.2f}/rollout" in progress_line(status)
    console = Console(width=120, record=True)
    render(status, console)  # `echo-hub status`
    assert f"{status.recent_tool_calls():.2f} per rollout" in console.export_text()
    (gauge,) = [m for m in status_metrics(status) if m.name == "echo2_tool_calls_per_rollout"]
    assert gauge.samples[0].value == pytest.approx(status.recent_tool_calls())
    # The tools' own totals (the rollouts' and the held-out evaluation's calls): the same numbers everywhere.
    tools = status.tools
    assert tools is not None and tools.errors <= tools.calls and (tools.environment_s > 0) == (tools.calls > 0), tools
    wide = Console(width=300, record=True)
    render(status, wide)
    assert tool_totals_text(tools) in wide.export_text()
    metrics = {m.name: m for m in status_metrics(status)}
    assert metrics["echo2_tool_calls"].samples[0].value == tools.calls
    assert {s.labels["reason"] for s in metrics["echo2_tool_rollout_ends"].samples} >= {r.value for r in RolloutEnd}


def test_echo_hub_eval_of_the_tool_task_is_one_line_not_a_single_turn_score(small_tool_model):
    """Without a run's config beside the model, `--task calc` still means its tool: refused, not scored single-turn."""
    assert_one_line_mistake(
        run("hub.cli", "eval", "--model", str(small_tool_model), "--task", "calc"), "echo-hub eval of one is not built yet"
    )
