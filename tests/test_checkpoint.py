"""Checkpoint files: written whole or not at all, pruned without ever exposing a partial directory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hub.training.checkpoint as checkpoint
from hub.training.checkpoint import latest_checkpoint, list_checkpoints, remove_stale_temporaries, save_checkpoint


@pytest.fixture(scope="module")
def policy(default_model_dir):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return model, tokenizer, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_keeps_newest_and_restores_weights(tmp_path, policy):
    model, tokenizer, optimizer = policy
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, step + 100, model, tokenizer, optimizer, keep=2)
    assert [(c.step, c.version) for c in list_checkpoints(tmp_path)] == [(4, 104), (6, 106)]
    latest = latest_checkpoint(tmp_path)
    restored = AutoModelForCausalLM.from_pretrained(latest.model_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]


def test_kill_while_pruning_leaves_only_complete_checkpoints(tmp_path, policy, monkeypatch):
    model, tokenizer, optimizer = policy
    save_checkpoint(tmp_path, 2, 2, model, tokenizer, optimizer, keep=1)

    def killed_halfway(path, *args, **kwargs):
        # A SIGKILL inside rmtree: some files are gone, the directory is not.
        (path / checkpoint.STATE_FILE).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, 4, model, tokenizer, optimizer, keep=1)
    monkeypatch.undo()

    assert [c.step for c in list_checkpoints(tmp_path)] == [4]
    assert remove_stale_temporaries(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_a_step_directory_without_state_is_never_resumed_from(tmp_path, policy, caplog):
    model, tokenizer, optimizer = policy
    save_checkpoint(tmp_path, 2, 2, model, tokenizer, optimizer)
    (tmp_path / "step-00000004" / "model").mkdir(parents=True)  # damaged by hand, or by an older echo2
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    assert "step-00000004" in caplog.text and "not a complete checkpoint" in caplog.text


def test_refuses_to_overwrite_a_step(tmp_path, policy):
    model, tokenizer, optimizer = policy
    save_checkpoint(tmp_path, 2, 2, model, tokenizer, optimizer)
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path, 2, 2, model, tokenizer, optimizer)


def test_a_checkpoint_is_due_by_steps_or_by_time_bounded_by_its_own_cost():
    due = checkpoint.checkpoint_due
    assert due(10, 10, 0.0, 60.0, 0.0)  # the step count
    assert not due(11, 10, 59.9, 60.0, 0.0)
    assert due(11, 10, 60.0, 60.0, 0.0)  # the seconds since the last one
    # One that took 5 s is not repeated by time within 5 / CHECKPOINT_TIME_SHARE = 100 s (at most 5% of the time) ...
    assert checkpoint.CHECKPOINT_TIME_SHARE == 0.05
    assert not due(11, 10, 99.9, 60.0, 5.0) and due(11, 10, 100.0, 60.0, 5.0)
    # ... but the step count still holds.
    assert due(20, 10, 1.0, 60.0, 5.0)


def test_the_steps_a_resume_loses_are_those_after_its_checkpoint_not_said_before():
    lost = checkpoint.lost_steps
    assert lost(129, 120) == (121, 129)
    assert lost(120, 120) is None and lost(0, 0) is None
    assert lost(5, 0) == (1, 5)  # no checkpoint: the starting model
    # A second crash before the next checkpoint: the first resume said steps 121-129 already.
    assert lost(135, 120, [(121, 129)]) == (130, 135)
    assert lost(129, 120, [(121, 129)]) is None
    # A span lost before an older checkpoint says nothing of this one.
    assert lost(135, 130, [(101, 109), (121, 129)]) == (131, 135)
