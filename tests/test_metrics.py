"""Metrics like TRL's: entropy, completion lengths, learning rate, the share of rollouts trained on and sample
completions (--log-completions), in metrics.jsonl and the trackers; checked by hand-computed values and on a
real hub whose cosine schedule survives a resume."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hub.config import TrackingConfig
from hub.training.learner import completion_lengths
from hub.training.metrics import (
    MetricsWriter,
    cut_completions_warning,
    lost_text,
    read_completions,
    read_lost,
    read_metrics,
    sample_completions,
)
from hub.training.trackers import LoggedCompletion, open_trackers
from shared.layout import METRICS_FILE
from shared.logprobs import completion_logprobs, completion_logprobs_and_entropy
from shared.rollout import Completion, Group


class FixedLogits(torch.nn.Module):
    """A causal LM stand-in whose next-token logits are always `row`: its head is a bias over zero weights."""

    def __init__(self, row: list[float]) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(1, len(row))
        with torch.no_grad():
            self.lm_head.weight.zero_()
            self.lm_head.bias.copy_(torch.tensor(row))
        self.config = SimpleNamespace(model_type="fixed", vocab_size=len(row))

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: torch.nn.Module) -> None:
        self.lm_head = head

    def forward(self, input_ids, position_ids, use_cache):  # noqa: ANN001, ANN201
        return SimpleNamespace(logits=self.lm_head(torch.zeros(*input_ids.shape, 1)))


def test_entropy_of_the_sampling_distribution() -> None:
    prompts, completions = [[1], [2, 3]], [[0, 1, 1], [1]]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    _, _, uniform = completion_logprobs_and_entropy(FixedLogits([0.0] * 5), prompts, completions)
    assert torch.allclose(uniform, math.log(5) * mask)
    # Probabilities 1/4 and 3/4: H = -(1/4 ln 1/4 + 3/4 ln 3/4).
    model = FixedLogits([0.0, math.log(3.0)])
    logprobs, got_mask, entropy = completion_logprobs_and_entropy(model, prompts, completions)
    assert torch.allclose(entropy, 0.5623351446 * mask) and torch.equal(got_mask, mask)
    assert torch.equal(logprobs, completion_logprobs(model, prompts, completions)[0])
    # top-p 0.5 keeps the likelier token only: nothing left to choose between.
    _, _, nucleus = completion_logprobs_and_entropy(model, prompts, completions, top_p=0.5)
    assert torch.equal(nucleus, torch.zeros_like(mask))


def group(prompt: str, lengths: list[int], reasons: list[str], rewards: list[float], version: int = 3) -> Group:
    return Group(
        prompt_id=prompt,
        prompt_text=prompt,
        version=version,
        rewards=tuple(rewards),
        completions=tuple(
            Completion(token_ids=tuple(range(n)), logprobs=(0.0,) * n, finish_reason=r, version=version, text=f"{prompt}{i}")
            for i, (n, r) in enumerate(zip(lengths, reasons))
        ),
    )


GROUPS = [group("a", [2, 10], ["stop", "length"], [1.0, 0.0]), group("b", [4, 4], ["stop", "stop"], [0.5, 0.25], 2)]


def test_completion_lengths_and_the_share_clipped() -> None:
    lengths = completion_lengths(GROUPS)
    assert (lengths.mean, lengths.max, lengths.clipped_ratio) == (5.0, 10, 0.25)


def test_cut_completions_warn_only_past_half_of_a_step() -> None:
    assert cut_completions_warning(3, 0.5, 10) is None
    line = cut_completions_warning(3, 0.75, 10)
    assert line is not None and line.startswith("75% of step 3's completions were cut at --max-new-tokens 10")


def test_sample_completions_spread_over_prompts() -> None:
    assert sample_completions(GROUPS, 3) == [
        LoggedCompletion("a", "a0", 1.0, 3),
        LoggedCompletion("b", "b0", 0.5, 2),
        LoggedCompletion("a", "a1", 0.0, 3),
    ]
    assert len(sample_completions(GROUPS, 10)) == 4 and sample_completions(GROUPS, 0) == []


def tensorboard_texts(directory: Path, tag: str) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in directory.iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


def test_completions_go_to_metrics_and_tensorboard_as_a_table(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    trackers = open_trackers(TrackingConfig(report_to=("tensorboard",), run_name="t"), tmp_path, {})
    writer = MetricsWriter(tmp_path / METRICS_FILE, trackers)
    writer.append_row({"step": 1, "loss": 0.5})
    writer.append_completions(1, [LoggedCompletion("say | hi", "hi\nthere", 1.0, 0)])
    trackers.close()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1]
    assert read_completions(tmp_path / METRICS_FILE) == [
        {"completions_step": 1, "completions": [{"prompt": "say | hi", "completion": "hi\nthere", "reward": 1.0, "version": 0}]}
    ]
    table = tensorboard_texts(tmp_path / "tensorboard", "train/completions/text_summary")[1]
    assert table.splitlines()[0] == "| step | prompt | completion | reward | version |"
    assert table.splitlines()[2] == "| 1 | say \\| hi | hi<br>there | 1.0 | 0 |"


def transformers_cosine(base: float, total: int, warmup: int) -> list[float]:
    """The learning rate of each of `total` optimizer steps under transformers' cosine schedule with warm-up."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total)
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_run_logs_like_trl_and_its_cosine_schedule_survives_a_resume(tmp_path: Path) -> None:
    """A hub stopped (Ctrl-C) after a few steps of 12 and started again: every step's lr is transformers' cosine
    with warm-up for 12 steps; each row has the TRL-like keys; --log-completions 4 puts 4 completions per step in
    metrics.jsonl and a table per step in TensorBoard."""
    from testbed.harness import query, start_hub, wait_until

    data = tmp_path / "data"
    args = (
        "--max-steps",
        "12",
        "--lr-scheduler-type",
        "cosine",
        "--warmup-ratio",
        "0.25",
        "--learning-rate",
        "1e-3",
        "--num-generations",
        "4",
        "--prompts-per-step",
        "4",
        "--local-nodes",
        "2",
        "--log-completions",
        "4",
        "--report-to",
        "tensorboard",
        "--save-steps",
        "100",
    )
    hub = start_hub(data, *args)
    try:
        wait_until(lambda: len(read_metrics(data / METRICS_FILE)) >= 3, 300, "three steps")
        assert hub.stop() == 130, hub.output()[-3000:]  # stopped by Ctrl-C, its state saved
    finally:
        hub.kill()
    first = len(read_metrics(data / METRICS_FILE))
    assert first < 12, "the run ended before it was stopped: nothing resumed"
    hub = start_hub(data, *args)
    try:
        assert hub.process.wait(timeout=400) == 0, hub.output()[-3000:]
    finally:
        hub.kill()
    assert query(data, "SELECT detail FROM events WHERE kind = 'learner_resume'")
    rows = {r["step"]: r for r in read_metrics(data / METRICS_FILE)}
    assert sorted(rows) == list(range(1, 13))
    expected = transformers_cosine(1e-3, 12, 3)
    assert [rows[s]["lr"] for s in range(1, 13)] == pytest.approx(expected, abs=1e-12), (first, expected)
    for row in rows.values():
        assert row["entropy"] > 0 and 1 <= row["completion_length_mean"] <= row["completion_length_max"] <= 10
        assert 0 <= row["clipped_ratio"] <= 1 and 0 < row["trained_share"] <= 1
    documented = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    undocumented = {
        key for row in rows.values() for key in row if f"`{key}`" not in documented and not key.startswith("rewards/")
    }  # `rewards/<name>/mean`
    assert not undocumented, f"metrics keys missing from docs/operations.md: {sorted(undocumented)}"
    logged = {r["completions_step"]: r["completions"] for r in read_completions(data / METRICS_FILE)}
    assert sorted(logged) == list(range(1, 13))
    for step, completions in logged.items():
        assert len(completions) == 4
        assert all(c["prompt"] and isinstance(c["reward"], float) and c["version"] < step for c in completions)
    tables = tensorboard_texts(data / "tensorboard", "train/completions/text_summary")
    assert sorted(tables) == list(range(1, 13))
    assert all(len(table.splitlines()) == 2 + 4 for table in tables.values())


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_completions_go_to_wandb_and_trackio_as_a_table(tmp_path: Path, tracker: str, monkeypatch) -> None:
    from tests.test_trackers import needs, trackio_metrics, wandb_run_files

    needs(tracker)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    trackers = open_trackers(TrackingConfig(report_to=(tracker,), run_name="t"), tmp_path, {})
    MetricsWriter(tmp_path / METRICS_FILE, trackers).append_completions(1, [LoggedCompletion("p", "c", 1.0, 0)])
    assert [name for name, _ in trackers.trackers] == [tracker]  # not dropped as failed
    trackers.close()
    if tracker == "wandb":
        (run_file,) = wandb_run_files(tmp_path / "wandb")
        assert b"train/completions" in run_file.read_bytes()
    else:
        import trackio.utils

        # trackio fixes its directory at its first import: another test of this process may have chosen it.
        assert "train/completions" in trackio_metrics(trackio.utils.TRACKIO_DIR, "echo2")


def test_steps_lost_in_a_crash_are_a_row_of_the_file_only_and_read_back_in_order(tmp_path: Path) -> None:
    logged: list[dict] = []
    writer = MetricsWriter(tmp_path / METRICS_FILE, SimpleNamespace(log=logged.append))
    writer.append_row({"step": 1, "reward_mean": 0.5, "lost_steps_from": 7.0})  # a reward's metric of that name
    writer.append_lost(2, 9, 1)
    writer.append_row({"step": 10, "reward_mean": 0.5})
    writer.append_lost(10, 10, 1)
    assert read_lost(tmp_path / METRICS_FILE) == [(2, 9), (10, 10)]
    assert [row["step"] for row in read_metrics(tmp_path / METRICS_FILE)] == [1, 10]  # plots' step rows are steps only
    assert [row["step"] for row in logged] == [1, 10]  # the trackers' rows are steps
    assert read_lost(tmp_path / "none.jsonl") == []
    assert [lost_text(s) for s in ((2, 9), (10, 10), None)] == ["steps 2-9", "step 10", "none"]
