"""The sampling test's figures (hub/trust/sampling.py): how close honest nodes come to being condemned, and how many
re-scored groups each kind of chosen completion takes to be caught.

Honest groups are sampled by the nodes' own sampler (shared.generation.Sampler) from the embedded default model, in
fp32 and in bf16 (an engine a few hundredths of a nat from the hub's recomputation), at temperature 1.0 and at 0.7
with top-p 0.95; and from a collapsed policy (the same model with its head scaled up: one answer, near certain).
Every group is scored by the hub's own functions, as an audit scores it (completion_logprobs_and_power_sums, the
audit's judge on its log-probs and nucleus, group_evidence, SamplingTest): a cheat is caught by whichever fails first.
The cheats claim their tokens' true log-probs, so the log-prob gap never fails them; under top-p, tokens outside the
nucleus do (at most `audit_max_outside_frac` of a group's).

Cheats, each by a node of its own:
- random: completions of uniformly random tokens, of honest lengths, with their true log-probs;
- greedy: the most likely token at every step;
- edited: an honest group with one token per completion replaced by a random one;
- best_of_k: of k honest completions per slot, the one with the highest reward (what a node can gain by choosing
  among honest samples; its reward bias is reported beside its evidence).

Copies (`--copies N`): N honest groups from half-collapsed policies (the head scaled 2x and 3x: a few answers
repeated across prompts, the trial's collapse) through the hub's copy detector (hub/trust/copies.py), as honest
nodes claim them: how many repeat an earlier group, how surprising the most surprising repeat was, and how many the
detector calls copies (it must be 0).

Usage: python bench/sampling.py [--groups 200] [--copies 20000] [--json] [--plot docs/plots/sampling.png]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch

from hub.config import AUDIT_GAP_BY_DTYPE, TrustConfig
from hub.trust.audit import gap_stats, judge
from hub.trust.copies import CopyDetector, group_fingerprint
from hub.trust.sampling import SAMPLING_ORDERS, GroupEvidence, SamplingTest, group_evidence
from shared.default_model import ensure_default_model
from shared.generation import Sampler
from shared.logprobs import completion_logprobs_and_power_sums
from shared.rollout import Completion, Group, SamplingParams
from shared.tasks.reverse import ReverseTask

GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
BEST_OF = 4
# The collapsed policy: the head's logits scaled by this, so the model's most likely answer is near certain.
COLLAPSE_SCALE = 6.0


@dataclass
class Setup:
    name: str
    sampling: SamplingParams
    engine_dtype: torch.dtype
    collapsed: bool


SETUPS = [
    Setup("T=1.0", SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS), torch.float32, False),
    Setup("T=1.0 bf16 engine", SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS), torch.bfloat16, False),
    Setup("T=0.7 top-p 0.95", SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=MAX_NEW_TOKENS), torch.float32, False),
    Setup("T=1.0 collapsed", SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS), torch.float32, True),
    Setup(
        "T=0.7 top-p 0.95 collapsed",
        SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=MAX_NEW_TOKENS),
        torch.float32,
        True,
    ),
]
CHEATS = ("random", "greedy", "edited", "best_of_k")


def load(model_dir: Path, dtype: torch.dtype, collapsed: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if collapsed:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(COLLAPSE_SCALE)
    return model


class Scorer:
    """The hub's side: re-scores a group with the claimed policy in fp32, as an audit does."""

    def __init__(self, model, tokenizer, sampling: SamplingParams, slack_nats: float) -> None:
        self.model, self.tokenizer, self.sampling, self.slack_nats = model, tokenizer, sampling, slack_nats
        self.trust = TrustConfig()

    def evidence(self, prompt: str, token_ids: list[list[int]]) -> tuple[GroupEvidence, str]:
        """The group's evidence, and why the audit fails it on its true log-probs ("" if it passes)."""
        ids = self.tokenizer(prompt)["input_ids"]
        s = self.sampling
        with torch.inference_mode():
            logprobs, mask, sums = completion_logprobs_and_power_sums(
                self.model, [ids] * len(token_ids), token_ids, SAMPLING_ORDERS, s.temperature, s.top_p, s.top_k, s.min_p
            )
        audit = judge(gap_stats(logprobs, logprobs, mask), self.slack_nats, self.trust.audit_max_outside_frac)
        return group_evidence(logprobs, sums, mask, self.slack_nats), audit.reason


def sample(sampler: Sampler, prompt: str, n: int, sampling: SamplingParams, greedy: bool = False) -> list[Completion]:
    return sampler.generate([prompt], n, sampling, version=0, greedy=greedy)[0]


def cheat_group(kind: str, rng: random.Random, sampler: Sampler, prompt, task: ReverseTask, sampling, vocab: int):
    """A cheat's token ids for one group, and its mean reward gain over honest sampling (best_of_k only)."""
    if kind == "greedy":
        return [list(c.token_ids) for c in sample(sampler, prompt.text, GROUP_SIZE, sampling, greedy=True)], None
    honest = sample(sampler, prompt.text, GROUP_SIZE * (BEST_OF if kind == "best_of_k" else 1), sampling)
    ids = [list(c.token_ids) for c in honest]
    if kind == "random":
        return [[rng.randrange(vocab) for _ in row] for row in ids[:GROUP_SIZE]], None
    if kind == "edited":
        for row in ids:
            row[rng.randrange(len(row))] = rng.randrange(vocab)
        return ids, None
    rewards = list(task.rewards(prompt, [c.text for c in honest]))
    chosen = [max(range(i, len(ids), GROUP_SIZE), key=lambda j: rewards[j]) for i in range(GROUP_SIZE)]
    gain = sum(rewards[j] for j in chosen) / GROUP_SIZE - sum(rewards) / len(rewards)
    return [ids[j] for j in chosen], gain


def run_setup(setup: Setup, model_dir: Path, groups: int, seed: int, false_alarm: float, kinds: list[str]) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hub_model = load(model_dir, torch.float32, setup.collapsed)
    engine_model = hub_model if setup.engine_dtype == torch.float32 else load(model_dir, setup.engine_dtype, setup.collapsed)
    sampler = Sampler(engine_model, tokenizer, torch.device("cpu"))
    slack = AUDIT_GAP_BY_DTYPE["bfloat16" if setup.engine_dtype == torch.bfloat16 else "float32"]
    scorer = Scorer(hub_model, tokenizer, setup.sampling, slack)
    task = ReverseTask()
    prompts = task.prompts()
    vocab = hub_model.get_output_embeddings().weight.shape[0]
    honest = SamplingTest(false_alarm)
    peak, per_token, tokens, trace = 0.0, [0.0] * len(SAMPLING_ORDERS), 0, []
    started = time.perf_counter()
    for _ in range(groups):
        prompt = rng.choice(prompts)
        evidence, _ = scorer.evidence(
            prompt.text, [list(c.token_ids) for c in sample(sampler, prompt.text, GROUP_SIZE, setup.sampling)]
        )
        assert honest.add("honest", evidence) is None, f"{setup.name}: an honest node was condemned"
        peak = max(peak, honest.statistic("honest"))
        trace.append(honest.statistic("honest"))
        per_token = [a + b for a, b in zip(per_token, evidence.log_e)]
        tokens += evidence.tokens
    honest_s = time.perf_counter() - started
    cheats = {}
    for kind in kinds:
        test, caught, by, gains, cheat_trace = SamplingTest(false_alarm), None, None, [], []
        for index in range(groups):
            prompt = rng.choice(prompts)
            ids, gain = cheat_group(kind, rng, sampler, prompt, task, setup.sampling, vocab)
            if gain is not None:
                gains.append(gain)
            evidence, audit_failure = scorer.evidence(prompt.text, ids)
            condemned = test.add(kind, evidence)
            cheat_trace.append(test.threshold_nats if condemned else test.statistic(kind))
            if condemned is not None or audit_failure:
                caught, by = index + 1, "audit: " + audit_failure if audit_failure else "sampling test"
                break
        cheats[kind] = {
            "caught_after_groups": caught,
            "caught_by": by,
            "groups_tried": len(cheat_trace),
            "statistic_nats": cheat_trace[-1],
            "reward_gain": sum(gains) / len(gains) if gains else None,
            "trace": cheat_trace,
        }
    return {
        "setup": setup.name,
        "groups": groups,
        "threshold_nats": honest.threshold_nats,
        "slack_nats_per_token": slack,
        "honest_peak_statistic_nats": peak,
        "honest_mean_log_e_per_token": [x / max(1, tokens) + slack for x in per_token],
        "honest_tokens": tokens,
        "scoring_ms_per_group": 1000 * honest_s / groups,
        "honest_trace": trace,
        "cheats": cheats,
    }


def run_copies(model_dir: Path, groups: int, scale: float, seed: int) -> dict:
    """`groups` honest groups of a policy with its head scaled by `scale`, each checked as the hub checks it."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load(model_dir, torch.float32, collapsed=False)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    sampler = Sampler(model, tokenizer, torch.device("cpu"))
    trust = TrustConfig()
    detector = CopyDetector(trust.copy_cache_groups, GROUP_SIZE, trust.copy_false_alarm, AUDIT_GAP_BY_DTYPE["float32"])
    prompts = ReverseTask().prompts()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS)
    seen: set[bytes] = set()
    repeats = flagged = disputed = 0
    entropy_nats = 0.0
    started = time.perf_counter()
    batch = 64
    for start in range(0, groups, batch):
        chosen = [rng.choice(prompts) for _ in range(min(batch, groups - start))]
        for i, (prompt, completions) in enumerate(
            zip(chosen, sampler.generate([p.text for p in chosen], GROUP_SIZE, sampling, 0))
        ):
            group = Group(
                prompt_id=prompt.id,
                prompt_text=prompt.text,
                version=0,
                completions=tuple(completions),
                rewards=(0.0,) * GROUP_SIZE,
                node_id="n",
            )
            entropy_nats -= sum(sum(c.logprobs) for c in completions) / GROUP_SIZE
            fingerprint = group_fingerprint(group)
            repeats += fingerprint in seen
            seen.add(fingerprint)
            verdict = detector.check(group, f"node{(start + i) % 3}", f"L{start + i}")
            if verdict is not None and not hasattr(verdict, "surprise_nats"):  # Disputed: the hub recomputes (honest)
                disputed += 1
                verdict = detector.settle(group, f"node{(start + i) % 3}", f"L{start + i}", None)
            flagged += verdict is not None
    return {
        "head_scale": scale,
        "groups": groups,
        "distinct_groups": len(seen),
        "whole_group_repeats": repeats,
        "mean_completion_nats": entropy_nats / groups,
        "disputed": disputed,
        "called_copies": flagged,
        "threshold_nats_at_end": detector.threshold_nats,
        "wall_s": time.perf_counter() - started,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"random": "tab:blue", "greedy": "tab:orange", "edited": "tab:purple", "best_of_k": "tab:red"}
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, result in zip(axes[0], results):
        for kind, cheat in result["cheats"].items():
            caught = f"caught after {cheat['caught_after_groups']}" if cheat["caught_after_groups"] else "not caught"
            steps = range(1, len(cheat["trace"]) + 1)
            ax.plot(steps, cheat["trace"], marker="o", markersize=3, color=colors[kind], label=f"{kind} ({caught})")
        ax.plot(range(1, len(result["honest_trace"]) + 1), result["honest_trace"], color="tab:green", label="honest")
        ax.axhline(result["threshold_nats"], color="black", linestyle="--", label="threshold")
        ax.set_title(result["setup"], fontsize=9)
        ax.set_xlabel("groups re-scored")
        ax.set_xscale("log")
        ax.legend(fontsize=6, loc="center right")
    axes[0][0].set_ylabel("evidence (CUSUM statistic, nats)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200, help="honest groups per setup, and most groups per cheat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setups", default=",".join(s.name for s in SETUPS), help="comma-separated setup names")
    parser.add_argument("--cheats", default=",".join(CHEATS), help="comma-separated cheats to run")
    parser.add_argument("--copies", type=int, default=0, help="honest collapsed groups through the copy detector")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="write the statistics' paths to this PNG")
    args = parser.parse_args(argv)
    names = args.setups.split(",")
    kinds = args.cheats.split(",")
    unknown = [n for n in names if n not in {s.name for s in SETUPS}] + [k for k in kinds if k not in CHEATS]
    if unknown or args.groups < 0 or args.copies < 0:
        print(f"error: {unknown} unknown (setups: {[s.name for s in SETUPS]}, cheats: {CHEATS}), or a count < 0", file=sys.stderr)
        return 2
    model_dir = ensure_default_model(progress=False)
    false_alarm = TrustConfig().sampling_false_alarm
    copies = []
    for scale in (2.0, 3.0) if args.copies else ():
        copies.append(run_copies(model_dir, args.copies, scale, args.seed))
        print(f"copies, head x{scale:g}: {copies[-1]}", file=sys.stderr, flush=True)
    results = []
    for setup in [s for s in SETUPS if s.name in names and args.groups]:
        results.append(run_setup(setup, model_dir, args.groups, args.seed, false_alarm, kinds))
        r = results[-1]
        print(
            f"{r['setup']:>28}: honest peak {r['honest_peak_statistic_nats']:.1f} of {r['threshold_nats']:.1f} nats; "
            + ", ".join(f"{k} caught after {c['caught_after_groups']}" for k, c in r["cheats"].items()),
            file=sys.stderr,
            flush=True,
        )
    if args.plot is not None and results:
        plot(results, args.plot)
    if args.json:
        for r in results:
            r.pop("honest_trace")
            for c in r["cheats"].values():
                c.pop("trace")
        print(json.dumps({"sampling": results, "copies": copies}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
