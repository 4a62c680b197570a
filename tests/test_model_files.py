"""Volunteers bring no model: the hub offers its config and tokenizer files (MODEL_PROTOCOL), a node without
--model checks each against the hub's list before writing it and builds its engine from them; a node with
another --model is refused with a line naming the hub's model."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from pydantic import ValidationError

from shared.layout import NODE_LOG_FILE, NODE_MODEL_DIR
from shared.messages import (
    MODEL_FILE_MAX_BYTES,
    MODEL_FILES_MAX_BYTES,
    MODEL_FILES_MAX_COUNT,
    ModelFile,
    ModelFiles,
    ModelFilesRequest,
    Reject,
    RejectCode,
)
from shared.model_files import ModelFilesRefused, model_label, model_offer, write_model_file
from shared.snapshot import blake3_hex
from testbed.harness import start_hub, start_node, wait_until

CONFIG = b'{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 50}'


def entry(name: str, data: bytes) -> ModelFile:
    return ModelFile(name=name, size=len(data), blake3=blake3_hex(data))


def listing(*files: ModelFile, lora: bool = False) -> ModelFiles:
    return ModelFiles(model="m (A, vocab 50)", weights_in_snapshots=not lora, files=files)


# -- the list's bounds: every field is hostile until these pass --------------------------------------------


@pytest.mark.parametrize(
    "name", ["../config.json", "a/b.json", "..", ".hidden", "", "x" * 101, "a\\b", "tok\n.json", "/etc/passwd"]
)
def test_a_file_name_that_is_no_plain_name_is_refused(name):
    with pytest.raises(ValidationError):
        ModelFile(name=name, size=1, blake3="0" * 64)
    with pytest.raises(ValidationError):
        ModelFilesRequest(name=name)


def test_sizes_counts_and_hashes_are_bounded():
    with pytest.raises(ValidationError):
        ModelFile(name="tokenizer.json", size=MODEL_FILE_MAX_BYTES + 1, blake3="0" * 64)
    with pytest.raises(ValidationError):
        ModelFile(name="tokenizer.json", size=-1, blake3="0" * 64)
    with pytest.raises(ValidationError):
        ModelFile(name="tokenizer.json", size=1, blake3="xyz")
    config = entry("config.json", CONFIG)
    big = [
        ModelFile(name=f"v{i}.txt", size=MODEL_FILE_MAX_BYTES, blake3="0" * 64)
        for i in range(MODEL_FILES_MAX_BYTES // MODEL_FILE_MAX_BYTES + 1)
    ]
    with pytest.raises(ValidationError, match="MODEL_FILES_MAX_BYTES"):
        listing(config, *big)
    with pytest.raises(ValidationError):
        listing(config, *[entry(f"f{i}.txt", b"") for i in range(MODEL_FILES_MAX_COUNT)])
    with pytest.raises(ValidationError, match="repeat"):
        listing(config, config)
    with pytest.raises(ValidationError, match="config.json"):
        listing(entry("tokenizer.json", b"{}"))
    assert listing(config).files == (config,)


# -- the node's check-then-write --------------------------------------------------------------------------


def test_a_file_lands_only_when_its_size_and_hash_match_the_list(tmp_path):
    good = entry("config.json", CONFIG)
    with pytest.raises(ModelFilesRefused, match="blake3"):
        write_model_file(tmp_path, good, CONFIG.replace(b"50", b"51"))
    with pytest.raises(ModelFilesRefused, match="bytes"):
        write_model_file(tmp_path, good, CONFIG + b" ")
    # A list entry built without its validation (model_construct) is checked again at the write.
    with pytest.raises(ModelFilesRefused, match="plain config or tokenizer file name"):
        write_model_file(
            tmp_path, ModelFile.model_construct(name="../x.json", size=len(CONFIG), blake3=blake3_hex(CONFIG)), CONFIG
        )
    # Weights, a weight index or code from a hostile hub: from_pretrained would load them instead of a snapshot.
    for name in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "modeling_evil.py"):
        with pytest.raises(ModelFilesRefused, match="plain config or tokenizer file name"):
            write_model_file(tmp_path, entry(name, CONFIG), CONFIG)
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "x.json").exists()
    write_model_file(tmp_path, good, CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"] and (tmp_path / "config.json").read_bytes() == CONFIG


class FakeHub:
    """A HubClient's model calls answered from a dict: what a hostile hub could send."""

    def __init__(self, files: ModelFiles | Reject, served: dict[str, bytes]) -> None:
        self.files, self.served, self.asked = files, served, []

    async def model_files(self):
        return self.files

    async def model_file(self, e: ModelFile):
        self.asked.append(e.name)
        return self.served[e.name]


def test_the_node_refuses_a_file_that_is_not_what_the_list_says_and_keeps_what_it_holds(tmp_path):
    from node.model_fetch import fetch_hub_model

    tok = b'{"model": {}}'
    files = listing(entry("config.json", CONFIG), entry("tokenizer.json", tok))
    hostile = FakeHub(files, {"config.json": CONFIG, "tokenizer.json": b'{"model": []}'})
    with pytest.raises(ModelFilesRefused, match="tokenizer.json does not match its blake3"):
        trio.run(fetch_hub_model, hostile, tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]
    (tmp_path / "model" / "vocab.txt").write_text("another model's")
    honest = FakeHub(files, {"config.json": CONFIG, "tokenizer.json": tok})
    assert trio.run(fetch_hub_model, honest, tmp_path / "model") == files
    assert honest.asked == ["tokenizer.json"]  # config.json was held already
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "tokenizer.json"]
    lora = FakeHub(listing(entry("config.json", CONFIG), lora=True), {})
    with pytest.raises(ModelFilesRefused, match="LoRA adapters on m .* start the node with --model"):
        trio.run(fetch_hub_model, lora, tmp_path / "lora")
    refused = FakeHub(Reject(code=RejectCode.NOT_HELD, reason="this hub offers no model files"), {})
    with pytest.raises(ModelFilesRefused, match="offers no model files"):
        trio.run(fetch_hub_model, refused, tmp_path / "none")


def test_a_throttled_file_is_asked_again_later_not_taken_for_a_refusal(tmp_path):
    """The hub serves model files per address (several nodes behind one NAT share it): a busy reply keeps what
    was written and is retried, where a refusal ends the node."""
    from node.model_fetch import ModelFilesBusy, fetch_hub_model

    tok = b'{"model": {}}'
    files = listing(entry("config.json", CONFIG), entry("tokenizer.json", tok))
    busy = Reject(code=RejectCode.BUSY, reason="model files from this address: retry in 60s")
    throttled = FakeHub(files, {"config.json": CONFIG, "tokenizer.json": busy})
    with pytest.raises(ModelFilesBusy, match="tokenizer.json: model files from this address"):
        trio.run(fetch_hub_model, throttled, tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]
    later = FakeHub(files, {"config.json": CONFIG, "tokenizer.json": tok})
    assert trio.run(fetch_hub_model, later, tmp_path / "model") == files
    assert later.asked == ["tokenizer.json"]


def test_the_hub_offers_configs_and_tokenizer_never_weights(default_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir)
    label = model_label(default_model_dir, config)
    assert label == f"{Path(default_model_dir).name} (Qwen2ForCausalLM, vocab {config.vocab_size})"
    offer = model_offer(default_model_dir, label, weights_in_snapshots=True)
    names = {f.name for f in offer.listing.files}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    first = offer.listing.files[0]
    assert blake3_hex(offer.read(first)) == first.blake3


# -- real processes -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_node_without_model_joins_any_hub_and_a_wrong_model_is_told_the_hubs(tmp_path, default_model_dir):
    """A hub training a Qwen3 (not the embedded default): `echo-node join --hub ADDR` with no --model fetches
    its config and tokenizer, installs the first snapshot and gets groups accepted; a node that brings the
    default model instead is refused in one line naming the hub's model."""
    from transformers import AutoConfig

    from testbed.models import random_model_dir

    model = random_model_dir(tmp_path / "qwen3-tiny", "qwen3", hidden=64, layers=2)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    (tmp_path / "hub.toml").write_text("[learner]\nskip_zero_variance = false\n")
    hub = start_hub(
        tmp_path / "hub",
        "--model",
        str(model),
        "--local-nodes",
        "0",
        "--steps",
        "2",
        "--config",
        str(tmp_path / "hub.toml"),
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--max-new-tokens",
        "10",
    )
    nodes = []
    try:
        wrong = start_node(hub.addr, tmp_path / "wrong", "--model", str(default_model_dir))
        nodes.append(wrong)
        assert wrong.process.wait(timeout=120) == 1, wrong.output()[-2000:]
        assert (
            f"model config differs from the hub's: the hub trains qwen3-tiny (Qwen3ForCausalLM, vocab {vocab}); "
            "start the node without --model to use the hub's, or with that model"
        ) in wrong.output()
        node = start_node(hub.addr, tmp_path / "node", "--no-model")
        nodes.append(node)
        assert hub.process.wait(timeout=300) == 0, hub.output()[-3000:] + node.output()[-3000:]
    finally:
        for proc in nodes:
            proc.kill()
        hub.kill()
    assert "the hub trains qwen3-tiny (Qwen3ForCausalLM" in node.output()
    written = {p.name for p in (tmp_path / "node" / NODE_MODEL_DIR).iterdir()}
    assert "config.json" in written and "tokenizer.json" in written and not any(n.endswith(".safetensors") for n in written)
    status = hub.status()
    assert status is not None and status.step == 2 and sum(n.tallies.accepted for n in status.nodes) >= 2 * 4


def test_engines_with_and_without_the_model_stop_where_the_hub_does(tmp_path, default_model_dir):
    """generation_config.json declares more EOS ids than config.json (Qwen's models do): a node that fetches the
    hub's files (building its model from config.json alone) and one whose own --model declares fewer both stop on
    the hub's set (its join reply names it), so the hub rejects none of their groups as "tokens after EOS"."""
    import shutil
    import sqlite3

    from transformers import AutoTokenizer, GenerationConfig

    from shared.layout import HUB_STORE_FILE

    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Vowels end a completion: most reversed words hold one before their end, so an engine stopping on
    # config.json's EOS alone would run past them.
    stops = [tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(v) for v in "aeiou")]
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = stops
    config.save_pretrained(model)
    (tmp_path / "hub.toml").write_text("[learner]\nskip_zero_variance = false\n")
    hub = start_hub(
        tmp_path / "hub",
        "--model",
        str(model),
        "--local-nodes",
        "0",
        "--steps",
        "1000",
        "--config",
        str(tmp_path / "hub.toml"),
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "10",
    )
    nodes = [
        start_node(hub.addr, tmp_path / "fetching", "--no-model"),
        start_node(hub.addr, tmp_path / "own", "--model", str(default_model_dir)),
    ]

    def both_paid() -> bool:
        status = hub.status()
        return status is not None and sum(n.tallies.accepted >= 8 for n in status.nodes) == 2

    try:
        wait_until(both_paid, 240, "both nodes to have groups accepted")
    finally:
        for proc in nodes:
            proc.kill()
        hub.kill()
    with sqlite3.connect(tmp_path / "hub" / HUB_STORE_FILE) as db:
        reasons = db.execute("SELECT reason, COUNT(*) FROM trajectories WHERE verdict != 'accepted' GROUP BY reason").fetchall()
    # Groups a loaded machine delivers after the learner moved on are refused as stale, honestly: none for EOS.
    assert [r for r, _ in reasons if not r.startswith("stale version")] == [], reasons
    logs = [(tmp_path / name / NODE_LOG_FILE).read_text() for name in ("fetching", "own")]
    assert "stopping on the hub's EOS ids" not in logs[0]  # the hub's files declare the hub's set
    assert f"stopping on the hub's EOS ids {sorted(stops)}" in logs[1]
