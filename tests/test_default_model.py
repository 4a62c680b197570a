from __future__ import annotations

import dataclasses
import json
import re
import threading

import pytest
import torch

import shared.default_model as dm
from shared.tasks.reverse import ReverseTask


def test_reverse_task_prompts_are_deterministic_and_well_formed():
    task = ReverseTask()
    prompts = task.prompts()
    assert len(prompts) == 4096
    assert [p.id for p in prompts[:3]] == ["rev-0", "rev-1", "rev-2"]
    assert prompts == ReverseTask().prompts()
    assert prompts != ReverseTask(seed=5).prompts()
    assert len({p.text for p in prompts}) == len(prompts)
    for p in prompts:
        assert re.fullmatch(r"[a-z]{3,7}>", p.text)
        assert task.target(p) == p.text[:-1][::-1]
    assert len(ReverseTask(size=10).prompts()) == 10


def test_reverse_task_reward_is_exact_match():
    task = ReverseTask()
    prompt = task.get("rev-0")
    word = prompt.text[:-1]
    assert task.reward(prompt, word[::-1]) == 1.0
    assert task.reward(prompt, f" {word[::-1]}\n") == 1.0
    assert task.reward(prompt, word[::-1] + "x") == 0.0
    assert task.reward(prompt, word) == (1.0 if word == word[::-1] else 0.0)
    assert task.reward(prompt, "") == 0.0


def test_recipe_digest_names_the_cache_dir(tmp_path):
    other = dataclasses.replace(dm.DEFAULT_MODEL_RECIPE, warmup_steps=1)
    assert dm.default_model_dir(tmp_path) != dm.default_model_dir(tmp_path, other)
    assert dm.default_model_dir(tmp_path).parent == tmp_path
    assert dm.DEFAULT_MODEL_RECIPE.digest() == dm.DefaultModelRecipe().digest()


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV_VAR, str(tmp_path))
    assert dm.default_model_dir().parent == tmp_path


def test_tokenizer_round_trip(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert len(tok) == 49
    assert tok.padding_side == "left"
    assert tok.convert_ids_to_tokens([tok.pad_token_id, tok.eos_token_id]) == ["<pad>", "<eos>"]
    text = dm.CHARACTERS + " qwert> trewq"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    batch = tok(["ab>", "abcd>"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1]


def test_default_model_reloads_and_generates(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stats = json.loads((default_model_dir / dm.BUILD_STATS_FILE).read_text())["stats"]
    assert 0.1 <= stats["warmup_accuracy"] <= 0.35
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == stats["params"] == 1_057_536
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tok(["abc>", "qwerty>"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=9)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - enc["input_ids"].shape[1] <= 9
    greedy = model.generate(**tok(["abc>"], return_tensors="pt"), do_sample=False, max_new_tokens=9)
    assert tok.decode(greedy[0, 4:], skip_special_tokens=True).isalpha()


def test_ensure_builds_once_under_concurrent_callers(tmp_path, monkeypatch):
    tiny = dataclasses.replace(
        dm.DEFAULT_MODEL_RECIPE,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        warmup_steps=2,
        batch_size=4,
        eval_prompts=4,
    )
    builds = []
    real_build = dm.build_default_model

    def counting_build(out_dir, recipe, on_step=None):
        builds.append(out_dir)
        return real_build(out_dir, recipe, on_step)

    monkeypatch.setattr(dm, "build_default_model", counting_build)
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path, progress=False, recipe=tiny)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [dm.default_model_dir(tmp_path, tiny)] * 3
    assert (results[0] / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [results[0].name]  # no temp dir left


def test_failed_build_leaves_no_model_dir(tmp_path, monkeypatch):
    def failing_build(out_dir, recipe, on_step=None):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(dm, "build_default_model", failing_build)
    with pytest.raises(RuntimeError, match="boom"):
        dm.ensure_default_model(tmp_path, progress=False)
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []
