"""Snapshot format: serialization of a real tied-embedding model, chunking, signatures and every rejection."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from shared.crypto import SIGNATURE_BYTES, Identity
from shared.model_io import build_snapshot, load_into, model_dir_config_hash, model_dir_weights
from shared.snapshot import (
    CHUNK_HEADER,
    DISK_KEEP_FREE_BYTES,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_OVERHEAD_BYTES,
    BadChunk,
    BadSignature,
    ChunkAssembler,
    MalformedManifest,
    Manifest,
    OversizedSnapshot,
    SignedManifest,
    SnapshotError,
    StaleSnapshot,
    blake3_hex,
    check_snapshot_size,
    decode_chunk,
    encode_chunk,
    file_hash,
    model_config_hash,
    read_snapshot_files,
    remove_snapshot_files,
    sign_manifest,
    snapshot_bytes_bound,
    snapshot_paths,
    verify_chunk,
    verify_manifest,
)

torch.set_num_threads(1)
CONFIG_HASH = "ab" * 32


def tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hub() -> Identity:
    return Identity.from_seed(bytes(range(32)))


@pytest.fixture(scope="module")
def other() -> Identity:
    return Identity.from_seed(bytes(range(1, 33)))


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def small_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"w": torch.randn(37, 11, generator=gen), "b": torch.arange(13, dtype=torch.int64)}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def snaps(tmp_path) -> Path:
    return tmp_path / "snaps"


def chunk_of(snapshot, index: int) -> bytes:
    m = snapshot.manifest
    start = index * m.chunk_size
    return snapshot.path.read_bytes()[start : start + m.chunk_length(index)]


def resign(manifest: Manifest, identity: Identity, **changes) -> SignedManifest:
    """Sign a modified manifest body with `identity` regardless of its signer field."""
    body = manifest.model_copy(update=changes).model_dump_json().encode()
    return SignedManifest(body=body, signature=identity.sign(body))


# --- serialization and loading of a real model ---------------------------------------------


def test_streamed_file_is_plain_safetensors_bit_identical_and_drops_tied_duplicate(model, hub, snaps):
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    snapshot = build_snapshot(state, 1, hub, CONFIG_HASH, snaps)
    loaded = load_file(snapshot.path)  # the safetensors library reads what we stream
    assert set(loaded) == set(state) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == state[name].dtype and tensor.shape == state[name].shape
        assert bits(tensor) == bits(state[name]), name
    assert file_hash(snapshot.path) == snapshot.manifest.whole_hash
    assert snapshot.manifest.total_bytes == snapshot.path.stat().st_size
    assert sorted(p.name for p in snaps.iterdir()) == ["v00000001.manifest", "v00000001.safetensors"]  # no temp left


def test_bf16_snapshot_is_half_the_bytes_and_casts_floats_only(model, hub, snaps):
    state = {**model.state_dict(), "steps": torch.arange(5, dtype=torch.int64)}
    fp32 = build_snapshot(state, 1, hub, CONFIG_HASH, snaps)
    bf16 = build_snapshot(state, 2, hub, CONFIG_HASH, snaps, dtype=torch.bfloat16)
    loaded = load_file(bf16.path)
    assert loaded["steps"].dtype == torch.int64 and torch.equal(loaded["steps"], state["steps"])
    assert all(t.dtype == torch.bfloat16 for k, t in loaded.items() if k != "steps")
    assert torch.equal(loaded["model.norm.weight"], state["model.norm.weight"].bfloat16())
    float_bytes = sum(t.numel() * 4 for k, t in loaded.items() if k != "steps")
    assert fp32.manifest.total_bytes - bf16.manifest.total_bytes == pytest.approx(float_bytes / 2, abs=512)
    target = tiny_model(seed=9).to(torch.bfloat16)
    load_into(target, build_snapshot(model.state_dict(), 3, hub, CONFIG_HASH, snaps, dtype=torch.bfloat16).path)
    assert torch.equal(target.model.norm.weight, state["model.norm.weight"].bfloat16())


def test_load_into_reads_files_the_safetensors_library_wrote(model, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "theirs.safetensors")
    target = tiny_model(seed=77)
    load_into(target, tmp_path / "theirs.safetensors")
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())


def test_load_into_in_place_gives_identical_logits(model, hub, snaps):
    snapshot = build_snapshot(model.state_dict(), 1, hub, CONFIG_HASH, snaps, chunk_size=4096)
    target = tiny_model(seed=123)
    params_before = {name: p.data_ptr() for name, p in target.named_parameters()}
    ids = torch.tensor([[1, 5, 7, 9, 2, 49]])
    with torch.no_grad():
        assert not torch.equal(target(ids).logits, model(ids).logits)
        load_into(target, snapshot.path)
        assert torch.equal(target(ids).logits, model(ids).logits)
    assert {name: p.data_ptr() for name, p in target.named_parameters()} == params_before
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_load_into_rejects_missing_unexpected_and_mismatched_keys_before_copying(model, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    target = tiny_model(seed=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    def saved(tensors) -> Path:
        path = tmp_path / f"w{len(list(tmp_path.iterdir()))}.safetensors"
        save_file(tensors, path)
        return path

    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(SnapshotError, match="model.norm.weight"):
        load_into(target, saved(missing))
    with pytest.raises(SnapshotError, match="extra.weight"):
        load_into(target, saved({**state, "extra.weight": torch.zeros(2)}))
    half = {**state, "model.norm.weight": state["model.norm.weight"].half()}
    with pytest.raises(SnapshotError, match="float16"):
        load_into(target, saved(half))
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())  # nothing copied


def test_build_clones_overlapping_views_and_writes_non_contiguous(hub, snaps):
    base = torch.arange(20.0)
    state = {"a": base[:10], "b": base[5:15], "t": torch.arange(6.0).reshape(2, 3).t()}
    loaded = load_file(build_snapshot(state, 0, hub, CONFIG_HASH, snaps).path)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


def test_malformed_weights_headers_are_refused(tmp_path):
    from shared.weights_file import WeightsFileError, read_entries

    def raw(header: dict, data: bytes) -> Path:
        text = json.dumps(header).encode()
        path = tmp_path / f"h{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text + data)
        return path

    good = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert [e.name for e in read_entries(raw(good, b"\0" * 8))] == ["w"]
    for header, data in [
        (good, b"\0" * 7),  # file shorter than the tensors
        (good, b"\0" * 9),  # trailing bytes
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),  # span is not the shape
        ({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),  # unknown dtype
        ({**good, "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),  # overlap
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),  # gap
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    ]:
        with pytest.raises(WeightsFileError):
            read_entries(raw(header, data))
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(WeightsFileError, match="does not fit"):
        read_entries(huge)
    (tmp_path / "junk.safetensors").write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(WeightsFileError, match="not JSON"):
        read_entries(tmp_path / "junk.safetensors")


def test_build_streams_without_a_second_copy_of_the_weights(tmp_path):
    """Peak RSS while writing 512 MB of weights (fp32 as is, then cast to bf16) grows by far less than a copy
    (512 MB fp32, 256 MB bf16): what growth there is is one-time (allocator, imports), not per tensor."""
    script = textwrap.dedent(f"""
        import resource, torch, json
        from shared.crypto import Identity
        from shared.model_io import build_snapshot
        torch.manual_seed(0)
        state = {{f"layer{{i}}.weight": torch.full((4096, 1024), i / 7) for i in range(32)}}  # 32 x 16 MiB
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        identity = Identity.generate()
        build_snapshot(state, 1, identity, "0" * 64, r"{tmp_path}")
        fp32 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        build_snapshot(state, 2, identity, "0" * 64, r"{tmp_path}", dtype=torch.bfloat16)
        bf16 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({{"fp32": fp32 - base, "bf16": bf16 - base}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    growth = json.loads(out.stdout)
    assert growth["fp32"] < 96 << 20 and growth["bf16"] < 96 << 20, growth


def test_model_config_hash_is_stable_and_sensitive(model):
    config = model.config.to_dict()
    h = model_config_hash(config)
    assert h == model_config_hash(dict(reversed(list(config.items()))))
    assert len(h) == 64
    assert model_config_hash({**config, "hidden_size": 65}) != h
    assert model_config_hash({**config, "rope_parameters": {"rope_theta": 1.0}}) != h
    volatile = {"_name_or_path": "/elsewhere", "transformers_version": "0.0", "dtype": "bfloat16"}
    assert model_config_hash({**config, **volatile}) == h


def test_a_runs_model_fingerprint_is_the_same_identity_at_every_level(tmp_path):
    """The data dir's recorded model (shared.checks.model_fingerprint) is model_config_hash of config.json: a nested
    config's dtype or private key (a multimodal model's text_config) is as volatile as a top-level one."""
    from shared.checks import model_fingerprint

    config = {"model_type": "x", "hidden_size": 8, "text_config": {"hidden_size": 4, "dtype": "float32"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fingerprint = model_fingerprint(tmp_path)
    assert fingerprint == model_config_hash(config)
    config["text_config"] = {"hidden_size": 4, "dtype": "bfloat16", "_name_or_path": "/elsewhere"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9"}))
    assert model_fingerprint(tmp_path) == fingerprint
    config["text_config"]["hidden_size"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(tmp_path) != fingerprint


def test_model_dir_config_hash_matches_loaded_model_anywhere(tmp_path, model):
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "hub_copy")
    model.save_pretrained(tmp_path / "node_copy")
    hub_side = AutoModelForCausalLM.from_pretrained(tmp_path / "hub_copy", dtype=torch.float32)
    node_side = model_dir_config_hash(tmp_path / "node_copy")
    assert node_side == model_config_hash(hub_side.config.to_dict()) == model_config_hash(model.config.to_dict())


# --- manifest and chunks ------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 100, 333, 1 << 20])
def test_chunking_any_order_reassembles_exactly_in_a_file(hub, snaps, tmp_path, chunk_size):
    snapshot = build_snapshot(small_state_dict(), 7, hub, CONFIG_HASH, snaps, chunk_size=chunk_size)
    m = snapshot.manifest
    whole = snapshot.path.read_bytes()
    assert m.total_bytes == len(whole)
    assert m.chunk_count == -(-len(whole) // chunk_size)
    assert sum(m.chunk_length(i) for i in range(m.chunk_count)) == m.total_bytes
    assembler = ChunkAssembler(m, tmp_path / "in" / "v7.safetensors")
    assert assembler.path.stat().st_size == m.total_bytes  # preallocated
    order = list(range(m.chunk_count))
    random.Random(chunk_size).shuffle(order)
    for n, index in enumerate(order):
        assert not assembler.complete
        assert assembler.missing_count == m.chunk_count - n
        with pytest.raises(BadChunk):
            assembler.finish()
        assert assembler.add(index, chunk_of(snapshot, index)) is True
        assert assembler.has(index)
        assert assembler.chunk(index) == chunk_of(snapshot, index)
    assert assembler.complete and assembler.first_missing() is None
    path = assembler.finish()
    assert path.read_bytes() == whole
    assert assembler.add(order[0], chunk_of(snapshot, order[0])) is False
    assembler.close()
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in small_state_dict().items())


def test_last_chunk_shorter_and_first_missing(hub, snaps, tmp_path):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, snaps, chunk_size=100)
    m = snapshot.manifest
    assert m.total_bytes % 100 != 0
    assert m.chunk_length(m.chunk_count - 1) == m.total_bytes % 100
    assembler = ChunkAssembler(m, tmp_path / "partial")
    assert assembler.first_missing() == 0
    assembler.add(0, chunk_of(snapshot, 0))
    assembler.add(2, chunk_of(snapshot, 2))
    assert assembler.first_missing() == 1
    assert not assembler.has(1) and not assembler.has(-1) and not assembler.has(m.chunk_count)
    with pytest.raises(BadChunk):
        assembler.chunk(1)
    assembler.discard()
    assert not (tmp_path / "partial").exists()


def test_tampered_short_and_out_of_range_chunks_rejected(hub, snaps, tmp_path):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, snaps, chunk_size=100)
    m = snapshot.manifest
    good = chunk_of(snapshot, 1)
    tampered = bytes([good[0] ^ 1]) + good[1:]
    assert verify_chunk(m, 1, good)
    assert not verify_chunk(m, 1, tampered)
    assert not verify_chunk(m, 1, good[:-1])
    assert not verify_chunk(m, 1, good + b"\0")
    assert not verify_chunk(m, 0, good)
    assert not verify_chunk(m, m.chunk_count, good)
    assert not verify_chunk(m, -1, good)
    assembler = ChunkAssembler(m, tmp_path / "in")
    with pytest.raises(BadChunk):
        assembler.add(1, tampered)
    with pytest.raises(BadChunk):
        assembler.add(m.chunk_count, good)
    with pytest.raises(BadChunk):
        assembler.add(-1, good)
    assert not assembler.has(1) and assembler.missing_count == m.chunk_count


def test_whole_hash_mismatch_never_exposes_the_file(hub, snaps, tmp_path):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, snaps, chunk_size=100)
    lying = snapshot.manifest.model_copy(update={"whole_hash": "00" * 32})
    assembler = ChunkAssembler(lying, tmp_path / "in")
    for i in range(lying.chunk_count):
        assembler.add(i, chunk_of(snapshot, i))
    assert assembler.complete
    with pytest.raises(BadChunk, match="whole hash"):
        assembler.finish()


def test_manifest_verifies_and_round_trips_through_bytes(hub, snaps):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, snaps)
    wire = SignedManifest.from_bytes(snapshot.signed.to_bytes())
    assert wire == snapshot.signed
    assert verify_manifest(wire, hub.peer_id) == snapshot.manifest
    assert verify_manifest(wire, hub.peer_id, newer_than=3).version == 4
    assert snapshot.manifest.format_version == SNAPSHOT_FORMAT_VERSION


def test_wrong_signer_rejected(hub, other, snaps):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, snaps)
    with pytest.raises(BadSignature):
        verify_manifest(snapshot.signed, other.peer_id)
    forged = resign(snapshot.manifest, other)  # claims the hub as signer, signed by another key
    with pytest.raises(BadSignature):
        verify_manifest(forged, hub.peer_id)
    mislabelled = resign(snapshot.manifest, hub, signer=other.peer_id)  # hub's key, wrong signer field
    with pytest.raises(BadSignature, match="names signer"):
        verify_manifest(mislabelled, hub.peer_id)
    with pytest.raises(BadSignature):
        verify_manifest(snapshot.signed, "not-a-peer-id")
    with pytest.raises(ValueError):
        sign_manifest(snapshot.manifest, other)


def test_tampered_manifest_bytes_or_signature_rejected(hub, snaps):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, snaps)
    body = snapshot.signed.body
    tampered_body = body.replace(b'"version":4', b'"version":9')
    assert tampered_body != body
    with pytest.raises(BadSignature):
        verify_manifest(SignedManifest(tampered_body, snapshot.signed.signature), hub.peer_id)
    sig = bytearray(snapshot.signed.signature)
    sig[10] ^= 1
    with pytest.raises(BadSignature):
        verify_manifest(SignedManifest(body, bytes(sig)), hub.peer_id)
    with pytest.raises(BadSignature):
        verify_manifest(SignedManifest(body, bytes(sig[:63])), hub.peer_id)


def test_stale_version_rejected(hub, snaps):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, snaps)
    for held in (4, 5):
        with pytest.raises(StaleSnapshot):
            verify_manifest(snapshot.signed, hub.peer_id, newer_than=held)


def test_oversized_manifest_rejected_before_signature_check(hub):
    huge = b"x" * (MAX_MANIFEST_BYTES + 1)
    with pytest.raises(MalformedManifest):
        verify_manifest(SignedManifest(huge, hub.sign(huge)), hub.peer_id)
    with pytest.raises(MalformedManifest):
        verify_manifest(SignedManifest(huge, b"\0" * SIGNATURE_BYTES), hub.peer_id)
    with pytest.raises(MalformedManifest):
        SignedManifest.from_bytes(b"\0" * (SIGNATURE_BYTES + MAX_MANIFEST_BYTES + 1))
    with pytest.raises(MalformedManifest):
        SignedManifest.from_bytes(b"\0" * SIGNATURE_BYTES)


def test_signed_but_malformed_manifest_rejected(hub, snaps):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, snaps, chunk_size=100)
    m = snapshot.manifest
    cases = [
        b"not json",
        b"[]",
        m.model_dump_json().replace('"version":4', '"version":"4"').encode(),  # strict: no coercion
        resign(m, hub, chunk_hashes=m.chunk_hashes[:-1]).body,
        resign(m, hub, format_version=SNAPSHOT_FORMAT_VERSION + 1).body,
        resign(m, hub, whole_hash="XYZ").body,
        m.model_dump_json()[:-1].encode() + b',"extra":1}',
    ]
    for body in cases:
        with pytest.raises(MalformedManifest):
            verify_manifest(SignedManifest(body, hub.sign(body)), hub.peer_id)


def test_manifest_bounds(hub):
    base = {
        "format_version": SNAPSHOT_FORMAT_VERSION,
        "version": 0,
        "total_bytes": 10,
        "chunk_size": 4,
        "chunk_hashes": (blake3_hex(b"a"),) * 3,
        "whole_hash": blake3_hex(b"a"),
        "config_hash": CONFIG_HASH,
        "created_at": 0.0,
        "signer": hub.peer_id,
    }
    assert Manifest(**base).chunk_length(2) == 2
    for bad in (
        {"version": -1},
        {"total_bytes": 0, "chunk_hashes": ()},
        {"chunk_size": MAX_CHUNK_BYTES + 1, "chunk_hashes": (blake3_hex(b"a"),)},
        {"chunk_hashes": (blake3_hex(b"a"),) * 2},
        {"created_at": float("nan")},
        {"signer": ""},
        {"base_version": 0},  # a full snapshot names no base
        {"kind": "delta"},  # a delta names its base and result
        {"kind": "delta", "base_version": 0, "base_hash": blake3_hex(b"b"), "result_hash": blake3_hex(b"c")},  # base not older
        {"kind": "delta", "version": 1, "base_version": 0, "base_hash": "x", "result_hash": blake3_hex(b"c")},
        {"kind": "patch"},
    ):
        with pytest.raises(ValidationError):
            Manifest(**{**base, **bad})


# --- relay frames -------------------------------------------------------------------------


def test_chunk_frame_round_trip_and_short_bodies():
    body = encode_chunk(2**40 + 3, 70000, b"payload")
    assert body[: CHUNK_HEADER.size] == (2**40 + 3).to_bytes(8, "big") + (70000).to_bytes(4, "big")
    version, index, data = decode_chunk(body)
    assert (version, index, bytes(data)) == (2**40 + 3, 70000, b"payload")
    for short in (b"", b"\0" * 11, b"\0" * CHUNK_HEADER.size):
        with pytest.raises(BadChunk):
            decode_chunk(short)
    with pytest.raises(BadChunk):
        decode_chunk(b"\0" * (CHUNK_HEADER.size + MAX_CHUNK_BYTES + 1))


# --- durable files ------------------------------------------------------------------------


def test_file_round_trip_and_removal(hub, model, snaps):
    snapshot = build_snapshot(model.state_dict(), 12, hub, CONFIG_HASH, snaps, chunk_size=10_000)
    assert snapshot.path.name == "v00000012.safetensors"
    assert sorted(p.name for p in snaps.iterdir()) == ["v00000012.manifest", "v00000012.safetensors"]
    back = read_snapshot_files(snaps, 12, hub.peer_id)
    assert back == snapshot
    remove_snapshot_files(snaps, 12)
    assert list(snaps.iterdir()) == []


def test_corrupted_files_detected(tmp_path, hub, other):
    snapshot = build_snapshot(small_state_dict(), 3, hub, CONFIG_HASH, tmp_path / "original", chunk_size=100)
    data, signed_bytes = snapshot.path.read_bytes(), snapshot.signed.to_bytes()
    weights, manifest = snapshot_paths(tmp_path, 3)

    def fresh() -> None:
        weights.write_bytes(data)
        manifest.write_bytes(signed_bytes)

    fresh()
    with pytest.raises(BadSignature):
        read_snapshot_files(tmp_path, 3, other.peer_id)

    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(BadChunk, match="chunk"):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    weights.write_bytes(data[:-1])
    with pytest.raises(BadChunk, match="bytes"):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    signed = bytearray(signed_bytes)
    signed[-5] ^= 1
    manifest.write_bytes(bytes(signed))
    with pytest.raises(BadSignature):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    manifest.rename(snapshot_paths(tmp_path, 4)[1])  # a valid manifest under another version's name
    weights.rename(snapshot_paths(tmp_path, 4)[0])
    with pytest.raises(MalformedManifest, match="version 3"):
        read_snapshot_files(tmp_path, 4, hub.peer_id)


# --- retention ------------------------------------------------------------------------------


def test_the_hub_shelf_keeps_s_plus_one_versions_on_disk_and_prunes_orphans(hub, snaps):
    import trio

    from hub.records.snapshots import SnapshotShelf

    shelf = SnapshotShelf(keep=3, directory=snaps)
    sizes = []
    for version in range(7):
        shelf.add(build_snapshot(small_state_dict(), version, hub, CONFIG_HASH, snaps, chunk_size=100))
        on_disk = sorted(p.name for p in snaps.iterdir())
        kept = list(range(max(0, version - 2), version + 1))
        assert on_disk == sorted(n for v in kept for n in (f"v{v:08d}.manifest", f"v{v:08d}.safetensors"))
        sizes.append(sum(p.stat().st_size for p in snaps.iterdir()))
    assert shelf.versions() == [4, 5, 6] and shelf.get(3) is None
    assert trio.run(shelf.chunk, 6, 0) == chunk_of(shelf.get(6), 0)
    with pytest.raises(LookupError):
        trio.run(shelf.chunk, 3, 0)
    # A crash's leftovers (a temp file, a weights file whose manifest went first) and versions from before a
    # restart are pruned at the next start; the version the learner serves again stays.
    (snaps / ".v00000007.safetensors.tmp").write_bytes(b"partial")
    (snaps / "v00000002.safetensors").write_bytes(b"orphan")
    shelf.close()
    assert SnapshotShelf(keep=3, directory=snaps).prune({6}) == 6
    assert sorted(p.name for p in snaps.iterdir()) == ["v00000006.manifest", "v00000006.safetensors"]


def test_snapshot_bytes_bound_by_hand():
    # 1000 weights of 2 bytes, 10% over, plus the overhead a header, a delta's manifest or an adapter may add.
    assert snapshot_bytes_bound(1000, 2) == 2200 + SNAPSHOT_OVERHEAD_BYTES
    assert snapshot_bytes_bound(3, 4) == 14 + SNAPSHOT_OVERHEAD_BYTES  # 13.2 rounds up


def test_a_manifest_past_the_model_or_the_free_disk_is_refused(tmp_path):
    """Issue 65: a hub signed a manifest of 1 TiB for a 4.2 MB model and the node began writing it."""
    identity = Identity.generate()
    snapshot = build_snapshot(tiny_model(0).state_dict(), 1, identity, CONFIG_HASH, tmp_path)
    honest = snapshot.manifest
    bound = snapshot_bytes_bound(sum(p.numel() for p in tiny_model(0).parameters()), 4)
    check_snapshot_size(honest, bound, free_bytes=honest.total_bytes + DISK_KEEP_FREE_BYTES)
    tib = honest.model_copy(update={"total_bytes": 1 << 40, "chunk_size": MAX_CHUNK_BYTES, "chunk_hashes": ("0" * 64,) * 65536})
    with pytest.raises(OversizedSnapshot, match="takes at most"):
        check_snapshot_size(tib, bound, free_bytes=1 << 50)
    with pytest.raises(OversizedSnapshot, match="does not fit"):
        check_snapshot_size(honest, bound, free_bytes=honest.total_bytes + DISK_KEEP_FREE_BYTES - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_models_snapshots_are_within_its_config_bound(default_model_dir, tmp_path, dtype):
    """The bound a node computes from its model directory's config admits the hub's honest snapshots of it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    snapshot = build_snapshot(model.state_dict(), 1, Identity.generate(), CONFIG_HASH, tmp_path, dtype=dtype)
    weights = model_dir_weights(default_model_dir)
    assert weights >= sum(p.numel() for p in model.parameters())
    assert snapshot.manifest.total_bytes <= snapshot_bytes_bound(weights, dtype.itemsize)
