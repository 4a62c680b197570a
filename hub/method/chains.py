"""Chain planner for the pipelined snapshot broadcast (docs/DESIGN.md §7), as pure functions.

Arranges active nodes into N_ch = max(1, floor(B0 / Bw)) store-and-forward chains, re-links a
chain when a node leaves, gives the ideal chained and star broadcast times the
benchmarks compare against, and judges whether a relay sends too slowly to keep its place.

Order inside a chain: fastest link first, so slow nodes sit at the tails. A hop runs at the
rate of the slowest link before it, so a slow node in the middle throttles everyone
downstream, while at the tail it only delays itself. Nodes are dealt round-robin over the
chains in that fastest-first order, so chain heads are the N_ch fastest nodes and lengths
differ by at most one.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence


def num_chains(hub_uplink_bps: float, node_link_bps: float, max_chains: int = 1 << 20) -> int:
    """N_ch = max(1, floor(B0 / Bw)) capped at `max_chains`: how many chains the hub uplink feeds at full node rate.

    The cap is applied before the floor, so no ratio (a tiny declared Bw makes it huge) reaches an
    int conversion that could overflow.
    """
    if not (hub_uplink_bps > 0 and node_link_bps > 0 and math.isfinite(hub_uplink_bps) and math.isfinite(node_link_bps)):
        raise ValueError(f"bandwidths must be finite and > 0, got B0={hub_uplink_bps}, Bw={node_link_bps}")
    if max_chains < 1:
        raise ValueError(f"max_chains must be >= 1, got {max_chains}")
    return max(1, math.floor(min(hub_uplink_bps / node_link_bps, float(max_chains))))


def plan_chains(nodes: Sequence[tuple[str, float]], hub_uplink_bps: float) -> list[list[str]]:
    """Chains of node names for (name, link bytes/s) pairs; Bw is the slowest link.

    min(N_ch, len(nodes)) chains, fastest link first in each (ties by name), lengths differing
    by at most one. No nodes, no chains.
    """
    if not nodes:
        return []
    names = [name for name, _ in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in {names}")
    for name, link_bps in nodes:
        if link_bps <= 0:
            raise ValueError(f"node {name!r}: link bandwidth must be > 0, got {link_bps}")
    slowest_bps = min(link_bps for _, link_bps in nodes)
    count = num_chains(hub_uplink_bps, slowest_bps, len(nodes))
    ordered = sorted(nodes, key=lambda node: (-node[1], node[0]))
    chains: list[list[str]] = [[] for _ in range(count)]
    for index, (name, _) in enumerate(ordered):
        chains[index % count].append(name)
    return chains


def relink_after_leave(chains: Sequence[Sequence[str]], gone: str) -> list[list[str]]:
    """Chains with `gone` cut out: its successor now reads from its predecessor (or the hub).

    Re-linking rather than re-planning keeps every other hop as it was, so transfers in flight
    on the rest of the fleet continue and only the successor resumes, from the first chunk it
    lacks. A chain left empty is dropped.
    """
    if not any(gone in chain for chain in chains):
        raise ValueError(f"node {gone!r} is in no chain")
    relinked = [[name for name in chain if name != gone] for chain in chains]
    return [chain for chain in relinked if chain]


def chain_ideal_s(model_bytes: float, chunk_bytes: float, chain_len: int, link_bps: float) -> float:
    """Ideal time for one chain to hold a snapshot: M / Bw + (L - 1) * c / Bw.

    link_bps is the rate every hop of the chain runs at, the hub's own hop included. With
    N_ch > 1 chains that assumes the hub uplink feeds each chain head at that rate, i.e.
    N_ch * link_bps <= B0, which N_ch = floor(B0 / Bw) guarantees; chains then run side by side
    and the broadcast takes as long as the longest one (see `chained_broadcast_ideal_s`).
    """
    if model_bytes < 0 or chunk_bytes <= 0 or chain_len < 1 or link_bps <= 0:
        raise ValueError(
            f"need model_bytes >= 0, chunk_bytes > 0, chain_len >= 1, link_bps > 0; got "
            f"{model_bytes}, {chunk_bytes}, {chain_len}, {link_bps}"
        )
    return model_bytes / link_bps + (chain_len - 1) * chunk_bytes / link_bps


def chained_broadcast_ideal_s(model_bytes: float, chunk_bytes: float, n_nodes: int, hub_bps: float, link_bps: float) -> float:
    """Ideal broadcast time to n_nodes over planned chains: the longest chain, ceil(N / N_ch) long.

    Each chain runs at min(Bw, B0 / N_ch): Bw normally, B0 itself when the hub uplink is slower
    than one node link (N_ch = 1).
    """
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    count = num_chains(hub_bps, link_bps, max(1, n_nodes))
    longest = math.ceil(n_nodes / count)
    return chain_ideal_s(model_bytes, chunk_bytes, longest, min(link_bps, hub_bps / count))


def star_ideal_s(model_bytes: float, nodes: int, hub_bps: float, link_bps: float) -> float:
    """Ideal time for the hub to send the snapshot to every node itself: M / min(Bw, B0 / N).

    That is N * M / B0 once B0 / N < Bw, and M / Bw while the hub uplink is not the bottleneck.
    """
    if model_bytes < 0 or nodes < 1 or hub_bps <= 0 or link_bps <= 0:
        raise ValueError(
            f"need model_bytes >= 0, nodes >= 1, hub_bps > 0, link_bps > 0; got {model_bytes}, {nodes}, {hub_bps}, {link_bps}"
        )
    return model_bytes / min(link_bps, hub_bps / nodes)


def join_chains(chains: Sequence[Sequence[str]], newcomer: str, max_chains: int) -> list[list[str]]:
    """Chains with `newcomer` appended: as a new chain while fewer than `max_chains`, else to the shortest tail.

    Appending at a tail leaves every existing hop as it was, so a join never interrupts a
    transfer in flight.
    """
    if any(newcomer in chain for chain in chains):
        raise ValueError(f"node {newcomer!r} is already in a chain")
    out = [list(chain) for chain in chains]
    if len(out) < max(1, max_chains):
        out.append([newcomer])
    else:
        min(out, key=len).append(newcomer)
    return out


def proven_first(chains: Sequence[Sequence[str]], proven: Collection[str]) -> list[list[str]]:
    """Each chain with its `proven` members (nodes the hub measured: they answered work) first, then the rest, each
    part in its order: a throwaway identity that never pulls stalls whoever pulls behind it, so no proven node waits
    behind an unproven one."""
    return [[p for p in chain if p in proven] + [p for p in chain if p not in proven] for chain in chains]


# -- a relay's pace ----------------------------------------------------------------------------------

# A relay holding the whole snapshot that sends its successor less than this share of what the link between them
# (both declared) and the hub's own pace promise throttles everyone below it: it is moved to its chain's tail.
SLOW_RELAY_FRACTION = 0.25
# A pace is judged only once a relay at that bound would have sent this many chunks: one or two chunks say nothing.
SLOW_RELAY_MIN_CHUNKS = 4


def relay_too_slow(
    delivered_bytes: float, elapsed_s: float, lag_s: float, declared_bps: float, hub_bps: float, chunk_bytes: float
) -> bool:
    """Whether a relay sent its successor too little in `elapsed_s`: `delivered_bytes` below SLOW_RELAY_FRACTION
    of min(`declared_bps`, `hub_bps`) over that window, judged only once the bound owes SLOW_RELAY_MIN_CHUNKS chunks.

    The relay gets the benefit of every doubt: the successor's report may be `lag_s` old (what it got since is not
    counted against the relay, nor is that time), and one chunk may be on its way unreported.
    """
    owed_bytes = SLOW_RELAY_FRACTION * min(declared_bps, hub_bps) * (elapsed_s - lag_s)
    return owed_bytes >= SLOW_RELAY_MIN_CHUNKS * chunk_bytes and delivered_bytes + chunk_bytes < owed_bytes


# -- reachability: who can dial whom -----------------------------------------------------------------

Reachability = str  # "public" (dialable), "nated" (dials out only), "unknown" (not probed yet: dialed by nobody)
LinkKind = str  # "hub": from the hub; "direct": dials its upstream; "pushed": its upstream dials it; "holepunch": both dial


def link_kind(upstream: Reachability | None, downstream: Reachability) -> LinkKind:
    """How a node gets its upstream's chunks: it dials a dialable upstream; a NATed upstream dials it when it
    is dialable itself; between two NATed nodes both dial at once, coordinated over the hub's relay (a hole
    punch, node/nat.py). `upstream` None: the node heads its chain. A node not probed yet is dialed by nobody:
    only an address the hub's dial-back confirmed is handed to peers, so its successor pulls from the hub."""
    if upstream is None or upstream == "unknown" or (upstream == "nated" and downstream == "unknown"):
        return "hub"
    if upstream == "public":
        return "direct"
    return "pushed" if downstream == "public" else "holepunch"


def separate_nated(chain: Sequence[str], reach: dict[str, Reachability]) -> list[str]:
    """The chain with a dialable node moved between each NATed node and a NATed successor (after a hole
    punch between two of them failed), as far as dialable nodes allow: one is taken only from where its
    leaving makes no new NATed pair. Otherwise order is kept (a re-plan must not reshuffle transfers in
    flight)."""
    out = list(chain)

    def nated(i: int) -> bool:
        return 0 <= i < len(out) and reach.get(out[i]) == "nated"

    i = 1
    while i < len(out):
        if nated(i - 1) and nated(i):
            spare = next(
                (j for j in range(len(out)) if j not in (i - 1, i) and not nated(j) and not (nated(j - 1) and nated(j + 1))), None
            )
            if spare is None:
                break
            node = out.pop(spare)
            out.insert(i if spare > i else i - 1, node)
            i = 1  # positions moved: look again from the start
            continue
        i += 1
    return out
