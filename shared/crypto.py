"""Ed25519 identities: one key file per process, used both to sign messages and as the libp2p identity.

Because libp2p inlines an Ed25519 public key in the peer id, a peer id names its signing
key: `public_key_from_peer_id` recovers it, so a node that knows the hub's address
(`.../p2p/<id>`) can verify everything the hub signs without any other exchange.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
KEY_FILE_MODE = 0o600


class Identity:
    """A private Ed25519 key with its libp2p peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_from_public_key(self.public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: Path) -> Identity:
        """The key at `path` (mode 0600, a 32-byte Ed25519 seed)."""
        path = Path(path)
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(f"key file {path} has mode {oct(mode)}; run: chmod 600 {path}")
        seed = path.read_bytes()
        if len(seed) != 32:
            raise ValueError(f"key file {path} holds {len(seed)} bytes, expected a 32-byte Ed25519 seed")
        return cls.from_seed(seed)

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at `path`, or create it there with mode 0600 (never readable by others)."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.seed())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return identity

    def seed(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def libp2p_keypair(self):
        """The same key as a py-libp2p KeyPair, so the host's peer id equals `self.peer_id`."""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey as P2PPrivateKey
        from libp2p.crypto.keys import KeyPair

        private = P2PPrivateKey.from_bytes(self.seed())
        return KeyPair(private, private.get_public_key())


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff `signature` is `public_key`'s Ed25519 signature of exactly `data`."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        _public_key(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _public_key(public_key: bytes) -> Ed25519PublicKey:
    # Parsed once per peer: a transfer verifies one signature per chunk from the same sender.
    return Ed25519PublicKey.from_public_bytes(public_key)


def peer_id_from_public_key(public_key: bytes) -> str:
    from libp2p.crypto.ed25519 import Ed25519PublicKey as P2PPublicKey
    from libp2p.peer.id import ID

    return ID.from_pubkey(P2PPublicKey.from_bytes(public_key)).to_base58()


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inlined in `peer_id`; ValueError for any other kind of id."""
    from libp2p.crypto.keys import KeyType
    from libp2p.peer.id import ID

    try:
        key = ID.from_base58(peer_id).extract_public_key()
    except Exception as exc:  # base58/multihash decoding raises several unrelated types
        raise ValueError(f"not a peer id: {peer_id!r}") from exc
    if key is None or key.get_type() != KeyType.Ed25519:
        raise ValueError(f"peer id {peer_id!r} does not inline an Ed25519 key")
    return key.to_bytes()


def verify_from_peer(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Verify a signature by the peer named `peer_id` (False for malformed ids)."""
    try:
        public_key = public_key_from_peer_id(peer_id)
    except ValueError:
        return False
    return verify(public_key, data, signature)


def peer_id_from_multiaddr(addr: str) -> str:
    """The peer id in the `/p2p/<id>` part of a multiaddr; ValueError when there is none."""
    parts = addr.rstrip("/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("p2p", "ipfs"):
            return parts[i + 1]
    raise ValueError(f"address {addr!r} has no /p2p/<peer id> part: the hub's printed address includes it")
