"""Real-model scale: snapshot bytes, publish time, T_bcast, peak RSS and snapshot-dir size against model size.

Usage: python bench/scale.py [--json] [--sizes 25M,100M,400M] [--dtypes float32,bfloat16]
                             [--link-mbps 800] [--snapshots 5] [--plot docs/plots/scale.png]
                             [--gradient-checkpointing]

For each size (a random-init Qwen2 built locally from its config class, no download) and dtype:
a real hub (`echo-hub start --model DIR --dtype D`) and three real nodes (`echo-node join`) on
loopback, one chain (hub and node links emulated at --link-mbps, the hub planning with the same
uplink), [scheduler] enabled = false so all three work, and a learner that publishes every step
(S = 0, kappa = 1: every version reaches every node before the next step, so every broadcast
is timed alone) until --snapshots broadcasts after v0 were timed. Measured:
- snapshot_bytes, publish_s (build + write of a snapshot: the store's published_at - created_at),
  t_bcast_s (from the hub recording a version to the last node's "installed vN" log line, the
  mean over versions every node installed) against ideal_s (hub.method.chains.chained_broadcast_ideal_s
  for 3 nodes in one chain). The hub's own T_bcast is not used: it records a version only if no
  newer one was published before the last node had it, and at S = 0 the chain's head already
  sends the learner the rollouts of the next step while the tail is still receiving;
- hub_peak_rss_bytes, node_peak_rss_bytes: each process's VmHWM, reset (/proc/PID/clear_refs 5)
  once it has loaded its model, joined and installed v0, so they cover steady state: training,
  audits, snapshot writes, transfers and installs. The start-up peaks (from_pretrained maps the
  model dir's fp32 file) are reported apart as *_startup_peak_rss_bytes;
- snapshot_dir_bytes: the largest the hub's snapshots/ got, sampled every 0.1 s
  (node_snapshot_dir_bytes: the same for the nodes'); a snapshot there is its weights and its
  signed manifest (and, while it is written, the manifest's temp file).
Targets (checked into "targets_met"): node peak <= 1.3 x the engine model's bytes + 700 MB; hub peak
<= learner state (16 bytes/parameter: fp32 weights, grads, two Adam moments) + 1 snapshot + 700 MB;
snapshot dir <= (S + 2) x snapshot bytes; t_bcast <= 1.25 x ideal; bf16 bytes = fp32 bytes / 2.

Relay: the largest snapshot through three processes (source -> relay -> sink) over unlimited
loopback links, each a real SnapshotKeeper; relay_cpu_s_per_gb is the relay process's own CPU
seconds (getrusage) per GB it received, verified, wrote and forwarded on the bulk channel (shared/bulk.py,
the path nodes take from a sender they dial), relay_libp2p_cpu_s_per_gb the same run on libp2p streams
(the path from NATed senders), one after the other. --profile writes the relay's
cProfile (top functions by own time) beside the JSON. transport_floor_cpu_s_per_gb: the same bytes
over one bare stream of our host setup (Noise + Yamux over TCP, no echo2 protocol), sender's and
receiver's CPU seconds together: what a relay, which receives and sends every byte, pays in
py-libp2p before any of our code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from hub.method.chains import chained_broadcast_ideal_s  # noqa: E402
from shared.layout import SNAPSHOTS_DIR  # noqa: E402
from shared.units import BYTES_PER_MBIT  # noqa: E402
from testbed.harness import Proc, query, start_hub, start_node, wait_until  # noqa: E402

MB = 1e6
# name -> (hidden, layers): ~12 x hidden^2 x layers with grouped-query attention (testbed/models.py).
SIZES = {"25M": (512, 9), "100M": (768, 16), "400M": (1280, 24)}
STALENESS = 0  # on-policy: each version is broadcast, used and timed before the next (kappa = 1)
NODES = 3
ALLOWANCE_BYTES = 700 * MB
POLL_S = 0.1
RUN_TIMEOUT_S = 1800.0


def hub_toml() -> str:
    # A random model scores 0 everywhere: train on zero-variance groups so the learner steps (and publishes).
    # Every version ships in full: at lr 1e-5 a bf16 delta is a few kB, and T_bcast would time applying it,
    # not the snapshot's bytes its ideal is computed for (bench/delta.py measures deltas).
    return f"""
steps = 0
local_nodes = 0
[learner]
staleness = {STALENESS}
kappa = 1
prompts_per_step = 2
group_size = 2
lr = 1e-5
skip_zero_variance = false
checkpoint_every = 100000
[sampling]
max_new_tokens = 2
[lease]
prompts_per_lease = 1
[scheduler]
enabled = false
[broadcast]
delta_max_ratio = 0.0
"""


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# The nodes log at debug: node.log says each install then (at info, one a minute and the last one again at the stop).
_INSTALLED_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:INFO|DEBUG) echo2\.node\.keeper: installed v(\d+) ", re.M)


def install_times(node_dir: Path) -> dict[int, float]:
    """version -> unix time the node logged installing it first (node.log, local time to the millisecond)."""
    log = node_dir / "node.log"
    text = log.read_text() if log.exists() else ""
    times: dict[int, float] = {}
    for at, v in _INSTALLED_RE.findall(text):
        times.setdefault(int(v), datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return times


def broadcast_times(data: Path, node_dirs: list[Path]) -> dict[int, float]:
    """version (> 0) -> seconds from the hub recording it to the last node installing it, for versions
    every node installed."""
    published = dict(query(data, "SELECT version, published_at FROM snapshots WHERE version > 0"))
    installs = [install_times(d) for d in node_dirs]
    return {v: max(i[v] for i in installs) - at for v, at in published.items() if all(v in i for i in installs)}


def dir_bytes(path: Path) -> int:
    total = 0
    for entry in path.iterdir() if path.is_dir() else ():
        try:
            total += entry.stat().st_size
        except FileNotFoundError:  # deleted between listing and stat
            pass
    return total


@dataclass
class Result:
    params: int
    dtype: str
    snapshot_bytes: int
    publish_s: float
    t_bcast_s: float
    ideal_s: float
    hub_peak_rss_bytes: int
    node_peak_rss_bytes: int
    snapshot_dir_bytes: int
    node_snapshot_dir_bytes: int
    hub_startup_peak_rss_bytes: int
    node_startup_peak_rss_bytes: int
    engine_model_bytes: int
    learner_state_bytes: int
    broadcasts: int
    targets_met: dict[str, bool]


def build_model(work: Path, size: str) -> tuple[Path, int]:
    from transformers import AutoConfig

    from testbed.models import random_model_dir

    hidden, layers = SIZES[size]
    out = work / f"qwen2-{size}"
    if not (out / "config.json").exists():
        random_model_dir(out, "qwen2", hidden=hidden, layers=layers, tie_word_embeddings=True)
    config = AutoConfig.from_pretrained(out)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return out, params


def run_one(
    work: Path, model_dir: Path, params: int, dtype: str, link_mbps: float, snapshots: int, log, checkpointing: bool = False
) -> Result:
    run_dir = work / f"run-{model_dir.name}-{dtype}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "hub.toml").write_text(hub_toml())
    data = run_dir / "hub"
    hub = start_hub(
        data,
        "--config",
        str(run_dir / "hub.toml"),
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--link-mbps",
        str(link_mbps),
        "--hub-mbps",
        str(link_mbps),
        "--gradient-checkpointing",
        "true" if checkpointing else "false",
    )
    nodes: list[Proc] = []
    try:
        node_dirs = [run_dir / f"node{i}" for i in range(NODES)]
        for node_dir in node_dirs:
            nodes.append(
                start_node(
                    hub.addr,
                    node_dir,
                    "--model",
                    str(model_dir),
                    "--dtype",
                    dtype,
                    "--link-mbps",
                    str(link_mbps),
                    "--declared-link-mbps",
                    str(link_mbps),
                    "--log-level",
                    "debug",
                )
            )

        def all_hold_v0() -> bool:
            views = [d / "node_status.json" for d in node_dirs]
            return all(v.exists() and json.loads(v.read_text())["version_held"] >= 0 for v in views)

        wait_until(all_hold_v0, 600, "three nodes to join and install v0", poll_s=0.5)
        startup = (vm_kib(hub.process.pid, "VmHWM") * 1024, max(vm_kib(n.process.pid, "VmHWM") * 1024 for n in nodes))
        for proc in (hub, *nodes):
            reset_peak(proc.process.pid)
        log(f"  {model_dir.name} {dtype}: running, start-up peaks hub {startup[0] / MB:.0f} MB, node {startup[1] / MB:.0f} MB")
        hub_dir, dir_peak, node_dir_peak = data / SNAPSHOTS_DIR, 0, 0
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            dir_peak = max(dir_peak, dir_bytes(hub_dir))
            node_dir_peak = max(node_dir_peak, *(dir_bytes(d / SNAPSHOTS_DIR) for d in node_dirs))
            if len(broadcast_times(data, node_dirs)) >= snapshots:
                break
            if hub.process.poll() is not None or any(n.process.poll() is not None for n in nodes):
                raise RuntimeError(f"a process died:\n{hub.output()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {snapshots} broadcasts timed in {RUN_TIMEOUT_S:.0f}s")
            time.sleep(POLL_S)
        hub_peak = vm_kib(hub.process.pid, "VmHWM") * 1024
        node_peak = max(vm_kib(n.process.pid, "VmHWM") * 1024 for n in nodes)
    finally:
        for proc in (hub, *nodes):  # measured: no need for the orderly (checkpointing) shutdown
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGKILL)
                proc.process.wait()
    manifest_bytes = max((p.stat().st_size for p in hub_dir.glob("*.manifest")), default=0)
    times = broadcast_times(data, node_dirs)
    rows = query(data, "SELECT total_bytes, published_at - created_at FROM snapshots WHERE version > 0")
    snapshot_bytes = rows[0][0]
    publish_s = sum(r[1] for r in rows) / len(rows)
    t_bcast = sum(times.values()) / len(times)
    link_bps = link_mbps * BYTES_PER_MBIT
    ideal = chained_broadcast_ideal_s(snapshot_bytes, 1 << 20, NODES, link_bps, link_bps)
    engine_bytes = params * (2 if dtype == "bfloat16" else 4)
    learner_state = 16 * params
    shutil.rmtree(run_dir, ignore_errors=True)
    return Result(
        params=params,
        dtype=dtype,
        snapshot_bytes=snapshot_bytes,
        publish_s=round(publish_s, 3),
        t_bcast_s=round(t_bcast, 3),
        ideal_s=round(ideal, 3),
        hub_peak_rss_bytes=hub_peak,
        node_peak_rss_bytes=node_peak,
        snapshot_dir_bytes=dir_peak,
        node_snapshot_dir_bytes=node_dir_peak,
        hub_startup_peak_rss_bytes=startup[0],
        node_startup_peak_rss_bytes=startup[1],
        engine_model_bytes=engine_bytes,
        learner_state_bytes=learner_state,
        broadcasts=len(times),
        targets_met={
            "node_rss": node_peak <= 1.3 * engine_bytes + ALLOWANCE_BYTES,
            "hub_rss": hub_peak <= learner_state + snapshot_bytes + ALLOWANCE_BYTES,
            # The one being written has, for a moment, its manifest's temp file beside its manifest.
            "snapshot_dir": dir_peak <= (STALENESS + 2) * (snapshot_bytes + manifest_bytes) + manifest_bytes,
            "t_bcast": t_bcast <= 1.25 * ideal,
        },
    )


# -- role processes: each its own interpreter, finding the others through JSON files in a work dir ---


def publish(work: Path, name: str, value: dict) -> None:
    tmp = work / f".{name}.json"
    tmp.write_text(json.dumps(value))
    tmp.replace(work / f"{name}.json")


async def wait_for(work: Path, name: str) -> dict:
    import trio

    while not (work / f"{name}.json").exists():
        await trio.sleep(0.05)
    return json.loads((work / f"{name}.json").read_text())


def run_roles(work: Path, roles: dict[str, list[str]]) -> None:
    """Run `python scale.py --role R --work-dir work *extra` for each role at once and wait for all of them;
    raise with every role's stderr tail if one fails."""
    import subprocess

    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--work-dir", str(work), *extra],
            stdout=subprocess.DEVNULL,
            stderr=open(work / f"{role}.err", "wb"),
        )
        for role, extra in roles.items()
    ]
    try:
        for proc in procs:
            if proc.wait(timeout=RUN_TIMEOUT_S) != 0:
                tails = "".join(f"\n{role}: {(work / f'{role}.err').read_text()[-2000:]}" for role in roles)
                raise RuntimeError(f"a role failed:{tails}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


# -- relay: source -> relay -> sink, each its own process ------------------------------------------


def relay_role(role: str, work: Path, snapshot_dir: Path | None, profile: Path | None, bulk: bool) -> None:
    """One process of the relay measurement; peers find each other through JSON files in `work`.
    `bulk`: transfers on the bulk channel (shared/bulk.py, the default path), else on libp2p streams."""
    import logging
    import resource

    import trio

    from hub.distribution.broadcast import HubUplink
    from hub.records.snapshots import SnapshotShelf
    from node.keeper import HUB, SnapshotKeeper, Upstream
    from shared.bulk import BulkChannel, serving_stream
    from shared.crypto import Identity
    from shared.messages import RELAY_PROTOCOL, SNAPSHOT_PROTOCOL, SnapshotRequest
    from shared.net import connect, remote_peer_id, running_host, set_handler
    from shared.snapshot import read_snapshot_files
    from shared.transfer import serve_snapshot
    from shared.wire import read_message

    log = logging.getLogger("bench.scale")

    async def source() -> None:
        identity = Identity.from_seed(bytes(32))
        version = max(int(p.stem[1:]) for p in snapshot_dir.glob("v*.manifest"))
        snapshot = read_snapshot_files(snapshot_dir, version, identity.peer_id)
        shelf = SnapshotShelf(keep=1)
        shelf.add(snapshot)
        uplink = HubUplink(None, None)

        channel = BulkChannel("127.0.0.1", 0) if bulk else None

        async def serve(stream) -> None:
            request = await read_message(stream, SnapshotRequest)
            async with serving_stream(stream, request, channel, remote_peer_id(stream)) as transfer:
                await serve_snapshot(transfer, shelf, request, uplink.for_stream(), identity)
            await stream.close()

        async with running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, addrs), trio.open_nursery() as nursery:
            if channel is not None:
                await channel.start(nursery)
            set_handler(host, SNAPSHOT_PROTOCOL, serve, log)
            publish(
                work,
                "source",
                {"peer_id": identity.peer_id, "addr": addrs[0], "version": version, "bytes": snapshot.manifest.total_bytes},
            )
            await wait_for(work, "sink-done")
            nursery.cancel_scope.cancel()

    async def keeper_node(name: str) -> None:
        info = await wait_for(work, "source")
        identity = Identity.generate()
        done = trio.Event()

        async def install(path: Path, version: int, probe) -> None:
            done.set()

        async def report(_report):
            raise RuntimeError(f"the {name} was sent a bad chunk")

        async with running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, addrs), trio.open_nursery() as nursery:
            channel = BulkChannel("127.0.0.1", 0) if bulk else None
            if channel is not None:
                await channel.start(nursery)
            keeper = SnapshotKeeper(
                host,
                identity,
                info["peer_id"],
                work / name,
                install,
                None,
                on_installed=lambda v: None,
                report=report,
                max_snapshot_bytes=info["bytes"],
                bulk=channel,
            )
            set_handler(host, SNAPSHOT_PROTOCOL, keeper.serve, log)
            set_handler(host, RELAY_PROTOCOL, keeper.on_relay_offer, log)
            await connect(host, info["addr"])
            await keeper.start(nursery)
            if name == "relay":
                publish(work, "relay", {"peer_id": identity.peer_id, "addr": addrs[0]})
                sink = await wait_for(work, "sink")
                started = resource.getrusage(resource.RUSAGE_SELF)
                wall = time.perf_counter()
                keeper.update(info["version"], HUB, sink["peer_id"])
                await done.wait()
                await wait_for(work, "sink-done")  # forwarding lasts until the sink has the last chunk
                ended = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (ended.ru_utime - started.ru_utime) + (ended.ru_stime - started.ru_stime)
                on_bulk = channel is not None and (channel.dialed, channel.served) == (1, 1)
                publish(
                    work,
                    "relay-result",
                    {"cpu_s": cpu, "wall_s": time.perf_counter() - wall, "bytes": info["bytes"], "bulk": on_bulk},
                )
            else:
                relay = await wait_for(work, "relay")
                publish(work, "sink", {"peer_id": identity.peer_id})
                keeper.update(info["version"], Upstream(relay["peer_id"], (relay["addr"],)), None)
                await done.wait()
                publish(work, "sink-done", {})
            nursery.cancel_scope.cancel()

    main = source if role == "source" else (lambda: keeper_node(role))
    if profile is not None:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        trio.run(main)
        profiler.disable()
        with open(profile, "w") as out:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
    else:
        trio.run(main)


def measure_relay(work: Path, model_dir: Path, dtype: str, profile: Path | None, log) -> dict:
    """Write one snapshot of `model_dir` in `dtype`, then time it through source -> relay -> sink, on the bulk
    channel (relay_*, the path nodes take) and then on libp2p streams (relay_libp2p_*, the fall-back)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.crypto import Identity
    from shared.model_io import build_snapshot, model_dir_config_hash

    relay_dir = work / "relay"
    shutil.rmtree(relay_dir, ignore_errors=True)
    relay_dir.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    build_snapshot(
        model.state_dict(),
        1,
        Identity.from_seed(bytes(32)),
        model_dir_config_hash(model_dir),
        relay_dir / "source-snapshots",
        dtype=getattr(torch, dtype),
    )
    del model
    out: dict = {}
    for path, prefix in (("bulk", "relay"), ("libp2p", "relay_libp2p")):
        run_dir = relay_dir / path
        run_dir.mkdir()
        args = ["--snapshot-dir", str(relay_dir / "source-snapshots"), "--relay-path", path]
        profiled = [] if profile is None else ["--profile", str(profile.with_name(f"{profile.stem}-{path}{profile.suffix}"))]
        run_roles(run_dir, {"source": args, "relay": args + profiled, "sink": args})
        result = json.loads((run_dir / "relay-result.json").read_text())
        if result["bulk"] != (path == "bulk"):
            raise RuntimeError(f"the {path} relay run took the {'bulk' if result['bulk'] else 'libp2p'} path")
        gb = result["bytes"] / 1e9
        log(f"  relay ({path}): {result['bytes'] / MB:.0f} MB in {result['wall_s']:.1f}s, {result['cpu_s']:.1f} CPU-s")
        out.update(
            {
                "relay_bytes": result["bytes"],
                "relay_dtype": dtype,
                f"{prefix}_wall_s": round(result["wall_s"], 2),
                f"{prefix}_cpu_s": round(result["cpu_s"], 2),
                f"{prefix}_cpu_s_per_gb": round(result["cpu_s"] / gb, 2),
                f"{prefix}_mb_per_s": round(result["bytes"] / MB / result["wall_s"], 1),
            }
        )
    shutil.rmtree(relay_dir, ignore_errors=True)
    return out


# -- transport floor: the same bytes through py-libp2p alone, sender -> receiver ------------------------

FLOOR_WRITE_BYTES = 1 << 20
FLOOR_PROTOCOL = "/echo2-bench/floor/1"


def floor_role(role: str, work: Path, total_bytes: int) -> None:
    """One end of a bare stream (Noise + Yamux over TCP, our host setup, no echo2 protocol): the receiver reads
    `total_bytes` in 1 MiB reads, the sender writes them in 1 MiB writes; each records its own CPU seconds."""
    import resource

    import trio

    from shared.crypto import Identity
    from shared.net import connect, open_stream, running_host
    from shared.wire import read_exact

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def receiver() -> None:
        done = trio.Event()

        async def handle(stream) -> None:
            started, wall = cpu_s(), time.perf_counter()
            left = total_bytes
            while left:
                left -= len(await read_exact(stream, min(left, FLOOR_WRITE_BYTES)))
            publish(work, "floor-recv", {"cpu_s": cpu_s() - started, "wall_s": time.perf_counter() - wall})
            await stream.write(b"ok")
            await stream.close()
            done.set()

        async with running_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as (host, addrs):
            host.set_stream_handler(FLOOR_PROTOCOL, handle)
            publish(work, "floor-addr", {"addr": addrs[0]})
            await done.wait()

    async def sender() -> None:
        addr = (await wait_for(work, "floor-addr"))["addr"]
        async with running_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as (host, _):
            stream = await open_stream(host, await connect(host, addr), FLOOR_PROTOCOL)
            block = os.urandom(FLOOR_WRITE_BYTES)
            started = cpu_s()
            left = total_bytes
            while left:
                await stream.write(block[: min(left, FLOOR_WRITE_BYTES)])
                left -= min(left, FLOOR_WRITE_BYTES)
            await read_exact(stream, 2)
            publish(work, "floor-send", {"cpu_s": cpu_s() - started})

    trio.run(receiver if role == "floor-recv" else sender)


def measure_transport_floor(work: Path, total_bytes: int, log) -> dict:
    """CPU seconds per GB that py-libp2p itself spends to move bytes one hop (sender + receiver): what a relay,
    which receives and forwards every byte, pays before any of our code runs."""
    floor_dir = work / "floor"
    shutil.rmtree(floor_dir, ignore_errors=True)
    floor_dir.mkdir(parents=True)
    size = ["--floor-bytes", str(total_bytes)]
    run_roles(floor_dir, {"floor-recv": size, "floor-send": size})
    recv = json.loads((floor_dir / "floor-recv.json").read_text())
    send = json.loads((floor_dir / "floor-send.json").read_text())
    shutil.rmtree(floor_dir, ignore_errors=True)
    gb = total_bytes / 1e9
    log(f"  transport floor: {recv['cpu_s'] + send['cpu_s']:.1f} CPU-s for {total_bytes / MB:.0f} MB one hop")
    return {
        "transport_floor_cpu_s_per_gb": round((recv["cpu_s"] + send["cpu_s"]) / gb, 2),
        "transport_floor_mb_per_s": round(total_bytes / MB / recv["wall_s"], 1),
    }


def plot(results: list[Result], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, bcast) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
        rows = sorted((r for r in results if r.dtype == dtype), key=lambda r: r.params)
        if not rows:
            continue
        x = [r.params / 1e6 for r in rows]
        rss.plot(x, [r.hub_peak_rss_bytes / 1e9 for r in rows], marker=marker, label=f"hub {dtype}")
        rss.plot(x, [r.node_peak_rss_bytes / 1e9 for r in rows], marker=marker, linestyle="--", label=f"node {dtype}")
        rss.plot(
            x,
            [(1.3 * r.engine_model_bytes + ALLOWANCE_BYTES) / 1e9 for r in rows],
            color="grey",
            linestyle=":",
            linewidth=1,
            label=f"node target {dtype}",
        )
        rss.plot(
            x,
            [(r.learner_state_bytes + r.snapshot_bytes + ALLOWANCE_BYTES) / 1e9 for r in rows],
            color="black",
            linestyle=":",
            linewidth=1,
            label=f"hub target {dtype}",
        )
        bcast.plot(x, [r.t_bcast_s for r in rows], marker=marker, label=f"T_bcast {dtype}")
        bcast.plot(x, [r.ideal_s for r in rows], color="grey", linestyle=":", marker=marker, label=f"ideal {dtype}")
    rss.set(xlabel="parameters (M)", ylabel="peak RSS in steady state (GB)", title="Memory vs model size")
    bcast.set(xlabel="parameters (M)", ylabel="seconds", title="Broadcast to 3 nodes in one chain")
    for ax in (rss, bcast):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--sizes", default="25M,100M,400M", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16")
    parser.add_argument("--link-mbps", type=float, default=800.0, help="emulated hub and node links, Mbit/s")
    parser.add_argument("--snapshots", type=int, default=5, help="timed broadcasts per run (after v0)")
    parser.add_argument("--no-relay", action="store_true", help="skip the relay CPU measurement")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="run the hub's learner with --gradient-checkpointing true (less peak RSS, slower steps)",
    )
    parser.add_argument("--profile", type=Path, default=None, help="write the relay's cProfile here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of RSS and T_bcast against size")
    parser.add_argument("--work-dir", type=Path, default=None, help="models and runs (default: a temp dir, removed)")
    parser.add_argument("--role", choices=("source", "relay", "sink", "floor-recv", "floor-send"), help=argparse.SUPPRESS)
    parser.add_argument("--snapshot-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--relay-path", choices=("bulk", "libp2p"), default="bulk", help=argparse.SUPPRESS)
    parser.add_argument("--floor-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role in ("floor-recv", "floor-send"):
        floor_role(args.role, args.work_dir, args.floor_bytes)
        return
    if args.role:
        relay_role(args.role, args.work_dir, args.snapshot_dir, args.profile, args.relay_path == "bulk")
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown or not sizes or any(d not in ("float32", "bfloat16") for d in dtypes):
        parser.error(f"--sizes takes {', '.join(SIZES)}; --dtypes takes float32, bfloat16")

    def log(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr, flush=True)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="echo2-scale-"))
    results: list[Result] = []
    try:
        for size in sizes:
            model_dir, params = build_model(work, size)
            log(f"{size}: {params / 1e6:.1f}M parameters")
            for dtype in dtypes:
                results.append(
                    run_one(work, model_dir, params, dtype, args.link_mbps, args.snapshots, log, args.gradient_checkpointing)
                )
                r = results[-1]
                log(
                    f"  {dtype}: {r.snapshot_bytes / MB:.0f} MB, publish {r.publish_s:.1f}s, T_bcast {r.t_bcast_s:.1f}s "
                    f"(ideal {r.ideal_s:.1f}s), hub {r.hub_peak_rss_bytes / MB:.0f} MB, node {r.node_peak_rss_bytes / MB:.0f} MB, "
                    f"dir {r.snapshot_dir_bytes / MB:.0f} MB, targets {r.targets_met}"
                )
        out: dict = {"results": [asdict(r) for r in results]}
        pairs = {(r.params, r.dtype): r.snapshot_bytes for r in results}
        out["bf16_half_of_fp32"] = {
            str(p): round(pairs[(p, "bfloat16")] / pairs[(p, "float32")], 4)
            for p, d in pairs
            if d == "float32" and (p, "bfloat16") in pairs
        }
        if not args.no_relay:
            largest = build_model(work, max(sizes, key=lambda s: SIZES[s][0] ** 2 * SIZES[s][1]))[0]
            out.update(measure_relay(work, largest, dtypes[0], args.profile, log))
            out.update(measure_transport_floor(work, out["relay_bytes"], log))
        out["link_mbps"] = args.link_mbps
        out["gradient_checkpointing"] = args.gradient_checkpointing
        out["cpus"] = os.cpu_count()
        if args.plot is not None:
            plot(results, args.plot)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
