"""Test-only `echo-node`: the real node runtime, recording what each install put into the engine.

Usage: python testbed/recording_node.py join --hub ... (the `echo-node join` flags), or `main(argv)`
After every install it writes DATA_DIR/installed/v<version>.json with the blake3 of the
file handed to the engine, a digest of the engine model's weights as they now are (so a
test can compare both, bit for bit, with the hub's snapshot file), and the peer it came from
(every install, where node.log says only one a minute).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import blake3
import torch
import trio

from node.run import NodeRuntime
from shared.files import atomic_write_text
from shared.snapshot import file_hash
from shared.weights_file import read_entries


def weights_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    """blake3 over (name, dtype, shape, raw bytes) of the named tensors, in name order."""
    digest = blake3.blake3()
    for name in sorted(names):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _describe(engine, path: Path, version: int, source: str | None) -> str:
    names = [e.name for e in read_entries(path)]
    with engine._lock:  # no generation may interleave with reading the weights back
        model = weights_digest(engine.model.state_dict(), names)
    return json.dumps({"version": version, "bytes_blake3": file_hash(path), "model_digest": model, "source": source})


def record_installs() -> None:
    install = NodeRuntime._install

    async def recording_install(self: NodeRuntime, path: Path, version: int, probe) -> None:
        transfer = self.keeper.transfer  # the keeper lets go of it only once the install returns
        source = transfer.source if transfer is not None and transfer.manifest.version == version else None
        await install(self, path, version, probe)
        text = await trio.to_thread.run_sync(_describe, self.engine, path, version, source)
        directory = self.config.data_dir / "installed"
        directory.mkdir(exist_ok=True)
        await trio.to_thread.run_sync(atomic_write_text, directory / f"v{version}.json", text)

    NodeRuntime._install = recording_install


def main(argv: list[str] | None = None) -> int:
    """`echo-node` with its installs recorded."""
    record_installs()
    from node.cli import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
