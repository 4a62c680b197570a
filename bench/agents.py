"""The embedded tool task end to end (issue 68's evidence): `echo-hub start --task calc` as a user runs it, with its
local nodes, on this machine. The embedded tool model can call its calculator but seldom does; the reward pays the
exact product, which only the tool gives. Every turn goes through the hub's tool loop and sandbox, every group
through the hub's checks and audits.

    python bench/agents.py [--steps 60] [--parts run,cache,trips] [--json] [--plot PNG]

First builds the embedded tool model if it is not cached (timed apart). Prints JSON: the build's seconds and what
its warm-up left (tool calls on the first turn, exact calls when it calls), the run's wall time, the reward's and
the tool calls per rollout's first and last fifth of steps (TRL's tools/call_frequency, over every rollout offered,
not only those trained on), groups accepted and rejected by the checks (all honest here), audits passed, nodes
banned. `--plot` draws both curves.

Two measurements of their own, each a part (`--parts`):
- `cache`: a node's model turns per second (the transformers engine, the calc prompts) with the batch's KV cache kept
  from turn to turn, and re-encoding every context each turn; alternated, the best of 3 each. Two shapes: the
  embedded tool model (32 rollouts x 4 turns of 24 tokens, 12-token answers), and a random Qwen2 of 8 layers x 512
  over its tokenizer (16 rollouts x 4 turns of 32 tokens, 128-token answers: a tool that returns a page).
- `sandbox`: each hostile call of testbed/agent_tools.py (a loop forever, 10 GiB, a socket, an endless sleep) and an
  honest one through the hub's sandbox with `echo-hub start`'s default limits: how each ended, and how long it took.
- `trips`: tool round trips the hub answers per second and per CPU-second of the hub's process and its sandbox
  workers (a hub core): the calc run's own tool loop, sandbox and renderer (`--max-tool-calls 4`), 64 rollouts at a
  time each calling `mul` every turn, through the path a held-out evaluation takes (a node's turns add the request's
  decoding and checks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import trl_grpo  # noqa: E402
from hub.cli.summary import fifth_means  # noqa: E402
from hub.training.metrics import policy_reward, read_metrics  # noqa: E402
from shared.default_model import BUILD_STATS_FILE, ensure_default_model  # noqa: E402
from shared.layout import METRICS_FILE  # noqa: E402
from shared.tool_model import TOOL_MODEL_RECIPE  # noqa: E402
from shared.tools import TOOL_CALLS_METRIC as CALLS  # noqa: E402
from testbed.harness import query, start_hub  # noqa: E402

RUN_TIMEOUT_S = 3600
PARTS = ("run", "cache", "trips", "sandbox")
# A hostile call of each kind (testbed/agent_tools.py, tools written as TRL's docs write them) and an honest one.
SANDBOX_CASES = (
    ("loops forever", "spin", {"n": 0}),
    ("allocates 10 GiB", "hog", {"gib": 10}),
    ("opens a socket", "dial", {"host": "127.0.0.1"}),
    ("sleeps past the wall", "nap", {"seconds": 3600}),
    ("honest", "add", {"a": 2, "b": 3}),
)
TRIPS_ROLLOUTS, TRIPS_ROUNDS, TRIPS_TOKENS = 64, 4, 1024


def run(work: Path, steps: int, quiet: bool) -> dict:
    started = time.monotonic()
    model = ensure_default_model(progress=not quiet and sys.stderr.isatty(), recipe=TOOL_MODEL_RECIPE)
    build_s = time.monotonic() - started
    built = json.loads((model / BUILD_STATS_FILE).read_text())["stats"]
    started = time.monotonic()
    hub = start_hub(work / "hub", "--task", "calc", "--steps", str(steps))
    code = hub.wait_or_kill(RUN_TIMEOUT_S)
    wall = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"echo-hub start --task calc exited with {code}:\n{hub.output()[-3000:]}")
    # A step with no group offered since the one before logs no rollout figures: its curve point is the previous one's.
    rows = [r for r in read_metrics(work / "hub" / METRICS_FILE) if CALLS in r]
    reward_first, reward_last = fifth_means([policy_reward(r) for r in rows])
    calls_first, calls_last = fifth_means([r[CALLS] for r in rows])
    verdicts = dict(query(work / "hub", "SELECT verdict, count(*) FROM trajectories GROUP BY verdict"))
    ((audits, banned),) = query(work / "hub", "SELECT sum(audits_passed), count(banned_reason) FROM nodes")
    return {
        "steps": len(rows),
        "model_build_s": round(build_s, 1),  # ~0 when the model was cached
        "model_build": {k: round(v, 4) if isinstance(v, float) else v for k, v in built.items()},
        "wall_s": round(wall, 1),
        "reward_first": round(reward_first, 4),
        "reward_last": round(reward_last, 4),
        "reward_gain": round(reward_last - reward_first, 4),
        "tool_calls_per_rollout_first": round(calls_first, 4),
        "tool_calls_per_rollout_last": round(calls_last, 4),
        "accepted": verdicts.get("accepted", 0),
        "honest_rejected": verdicts.get("rejected", 0),
        "audits_passed": audits or 0,
        "nodes_banned": banned,
        "curve": [(r["step"], round(policy_reward(r), 4), round(r[CALLS], 4)) for r in rows],
    }


def calc_run(work: Path, max_tool_calls: int, max_new_tokens: int):
    """The config, model identity and task `echo-hub start --task calc --max-tool-calls N --max-new-tokens M` runs
    with."""
    from hub.training.tasks import hub_tasks
    from shared.model_identity import load_model_identity

    flags = ["--max-tool-calls", str(max_tool_calls), "--max-new-tokens", str(max_new_tokens), "--data-dir", str(work)]
    config = trl_grpo.hub_config(["--task", "calc", *flags])
    model = load_model_identity(ensure_default_model(progress=False, recipe=TOOL_MODEL_RECIPE))
    return config, model, hub_tasks(config, model)[0]


@dataclass(frozen=True)
class CacheShape:
    """One measurement of the turn cache: a model, and the batch's turns."""

    name: str
    hidden: int | None  # None: the embedded tool model itself; else a random Qwen2 of this width over its tokenizer
    layers: int
    rollouts: int
    turns: int
    turn_tokens: int
    answer_tokens: int


CACHE_SHAPES = (
    CacheShape("tool-model", None, 0, rollouts=32, turns=4, turn_tokens=24, answer_tokens=12),
    CacheShape("qwen2-512x8", 512, 8, rollouts=16, turns=4, turn_tokens=32, answer_tokens=128),
)


def turn_cache_speed(work: Path, shape: CacheShape, repeats: int = 3) -> dict:
    """Model-turn tokens per second with the batch's KV cache kept across turns, and re-encoding each turn: the
    node's own engine on the calc prompts, every turn `turn_tokens` sampled (no early stop) then an answer of
    `answer_tokens`; the two ways alternated, the best of `repeats` each."""
    from node.hf_engine import HFEngine
    from shared.rollout import SamplingParams
    from testbed.models import random_model_dir

    budget = shape.turns * (shape.turn_tokens + shape.answer_tokens)
    _, model, task = calc_run(work, shape.turns, budget)
    model_dir = model.model_dir
    if shape.hidden is not None:
        model_dir = random_model_dir(
            work / shape.name, hidden=shape.hidden, layers=shape.layers, tokenizer_dir=model_dir, context=2048
        )
    engine = HFEngine(model_dir, seed=0)
    engine.use_stop_ids([engine.pad_id])  # no turn stops early: both ways sample the same number of tokens
    prompts = [p.text for p in task.prompts()][: shape.rollouts]
    encoded = [list(ids) for ids in engine.tokenizer(prompts)["input_ids"]]
    response = list(engine.tokenizer("<tool_response>\n1776\n</tool_response>")["input_ids"])
    answer = (response * (shape.answer_tokens // len(response) + 1))[: shape.answer_tokens]

    def turns(keep: bool) -> float:
        contexts = [list(ids) for ids in encoded]
        kept, keys = engine.turn_cache() if keep else None, list(range(len(contexts)))
        started = time.perf_counter()
        for turn in range(shape.turns):
            budgets = [shape.turn_tokens] * len(contexts)
            made = engine.generate_turns(contexts, budgets, SamplingParams(max_new_tokens=1, seed=turn), kept=kept, keys=keys)
            for context, m in zip(contexts, made):
                context += [*m.token_ids, *answer]
        return time.perf_counter() - started

    kept_s, again_s = [], []
    for _ in range(repeats):
        kept_s.append(turns(True))
        again_s.append(turns(False))
    tokens = shape.rollouts * shape.turns * shape.turn_tokens
    return {
        **{k: v for k, v in asdict(shape).items() if k != "name"},
        "last_context_tokens": max(len(ids) for ids in encoded) + budget - shape.answer_tokens,
        "tokens_per_s_kept": round(tokens / min(kept_s), 1),
        "tokens_per_s_reencoded": round(tokens / min(again_s), 1),
        "speedup": round(min(again_s) / min(kept_s), 3),
    }


def round_trips(work: Path) -> dict:
    """Tool round trips per second and per hub CPU-second, through the calc run's own tool loop and sandbox."""
    import psutil
    import trio

    from hub.cli.build import tool_rollouts
    from shared.tools import rollout_key

    config, model, task = calc_run(work, TRIPS_ROUNDS, TRIPS_TOKENS)
    prompts = list(task.prompts())[:TRIPS_ROLLOUTS]
    call = '<tool_call>\n{"name": "mul", "arguments": {"a": 37, "b": 48}}\n</tool_call><|im_end|>'
    call_ids = tuple(model.tokenizer(call)["input_ids"])
    me = psutil.Process()

    def cpu_s() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])

    async def main() -> dict:
        agents = tool_rollouts(config, model, task)
        await agents.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agents.run)
                shown = await agents.open_evaluation("trips", prompts, 1)
                keys = [rollout_key("trips", p.id, 0) for p in shown]
                cpu, started, trips, ended = cpu_s(), time.perf_counter(), 0, 0
                for _ in range(TRIPS_ROUNDS):
                    answers = await agents.answer_evaluation([(key, call_ids) for key in keys])
                    trips += sum(not a.done for a in answers)
                    ended += sum(a.done for a in answers)
                wall, cpu = time.perf_counter() - started, cpu_s() - cpu
                await agents.close_evaluation("trips")
                nursery.cancel_scope.cancel()
        finally:
            agents.stop()
        return {
            "rollouts": len(keys),
            "round_trips": trips,
            "ended_early": ended,
            "tool_procs": config.agents.tool_procs,
            "wall_s": round(wall, 3),
            "hub_cpu_s": round(cpu, 3),
            "round_trips_per_s": round(trips / wall, 1),
            "round_trips_per_hub_core_s": round(trips / cpu, 1),
        }

    return trio.run(main)


def sandbox_cases() -> dict:
    """Each case's outcome through the production sandbox at the hub's default limits: the reason its rollout ends (or
    the tool's answer), and the seconds it took; then an honest call on the same sandbox, still answered."""
    import trio

    from hub.agents.sandbox import SandboxLimits, open_sandbox
    from hub.config import AgentsConfig

    a = AgentsConfig()
    limits = SandboxLimits(a.tool_wall_s, a.tool_cpu_s, a.tool_memory_mb << 20, a.environments_per_worker)
    tools = sorted({f"testbed.agent_tools:{name}" for _, name, _ in SANDBOX_CASES})

    async def main() -> dict:
        out = {}
        async with open_sandbox(tools, None, limits, procs=1) as sandbox:
            for case, name, arguments in SANDBOX_CASES:
                started = time.perf_counter()
                outcome = await sandbox.call(None, name, arguments, "bench")
                ended = outcome.end.value if outcome.end is not None else None
                out[case] = {
                    "ended": ended,
                    "answer": None if ended else outcome.text,
                    "s": round(time.perf_counter() - started, 2),
                }
        return out

    return {"limits": {"wall_s": a.tool_wall_s, "cpu_s": a.tool_cpu_s, "memory_mb": a.tool_memory_mb}, **trio.run(main)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards, calls = zip(*result["curve"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, label="reward (every rollout offered)")
    ax.plot(steps, calls, label="tool calls per rollout")
    ax.set_xlabel("learner step")
    ax.set_ylim(0, 1.05)
    ax.set_title(
        f"echo-hub start --task calc: {result['wall_s']:.0f} s, {result['accepted']} groups, {result['honest_rejected']} rejected"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="learner steps of the run")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--plot", type=Path, help="draw the reward and tool calls per rollout to this PNG")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which measurements, comma-separated, of {PARTS}")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.plot is not None and "run" not in parts:
        parser.error("--plot draws the run: add run to --parts")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="echo2-bench-agents-") as tmp:
        if "run" in parts:
            out = run(Path(tmp), args.steps, args.json)
        if "cache" in parts:
            out["turn_cache"] = {shape.name: turn_cache_speed(Path(tmp) / "cache", shape) for shape in CACHE_SHAPES}
        if "trips" in parts:
            out["tool_round_trips"] = round_trips(Path(tmp) / "trips")
        if "sandbox" in parts:
            out["sandbox"] = sandbox_cases()
    if args.plot is not None:
        plot(out, args.plot)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
