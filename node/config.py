"""The volunteer node's configuration: one strict model."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from node.price_schedule import parse_price_schedule
from shared.config import HttpBind, Section
from shared.layout import NODE_KEY_FILE
from shared.logs import LOG_BACKUPS, LOG_MAX_MB
from shared.messages import DisplayName


class NodeConfig(Section):
    """Everything `echo-node join` needs."""

    hub: str = Field(description="hub multiaddr including /p2p/<hub peer id>, as the hub printed it")
    name: DisplayName | None = Field(
        None,
        description="display name on the hub's status page, in echo-hub status and both dashboards (beside the short peer id), 1-32 printable characters (None: the short peer id)",
    )
    http: HttpBind = Field("off", description="this node's own page, /api/status and /metrics at HOST:PORT, or off")
    price: float = Field(
        0.35,
        ge=0.0,
        le=1000.0,
        description="declared price in $/h (how the hub ranks and pays it: the top of echo-node join --help)",
    )
    price_schedule: str | None = Field(
        None,
        max_length=1000,
        description="price by local time of day, e.g. 07:00=0.45,23:00=0.30: re-declared to the hub as it changes (replaces --price)",
    )
    backend: Literal["auto", "hf", "vllm"] = Field("auto", description="rollout engine")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="torch device (auto: cuda when torch sees a GPU, else cpu)"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="engine weight dtype, must be the hub's (auto: bfloat16 on a CUDA GPU that has it, else float32)"
    )
    data_dir: Path = Field(Path("echo2-node"), description="identity, snapshots, logs, node_status.json")
    key: Path | None = Field(None, description="identity key file (default DATA_DIR/node.key)")
    model: Path | None = Field(
        None,
        description="a local copy of the model the hub trains, weights included (a LoRA run's nodes need it; None: the node fetches the hub's config and tokenizer, and the weights come as snapshots)",
    )
    listen: str = Field("/ip4/0.0.0.0/tcp/0", description="libp2p listen multiaddr (for chain relays)")
    public_addr: str | None = Field(
        None,
        pattern=r"^/(ip4|ip6|dns4|dns6)/[^/]+/tcp/[0-9]{1,5}$",
        description="where peers dial this node when its router forwards a port to it, e.g. /ip4/203.0.113.5/tcp/4001 (behind a NAT: leave unset)",
    )
    bulk_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="TCP port of the bulk channel snapshot transfers take (shared/bulk.py; 0: any free port, -1: off, transfers go over libp2p; behind a forwarded port, forward this one too)",
    )
    max_rollouts_per_s: float | None = Field(None, gt=0.0, description="throttle generation (tests, benchmarks)")
    link_mbps: float | None = Field(None, gt=0.0, description="emulated outbound link rate in Mbit/s")
    declared_link_mbps: float = Field(1000.0, gt=0.0, le=1e6, description="link bandwidth declared on join")
    reconnect_max_s: float = Field(10.0, gt=0.0, le=3600.0, description="cap of the reconnect backoff")
    wait_next_run: bool = Field(
        False,
        description="when the hub says its run is over (finished, or stopped by its operator), wait for the next run at its address instead of stopping with a summary",
    )
    threads: int = Field(1, ge=1, le=256, description="torch threads for generation")
    seed: int | None = Field(
        None,
        ge=0,
        lt=2**31,
        description="sampling seed of this process (None: a fresh random one at every start, so nodes never sample alike)",
    )
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0.0,
        le=0.98,
        description="vLLM on CUDA: share of the GPU's memory the engine may take (None: 0.85; several nodes on one GPU: split it)",
    )
    kv_cache_gib: int | None = Field(
        None, ge=1, le=4096, description="vLLM on a CPU: GiB of host memory for the KV cache (None: 1)"
    )
    cpu_cores: str | None = Field(
        None,
        pattern=r"^[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,63}$",
        description="vLLM on a CPU: cores its threads are bound to, e.g. 2-3 (None: --threads threads, left to the OS; two nodes on one machine: give each its own cores)",
    )
    max_lora_rank: int = Field(
        0,
        ge=0,
        le=512,
        description="vLLM: serve LoRA runs' adapters up to this rank (0: full-weight runs only; vLLM reserves memory for LoRA)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_max_mb: float = Field(
        LOG_MAX_MB, ge=0.01, le=1e6, description="node.log (and a dashboard's node.err) is rotated past this size, in MB"
    )
    log_backups: int = Field(LOG_BACKUPS, ge=1, le=1000, description="rotated logs kept (node.log.1 ...); older ones are deleted")

    @field_validator("price_schedule")
    @classmethod
    def _schedule_parses(cls, text: str | None) -> str | None:
        if text is not None:
            parse_price_schedule(text)
        return text

    @property
    def key_path(self) -> Path:
        return self.key if self.key is not None else self.data_dir / NODE_KEY_FILE
