"""The hub's state as `echo-hub start` builds it from a config and a model directory: the training task, the
rules every submission is checked against (stop ids: every EOS the model declares), the audits and the
HubState over the data dir's store. The composition root (hub.cli.run) and the test bed (testbed/) build
their hubs here, so a test's hub checks submissions as a real one does."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hub.cli.preflight import run_identity
from hub.config import HubConfig
from hub.records.snapshots import SnapshotShelf
from hub.records.store import Store
from hub.service.leasing import LearnerVersions
from hub.service.state import HubState
from hub.training.tasks import context_tokens, hub_tasks, load_hub_task
from hub.trust.audit import Auditor, AuditQueue
from hub.trust.checkpool import CheckPool, SubmissionChecks, resolved_check_procs
from hub.trust.submissions import SubmissionRules, token_text_bytes
from shared.layout import HUB_STORE_FILE
from shared.model_files import ModelOffer, model_label, model_offer
from shared.precision import resolve_dtype
from shared.tasks.base import Task

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class HubCore:
    """A built hub state and what the rest of the hub is wired to besides it."""

    state: HubState
    task: Task
    eval_task: Task | None  # None: evaluation is off
    auditor: Auditor  # the audits' model, which also computes the learner's install probes
    # The service's own tokenizer: it decodes in worker threads while the learner tokenizes in its own.
    tokenizer: PreTrainedTokenizerBase
    context_tokens: int  # what a lease can need of a model's context (hub.training.tasks.context_tokens)
    model_offer: ModelOffer | None  # the config and tokenizer files nodes without --model fetch (None: none)


def submission_rules(
    config: HubConfig, task: Task, model_dir: Path, tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig
) -> SubmissionRules:
    """What every submission is checked against: the task, the sampling, the model's stop ids and vocabulary."""
    from shared.generation import model_stop_ids

    return SubmissionRules(
        task=task,
        group_size=config.learner.group_size,
        sampling=config.sampling,
        stop_ids=frozenset(model_stop_ids(model_dir)),
        vocab_size=model_config.vocab_size,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        token_text_bytes=token_text_bytes(tokenizer.get_vocab()),
        reward_budget_s=config.trust.reward_budget_s,
    )


def load_submission_rules(config_json: str, model_dir: Path) -> SubmissionRules:
    """The submission rules built from the config alone, as each check worker process builds its own (the config
    as JSON: a worker started later may run newer code, whose config has fields the hub's object lacks)."""
    from transformers import AutoConfig, AutoTokenizer

    config = HubConfig.model_validate_json(config_json)
    task = load_hub_task(config.task, config, model_dir)
    return submission_rules(
        config, task, model_dir, AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    )


def submission_checks(config: HubConfig, model_dir: Path, task: Task) -> SubmissionChecks | None:
    """A pool of `--check-procs` check processes (None for 0: the intake checks in a thread of its own)."""
    procs = resolved_check_procs(config.trust.check_procs, task.light_reward)
    if procs == 0:
        return None
    factory = functools.partial(load_submission_rules, config.model_dump_json(), model_dir)
    return CheckPool(factory, procs, config.trust.check_timeout_s)


def build_hub_state(config: HubConfig, model_dir: Path, shelf: SnapshotShelf, learner: LearnerVersions | None = None) -> HubCore:
    """The HubState over config.data_dir's store, serving `shelf`, with its rules, audits and run identity.
    `learner`: a stand-in for the learner's window (hub.records.measurements.LearnerWindow), for a hub with no learner of its own (the test
    bed's); None: the window the hub's learner keeps in the state's measurements."""
    from transformers import AutoConfig, AutoTokenizer

    from shared.snapshot import model_config_hash

    lc = config.learner
    task, eval_task = hub_tasks(config, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = AutoConfig.from_pretrained(model_dir)
    label = model_label(model_dir, model_config)
    auditor = Auditor(model_dir, shelf, config.sampling, config.trust, resolve_dtype(lc.dtype, lc.device))
    state = HubState(
        Store(config.data_dir / HUB_STORE_FILE),
        config,
        task,
        rules=submission_rules(config, task, model_dir, tokenizer, model_config),
        checks=submission_checks(config, model_dir, task),
        model_config_hash=model_config_hash(model_config.to_dict()),
        model_label=label,
        audits=AuditQueue(auditor, config.trust.audit_queue_groups),
        learner=learner,
        newest_version=shelf.newest_version,
        shelved_versions=shelf.versions,
        run={**run_identity(config, model_dir), "model": str(model_dir)},
    )
    # A LoRA run's snapshots carry the adapters only: a node needs the base weights on disk then.
    # Its list says the price ceiling too: a node checks its price before it builds its engine (node/run.py).
    offer = model_offer(
        model_dir, label, weights_in_snapshots=not lc.lora_rank, max_price_per_hour=config.scheduler.max_price_per_hour
    )
    return HubCore(
        state, task, eval_task, auditor, tokenizer, context_tokens(task, tokenizer, config.sampling.max_new_tokens), offer
    )
