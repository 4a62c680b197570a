"""vLLM rollout engine (GPU nodes): sampling with processed log-probs, weight swaps through a worker extension.

Written against vLLM 0.33 (the `gpu` extra): LLM(worker_extension_cls=..., logprobs_mode=
"processed_logprobs") so reported log-probs are those of the temperature/top-p distribution
actually sampled from; the worker process reads the verified snapshot file itself, one tensor
at a time (shared/weights_file.py), into the model's own load_weights; the prefix cache is reset
after every swap because cached KV blocks were computed with the old weights. The engine dtype is
explicit (never "auto") and checked against what vLLM built, so no snapshot is cast on install.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from pathlib import Path

from node.engine import Engine
from shared.rollout import Completion, SamplingParams

WORKER_EXTENSION = "node.vllm_engine.SnapshotWorkerExtension"


class SnapshotWorkerExtension:
    """Mixed into vLLM's GPU worker (runs inside the worker process, where self.model_runner exists)."""

    def echo2_load_snapshot(self, path: str) -> int:
        """Stream a safetensors file's tensors into the running model; returns the tensor count."""
        import torch

        from shared.weights_file import iter_tensors

        count = 0

        def counted():
            nonlocal count
            for item in iter_tensors(Path(path)):
                count += 1
                yield item

        # load_weights maps HF names onto vLLM's fused layers (qkv, gate_up) and skips tied lm_head.
        self.model_runner.model.load_weights(weights=counted())
        torch.cuda.synchronize()
        return count


class VLLMEngine(Engine):
    """vLLM offline engine; snapshots are hot-swapped through a worker extension (see module docstring)."""

    backend = "vllm"

    def __init__(
        self,
        model_dir: Path,
        version: int = 0,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = False,
        seed: int = 0,
    ):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = version
        self._llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
        )
        built = str(self._llm.llm_engine.model_config.dtype).removeprefix("torch.")
        if built != dtype:
            raise RuntimeError(f"vLLM built the model in {built}, asked for {dtype}")
        eos = self._llm.llm_engine.model_config.hf_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self._stop_ids = set(eos if isinstance(eos, list) else [eos])
        self._lock = threading.Lock()

    def install(self, path: Path, version: int) -> None:
        with self._lock:
            self._llm.collective_rpc("echo2_load_snapshot", args=(str(path),))
            if self._llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight swap")
            self.version = version

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            return []
        params = VLLMSamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,  # disabled: the recorded distribution is temperature + top-p only
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            seed=sampling.seed,
        )
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        with self._lock:
            outputs = self._llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
            version = self.version
        return [[self._completion(o, version) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs]

    def _completion(self, output, version: int) -> Completion:
        token_ids = tuple(output.token_ids)
        logprobs = tuple(step[token].logprob for step, token in zip(output.logprobs, token_ids))
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
        if output.finish_reason == "stop":
            if not token_ids or token_ids[-1] not in self._stop_ids:
                raise RuntimeError(f"vLLM finished on a stop other than EOS (stop_reason={output.stop_reason!r})")
        elif output.finish_reason != "length":
            raise RuntimeError(f"unexpected vLLM finish_reason {output.finish_reason!r}")
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            version=version,
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
        )

    def close(self) -> None:
        import torch

        with self._lock:
            self._llm = None
            gc.collect()
            torch.cuda.empty_cache()
