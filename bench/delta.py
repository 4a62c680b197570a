"""Delta snapshots: bytes per broadcast against the full snapshot, bit-exactness on real keepers, and T_bcast.

Usage: python bench/delta.py [--json] [--models default,100M] [--lrs 1e-6,default] [--publishes 20]
                             [--link-mbps 100] [--plot docs/plots/delta.png]

For each model (the embedded default, or a random-init Qwen2 of bench/scale.py's sizes built
locally) and learning rate: the hub's real Learner (fp32 master weights, bf16 autocast, AdamW)
takes one GRPO step per publish on a batch generated once by the model itself (HFEngine; the
reverse task's rewards, or alternating 1/0 where a random-init model earns none, so every group
has an advantage signal). After each step the hub's code writes the bf16 snapshot and its
delta against the previous one (shared/delta.py; every delta is built here, whatever its size,
so the ratio is reported even where the hub would publish the full snapshot alone). Three real
SnapshotKeepers on loopback libp2p hosts, in one chain, pull every version (as deltas) and hash
what they install: weights_bit_exact says every node's installed file had the hub's hash after
every publish.

Timing, at --link-mbps on every hop (the hub's uplink too): t_bcast_delta_s is the last publish
reaching the chain as a delta (pull, relay, apply, verify, install, on every node);
t_bcast_full_s is the same version reaching three fresh keepers, which hold no base and so get
it in full. Target (issue 16): delta_ratio <= 0.10 at lr 1e-6, t_bcast_delta <= 0.2 x t_bcast_full.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from shared.units import BYTES_PER_MBIT  # noqa: E402

NODES = 3
PROMPTS, GROUP_SIZE, MAX_NEW_TOKENS = 8, 4, 12
WAIT_S = 600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--models", default="default,100M", help="comma-separated: default and/or 25M, 100M, 400M")
    parser.add_argument("--lrs", default="1e-6,default", help="comma-separated learning rates ('default': LearnerConfig's)")
    parser.add_argument("--publishes", type=int, default=20, help="learner steps, each published (kappa = 1)")
    parser.add_argument("--link-mbps", type=float, default=100.0, help="emulated rate of every hop for the timings")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for the learner")
    parser.add_argument("--plot", type=Path, default=None, help="write delta ratio per publish to this PNG")
    return parser.parse_args(argv)


def model_dir_for(name: str, work: Path) -> tuple[Path, int]:
    from shared.default_model import ensure_default_model

    if name == "default":
        path = ensure_default_model(progress=False)
        from transformers import AutoModelForCausalLM

        return path, sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    from bench.scale import build_model

    return build_model(work, name)


def make_groups(model_dir: Path, sampling) -> list:
    """PROMPTS groups the model generated itself, each with reward variance."""
    from node.hf_engine import HFEngine
    from shared.rollout import Group
    from shared.tasks.reverse import ReverseTask

    task, engine, rng = ReverseTask(), HFEngine(model_dir), random.Random(0)
    prompts = task.sample(rng, PROMPTS)
    groups = []
    for prompt, completions in zip(prompts, engine.generate([p.text for p in prompts], GROUP_SIZE, sampling), strict=True):
        rewards = tuple(task.rewards(prompt, [c.text for c in completions]))
        if len(set(rewards)) == 1:
            rewards = tuple(float(i % 2) for i in range(GROUP_SIZE))
        groups.append(
            Group(prompt_id=prompt.id, prompt_text=prompt.text, version=0, completions=tuple(completions), rewards=rewards)
        )
    return groups


async def run_one(model: str, model_dir: Path, params: int, lr: float, args: argparse.Namespace, log) -> dict:
    import trio

    from hub.config import HubConfig, LearnerConfig
    from hub.distribution.broadcast import HubUplink
    from hub.training.learner import Learner
    from shared.crypto import Identity
    from shared.delta import build_delta_snapshot
    from shared.model_identity import load_model_identity
    from shared.model_io import build_snapshot
    from shared.net import RateLimiter
    from shared.snapshot import file_hash, remove_snapshot_files
    from testbed.peers import hub_peer, node_peer, scratch_dir
    from testbed.relay_scenarios import Hub, join

    sampling = HubConfig().sampling.model_copy(update={"max_new_tokens": MAX_NEW_TOKENS, "seed": 0})
    cfg = LearnerConfig(prompts_per_step=PROMPTS, group_size=GROUP_SIZE, lr=lr, dtype="bfloat16", threads=args.threads)
    learner = await trio.to_thread.run_sync(Learner, load_model_identity(model_dir), cfg, sampling)
    groups = await trio.to_thread.run_sync(make_groups, model_dir, sampling)
    identity, directory = Identity.generate(), scratch_dir()
    link_bps = args.link_mbps * BYTES_PER_MBIT

    def publish(version: int, previous):
        snapshot = build_snapshot(
            learner.state_dict(), version, identity, learner.config_hash, directory, dtype=learner.snapshot_dtype
        )
        built = build_delta_snapshot(previous, snapshot, identity, directory, 1.0) if previous else None
        return snapshot, (built[0] if built else None), (built[1] if built else None)

    ratios: list[float] = []
    changed: list[float] = []
    bit_exact = True
    async with hub_peer(identity) as peer:
        hub = Hub(peer, "chain")
        async with (
            node_peer(peer, read=file_hash) as a,
            node_peer(peer, read=file_hash) as b,
            node_peer(peer, read=file_hash) as c,
            trio.open_nursery() as nursery,
        ):
            nodes = [a, b, c]
            await nursery.start(hub.broadcaster.run)
            for node in nodes:
                join(hub.fleet, node)
            hub.broadcaster.chains = [[n.peer_id for n in nodes]]
            nursery.start_soon(hub.heartbeats, nodes, 0.05)
            previous = None
            for version in range(args.publishes + 1):
                if version:
                    await trio.to_thread.run_sync(learner.train_step, groups, version)
                snapshot, delta, stats = await trio.to_thread.run_sync(publish, version, previous)
                if version == args.publishes:  # the timed one: every hop at the emulated link rate
                    peer.uplink = HubUplink(None, link_bps)
                    for node in nodes:
                        node.keeper.limiter = RateLimiter(link_bps)
                started = time.monotonic()
                peer.shelf.add(snapshot, delta)
                await hub.broadcaster.publish(version)
                with trio.fail_after(WAIT_S):
                    while not all(version in n.installed for n in nodes):
                        await trio.sleep(0.01)
                t_delta = max(n.installed_at[version] for n in nodes) - started
                bit_exact &= all(n.installed[version] == snapshot.manifest.whole_hash for n in nodes)
                if stats is not None:
                    ratios.append(stats.bytes / snapshot.manifest.total_bytes)
                    changed.append(stats.changed_elements / stats.total_elements)
                    log(
                        f"  {model} lr {lr:g}: v{version} delta {stats.bytes / 1e6:.3g} MB = {ratios[-1]:.2%} of "
                        f"{snapshot.manifest.total_bytes / 1e6:.3g} MB, {changed[-1]:.2%} of elements changed"
                    )
                if previous is not None and previous.manifest.version > 0:
                    remove_snapshot_files(directory, previous.manifest.version - 1)
                previous = snapshot
            deltas_applied = [n.keeper.deltas_applied for n in nodes]
            nursery.cancel_scope.cancel()
        # The same version to three fresh keepers at the same link rate: no base, so in full.
        async with (
            node_peer(peer, RateLimiter(link_bps), read=file_hash) as d,
            node_peer(peer, RateLimiter(link_bps), read=file_hash) as e,
            node_peer(peer, RateLimiter(link_bps), read=file_hash) as f,
            trio.open_nursery() as nursery,
        ):
            fresh = [d, e, f]
            await nursery.start(hub.broadcaster.run)
            for node in fresh:
                join(hub.fleet, node)
            hub.broadcaster.chains = [[n.peer_id for n in fresh]]
            started = time.monotonic()
            nursery.start_soon(hub.heartbeats, fresh, 0.05)
            with trio.fail_after(WAIT_S):
                while not all(args.publishes in n.installed for n in fresh):
                    await trio.sleep(0.01)
            t_full = max(n.installed_at[args.publishes] for n in fresh) - started
            bit_exact &= all(n.installed[args.publishes] == previous.manifest.whole_hash for n in fresh)
            assert all(n.keeper.deltas_applied == 0 for n in fresh)
            nursery.cancel_scope.cancel()
    mean_ratio = sum(ratios) / len(ratios)
    return {
        "model": model,
        "params": params,
        "lr": lr,
        "publishes": len(ratios),
        "full_bytes": previous.manifest.total_bytes,
        "delta_bytes_mean": round(mean_ratio * previous.manifest.total_bytes),
        "delta_ratio": round(mean_ratio, 4),
        "delta_ratio_max": round(max(ratios), 4),
        "changed_fraction_mean": round(sum(changed) / len(changed), 4),
        "weights_bit_exact": bit_exact,
        "deltas_applied_per_node": deltas_applied,
        "t_bcast_full_s": round(t_full, 3),
        "t_bcast_delta_s": round(t_delta, 3),
        "t_bcast_ratio": round(t_delta / t_full, 3),
        "ratios": [round(r, 4) for r in ratios],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(range(1, len(r["ratios"]) + 1), r["ratios"], "o-", label=f"{r['model']} lr {r['lr']:g}")
    ax.axhline(0.10, color="gray", ls="--", lw=1, label="target at lr 1e-6")
    ax.axhline(0.5, color="gray", ls=":", lw=1, label="hub's cut-off (delta_max_ratio)")
    ax.set(
        xlabel="publish (one GRPO step each)",
        ylabel="delta bytes / full bf16 snapshot",
        yscale="log",
        title="Delta snapshots: bytes per broadcast",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def progress_log(quiet: bool):
    """What a bench prints as it goes (nothing with --json, whose one line must stay alone); transformers'
    loading bars off either way."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    def log(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    return log


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import trio

    from hub.config import LearnerConfig

    log = progress_log(args.json)
    results = []
    with tempfile.TemporaryDirectory(prefix="echo2-delta-") as tmp:
        for model in args.models.split(","):
            model_dir, params = model_dir_for(model, Path(tmp))
            for lr_text in args.lrs.split(","):
                lr = LearnerConfig().lr if lr_text == "default" else float(lr_text)
                log(f"{model} ({params / 1e6:.1f}M parameters), lr {lr:g}: {args.publishes} publishes")
                results.append(trio.run(run_one, model, model_dir, params, lr, args, log))
                r = results[-1]
                log(
                    f"  -> delta {r['delta_ratio']:.2%} of full, T_bcast {r['t_bcast_delta_s']:.2f}s vs "
                    f"{r['t_bcast_full_s']:.2f}s full, bit-exact {r['weights_bit_exact']}"
                )
    if args.plot:
        plot(results, args.plot)
    out = {"link_mbps": args.link_mbps, "results": results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
