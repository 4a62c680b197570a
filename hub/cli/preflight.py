"""What `echo-hub start` checks before it runs: every user mistake found here is one line and exit 2, before
anything is written to the data dir. Then `echo-hub start` locks the data dir (shared/lock.py: one hub per
data dir) and this module says what it resumes: nothing, when the run already did the steps asked; refused,
when its model, task, held-out prompts or training settings changed (unless --resume-anyway).

Everything here is quick (files, sockets, one read-only SQLite query, importing the task, reading --model's
identity, which the run then uses: shared/model_identity.py): no model weights.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from hub.config import HubConfig
from shared.checks import (
    UserError,
    check_bulk_port,
    check_data_dir,
    check_http,
    check_key_file,
    check_listen,
    check_model_dir,
    model_fingerprint,
)
from shared.default_model import DEFAULT_MODEL_RECIPE
from shared.layout import CHECKPOINTS_DIR, FINAL_DIR, HUB_KEY_FILE, HUB_STORE_FILE
from shared.precision import resolve_device
from shared.tasks.base import Task
from shared.tool_model import embedded_recipe

if TYPE_CHECKING:
    from shared.model_identity import ModelIdentity


@dataclass(frozen=True)
class Started:
    """A start that passed every check: the data dir lock (held while the hub runs), what it resumes and the model
    the checks read (None: the embedded default, read by its recipe: its directory may not be built yet)."""

    lock: IO[str]
    resume: Resume | None
    model: ModelIdentity | None


@dataclass(frozen=True)
class Resume:
    """What an existing data dir holds, as the start line reports it."""

    step: int
    groups_waiting: int
    model: str
    task: str
    changed: tuple[str, ...] = ()  # training settings this start changes (--resume-anyway), as "lr 0.0003 -> 3e-05"
    finished: bool = False  # the run already did the steps this start asks for, and saved its final policy
    checkpoint: int | None = None  # the step of the checkpoint the learner resumes (None: none, the starting model)

    def policy_text(self) -> str:
        """Where the learner's policy comes from, when not from the newest step (a crash after its checkpoint): " from
        the checkpoint of step 120"; "" when it is."""
        if self.step == 0 or self.checkpoint == self.step or self.finished:
            return ""
        if self.checkpoint is None:
            return " from the starting model (no checkpoint yet)"
        return f" from the checkpoint of step {self.checkpoint}"


def check_start(config: HubConfig) -> ModelIdentity | None:
    """Every check of `echo-hub start` that needs no lock: UserError on the first mistake; a warning printed for
    what a flag lets through (--allow-lossy-prompts). The model --model names, read once for the checks and the run
    (None: the embedded default)."""
    check_data_dir(config.data_dir)
    if config.save_rollouts is not None:
        check_data_dir(config.save_rollouts, "--save-rollouts")
    model = read_model(config.model) if config.model is not None else None
    check_agents(config, model)
    tasks = checked_tasks(config, model, evaluate=config.eval.every > 0)
    check_tool_task(config, tasks[0])
    check_lora(config)
    check_learner_procs(config)
    check_learner_kernels(config)
    check_trackers(config)
    check_listen(config.listen)
    check_bulk_port(config.listen, config.broadcast.bulk_port)
    check_http(config.http, config.listen)
    check_key_file(config.key_path, "--key" if config.key is not None else "the hub key")
    from hub.training.tasks import check_prompts, unlogged_note

    note = unlogged_note(tasks[0])
    for warning in [*check_prompts(config, model, *tasks), *([note] if note else [])]:  # last: no warning before a mistake
        print(f"echo-hub: {warning}", file=sys.stderr, flush=True)
    return model


def read_model(model_dir: Path) -> ModelIdentity:
    """The model identity of a --model directory (shared/model_identity.py); UserError when it is not a model
    directory or its tokenizer or config cannot be read."""
    from shared.model_identity import load_model_identity

    check_model_dir(model_dir)
    try:
        return load_model_identity(model_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model_dir}: cannot load its tokenizer or config ({str(exc).splitlines()[0]})") from None


def checked_tasks(config: HubConfig, model: ModelIdentity | None, evaluate: bool) -> tuple[Task, Task | None]:
    """(training task, held-out task when `evaluate`): UserError naming the flag when one cannot load or is empty,
    or naming the reward function when it fails the start check (hub.training.tasks.check_reward)."""
    from hub.training.tasks import held_out, load_hub_task

    errors = (ValueError, ImportError, AttributeError, TypeError, OSError)
    try:
        task = load_hub_task(config.task, config, model)
        if not task.prompts():
            raise ValueError("it has no prompts")
    except errors as exc:
        raise UserError(f"--task {config.task}: {str(exc).removeprefix(f'task spec {config.task!r}: ')}") from None
    checked_reward(task, config.learner.group_size)
    if not evaluate:
        return task, None
    ev = config.eval
    try:
        return task, held_out(config, task, model)[1]
    except errors as exc:
        flag = f"--eval-task {ev.task}" if ev.task is not None else f"--eval-split {ev.split:g}"
        raise UserError(f"{flag}: {str(exc).removeprefix(f'task spec {ev.task!r}: ')}") from None


def checked_reward(task: Task, group_size: int) -> None:
    """The task's reward passes the start check; UserError with its one line when it does not."""
    from hub.training.tasks import check_reward
    from shared.tasks.base import RewardError

    try:
        check_reward(task, group_size)
    except RewardError as exc:
        raise UserError(str(exc)) from None


def check_agents(config: HubConfig, model: ModelIdentity | None) -> None:
    """Tools and an environment as TRL takes them, which this hub can run: their specs load and offer at least one
    tool, the sandbox has what it needs (Linux), --model's chat template renders them (hub/agents/conversation.py),
    and nothing asks for what the tool loop does not do yet (held-out evaluation on another task than a split of
    the training one)."""
    agents = config.agents
    if not agents.enabled:
        return
    flag = "--tools" if agents.tools else "--environment"
    if not sys.platform.startswith("linux"):
        raise UserError(f"{flag}: the tool sandbox needs Linux (it caps a call's memory with RLIMIT_AS)")
    if model is None and embedded_recipe(config.task) is DEFAULT_MODEL_RECIPE:
        raise UserError(
            f"{flag} needs --model: a model whose chat template renders tools (the embedded default's does not; "
            "--task calc trains the embedded tool model)"
        )
    if config.eval.every > 0 and config.eval.task is not None:
        raise UserError(
            f"--eval-task {config.eval.task} with {flag}: a tool-using run evaluates on a held-out split of its own task "
            "(--eval-split) only, for now; drop --eval-task"
        )
    from hub.agents.conversation import check_tool_template
    from hub.agents.toolset import load_toolset
    from hub.training.tasks import embedded_tokenizer

    try:
        toolset = load_toolset(agents.tools, agents.environment)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if not toolset.names:
        raise UserError(f"--environment {agents.environment}: it has no public methods, so the model has no tool to call")
    try:
        check_tool_template(model.tokenizer if model is not None else embedded_tokenizer(config.task), toolset.schemas)
    except ValueError as exc:
        raise UserError(
            f"{flag} with --model {config.model}: {exc}; use a model whose template renders tools (Qwen's does)"
        ) from None


def check_tool_task(config: HubConfig, task: Task) -> None:
    """A tool-using run's prompts are chat messages, rendered with the tools' schemas as TRL renders them."""
    from shared.tasks.dataset import DatasetTask

    if not config.agents.enabled:
        return
    flag = "--tools" if config.agents.tools else "--environment"
    if not isinstance(task, DatasetTask) or any(task.messages_of(p.id) is None for p in task.prompts()):
        raise UserError(
            f"{flag} with --task {config.task}: the prompts must be chat messages the template renders the tools into "
            "(a dataset whose prompts are message lists, or pass --chat)"
        )


def check_learner_procs(config: HubConfig) -> None:
    """A learner sharded over several processes trains full weights without a KL reference."""
    lc = config.learner
    world = int(os.environ.get("WORLD_SIZE", lc.procs))
    if world == 1:
        return
    if lc.lora_rank:
        raise UserError(
            f"--lora-rank {lc.lora_rank} with {world} learner processes: LoRA adapters train on one "
            "learner process; drop --learner-procs (or --lora-rank)"
        )
    if lc.beta > 0:
        raise UserError(
            f"learner.beta = {lc.beta:g} with {world} learner processes: the KL reference model is not "
            "sharded; set beta = 0 or run one learner process"
        )
    if resolve_device(lc.device, "--device") == "cuda":
        import torch

        if torch.cuda.device_count() < lc.procs:
            raise UserError(
                f"--learner-procs {lc.procs}: this machine has {torch.cuda.device_count()} CUDA devices, one "
                "per learner process is needed"
            )


def check_learner_kernels(config: HubConfig) -> None:
    """The optimizer and attention kernel the learner is asked for are installed and run on its device."""
    import importlib.util

    lc = config.learner
    world = int(os.environ.get("WORLD_SIZE", lc.procs))
    if lc.optimizer == "adamw8bit":
        if importlib.util.find_spec("torchao") is None:
            raise UserError('--optimizer adamw8bit needs torchao: pip install -e ".[lowbit]" (or --optimizer adamw)')
        if world > 1:
            raise UserError(
                f"--optimizer adamw8bit with {world} learner processes: its 8-bit moments train on one "
                "learner process; drop --learner-procs (or use --optimizer adamw)"
            )
    if lc.attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            "--attention flash_attention_2 needs the flash-attn package (pip install flash-attn); "
            "or use --attention flex_attention on CUDA, or sdpa"
        )
    if lc.attention == "flex_attention" and resolve_device(lc.device, "--device") != "cuda":
        raise UserError(
            "--attention flex_attention trains on CUDA only (torch's flex attention has no CPU backward); use --attention sdpa"
        )
    if lc.compile and resolve_device(lc.device, "--device") == "cpu" and not any(map(shutil.which, ("c++", "g++", "clang++"))):
        raise UserError(
            "--compile on a CPU needs a C++ compiler (torch.compile's CPU kernels are C++): install g++, or drop --compile"
        )


def check_lora(config: HubConfig) -> None:
    """--lora-targets must name Linear modules of the model (checked on a weightless copy of it)."""
    lc = config.learner
    if not lc.lora_rank or config.model is None:
        return  # the embedded default has peft's default targets (q_proj, v_proj)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.adapters import add_adapters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model))
    try:
        add_adapters(model, lc.lora_rank, lc.lora_alpha, lc.lora_targets)
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        what = f"--lora-targets {','.join(lc.lora_targets)}" if lc.lora_targets else "--lora-rank (peft's default targets)"
        raise UserError(f"{what}: {str(exc).splitlines()[0]}; this model's Linear modules are {','.join(linear)}") from None


def check_trackers(config: HubConfig) -> None:
    from hub.training.trackers import TRACK_EXTRA, missing_tracker_packages

    missing = missing_tracker_packages(config.tracking)
    if missing:
        raise UserError(f"--report-to {','.join(config.tracking.report_to)}: {', '.join(missing)} not installed; {TRACK_EXTRA}")


# What a run trains with besides its model, task and held-out prompts, by the name the user knows (its flag, or
# its hub.toml key) -> where HubConfig keeps it. A resume that changes one is refused unless --resume-anyway;
# what changes only how or how long the run goes (devices, ports, logging, steps, checkpoints) never is.
TRAINING_SETTINGS = {
    "lr": "learner.lr",
    "group_size": "learner.group_size",
    "prompts_per_step": "learner.prompts_per_step",
    "staleness": "learner.staleness",
    "kappa": "learner.effective_kappa",
    "seed": "learner.seed",
    "weight_decay": "learner.weight_decay",
    "grad_clip": "learner.grad_clip",
    "eps_low": "learner.eps_low",
    "eps_high": "learner.eps_high",
    "use_is_ratio": "learner.use_is_ratio",
    "max_is_ratio": "learner.max_is_ratio",
    "rollout_is_mode": "learner.rollout_is_mode",
    "rollout_is_level": "learner.rollout_is_level",
    "rollout_is_threshold": "learner.rollout_is_threshold",
    "rollout_is_threshold_lower": "learner.rollout_is_threshold_lower",
    "rollout_is_veto_threshold": "learner.rollout_is_veto_threshold",
    "importance_sampling_level": "learner.importance_sampling_level",
    "off_policy_mask_threshold": "learner.off_policy_mask_threshold",
    "beta": "learner.beta",
    "advantage_scale": "learner.advantage_scale",
    "loss_type": "learner.loss_type",
    "lr_scheduler": "learner.lr_scheduler",
    "warmup_ratio": "learner.warmup_ratio",
    "skip_zero_variance": "learner.skip_zero_variance",
    "max_new_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "prompt_column": "dataset.prompt_column",
    "answer_column": "dataset.answer_column",
    "reward": "dataset.reward",
    "reward_weights": "dataset.reward_weights",
    "reward_style": "dataset.reward_style",
    "dataset_split": "dataset.split",
    "chat": "dataset.chat",
}


def held_out_spec(config: HubConfig) -> str:
    """Which prompts the run keeps out of training: changing it on resume would evaluate on trained prompts."""
    if config.eval.every == 0:
        return "none"
    return f"task {config.eval.task.strip()}" if config.eval.task is not None else f"split {config.eval.split:g}"


def training_settings(config: HubConfig) -> dict[str, str]:
    """TRAINING_SETTINGS of `config`, each value as JSON text (how the store records them)."""
    return {name: json.dumps(functools.reduce(getattr, dotted.split("."), config)) for name, dotted in TRAINING_SETTINGS.items()}


def run_identity(config: HubConfig, model_dir: Path) -> dict[str, str]:
    """What the run this start asks for trains (the store records it; a resume is checked against it): the model's
    fingerprint, the task, the held-out prompts and the training settings."""
    return {
        "model_fingerprint": model_fingerprint(model_dir),
        "task": config.task.strip(),
        "held_out": held_out_spec(config),
        **training_settings(config),
    }


@dataclass(frozen=True)
class RecordedRun:
    """What a data dir's store says of its run: what it trains (Store.set_run), its step, its waiting groups."""

    meta: dict[str, str]
    step: int
    groups_waiting: int


def read_run(config: HubConfig) -> RecordedRun | None:
    """The run the data dir's store records (None: none yet), read without writing a byte. UserError when the
    store is of an echo2 schema this one cannot open (a newer one)."""
    store = config.data_dir / HUB_STORE_FILE
    if not store.exists():
        return None
    from hub.records.schema import SCHEMA_VERSION, schema_opens

    # A store closed cleanly has no -wal file: read it `immutable`, or SQLite would create -wal/-shm files.
    # After a crash they exist already and hold committed pages: read through them.
    wal = store.with_name(store.name + "-wal").exists()
    db = sqlite3.connect(f"file:{store}?mode=ro{'' if wal else '&immutable=1'}", uri=True, timeout=10)
    try:
        found = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and not schema_opens(found):  # an older one is brought up to this echo2's when the hub opens it
            raise UserError(
                f"--data-dir {config.data_dir}: its store holds echo2 schema {found}, this echo2 uses "
                f"{SCHEMA_VERSION}; finish that run with the echo2 that started it, or pass --fresh "
                "(the old run is moved aside) or another --data-dir"
            )
        if "run" not in tables:
            return None
        return RecordedRun(
            meta=dict(db.execute("SELECT key, value FROM run").fetchall()),
            step=db.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0],
            groups_waiting=db.execute(
                "SELECT COUNT(*) FROM trajectories WHERE verdict = 'accepted' AND consumed_step IS NULL"
                " AND discard_reason IS NULL"
            ).fetchone()[0],
        )
    finally:
        db.close()


def check_same_run(config: HubConfig, model_dir: Path, meta: dict[str, str]) -> None:
    """UserError when the recorded run trains another model, task or held-out prompts than this start asks for."""
    fingerprint = model_fingerprint(model_dir) if model_dir.exists() else None
    asked = (
        ("model", "model_fingerprint", fingerprint),
        ("task", "task", config.task.strip()),
        ("held-out prompts", "held_out", held_out_spec(config)),
    )
    changed = [(what, key) for what, key, now in asked if now is not None and key in meta and meta[key] != now]
    if changed:
        was = ", ".join(f"{what} {meta[key]!r}" for what, key in changed)
        raise UserError(
            f"--data-dir {config.data_dir} holds a run of another {' and '.join(w for w, _ in changed)} "
            f"({was}); pass --fresh to start over (the old run is moved aside), --resume-anyway to go on "
            "with the new one, or another --data-dir"
        )


def changed_settings(config: HubConfig, meta: dict[str, str]) -> tuple[str, ...]:
    """The training settings this start changes from the recorded run's, each as "lr 0.0003 -> 3e-05" (a run
    recorded before a setting existed names none of it: nothing to compare)."""
    now = training_settings(config)
    return tuple(f"{name} {meta[name]} -> {value}" for name, value in now.items() if name in meta and meta[name] != value)


def check_resume(config: HubConfig, model_dir: Path, anyway: bool) -> Resume | None:
    """What the data dir's existing run is (None: a fresh one). UserError when it trains another model, task or
    held-out prompts, or with other training settings, than this start asks for, unless `anyway`."""
    run = read_run(config)
    if run is None:
        return None
    changed = changed_settings(config, run.meta)
    if not anyway:
        check_same_run(config, model_dir, run.meta)
        if changed:
            raise UserError(
                f"--data-dir {config.data_dir}: on resume: {', '.join(changed)}; start it with the run's "
                "settings, pass --resume-anyway to go on with these, or --fresh to start over (the old run "
                "is moved aside)"
            )
    finished = 0 < config.steps <= run.step and (config.data_dir / FINAL_DIR).is_dir()
    if not finished:  # a finished run loads no checkpoint (nor torch, to read one)
        check_checkpoint_fits(config)
    return Resume(
        step=run.step,
        groups_waiting=run.groups_waiting,
        model=run.meta.get("model", "?"),
        task=run.meta.get("task", "?"),
        changed=changed,
        finished=finished,
        checkpoint=None if finished else newest_checkpoint_step(config),
    )


def newest_checkpoint_step(config: HubConfig) -> int | None:
    """The step of the newest complete checkpoint in the data dir (None: none)."""
    from hub.training.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(config.data_dir / CHECKPOINTS_DIR)
    return checkpoint.step if checkpoint is not None else None


def check_checkpoint_fits(config: HubConfig) -> None:
    """The checkpoint a resume loads must be of this start's kind: LoRA adapters of the same rank and alpha,
    or full weights."""
    from hub.training.checkpoint import latest_checkpoint
    from shared.adapters import snapshot_spec
    from shared.snapshot import SnapshotError

    checkpoint = latest_checkpoint(config.data_dir / CHECKPOINTS_DIR)
    if checkpoint is None:
        return
    lc = config.learner
    fix = "start it so, or pass --fresh (the old run is moved aside) or another --data-dir"
    if not checkpoint.adapter_path.exists():
        if lc.lora_rank:
            raise UserError(
                f"--lora-rank {lc.lora_rank}: the run in {config.data_dir} trains full weights "
                f"(checkpoint step {checkpoint.step}); drop --lora-rank, or pass --fresh or another --data-dir"
            )
        return
    try:
        spec = snapshot_spec(checkpoint.adapter_path)
    except SnapshotError as exc:
        raise UserError(f"{checkpoint.adapter_path}: {exc}") from None
    if spec is not None and (spec.rank, spec.alpha) != (lc.lora_rank, lc.lora_alpha):
        raise UserError(
            f"the run in {config.data_dir} trains LoRA adapters of rank {spec.rank}, alpha {spec.alpha:g} "
            f"(checkpoint step {checkpoint.step}): {fix} (--lora-rank {spec.rank} --lora-alpha {spec.alpha:g})"
        )


def move_aside(data_dir: Path, keep_key: bool) -> Path:
    """--fresh: the old run is renamed, never deleted; the new run starts in an empty data dir, with the hub's
    key copied back when it lived there (`keep_key`), so the hub keeps its address."""
    aside = data_dir.with_name(f"{data_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.rename(data_dir, aside)
    except OSError as exc:  # a name past the filesystem's limit, a data dir that is a mount point...
        raise UserError(
            f"--fresh: the old run in --data-dir {data_dir} cannot be renamed {aside.name} "
            f"({exc.strerror}); move it away yourself, or pass another --data-dir"
        ) from None
    if keep_key and (aside / HUB_KEY_FILE).exists():
        data_dir.mkdir()
        shutil.copy2(aside / HUB_KEY_FILE, data_dir / HUB_KEY_FILE)
    return aside
