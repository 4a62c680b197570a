"""The model identity (shared/model_identity.py): read once from the embedded default and from a small Qwen2 model
with a chat template; the same files give the same fingerprint in any process, another tokenizer, chat template or
EOS set another one; a spawned process rebuilds the hub's identity from its description, and is refused when the
directory changed meanwhile."""

from __future__ import annotations

import multiprocessing
import pickle
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from hub.config import HubConfig
from shared.model_identity import ModelChanged, ModelSource, load_model_identity
from shared.model_io import model_dir_config_hash
from testbed.models import random_model_dir

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen2 model saved with save_pretrained, its tokenizer given a chat template."""
    from transformers import AutoTokenizer

    directory = random_model_dir(tmp_path_factory.mktemp("qwen2") / "model", arch="qwen2")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def copy_of(model_dir: Path, to: Path) -> Path:
    shutil.copytree(model_dir, to)
    return to


def test_the_default_models_identity(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = load_model_identity(default_model_dir)
    eos = AutoTokenizer.from_pretrained(default_model_dir).eos_token_id
    assert model.stop_ids == {eos}
    assert model.config_hash == model_dir_config_hash(default_model_dir)  # what nodes and snapshots name it by
    assert model.context == 64 and model.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        model.chat_renderer()
    again = load_model_identity(default_model_dir)
    assert again.fingerprint == model.fingerprint and len(model.fingerprint) == 64
    # Copies for components of their own: other objects, the same behaviour; the shared ones are left as they were.
    copy = model.tokenizer_copy()
    assert copy is not model.tokenizer and copy("abc>")["input_ids"] == model.tokenizer("abc>")["input_ids"]
    config = model.config_copy()
    config.dtype = "bfloat16"
    assert model.config.dtype != "bfloat16"
    assert pickle.loads(pickle.dumps(model.source)) == ModelSource(default_model_dir, model.fingerprint)


def test_a_qwen2_model_with_a_chat_template(qwen2_dir: Path, default_model_dir: Path) -> None:
    model = load_model_identity(qwen2_dir)
    assert model.chat_template == TEMPLATE and model.context == 256
    render = model.chat_renderer()
    assert render(({"role": "user", "content": "abc"},)) == "<user>abc<assistant>"
    assert model.stop_ids == load_model_identity(default_model_dir).stop_ids  # the default's tokenizer, same EOS
    assert model.config_hash != load_model_identity(default_model_dir).config_hash
    assert load_model_identity(qwen2_dir).fingerprint == model.fingerprint


def test_another_tokenizer_chat_template_or_eos_set_is_another_identity(qwen2_dir: Path, tmp_path: Path) -> None:
    """Each change leaves config.json as it was (the same config hash, which nodes compare), and changes the
    fingerprint."""
    from transformers import AutoTokenizer, GenerationConfig

    base = load_model_identity(qwen2_dir)

    template = copy_of(qwen2_dir, tmp_path / "template")
    tokenizer = AutoTokenizer.from_pretrained(template)
    tokenizer.chat_template = TEMPLATE.replace("<assistant>", "<bot>")
    tokenizer.save_pretrained(template)

    vocabulary = copy_of(qwen2_dir, tmp_path / "vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(vocabulary)
    tokenizer.add_tokens(["<tool_call>"])
    tokenizer.save_pretrained(vocabulary)

    eos = copy_of(qwen2_dir, tmp_path / "eos")
    generation = GenerationConfig.from_pretrained(eos)
    generation.eos_token_id = [base.tokenizer.eos_token_id, 5]
    generation.save_pretrained(eos)

    changed = {name: load_model_identity(tmp_path / name) for name in ("template", "vocabulary", "eos")}
    assert {m.config_hash for m in changed.values()} == {base.config_hash}
    assert len({base.fingerprint, *(m.fingerprint for m in changed.values())}) == 4
    assert changed["eos"].stop_ids == {base.tokenizer.eos_token_id, 5}
    assert load_model_identity(tmp_path / "template").fingerprint == changed["template"].fingerprint


def rules_stop_ids(config_json: str, source: ModelSource) -> frozenset[int]:
    """In a spawned process: the submission rules as a check worker builds them (hub/cli/build.py), their stop ids."""
    from hub.cli.build import load_submission_rules

    return load_submission_rules(config_json, source).stop_ids


def test_a_spawned_process_rebuilds_the_identity_and_refuses_a_changed_directory(qwen2_dir: Path, tmp_path: Path) -> None:
    """What a check worker does: the identity read again in a process of its own has the hub's fingerprint; once the
    chat template on disk changed, the worker is refused with one line saying so."""
    from transformers import AutoTokenizer

    model_dir = copy_of(qwen2_dir, tmp_path / "model")
    model = load_model_identity(model_dir)
    config_json = HubConfig().model_dump_json()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as worker:
        assert worker.submit(rules_stop_ids, config_json, model.source).result() == model.stop_ids
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = None
        tokenizer.save_pretrained(model_dir)
        (model_dir / "chat_template.jinja").unlink(missing_ok=True)
        with pytest.raises(ModelChanged, match=r"the model in .* changed since this run started"):
            worker.submit(rules_stop_ids, config_json, model.source).result()
