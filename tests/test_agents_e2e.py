"""Tool-using runs end to end, and what `echo-hub start` refuses of them.

The run: a real `echo-hub start` with an environment as TRL's environment_factory takes it
(testbed.agent_tools:Counter: reset() appends "counter at 0" to the prompt, bump(by) is its tool, get_reward() its
reward) and a local node, on a small model over a tokenizer whose chat template renders tools, trained here to call
bump(3) and then say done. The node's rollouts call the tool, the hub's sandbox answers, and their groups, with the
environment's segments marked, are accepted, rewarded by the environment as TRL rewards them, and trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from hub.agents.evaluation import tool_groups
from hub.agents.loop import LoopLimits, ToolLoop
from hub.agents.rollouts import AgentRollouts, with_observation
from hub.agents.sandbox import SandboxLimits, open_sandbox
from hub.agents.toolset import load_toolset
from hub.cli.eval import check_eval
from hub.cli.preflight import check_agents, check_tool_task
from hub.config import AgentsConfig, EvalConfig, HubConfig
from shared.checks import UserError
from shared.generation import Sampler
from shared.model_identity import load_model_identity
from shared.rollout import Group, SamplingParams
from shared.tasks.dataset import DatasetOptions, DatasetTask, chat_renderer
from shared.tasks.reverse import ReverseTask
from testbed.harness import query, start_hub
from testbed.tool_chat import NAMES_TEMPLATE, tool_chat_tokenizer, tool_model_dir
from tests.test_first_contact import assert_one_line_mistake, run

ENVIRONMENT = "testbed.agent_tools:Counter"
ASK = "Bump to 3."
CALL = '<tool_call>\n{"name": "bump", "arguments": {"by": 3}}\n</tool_call><|im_end|>'
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the task, the model): four rows asking the same, and a model trained on the prompt the hub leases for them."""
    out = tmp_path_factory.mktemp("tool-run")
    task = out / "bump.jsonl"
    task.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": ASK}]}) + "\n" for _ in range(4)))
    render = chat_renderer(tool_chat_tokenizer(NAMES_TEMPLATE), "test", load_toolset([], ENVIRONMENT).schemas)
    prompt = render(with_observation(({"role": "user", "content": ASK},), "counter at 0"))
    return task, tool_model_dir(out / "model", prompt, [CALL, "done<|im_end|>"], [[("bump", "3")]])


def test_a_tool_using_run_trains_on_rollouts_whose_tool_calls_the_hub_answered(tmp_path, tool_run):
    task, model = tool_run
    (tmp_path / "hub.toml").write_text("[learner]\nskip_zero_variance = false\n")  # a memorised policy: equal rewards
    hub = start_hub(
        tmp_path / "data",
        *("--model", str(model), "--task", str(task), "--environment", ENVIRONMENT, "--config", str(tmp_path / "hub.toml")),
        *("--reward", "testbed.agent_tools:said_done", "--steps", "2", "--local-nodes", "1", "--group-size", "4"),
        *("--prompts-per-step", "2", "--max-new-tokens", "160", "--lr", "1e-6"),
    )
    assert hub.wait_or_kill(RUN_TIMEOUT_S) == 0, hub.output()[-3000:]
    verdicts = dict(query(tmp_path / "data", "SELECT verdict, count(*) FROM trajectories GROUP BY verdict"))
    assert verdicts.get("accepted", 0) >= 4 and "rejected" not in verdicts, (verdicts, hub.output()[-3000:])
    groups = [Group.model_validate_json(j) for (j,) in query(tmp_path / "data", "SELECT group_json FROM payloads")]
    assert all(g.prompt_text.endswith(f"{ASK}counter at 0<|im_end|>\n<|im_start|>assistant\n") for g in groups)
    called = [c for g in groups for c in g.completions if c.env_spans]
    assert called, "no rollout called a tool"
    for g in groups:
        rewards = dict(g.reward_parts)["Counter"]
        assert rewards == tuple(1.0 if c.env_spans else 0.0 for c in g.completions)  # bump(3) made the count 3
    assert all(c.logprobs[s : s + n] == (0.0,) * n for c in called for s, n in c.env_spans)
    steps = query(tmp_path / "data", "SELECT count(*) FROM steps")[0][0]
    assert steps == 2


def test_what_the_tool_loop_cannot_run_is_refused_in_one_line(tmp_path):
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--tools", "testbed.agent_tools:add"),
        "--tools needs --model",
    )
    assert not (tmp_path / "data").exists()
    tools = AgentsConfig(tools=("testbed.agent_tools:add",))
    with pytest.raises(UserError, match="evaluates on a held-out split of its own task"):
        check_agents(HubConfig(agents=tools, eval=EvalConfig(every=5, task="other.jsonl")), object())  # type: ignore[arg-type]
    with pytest.raises(UserError, match="echo-hub eval of one is not built yet"):
        check_eval(HubConfig(agents=tools), Path("no-model-read"))
    with pytest.raises(UserError, match="no attribute 'nothing'"):
        check_agents(HubConfig(agents=AgentsConfig(tools=("testbed.agent_tools:nothing",))), object())  # type: ignore[arg-type]
    with pytest.raises(UserError, match="the prompts must be chat messages"):
        check_tool_task(HubConfig(agents=tools), ReverseTask())


def test_held_out_rollouts_run_the_tool_loop_and_get_their_environments_rewards(tool_run):
    """The hub's held-out evaluation of a tool-using run (hub/agents/evaluation.py): its own model generates each
    turn, the tool loop answers it in the sandbox as it answers a node's, and each environment's reward is asked at
    the end; nothing stays open."""
    task_path, model_dir = tool_run
    identity = load_model_identity(model_dir)
    render = chat_renderer(identity.tokenizer_copy(), "test", load_toolset([], ENVIRONMENT).schemas)
    options = DatasetOptions(reward="testbed.agent_tools:said_done", keep_rows=True)
    task = DatasetTask(task_path, options, lambda: render)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sampler = Sampler(model, identity.tokenizer_copy(), torch.device("cpu"), stop_ids=sorted(identity.stop_ids))
    limits = SandboxLimits(wall_s=5.0, cpu_s=1.0, memory_bytes=256 * 1024**2)

    async def main():
        async with open_sandbox([], ENVIRONMENT, limits, procs=1) as sandbox:
            loop = ToolLoop(sandbox, identity.tokenizer_copy(), LoopLimits(max_tool_calls=2, max_completion_tokens=160))
            agents = AgentRollouts(loop, task, render, 4, identity.config.vocab_size, 160, "Counter")
            sampling = SamplingParams(max_new_tokens=160, seed=1)
            # Greedy: the memorised policy's most likely turns (a sampled one may garble the call, as the run allows).
            held = await trio.to_thread.run_sync(tool_groups, agents, sampler, task.prompts()[:1], 2, sampling, 0, True)
            return held, dict(loop.rollouts), dict(agents.keys)

    (group,), still_open, keys = trio.run(main)
    assert not still_open and not keys
    assert all(c.env_spans for c in group.completions), [c.text for c in group.completions]
    assert group.environment_rewards == [1.0, 1.0]  # bump(3) made each counter 3: its get_reward()
    assert all(c.text.endswith("done") for c in group.completions)
