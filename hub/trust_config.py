"""Config of the hub's trust defences (DESIGN section 7): log-prob audits, copy detection, Sybil and peer limits.

Defaults and why (measured on the embedded default model, 20 prompts x 8 completions x <= 10 tokens):
- honest fp32 CPU node vs the hub's fp32 CPU recomputation: mean |dlogp| ~3e-7, max ~7e-6;
- honest bf16 node vs the same fp32 recomputation: mean ~0.008, worst group mean ~0.016, max token
  ~0.16, and ~1 token in 900 outside the hub's top-p nucleus (top_p 0.9);
- a node generating with another model (the base model while claiming a snapshot three Adam steps
  at lr 1e-4 away): mean ~0.3, every group above 0.05.
The hub cannot trust the backend or dtype a node declares, so the tolerance must admit the least
exact engine any honest node may run (bf16/vLLM): 0.05 nats is three times the worst honest bf16
group seen. An operator whose fleet is known to run fp32 can lower it to ~1e-3.
"""

from __future__ import annotations

from pydantic import Field

from shared.config import Section


class TrustConfig(Section):
    """Audits, copy detection and per-peer limits of the hub (DESIGN section 7)."""

    audit_rate: float = Field(0.05, ge=0.0, le=1.0, description="fraction of a trusted node's submissions re-scored")
    audit_first_n: int = Field(10, ge=0, le=10_000, description="a node is audited on every submission until it passed this many")
    audit_mean_abs_gap: float = Field(0.05, gt=0.0, le=10.0, description="max mean |reported - recomputed| log-prob per group, nats")
    audit_max_outside_frac: float = Field(0.05, ge=0.0, le=1.0, description="max fraction of tokens outside the hub's top-p nucleus")
    audit_queue_groups: int = Field(256, ge=1, le=100_000, description="sampled groups waiting for an audit before new ones are skipped (counted)")
    copy_cache_groups: int = Field(100_000, ge=1, le=10_000_000, description="recent group fingerprints kept for copy detection (LRU)")
    copy_min_surprise_nats: float = Field(20.0, ge=0.0, le=1e6, description="a repeat is a copy only if an honest repeat had probability < exp(-this)")
    lease_new_node_prompts: int = Field(1, ge=1, le=1024, description="prompts per lease until a node passed trusted_after_audits audits")
    trusted_after_audits: int = Field(3, ge=0, le=10_000, description="audits a node must pass before full-size leases")
    max_open_leases_per_peer: int = Field(2, ge=1, le=1024, description="open leases one identity may hold")
    max_open_leases_per_ip: int = Field(8, ge=1, le=100_000, description="open leases all identities behind one address (IPv6: /64) may hold")
    quota_exempt_loopback: bool = Field(True, description="loopback peers (the hub's own local nodes) skip the per-address quota")
    max_streams_per_peer: int = Field(16, ge=1, le=4096, description="concurrent inbound streams one peer may hold")
    requests_per_s: float = Field(20.0, gt=0.0, le=1e6, description="sustained inbound streams per second per peer (token bucket rate)")
    request_burst: int = Field(40, ge=1, le=1_000_000, description="token bucket depth: streams a peer may open at once after a quiet spell")
    max_buffered_bytes_per_peer: int = Field(96 << 20, ge=1 << 20, le=1 << 40, description="frame bytes one peer may have in hub memory at once")
    max_buffered_bytes_total: int = Field(2 << 30, ge=1 << 20, le=1 << 44, description="frame bytes all peers together may have in hub memory at once")
    violations_to_disconnect: int = Field(20, ge=1, le=1_000_000, description="refusals within violation_window_s that get a peer disconnected")
    violation_window_s: float = Field(10.0, gt=0.0, le=86400.0, description="sliding window over which refusals are counted")
    disconnect_cooldown_s: float = Field(60.0, ge=0.0, le=86400.0, description="a disconnected peer is refused outright this long")
