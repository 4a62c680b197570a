"""The model a process runs, read once: its config, its tokenizer and chat template, its generation config, the ids
that end a completion and a fingerprint of them all.

Every component that renders, tokenizes, decodes or checks token ids must do so as every other one does, or an
honest node's work fails an audit or a renderer disagrees with the learner. So a process reads its model directory
once, at start (`load_model_identity`), and passes the one `ModelIdentity` down: the hub's composition root to its
tasks, submission rules, audits, learner and evaluator; a node's engine to the rest of the node. A process of its
own (a spawned check worker, a learner rank) rebuilds it from the picklable `ModelSource`, and is refused when the
directory no longer holds the identity the hub started with.

Nothing here imports torch or transformers at import time: `echo-hub start --help` stays light.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.snapshot import blake3_hex, model_config_hash

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

    from shared.tasks.dataset import Messages

# Settings transformers applies around a tokenizer's backend, which change what it encodes or decodes.
TOKENIZER_SETTINGS = ("padding_side", "truncation_side", "model_max_length", "clean_up_tokenization_spaces")


class ModelChanged(ValueError):
    """A model directory no longer holds the identity a process was started with (its files changed meanwhile)."""


def stop_token_ids(*declared: int | Sequence[int] | None) -> tuple[int, ...]:
    """Every id that ends a completion: the union of the EOS declarations given (the tokenizer's, the
    generation config's, the model config's), as vLLM stops on all of them. Qwen3 and Llama 3 declare several."""
    ids: set[int] = set()
    for value in declared:
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    if not ids:
        raise ValueError("the model declares no EOS token (tokenizer, generation_config.json and config.json)")
    return tuple(sorted(ids))


def tokenizer_digest(tokenizer: Any) -> str:
    """blake3 hex of what a tokenizer does to text: its class, its backend as the tokenizers library writes it
    (vocabulary, merges, added tokens, normalizer, pre-tokenizer, post-processor, decoder) or, for a tokenizer without
    one, its vocabulary; its special tokens and the settings transformers applies around it (TOKENIZER_SETTINGS)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": tokenizer.special_tokens_map,
        "settings": {name: getattr(tokenizer, name, None) for name in TOKENIZER_SETTINGS},
    }
    return blake3_hex(json.dumps(parts, sort_keys=True, default=str).encode())


def generation_settings(generation_config: GenerationConfig | None) -> dict[str, Any] | None:
    """What a generation config says beyond transformers' defaults, without the version that wrote it (None: none)."""
    if generation_config is None:
        return None
    return {k: v for k, v in generation_config.to_diff_dict().items() if k != "transformers_version"}


def identity_fingerprint(
    config_hash: str,
    tokenizer_hash: str,
    chat_template: str | Mapping[str, str] | None,
    generation: Mapping[str, Any] | None,
    stop_ids: frozenset[int],
) -> str:
    """blake3 hex of a model identity's parts: the same parts give the same fingerprint in any process."""
    parts = {
        "config": config_hash,
        "tokenizer": tokenizer_hash,
        "chat_template": chat_template,
        "generation": generation,
        "stop_ids": sorted(stop_ids),
    }
    return blake3_hex(json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode())


@dataclass(frozen=True)
class ModelSource:
    """What a process of its own needs to rebuild the hub's ModelIdentity (picklable: a spawned check worker's)."""

    model_dir: Path
    fingerprint: str  # the identity the directory must still hold

    def load(self) -> ModelIdentity:
        """The identity read again from `model_dir`; ModelChanged when its fingerprint is not `fingerprint`."""
        return load_model_identity(self.model_dir, self.fingerprint)


@dataclass(frozen=True, eq=False)
class ModelIdentity:
    """One model directory read once (load_model_identity). Its objects are shared, so nobody changes them: a
    component that tokenizes in a thread of its own takes `tokenizer_copy()` (a fast tokenizer's state is not
    for two threads at once), one that builds a model from the config takes `config_copy()` (from_config sets its
    dtype)."""

    model_dir: Path
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfig | None  # None: the directory has no generation_config.json
    stop_ids: frozenset[int]  # every EOS the tokenizer, the generation config and the config declare
    config_hash: str  # shared.snapshot.model_config_hash of the config: what nodes and snapshots name the model by
    fingerprint: str  # of all the above (identity_fingerprint): another tokenizer or chat template, another one

    @property
    def source(self) -> ModelSource:
        return ModelSource(self.model_dir, self.fingerprint)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def context(self) -> int | None:
        """The model's positions (max_position_embeddings); None when its config names none."""
        return getattr(self.config, "max_position_embeddings", None)

    def tokenizer_copy(self) -> PreTrainedTokenizerBase:
        return copy.deepcopy(self.tokenizer)

    def config_copy(self) -> PretrainedConfig:
        return copy.deepcopy(self.config)

    def chat_renderer(self) -> Callable[[Messages], str]:
        """Messages -> the prompt text the model sees, by this tokenizer's chat template (ValueError: it has none)."""
        from shared.tasks.dataset import chat_renderer

        return chat_renderer(self.tokenizer, f"the tokenizer in {self.model_dir}")


def load_model_identity(model_dir: Path, fingerprint: str | None = None) -> ModelIdentity:
    """Read `model_dir`'s config, tokenizer and generation config (no weights). `fingerprint`: the identity it must
    hold (a process rebuilding another's, ModelSource); ModelChanged when it holds another. OSError or ValueError when
    it cannot be read, or declares no EOS token."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    try:
        generation_config: GenerationConfig | None = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        generation_config = None
    generation_eos = generation_config.eos_token_id if generation_config is not None else None
    stop_ids = frozenset(stop_token_ids(tokenizer.eos_token_id, generation_eos, config.eos_token_id))
    config_hash = model_config_hash(config.to_dict())
    found = identity_fingerprint(
        config_hash,
        tokenizer_digest(tokenizer),
        getattr(tokenizer, "chat_template", None),
        generation_settings(generation_config),
        stop_ids,
    )
    if fingerprint is not None and found != fingerprint:
        raise ModelChanged(
            f"the model in {model_dir} changed since this run started (fingerprint {found[:12]}, was "
            f"{fingerprint[:12]}): put its files back as they were, or start the hub again"
        )
    return ModelIdentity(model_dir, config, tokenizer, generation_config, stop_ids, config_hash, found)
