"""Snapshot format: serialization of a real tied-embedding model, chunking, signatures and every rejection."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from shared.crypto import SIGNATURE_BYTES, Identity
from shared.snapshot import (
    CHUNK_HEADER,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    SNAPSHOT_FORMAT_VERSION,
    BadChunk,
    BadSignature,
    ChunkAssembler,
    MalformedManifest,
    Manifest,
    SignedManifest,
    SnapshotError,
    StaleSnapshot,
    blake3_hex,
    build_snapshot,
    chunk_of,
    decode_chunk,
    encode_chunk,
    load_into,
    load_state_dict_bytes,
    model_config_hash,
    model_dir_config_hash,
    read_snapshot_files,
    serialize_state_dict,
    sign_manifest,
    snapshot_paths,
    verify_chunk,
    verify_manifest,
    write_snapshot_files,
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


def resign(manifest: Manifest, identity: Identity, **changes) -> SignedManifest:
    """Sign a modified manifest body with `identity` regardless of its signer field."""
    body = manifest.model_copy(update=changes).model_dump_json().encode()
    return SignedManifest(body=body, signature=identity.sign(body))


# --- serialization and loading of a real model ---------------------------------------------


def test_state_dict_round_trip_is_bit_identical_and_drops_tied_duplicate(model):
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    loaded = load_state_dict_bytes(serialize_state_dict(state))
    assert set(loaded) == set(state) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == state[name].dtype and tensor.shape == state[name].shape
        assert bits(tensor) == bits(state[name]), name


def test_load_into_in_place_gives_identical_logits(model, hub):
    snapshot = build_snapshot(model.state_dict(), 1, hub, CONFIG_HASH, chunk_size=4096)
    target = tiny_model(seed=123)
    params_before = {name: p.data_ptr() for name, p in target.named_parameters()}
    ids = torch.tensor([[1, 5, 7, 9, 2, 49]])
    with torch.no_grad():
        assert not torch.equal(target(ids).logits, model(ids).logits)
        load_into(target, snapshot.data)
        assert torch.equal(target(ids).logits, model(ids).logits)
    assert {name: p.data_ptr() for name, p in target.named_parameters()} == params_before
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_load_into_rejects_missing_unexpected_and_mismatched_keys(model):
    state = dict(model.state_dict())
    target = tiny_model(seed=5)
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(SnapshotError, match="model.norm.weight"):
        load_into(target, serialize_state_dict(missing))
    with pytest.raises(SnapshotError, match="extra.weight"):
        load_into(target, serialize_state_dict({**state, "extra.weight": torch.zeros(2)}))
    half = {**state, "model.norm.weight": state["model.norm.weight"].half()}
    with pytest.raises(SnapshotError, match="float16"):
        load_into(target, serialize_state_dict(half))


def test_serialize_clones_overlapping_views_and_copies_non_contiguous():
    base = torch.arange(20.0)
    state = {"a": base[:10], "b": base[5:15], "t": torch.arange(6.0).reshape(2, 3).t()}
    loaded = load_state_dict_bytes(serialize_state_dict(state))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


def test_model_config_hash_is_stable_and_sensitive(model):
    config = model.config.to_dict()
    h = model_config_hash(config)
    assert h == model_config_hash(dict(reversed(list(config.items()))))
    assert len(h) == 64
    assert model_config_hash({**config, "hidden_size": 65}) != h
    assert model_config_hash({**config, "rope_parameters": {"rope_theta": 1.0}}) != h
    volatile = {"_name_or_path": "/elsewhere", "transformers_version": "0.0", "dtype": "bfloat16"}
    assert model_config_hash({**config, **volatile}) == h


def test_model_dir_config_hash_matches_loaded_model_anywhere(tmp_path, model):
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "hub_copy")
    model.save_pretrained(tmp_path / "node_copy")
    hub_side = AutoModelForCausalLM.from_pretrained(tmp_path / "hub_copy", dtype=torch.float32)
    node_side = model_dir_config_hash(tmp_path / "node_copy")
    assert node_side == model_config_hash(hub_side.config.to_dict()) == model_config_hash(model.config.to_dict())


# --- manifest and chunks ------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 100, 333, 1 << 20])
def test_chunking_any_order_reassembles_exactly(hub, chunk_size):
    snapshot = build_snapshot(small_state_dict(), 7, hub, CONFIG_HASH, chunk_size=chunk_size)
    m = snapshot.manifest
    assert m.total_bytes == len(snapshot.data)
    assert m.chunk_count == -(-len(snapshot.data) // chunk_size)
    assert sum(m.chunk_length(i) for i in range(m.chunk_count)) == m.total_bytes
    assembler = ChunkAssembler(m)
    order = list(range(m.chunk_count))
    random.Random(chunk_size).shuffle(order)
    for n, index in enumerate(order):
        assert not assembler.complete
        assert assembler.missing_count == m.chunk_count - n
        with pytest.raises(BadChunk):
            assembler.data()
        assert assembler.add(index, chunk_of(snapshot.data, m, index)) is True
        assert assembler.has(index)
        assert bytes(assembler.chunk(index)) == bytes(chunk_of(snapshot.data, m, index))
    assert assembler.complete and assembler.first_missing() is None
    assert bytes(assembler.data()) == snapshot.data
    assert assembler.add(order[0], chunk_of(snapshot.data, m, order[0])) is False
    loaded = load_state_dict_bytes(assembler.data())
    assert all(torch.equal(loaded[k], v) for k, v in small_state_dict().items())


def test_last_chunk_shorter_and_first_missing(hub):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, chunk_size=100)
    m = snapshot.manifest
    assert m.total_bytes % 100 != 0
    assert m.chunk_length(m.chunk_count - 1) == m.total_bytes % 100
    assembler = ChunkAssembler(m)
    assert assembler.first_missing() == 0
    assembler.add(0, chunk_of(snapshot.data, m, 0))
    assembler.add(2, chunk_of(snapshot.data, m, 2))
    assert assembler.first_missing() == 1
    assert not assembler.has(1) and not assembler.has(-1) and not assembler.has(m.chunk_count)
    with pytest.raises(BadChunk):
        assembler.chunk(1)


def test_tampered_short_and_out_of_range_chunks_rejected(hub):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, chunk_size=100)
    m = snapshot.manifest
    good = bytes(chunk_of(snapshot.data, m, 1))
    tampered = bytes([good[0] ^ 1]) + good[1:]
    assert verify_chunk(m, 1, good)
    assert not verify_chunk(m, 1, tampered)
    assert not verify_chunk(m, 1, good[:-1])
    assert not verify_chunk(m, 1, good + b"\0")
    assert not verify_chunk(m, 0, good)
    assert not verify_chunk(m, m.chunk_count, good)
    assert not verify_chunk(m, -1, good)
    assembler = ChunkAssembler(m)
    with pytest.raises(BadChunk):
        assembler.add(1, tampered)
    with pytest.raises(BadChunk):
        assembler.add(m.chunk_count, good)
    with pytest.raises(BadChunk):
        assembler.add(-1, good)
    with pytest.raises(BadChunk):
        chunk_of(snapshot.data, m, m.chunk_count)
    assert not assembler.has(1) and assembler.missing_count == m.chunk_count


def test_whole_hash_mismatch_never_exposes_data(hub):
    snapshot = build_snapshot(small_state_dict(), 1, hub, CONFIG_HASH, chunk_size=100)
    lying = snapshot.manifest.model_copy(update={"whole_hash": "00" * 32})
    assembler = ChunkAssembler(lying)
    for i in range(lying.chunk_count):
        assembler.add(i, chunk_of(snapshot.data, lying, i))
    assert assembler.complete
    with pytest.raises(BadChunk, match="whole hash"):
        assembler.data()


def test_manifest_verifies_and_round_trips_through_bytes(hub):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH)
    wire = SignedManifest.from_bytes(snapshot.signed.to_bytes())
    assert wire == snapshot.signed
    assert verify_manifest(wire, hub.peer_id) == snapshot.manifest
    assert verify_manifest(wire, hub.peer_id, newer_than=3).version == 4
    assert snapshot.manifest.format_version == SNAPSHOT_FORMAT_VERSION


def test_wrong_signer_rejected(hub, other):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH)
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


def test_tampered_manifest_bytes_or_signature_rejected(hub):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH)
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


def test_stale_version_rejected(hub):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH)
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


def test_signed_but_malformed_manifest_rejected(hub):
    snapshot = build_snapshot(small_state_dict(), 4, hub, CONFIG_HASH, chunk_size=100)
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
        "format_version": 1,
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


def test_file_round_trip(tmp_path, hub, model):
    snapshot = build_snapshot(model.state_dict(), 12, hub, CONFIG_HASH, chunk_size=10_000)
    weights = write_snapshot_files(snapshot, tmp_path / "snaps")
    assert weights.name == "v00000012.safetensors"
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["v00000012.manifest", "v00000012.safetensors"]
    back = read_snapshot_files(tmp_path / "snaps", 12, hub.peer_id)
    assert back == snapshot


def test_corrupted_files_detected(tmp_path, hub, other):
    snapshot = build_snapshot(small_state_dict(), 3, hub, CONFIG_HASH, chunk_size=100)
    weights, manifest = snapshot_paths(tmp_path, 3)

    def fresh() -> None:
        write_snapshot_files(snapshot, tmp_path)

    fresh()
    with pytest.raises(BadSignature):
        read_snapshot_files(tmp_path, 3, other.peer_id)

    raw = bytearray(snapshot.data)
    raw[len(raw) // 2] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(BadChunk, match="chunk"):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    weights.write_bytes(snapshot.data[:-1])
    with pytest.raises(BadChunk, match="bytes"):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    signed = bytearray(snapshot.signed.to_bytes())
    signed[-5] ^= 1
    manifest.write_bytes(bytes(signed))
    with pytest.raises(BadSignature):
        read_snapshot_files(tmp_path, 3, hub.peer_id)

    fresh()
    manifest.rename(snapshot_paths(tmp_path, 4)[1])  # a valid manifest under another version's name
    weights.rename(snapshot_paths(tmp_path, 4)[0])
    with pytest.raises(MalformedManifest, match="version 3"):
        read_snapshot_files(tmp_path, 4, hub.peer_id)
