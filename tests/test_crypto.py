"""Identity key files, signatures checked against peer ids, and peer ids in multiaddrs."""

from __future__ import annotations

import os
import stat

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair
from libp2p.peer.id import ID

from shared.crypto import Identity, peer_id_from_multiaddr, public_key_from_peer_id, verify, verify_from_peer


def test_load_or_create_persists_with_mode_0600(tmp_path):
    path = tmp_path / "keys" / "node.key"
    created = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.with_name("node.key.tmp").exists()
    reloaded = Identity.load_or_create(path)
    assert reloaded.peer_id == created.peer_id
    assert reloaded.peer_id.startswith("12D3KooW")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_readable_by_others_is_refused(tmp_path, mode):
    path = tmp_path / "node.key"
    Identity.load_or_create(path)
    os.chmod(path, mode)
    with pytest.raises(PermissionError, match="chmod 600"):
        Identity.load_or_create(path)


def test_wrong_length_key_file_is_refused(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"x" * 31)
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="31 bytes"):
        Identity.load_or_create(path)


def test_signature_verifies_from_peer_id_alone():
    signer, other = Identity.generate(), Identity.generate()
    signature = signer.sign(b"payload")
    assert public_key_from_peer_id(signer.peer_id) == signer.public_key_bytes
    assert verify(signer.public_key_bytes, b"payload", signature)
    assert verify_from_peer(signer.peer_id, b"payload", signature)
    assert not verify_from_peer(signer.peer_id, b"payload!", signature)
    assert not verify_from_peer(other.peer_id, b"payload", signature)
    assert not verify_from_peer(signer.peer_id, b"payload", signature[:-1])


def test_libp2p_keypair_has_the_same_peer_id():
    identity = Identity.from_seed(bytes(range(32)))
    key_pair = identity.libp2p_keypair()
    assert ID.from_pubkey(key_pair.public_key).to_base58() == identity.peer_id


@pytest.mark.parametrize("bad", ["", "not-a-peer-id", "12D3KooWxxxxxxxx", "0OIl"])
def test_malformed_peer_id_rejected(bad):
    with pytest.raises(ValueError):
        public_key_from_peer_id(bad)
    assert not verify_from_peer(bad, b"data", b"\0" * 64)


def test_non_ed25519_peer_id_rejected():
    # secp256k1 keys are small enough to be inlined in the peer id too, but are not Ed25519.
    secp_id = ID.from_pubkey(create_secp256k1_key_pair().public_key).to_base58()
    with pytest.raises(ValueError, match="does not inline an Ed25519 key"):
        public_key_from_peer_id(secp_id)


def test_peer_id_from_multiaddr():
    pid = Identity.generate().peer_id
    assert peer_id_from_multiaddr(f"/ip4/10.0.0.1/tcp/4001/p2p/{pid}") == pid
    assert peer_id_from_multiaddr(f"/ip4/10.0.0.1/tcp/4001/p2p/{pid}/") == pid
    assert peer_id_from_multiaddr(f"/dns4/hub.example/tcp/4001/ipfs/{pid}") == pid
    with pytest.raises(ValueError, match="no /p2p/"):
        peer_id_from_multiaddr("/ip4/10.0.0.1/tcp/4001")
