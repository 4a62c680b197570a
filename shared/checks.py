"""Checks of what a person typed, run before anything starts or is written: each failure is a `UserError`
whose message is the one line that names the value and says what to do (the CLIs print it and exit 2).

Only cheap checks live here (files, addresses, ports): no torch, no transformers, so a mistake is
reported within a second.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sqlite3
from collections.abc import Callable
from pathlib import Path

from shared.snapshot import model_config_hash

ADDR_EXAMPLE = "/ip4/203.0.113.7/tcp/4077/p2p/12D3KooW..."


class UserError(Exception):
    """A mistake of the person running the command; str() is the whole message."""


def check_model_dir(path: Path, flag: str = "--model") -> None:
    """A local Hugging Face model directory: config, tokenizer and weights."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such directory; give a local Hugging Face model directory (nothing is downloaded)")
    if not path.is_dir():
        raise UserError(f"{flag} {path}: not a directory; give the directory that holds config.json")
    if not (path / "config.json").is_file():
        raise UserError(
            f"{flag} {path}: no config.json, so not a Hugging Face model directory (save one with model.save_pretrained(DIR))"
        )
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(
            f"{flag} {path}: no tokenizer files (tokenizer.json); save the tokenizer beside the model "
            "with tokenizer.save_pretrained(DIR)"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"{flag} {path}: no weights (*.safetensors); save them with model.save_pretrained(DIR)")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {path}: config.json is not readable JSON ({exc})") from None


def model_fingerprint(path: Path) -> str:
    """The model identity (shared.snapshot.model_config_hash) of a model directory's config.json as written, without
    loading transformers: what a run records and a resume compares."""
    return model_config_hash(json.loads((Path(path) / "config.json").read_text()))


def check_data_dir(path: Path, flag: str = "--data-dir") -> None:
    """A directory we may create or write in (it need not exist yet)."""
    path = Path(path)
    try:
        path.exists()
    except OSError as exc:  # a name past the filesystem's limit, a component that is a file...
        raise UserError(f"{flag} {path}: {exc.strerror}; pass another {flag}") from None
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: is a file, not a directory; pass another {flag}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, so {path} cannot be created; pass another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {existing} is not writable by this user; pass a {flag} you can write to")


def check_peer_addr(addr: str, flag: str = "--hub") -> str:
    """A multiaddr ending in /p2p/<peer id>; its peer id."""
    from multiaddr import Multiaddr

    from shared.crypto import peer_id_from_multiaddr, public_key_from_peer_id

    if "/p2p/" not in addr and addr.startswith(("/ip4/", "/ip6/", "/dns")):
        raise UserError(
            f"{flag} {addr!r} lacks the hub's peer id: add the /p2p/12D3KooW... part `echo-hub start` prints after the port"
        )
    try:
        Multiaddr(addr)
        peer_id = peer_id_from_multiaddr(addr)
        public_key_from_peer_id(peer_id)
    except Exception:  # noqa: BLE001 - multiaddr and base58 raise many types; all mean a mistyped address
        raise UserError(
            f"{flag} {addr!r} is not a hub address: copy the one `echo-hub start` prints, like {ADDR_EXAMPLE}"
        ) from None
    return peer_id


def check_listen(addr: str, flag: str = "--listen") -> None:
    """A TCP multiaddr we can bind now (port 0 always can)."""
    from multiaddr import Multiaddr

    example = "/ip4/0.0.0.0/tcp/4077"
    try:
        ma = Multiaddr(addr)
        port = int(ma.value_for_protocol("tcp"))
    except Exception:  # noqa: BLE001 - any parse failure is a mistyped address
        raise UserError(f"{flag} {addr!r} is not a TCP listen address like {example}") from None
    host, family = _host(ma)
    if host is None:
        raise UserError(f"{flag} {addr!r}: give an /ip4/ or /ip6/ address to listen on, like {example}")
    extra = [p.name for p in ma.protocols()][2:]
    if extra:
        # The hosts speak plain TCP (Noise, Yamux) only: a listener for another transport is never reached.
        raise UserError(f"{flag} {addr!r}: echo2 listens on plain TCP; drop /{'/'.join(extra)}, like {example}")
    if port != 0:
        _check_bindable(host, family, port, f"{flag} {addr}", f"{addr.rsplit('/', 1)[0]}/{port + 1}")


def check_bulk_port(listen: str, port: int, flag: str = "--bulk-port") -> None:
    """The bulk channel's port (shared/bulk.py), on the libp2p listen address's interface: free now, and not the
    libp2p port itself (0: any free port, -1: no channel; `listen` is already checked)."""
    from multiaddr import Multiaddr

    if port in (0, -1):
        return
    ma = Multiaddr(listen)
    if int(ma.value_for_protocol("tcp")) == port:
        raise UserError(
            f"{flag} {port} is the libp2p listen port too ({listen}); give the bulk channel its own, e.g. {flag} {port + 1}"
        )
    host, family = _host(ma)
    assert host is not None  # `listen` is already checked
    _check_bindable(host, family, port, f"{flag} {port}", str(port + 1))


def check_http(bind: str, listen: str, flag: str = "--http") -> None:
    """The status page's HOST:PORT (its form is already checked): free now, and not the libp2p port ("off": no page)."""
    from multiaddr import Multiaddr

    if bind == "off":
        return
    host, _, port = bind.rpartition(":")
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    libp2p_port = int(Multiaddr(listen).value_for_protocol("tcp"))
    if int(port) == libp2p_port and libp2p_port != 0:
        raise UserError(
            f"{flag} {bind}: port {port} is the libp2p listen port too ({listen}); give the page its own, "
            f"e.g. {flag} {host}:{libp2p_port + 1}"
        )
    _check_bindable(host.strip("[]"), family, int(port), f"{flag} {bind}", f"{host}:{int(port) + 1} or {flag} off")


def _check_bindable(host: str, family: int, port: int, what: str, suggestion: str) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"{what}: port {port} is already in use (another hub or node?); stop it or "
                    f"listen on another port, e.g. {suggestion}"
                ) from None
            raise UserError(f"{what}: cannot listen there ({exc.strerror})") from None


def _host(ma) -> tuple[str | None, int]:
    for protocol, family in (("ip4", socket.AF_INET), ("ip6", socket.AF_INET6)):
        try:
            return ma.value_for_protocol(protocol), family
        except Exception:  # noqa: BLE001 - absent protocol
            continue
    return None, socket.AF_INET


def check_key_file(path: Path, flag: str = "--key") -> None:
    """An existing identity key must be private to its owner (a missing one is created)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_file():
        raise UserError(f"{flag} {path}: not a file")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UserError(f"{flag} {path}: mode {oct(mode)} lets others read the key; run: chmod 600 {path}")
    if path.stat().st_size != 32:
        raise UserError(
            f"{flag} {path}: holds {path.stat().st_size} bytes, not a 32-byte Ed25519 key; "
            "point --key at the right file, or move this one away to make a new identity"
        )


def found_in(exc: BaseException, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first error in `exc`, or in the exception groups it nests (trio wraps what tasks raise), that `match`
    accepts; None when there is none."""
    if isinstance(exc, BaseExceptionGroup):
        return next((found for inner in exc.exceptions if (found := found_in(inner, match)) is not None), None)
    return exc if match(exc) else None


def disk_full(exc: BaseException) -> BaseException | None:
    """The error in `exc` (found_in) that says a disk (or the user's quota) is full: an OSError ENOSPC or EDQUOT,
    or SQLite's SQLITE_FULL; None when there is none."""
    return found_in(
        exc,
        lambda e: (
            (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
            or (isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL)
        ),
    )


def free_space(path: Path) -> str:
    """The free space on the disk of `path` (or of its nearest existing parent): "12.3 MB free"."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return f"{shutil.disk_usage(existing).free / 1e6:.1f} MB free"
