"""The tool sandbox (hub/agents/sandbox.py) against hostile arguments, with real worker processes running a
tools module and a TRL-style environment written the way TRL's docs write them."""

from __future__ import annotations

import json
import sys
import time

import pytest
import trio

import testbed.agent_tools as agent_tools
from hub.agents.sandbox import SandboxBroken, SandboxFull, SandboxLimits, open_sandbox
from hub.agents.toolset import load_toolset
from shared.tools import TOOL_ARGUMENT_MAX_BYTES, TOOL_RESULT_MAX_CHARS, RolloutEnd

FUNCTIONS = [f"testbed.agent_tools:{name}" for name in ("add", "spin", "hog", "dial", "nap", "shout")]
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=0.5, memory_bytes=256 * 1024**2, environments_per_worker=4)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory of the user's own, current and importable (as `echo-hub start` run there sees it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("m", None)


def test_the_toolset_has_transformers_schemas_and_the_environments_public_methods():
    toolset = load_toolset(["testbed.agent_tools:add"], "testbed.agent_tools:Counter")
    assert toolset.names == ("add", "bump")
    assert toolset.environment_reward
    (add, bump) = toolset.schemas
    assert add["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert bump["function"]["name"] == "bump" and "self" not in bump["function"]["parameters"]["properties"]


@pytest.mark.parametrize(
    ("source", "specs", "environment", "says"),
    [
        ("def f(a):\n    return a\n", ["m:f"], None, "docstring"),
        (
            "class E:\n    def step(self, a: int) -> int:\n        '''S.\n\n        Args:\n            a: A.\n        '''\n",
            [],
            "m:E",
            "reset",
        ),
        ("def f(a: int) -> int:\n    '''F.\n\n    Args:\n        a: A.\n    '''\n", ["m:f", "m:f"], None, "unique"),
        ("x = 3\n", ["m:x"], None, "not a function"),
        ("class E:\n    def __init__(self):\n        raise OSError('no db')\n", [], "m:E", "no db"),
    ],
)
def test_a_toolset_trl_would_refuse_is_one_line_naming_what_is_wrong(user_dir, source, specs, environment, says):
    (user_dir / "m.py").write_text(source)
    sys.modules.pop("m", None)
    with pytest.raises(ValueError, match=says) as caught:
        load_toolset(specs, environment)
    assert "\n" not in str(caught.value)


def run(body, environment=None, procs=1):
    async def main():
        async with open_sandbox(FUNCTIONS, environment, LIMITS, procs=procs) as sandbox:
            return await body(sandbox)

    return trio.run(main)


def test_a_call_answers_and_a_tool_that_raises_answers_the_model_with_its_error():
    async def body(sandbox):
        return [
            await sandbox.call(None, "add", {"a": 2, "b": 3}, "node"),
            await sandbox.call(None, "add", {"a": 2}, "node"),
            await sandbox.call(None, "nowhere", {}, "node"),
            await sandbox.call(None, "shout", {"n": 10 * TOOL_RESULT_MAX_CHARS}, "node"),
        ]

    ok, missing, unknown, long = run(body)
    assert ok.text == "5" and ok.end is None and not ok.error
    assert missing.error and "TypeError" in json.loads(missing.text)["error"]
    assert unknown.error and json.loads(unknown.text) == {"error": "Tool nowhere not found."}
    assert len(long.text) < TOOL_RESULT_MAX_CHARS + 20 and long.text.endswith("[cut]")


def test_hostile_calls_end_their_rollout_with_a_reason_and_the_sandbox_keeps_serving():
    """An endless loop, 10 GiB, a socket, an endless sleep and a 10 MB argument: each ends its rollout with its
    reason within its limit, the next call is answered, and the hub's event loop never stalls."""
    gaps: list[float] = []

    async def ticker():
        last = time.monotonic()
        while True:
            await trio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def body(sandbox):
        results = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            for name, args in [
                ("spin", {"n": 0}),
                ("hog", {"gib": 10}),
                ("dial", {"host": "127.0.0.1"}),
                ("nap", {"seconds": 3600}),
                ("add", {"a": 1, "b": "x" * (10 * 1024 * 1024)}),
            ]:
                started = time.monotonic()
                outcome = await sandbox.call(None, name, args, "hostile")
                after = await sandbox.call(None, "add", {"a": 1, "b": 1}, "honest")
                results[name] = (outcome.end, time.monotonic() - started, after.text)
            nursery.cancel_scope.cancel()
        return results, sandbox.restarts

    results, restarts = run(body)
    assert {name: end for name, (end, _, _) in results.items()} == {
        "spin": RolloutEnd.TOOL_CPU,
        "hog": RolloutEnd.TOOL_MEMORY,
        "dial": RolloutEnd.TOOL_NETWORK,
        "nap": RolloutEnd.TOOL_WALL_TIME,
        "add": RolloutEnd.ARGUMENTS_TOO_LARGE,
    }
    assert all(after == "2" for _, _, after in results.values())
    assert restarts == 1  # only the sleeper's worker was killed: the others were bounded inside it
    # Bounded: CPU past its 0.5 s, a worker start after the 3 s wall clock (spawn, imports), and a busy machine.
    assert results["spin"][1] < 30 and results["nap"][1] < 60
    assert max(gaps) < 1.0, f"the event loop stalled {max(gaps):.2f} s"
    assert 10 * 1024 * 1024 > TOOL_ARGUMENT_MAX_BYTES


def test_each_rollout_has_its_own_environment_bounded_per_worker_and_lost_with_a_killed_worker():
    async def body(sandbox):
        opened = [await sandbox.open_environment(f"r{i}", {"start": i}, "node") for i in range(4)]
        with pytest.raises(SandboxFull):
            await sandbox.open_environment("r4", {}, "node")
        bumps = [await sandbox.call("r1", "bump", {"by": 2}, "node"), await sandbox.call("r2", "bump", {"by": 1}, "node")]
        rewards = [await sandbox.reward(key, "node") for key in ("r1", "r2")]
        await sandbox.close_environment("r0", "node")
        reopened = await sandbox.open_environment("r5", {"start": 2}, "node")
        killed = await sandbox.call("r5", "nap", {"seconds": 3600}, "hostile")
        after = [await sandbox.call(key, "bump", {"by": 1}, "node") for key in ("r1", "r5")]
        fresh = await sandbox.open_environment("r6", {}, "node")
        return opened, bumps, rewards, reopened, killed, after, fresh

    opened, bumps, rewards, reopened, killed, after, fresh = run(body, "testbed.agent_tools:Counter")
    assert [o.text for o in opened] == [f"counter at {i}" for i in range(4)]
    assert [b.text for b in bumps] == ["3", "3"]
    assert [r.text for r in rewards] == ["1.0", "1.0"]
    assert reopened.text == "counter at 2"
    assert killed.end is RolloutEnd.TOOL_WALL_TIME
    assert [a.end for a in after] == [RolloutEnd.ENVIRONMENT_LOST, RolloutEnd.ENVIRONMENT_LOST]
    assert fresh.text == "counter at 0"


def test_tools_that_fail_to_load_stop_the_start_in_one_line():
    async def main():
        async with open_sandbox(["testbed.agent_tools:add", "testbed.agent_tools:nothing"], None, LIMITS, procs=1):
            pass

    with pytest.raises(SandboxBroken, match="has no attribute 'nothing'"):
        trio.run(main)


def test_a_tools_module_path_is_loaded_as_verl_loads_a_file():
    toolset = load_toolset([f"{agent_tools.__file__}:add"], None)
    assert toolset.names == ("add",) and toolset.functions["add"](a=1, b=2) == 3


def test_the_sandbox_module_is_cheap_to_import():
    assert "transformers" not in {m.split(".")[0] for m in _imports_of("hub.agents.sandbox")}


def _imports_of(module: str) -> set[str]:
    import subprocess

    code = f"import sys; before = set(sys.modules); import {module}; print(' '.join(set(sys.modules) - before))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_a_cancelled_call_leaves_no_answer_behind_for_the_next_one():
    async def body(sandbox):
        with trio.move_on_after(0.2):
            await sandbox.call(None, "nap", {"seconds": 1.0}, "node")
        return (await sandbox.call(None, "add", {"a": 20, "b": 1}, "node")).text

    assert run(body) == "21"


def test_calls_queued_on_a_killed_worker_are_answered_by_another_each_with_its_own_answer():
    async def body(sandbox):
        answers = {}

        async def ask(owner, name, args):
            answers[owner] = await sandbox.call(None, name, args, owner)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "sleeper", "nap", {"seconds": 3600})
            await trio.sleep(0.2)  # the sleeper holds the only worker
            nursery.start_soon(ask, "first", "add", {"a": 1, "b": 2})
            nursery.start_soon(ask, "second", "add", {"a": 2, "b": 3})
        return answers, [w.waiting for w in sandbox.workers]

    answers, waiting = run(body)
    assert answers["sleeper"].end is RolloutEnd.TOOL_WALL_TIME
    assert (answers["first"].text, answers["second"].text) == ("3", "5")
    assert waiting == [0]
