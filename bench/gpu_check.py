"""The vLLM path on a CUDA machine, in one run: prints one JSON line.

    python bench/gpu_check.py [--steps 30] [--out DIR]

1. vLLM against transformers on the same weights (the default model), fp32 and bf16: mean
   |log-prob gap| over sampled tokens inside the HF nucleus, and the share outside it.
2. A hot swap under CUDA graphs (enforce_eager off): the gap after installing a perturbed snapshot.
3. `echo-hub start` (learner on the GPU, bf16) with two `echo-node join --backend vllm` nodes
   sharing the GPU, for --steps steps: exit codes, reward first/last fifth, groups accepted by node.

Refuses at once, in one line, where vLLM or CUDA is missing (bench/gpu_check.sh installs the `gpu`
extra first). Never run on this project's CPU machines; see the closing notes for GPU results.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.engine import vllm_unavailable_reason  # noqa: E402

ADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)\s*$", re.M)


def logprob_gaps(model_dir: Path, tmp: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    from hub.config import TrustConfig
    from node.hf_engine import HFEngine
    from node.vllm_engine import VLLMEngine
    from shared.logprobs import completion_logprobs
    from shared.rollout import SamplingParams
    from shared.snapshot import tied_duplicates
    from shared.tasks.reverse import ReverseTask

    prompts = [p.text for p in ReverseTask().prompts()[:32]]
    limit = TrustConfig().audit_max_outside_frac

    def gap(vllm_engine, hf_engine, sampling: SamplingParams, n: int = 4) -> dict:
        out = vllm_engine.generate(prompts, n, sampling)
        flat = [c for group in out for c in group]
        ids = [i for i in hf_engine.tokenizer(prompts)["input_ids"] for _ in range(n)]
        with torch.no_grad():
            ref, mask = completion_logprobs(hf_engine.model, ids, [list(c.token_ids) for c in flat], hf_engine.pad_id,
                                            sampling.temperature, sampling.top_p)
        reported = torch.zeros_like(ref)
        for row, c in enumerate(flat):
            reported[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
        inside = mask.bool() & torch.isfinite(ref)
        outside = 1 - float(inside.sum()) / float(mask.sum())
        mean = float((ref.float() - reported.float()).abs()[inside].sum() / inside.sum())
        return {"mean_abs_gap": round(mean, 6), "outside_nucleus_frac": round(outside, 5), "outside_ok": outside <= limit}

    results: dict = {}
    for dtype in ("float32", "bfloat16"):
        vllm_engine = VLLMEngine(model_dir, dtype=dtype, gpu_memory_utilization=0.3, enforce_eager=True, seed=0)
        hf_engine = HFEngine(model_dir, device="cuda", dtype=dtype)
        results[dtype] = {f"T{t}_p{p}": gap(vllm_engine, hf_engine, SamplingParams(temperature=t, top_p=p, max_new_tokens=8, seed=1))
                          for t, p in ((1.0, 1.0), (0.7, 0.9))}
        vllm_engine.close()
    # Hot swap with CUDA graphs captured.
    graphed = VLLMEngine(model_dir, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=False, seed=0)
    hf_engine = HFEngine(model_dir, device="cuda", dtype="float32")
    gen = torch.Generator().manual_seed(9)
    dropped = tied_duplicates(hf_engine.model)
    state = {k: (v.cpu() + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in hf_engine.model.state_dict().items()
             if k not in dropped}
    save_file(state, tmp / "swap.safetensors")
    started = time.perf_counter()
    graphed.install(tmp / "swap.safetensors", 1)
    swap_s = time.perf_counter() - started
    hf_engine.install(tmp / "swap.safetensors", 1)
    results["cuda_graph_swap"] = {"install_s": round(swap_s, 3), **gap(graphed, hf_engine, SamplingParams(max_new_tokens=8, seed=2))}
    graphed.close()
    return results


def run_fleet(steps: int, tmp: Path) -> dict:
    from hub.metrics import policy_reward, read_metrics
    from hub.summary import fifth_means
    from shared.layout import HUB_STATUS_FILE, METRICS_FILE
    from shared.messages import HubStatus

    data = tmp / "hub"
    data.mkdir()
    (tmp / "hub.toml").write_text('[learner]\ndevice = "cuda"\n')
    hub_log = open(tmp / "hub.out", "wb")  # noqa: SIM115 - open for the life of the process
    hub = subprocess.Popen([sys.executable, "-m", "hub.cli", "start", "--config", str(tmp / "hub.toml"), "--data-dir", str(data),
                            "--steps", str(steps), "--local-nodes", "0", "--dtype", "bfloat16", "--no-progress",
                            "--listen", "/ip4/127.0.0.1/tcp/0"], cwd=ROOT, stdout=hub_log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    addr = None
    while addr is None and time.monotonic() < deadline and hub.poll() is None:
        time.sleep(1)
        found = ADDR_RE.search((tmp / "hub.out").read_text(errors="replace"))
        addr = found.group(1) if found else None
    if addr is None:
        hub.kill()
        return {"error": "hub never printed its address", "hub_tail": (tmp / "hub.out").read_text(errors="replace")[-2000:]}
    nodes = []
    for i in range(2):
        log = open(tmp / f"node{i}.out", "wb")  # noqa: SIM115
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "node.cli", "join", "--hub", addr, "--backend", "vllm", "--dtype", "bfloat16",
             "--gpu-memory-fraction", "0.3", "--data-dir", str(tmp / f"node{i}"), "--listen", "/ip4/127.0.0.1/tcp/0",
             "--price", str(0.3 + 0.1 * i)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    started = time.monotonic()
    try:
        hub_rc = hub.wait(timeout=420)
    except subprocess.TimeoutExpired:
        hub.kill()
        hub_rc = None
    wall = time.monotonic() - started
    for node in nodes:
        node.terminate()
    node_rcs = [node.wait(timeout=60) for node in nodes]
    rows = read_metrics(data / METRICS_FILE)
    out = {"hub_rc": hub_rc, "node_rcs": node_rcs, "wall_s": round(wall, 1), "steps": len(rows)}
    if rows:
        first, last = fifth_means([policy_reward(r) for r in rows])
        out.update(reward_first=round(first, 4), reward_last=round(last, 4))
    status_path = data / HUB_STATUS_FILE
    if status_path.exists():
        status = HubStatus.model_validate_json(status_path.read_text())
        out["accepted_by_node"] = [n.tallies.accepted for n in status.nodes]
        out["rejected_by_node"] = [n.tallies.rejected for n in status.nodes]
    if hub_rc != 0:
        out["hub_tail"] = (tmp / "hub.out").read_text(errors="replace")[-2000:]
        out["node_tails"] = [(tmp / f"node{i}.out").read_text(errors="replace")[-1500:] for i in range(2)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="learner steps of the fleet run")
    parser.add_argument("--out", type=Path, default=None, help="keep logs here (default: a temp dir)")
    args = parser.parse_args()
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"gpu_check: cannot run here: {reason}", file=sys.stderr)
        return 2
    from shared.default_model import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    with tempfile.TemporaryDirectory(prefix="echo2-gpu-check-") as scratch:
        tmp = args.out or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        result = {"logprobs": logprob_gaps(model_dir, tmp), "fleet": run_fleet(args.steps, tmp)}
        result["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
