"""The hub's state as `echo-hub start` builds it from a config and the model's identity (read once:
shared/model_identity.py): the training task, the rules every submission is checked against (stop ids: every EOS
the model declares), the audits and the HubState over the data dir's store. The composition root (hub.cli.run) and
the test bed (testbed/) build their hubs here, so a test's hub checks submissions as a real one does."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
from shared.model_identity import ModelIdentity, ModelSource
from shared.precision import resolve_dtype
from shared.tasks.base import Task

if TYPE_CHECKING:
    from hub.agents.rollouts import AgentRollouts


@dataclass(frozen=True)
class HubCore:
    """A built hub state and what the rest of the hub is wired to besides it."""

    state: HubState
    task: Task
    eval_task: Task | None  # None: evaluation is off
    auditor: Auditor  # the audits' model, which also computes the learner's install probes
    context_tokens: int  # what a lease can need of a model's context (hub.training.tasks.context_tokens)
    model_offer: ModelOffer | None  # the config and tokenizer files nodes without --model fetch (None: none)


def submission_rules(config: HubConfig, task: Task, model: ModelIdentity) -> SubmissionRules:
    """What every submission is checked against: the task, the sampling, the model's stop ids and vocabulary. The
    identity's own tokenizer decodes: the service's (the audits, the learner and the evaluator tokenize with copies)."""
    tokenizer = model.tokenizer
    return SubmissionRules(
        task=task,
        group_size=config.learner.group_size,
        sampling=config.sampling,
        stop_ids=model.stop_ids,
        vocab_size=model.config.vocab_size,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        token_text_bytes=token_text_bytes(tokenizer.get_vocab()),
        reward_budget_s=config.trust.reward_budget_s,
        # A tool-using rollout's model and tool tokens together: --max-new-tokens, TRL's max_completion_length.
        max_completion_tokens=config.sampling.max_new_tokens if config.agents.enabled else None,
    )


def load_submission_rules(config_json: str, model: ModelSource) -> SubmissionRules:
    """The submission rules built from the config and the hub's model alone, as each check worker process builds its
    own (the config as JSON: a worker started later may run newer code, whose config has fields the hub's object
    lacks; the model read again, ModelChanged when its directory no longer holds the hub's)."""
    config = HubConfig.model_validate_json(config_json)
    identity = model.load()
    return submission_rules(config, load_hub_task(config.task, config, identity), identity)


def submission_checks(config: HubConfig, model: ModelIdentity, task: Task) -> SubmissionChecks | None:
    """A pool of `--check-procs` check processes (None for 0: the intake checks in a thread of its own)."""
    procs = resolved_check_procs(config.trust.check_procs, task.light_reward)
    if procs == 0:
        return None
    factory = functools.partial(load_submission_rules, config.model_dump_json(), model.source)
    return CheckPool(factory, procs, config.trust.check_timeout_s)


def tool_rollouts(config: HubConfig, model: ModelIdentity, task: Task) -> AgentRollouts:
    """A tool-using run's rollouts: its tools (and environment) in a sandbox not started yet (AgentRollouts.start),
    the tool loop over them, its prompts rendered with the tools' schemas. The start's checks passed on them
    (hub/cli/preflight.py check_agents)."""
    from hub.agents.loop import LoopLimits, ToolLoop
    from hub.agents.rollouts import AgentRollouts
    from hub.agents.sandbox import SandboxLimits, ToolSandbox
    from hub.agents.toolset import load_toolset
    from shared.tasks.dataset import DatasetTask, chat_renderer
    from shared.tasks.split import TaskPart

    a = config.agents
    if isinstance(task, TaskPart):  # the training side of a held-out split: its rows and messages are the task's
        task = task.task
    assert isinstance(task, DatasetTask), "tools need a dataset task (check_agents)"
    toolset = load_toolset(a.tools, a.environment)
    limits = SandboxLimits(a.tool_wall_s, a.tool_cpu_s, a.tool_memory_mb << 20, a.environments_per_worker)
    sandbox = ToolSandbox(a.tools, a.environment, limits, a.tool_procs)
    # The loop decodes and renders in a thread of its own: a copy of the tokenizer of its own.
    loop = ToolLoop(
        sandbox,
        model.tokenizer_copy(),
        LoopLimits(a.max_tool_calls, config.sampling.max_new_tokens, rollouts_per_owner=a.rollouts_per_node),
    )
    render = chat_renderer(model.tokenizer_copy(), f"the tokenizer in {model.model_dir}", toolset.schemas)
    reward_name = getattr(toolset.environment, "__name__", "environment") if toolset.environment_reward else None
    return AgentRollouts(
        loop, task, render, config.learner.group_size, model.config.vocab_size, config.sampling.max_new_tokens, reward_name
    )


def build_hub_state(
    config: HubConfig, model: ModelIdentity, shelf: SnapshotShelf, learner: LearnerVersions | None = None
) -> HubCore:
    """The HubState over config.data_dir's store, serving `shelf`, with its rules, audits and run identity, all of
    `model`. `learner`: a stand-in for the learner's window (hub.records.measurements.LearnerWindow), for a hub with
    no learner of its own (the test bed's); None: the window the hub's learner keeps in the state's measurements."""
    lc = config.learner
    task, eval_task = hub_tasks(config, model)
    label = model_label(model.model_dir, model.config)
    auditor = Auditor(model, shelf, config.sampling, config.trust, resolve_dtype(lc.dtype, lc.device))
    agents = tool_rollouts(config, model, task) if config.agents.enabled else None
    state = HubState(
        Store(config.data_dir / HUB_STORE_FILE),
        config,
        task,
        rules=submission_rules(config, task, model),
        checks=submission_checks(config, model, task),
        model_config_hash=model.config_hash,
        model_label=label,
        audits=AuditQueue(auditor, config.trust.audit_queue_groups),
        learner=learner,
        newest_version=shelf.newest_version,
        shelved_versions=shelf.versions,
        run={**run_identity(config, model.model_dir), "model": str(model.model_dir)},
        sent_matches=agents.sent_matches if agents is not None else None,
        agents=agents,
    )
    # A LoRA run's snapshots carry the adapters only: a node needs the base weights on disk then.
    # Its list says the price ceiling too: a node checks its price before it builds its engine (node/run.py).
    offer = model_offer(
        model.model_dir, label, weights_in_snapshots=not lc.lora_rank, max_price_per_hour=config.scheduler.max_price_per_hour
    )
    return HubCore(state, task, eval_task, auditor, context_tokens(task, model.tokenizer, config.sampling.max_new_tokens), offer)
