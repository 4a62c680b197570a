"""A host's peerstore: bounded, never evicting the host's own keys or a peer it is connected to, and forgetting a
peer once its last inbound connection ends.

py-libp2p 0.8.1's PeerStore keeps at most 1,000 peers and, past that, evicts address-less entries first. The host's
own entry holds its key pair and no address, so it goes first: the next identify raised `PeerStoreError: peer ID
not found` and the hub exited after 1,590 throwaway identities had connected and hung up (issue 65;
docs/upstream/peerstore-eviction.md is the report for py-libp2p). `BoundedPeerStore` evicts only peers with no
live connection, oldest first, and never the host itself; `ForgetOnHangUp` drops a peer that dialled in as soon
as its last connection is gone, so a flood of identities leaves nothing behind. A peer this host dialled itself
(the hub, an upstream, a reachability target) is kept until the bound needs its room: py-libp2p redials it from
the addresses stored here.
"""

from __future__ import annotations

from collections.abc import Callable

from libp2p.abc import INetConn, INetStream, INotifee
from libp2p.network.connection.swarm_connection import Direction
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore
from multiaddr import Multiaddr

# Peers a peerstore keeps that have no live connection: py-libp2p's own bound, kept (live peers come on top of it,
# and they are bounded by the swarm's connection limit).
MAX_IDLE_PEERS = 1000


class BoundedPeerStore(PeerStore):
    """py-libp2p's PeerStore, with an eviction that spares the host's own entry and every peer `is_live` says is
    connected (`attach` sets it once the swarm exists)."""

    def __init__(self, own: ID, max_idle_peers: int = MAX_IDLE_PEERS) -> None:
        super().__init__(max_peers=max_idle_peers)
        self.own = own
        self.is_live: Callable[[ID], bool] = lambda _peer: False

    def _enforce_peer_limit(self) -> None:
        excess = len(self.peer_data_map) - self.max_peers
        if excess <= 0:
            return
        # Insertion order is age: py-libp2p adds an entry when it first hears of a peer.
        idle = [peer for peer in self.peer_data_map if peer != self.own and not self.is_live(peer)]
        for peer in idle[:excess]:
            self.forget(peer)

    def forget(self, peer: ID) -> None:
        """Drop all that is held of `peer` (nothing for the host itself, or a peer never recorded)."""
        if peer == self.own:
            return
        self.peer_data_map.pop(peer, None)
        self.peer_record_map.pop(peer, None)
        self.addr_update_channels.pop(peer, None)


class QuietNotifee(INotifee):
    """py-libp2p's network notifee with every event ignored: a subclass overrides those it listens to."""

    async def connected(self, network, conn: INetConn) -> None:
        pass

    async def disconnected(self, network, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network, stream: INetStream) -> None:
        pass

    async def listen(self, network, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr: Multiaddr) -> None:
        pass


class ForgetOnHangUp(QuietNotifee):
    """Forgets a peer once its last connection has closed, where every one of them was inbound."""

    def __init__(self, store: BoundedPeerStore, connections: Callable[[ID], list[INetConn]]) -> None:
        self.store = store
        self.connections = connections
        self._dialled: set[ID] = set()

    async def connected(self, network, conn: INetConn) -> None:
        if getattr(conn, "direction", None) == Direction.OUTBOUND:
            self._dialled.add(conn.muxed_conn.peer_id)

    async def disconnected(self, network, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        if self.connections(peer):
            return
        if peer in self._dialled:  # kept for redials, within the store's bound
            self._dialled.discard(peer)
            return
        self.store.forget(peer)
