"""A node started without --model: the hub's config and tokenizer files, fetched into DATA_DIR/hub-model before the
engine is built from them (the weights come as the first snapshot, as for every node). A node with --model asks only
for their list, which also says the hub's price ceiling: a price above it is refused before the engine is built."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

from node.client import HubClient, WrongHub
from node.config import NodeConfig
from node.hub_link import BACKOFF_START_S, LinkState
from shared.crypto import Identity
from shared.failures import plain_failure
from shared.files import atomic_write_text
from shared.layout import NODE_STATUS_FILE
from shared.messages import PEER_TEXT_CHARS, EventRecord, ModelFiles, NodeView, Reject, printable_excerpt
from shared.model_files import ModelFilesRefused, held, prune_unlisted, write_model_file
from shared.net import running_host
from shared.signals import Stopper

log = logging.getLogger("echo2.node.model_fetch")

# A host that only dials: any free port on loopback's family is enough.
DIAL_ONLY_LISTEN = "/ip4/127.0.0.1/tcp/0"
STATUS_PERIOD_S = 1.0  # how often node_status.json is rewritten, in this phase and by the running node


async def write_status(path: Path, view: Callable[[], NodeView]) -> None:
    """Rewrite the node's status file (`view()`) every STATUS_PERIOD_S until cancelled, and once more on the way
    out: what changed since the last write must not vanish from the dashboard's view."""
    try:
        while True:
            await trio.to_thread.run_sync(atomic_write_text, path, view().model_dump_json())
            await trio.sleep(STATUS_PERIOD_S)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(atomic_write_text, path, view().model_dump_json())


class ModelFilesBusy(Exception):
    """The hub is throttling model files (its per-address limit, or its own load): ask again after a while."""


async def fetch_hub_model(client: HubClient, directory: Path) -> ModelFiles:
    """Ask the hub for its model's file list, then for each file `directory` lacks; each is checked against the
    list before it is written, and files the list does not name are removed. ModelFilesRefused: the hub offers
    none, its run needs the base weights on disk (LoRA), or a file is not what the list says."""
    listing = await client.model_files()
    if isinstance(listing, Reject):
        raise (ModelFilesBusy if listing.busy else ModelFilesRefused)(printable_excerpt(listing.reason, PEER_TEXT_CHARS))
    if not listing.weights_in_snapshots:
        raise ModelFilesRefused(
            f"the hub trains LoRA adapters on {listing.model} and its snapshots carry no base "
            "weights: start the node with --model and that model"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for entry in listing.files:
        if await trio.to_thread.run_sync(held, directory, entry):
            continue
        data = await client.model_file(entry)
        if isinstance(data, Reject):
            reason = printable_excerpt(data.reason, PEER_TEXT_CHARS)
            raise (ModelFilesBusy if data.busy else ModelFilesRefused)(f"{entry.name}: {reason}")
        await trio.to_thread.run_sync(write_model_file, directory, entry, data)
    await trio.to_thread.run_sync(prune_unlisted, directory, listing)
    return listing


async def hub_terms(client: HubClient) -> ModelFiles | None:
    """What a node with its own --model asks before it builds its engine: the hub's file list alone, for its terms
    (the price ceiling). None from a hub that offers no files: its ceiling is then checked at join."""
    listing = await client.model_files()
    if isinstance(listing, Reject):
        if listing.busy:
            raise ModelFilesBusy(printable_excerpt(listing.reason, PEER_TEXT_CHARS))
        return None
    return listing


class ModelFetch:
    """The node's first phase, before its engine is built: dial the hub until it answers (backoff as the hub link's)
    and fetch its model files (a node without --model) or only their list (with --model: the hub's terms), writing
    node_status.json meanwhile (the dashboard shows a node waiting for its hub) and stopping on SIGINT/SIGTERM. Another
    peer at the hub's address (WrongHub) or a refusal ends it."""

    def __init__(
        self, config: NodeConfig, identity: Identity, directory: Path | None, on_note: Callable[[EventRecord], None]
    ) -> None:
        """`directory`: where the hub's files go (None: only their list is asked for)."""
        self.config = config
        self.identity = identity
        self.directory = directory
        self.state = LinkState(on_note=on_note)
        self.stopper = Stopper()
        self.answered = False  # False once run returns: stopped by a signal
        self.listing: ModelFiles | None = None  # the hub's list (None: it offers none, or it has not answered)

    def view(self) -> NodeView:
        return NodeView(
            peer_id=self.identity.peer_id,
            name=self.config.name or "",
            hub_addr=self.config.hub,
            connected=False,
            state="connecting",
            updated_at=time.time(),
            price_per_hour=self.config.price,
            backend=self.config.backend,
            version_held=-1,
            events=tuple(self.state.events[-20:]),
        )

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.stopper.run, nursery.cancel_scope)
            nursery.start_soon(write_status, self.config.data_dir / NODE_STATUS_FILE, self.view)
            self.listing = await self._fetch()
            self.answered = True
            nursery.cancel_scope.cancel()

    async def _fetch(self) -> ModelFiles | None:
        async with running_host(self.identity, [DIAL_ONLY_LISTEN]) as (host, _):
            client = HubClient(host, self.identity, self.config.hub)
            backoff = BACKOFF_START_S
            while True:
                try:
                    await client.connect()
                    if self.directory is None:
                        return await hub_terms(client)
                    return await fetch_hub_model(client, self.directory)
                except (WrongHub, ModelFilesRefused):
                    raise
                except ModelFilesBusy as exc:  # files already written are kept: the next try asks for the rest
                    self.state.note("busy", f"model files: {exc}; next try in {backoff:.0f}s")
                except Exception as exc:  # noqa: BLE001 - any dial or stream failure means "hub not reachable yet"
                    log.info("model files: hub not reachable (%r)", exc)
                    self.state.note("unreachable", f"the hub {plain_failure(exc)}; next try in {backoff:.0f}s")
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.config.reconnect_max_s)
