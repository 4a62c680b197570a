"""`echo-hub`: the operator's entry point. Parses flags, then imports the heavy modules it needs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.checks import UserError
from shared.flags import EXAMPLE_FORMAT, FlagParser
from shared.logs import quiet_wheel_noise

# Before torch is imported: the hub's start imports it, and transformers imports torchao.
quiet_wheel_noise()

if TYPE_CHECKING:
    from hub.config import HubConfig


def _bool(text: str) -> bool:
    """A flag's on/off value: on/off, true/false, yes/no or 1/0."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    if text.lower() not in value:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value[text.lower()]


def _staleness(text: str) -> int | str:
    """`--staleness`: a whole number of versions, or auto (the hub adapts S, up to --staleness-max)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list (`--report-to tensorboard,wandb`)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


# flag name -> (dotted HubConfig field, type); flags override the TOML file, which overrides defaults.
# Each flag's help is its field's description, choices and default (hub/config.py).
START_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "data_dir": ("data_dir", Path),
    "model": ("model", Path),
    "task": ("task", str),
    "listen": ("listen", str),
    "http": ("http", str),
    "key": ("key", Path),
    "steps": ("steps", int),
    "local_nodes": ("local_nodes", int),
    "local_device": ("local_device", str),
    "device": ("learner.device", str),
    "staleness": ("learner.staleness", _staleness),
    "staleness_max": ("learner.staleness_max", int),
    "drift_max": ("learner.drift_max", float),
    "kappa": ("learner.kappa", int),
    "prompts_per_step": ("learner.prompts_per_step", int),
    "group_size": ("learner.group_size", int),
    "lr": ("learner.lr", float),
    "lr_scheduler": ("learner.lr_scheduler", str),
    "warmup_ratio": ("learner.warmup_ratio", float),
    "weight_decay": ("learner.weight_decay", float),
    "beta": ("learner.beta", float),
    "eps_low": ("learner.eps_low", float),
    "eps_high": ("learner.eps_high", float),
    "loss_type": ("learner.loss_type", str),
    "num_iterations": ("learner.num_iterations", int),
    "rollout_is_mode": ("learner.rollout_is_mode", str),
    "rollout_is_level": ("learner.rollout_is_level", str),
    "rollout_is_threshold": ("learner.rollout_is_threshold", float),
    "rollout_is_threshold_lower": ("learner.rollout_is_threshold_lower", float),
    "rollout_is_veto_threshold": ("learner.rollout_is_veto_threshold", float),
    "importance_sampling_level": ("learner.importance_sampling_level", str),
    "off_policy_mask_threshold": ("learner.off_policy_mask_threshold", float),
    "grad_clip": ("learner.grad_clip", float),
    "checkpoint_every": ("learner.checkpoint_every", int),
    "checkpoint_every_s": ("learner.checkpoint_every_s", float),
    "seed": ("learner.seed", int),
    "max_new_tokens": ("sampling.max_new_tokens", int),
    "temperature": ("sampling.temperature", float),
    "top_p": ("sampling.top_p", float),
    "top_k": ("sampling.top_k", int),
    "min_p": ("sampling.min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "dtype": ("learner.dtype", str),
    "micro_batch_tokens": ("learner.micro_batch_tokens", int),
    "attention": ("learner.attention", str),
    "optimizer": ("learner.optimizer", str),
    "gradient_checkpointing": ("learner.gradient_checkpointing", _bool),
    "compile": ("learner.compile", _bool),
    "learner_procs": ("learner.procs", int),
    "lora_rank": ("learner.lora_rank", int),
    "lora_alpha": ("learner.lora_alpha", float),
    "lora_targets": ("learner.lora_targets", _names),
    "checkpoints_kept": ("learner.checkpoints_kept", int),
    "broadcast": ("broadcast.mode", str),
    "link_mbps": ("broadcast.link_mbps", float),
    "hub_mbps": ("broadcast.hub_uplink_mbps", float),
    "delta_max_ratio": ("broadcast.delta_max_ratio", float),
    "bulk_port": ("broadcast.bulk_port", int),
    "check_procs": ("trust.check_procs", int),
    "log_level": ("log_level", str),
    "log_max_mb": ("log_max_mb", float),
    "log_backups": ("log_backups", int),
    "save_rollouts": ("save_rollouts", Path),
    "save_rollouts_max_gb": ("save_rollouts_max_gb", float),
    "prompt_column": ("dataset.prompt_column", str),
    "answer_column": ("dataset.answer_column", str),
    "reward": ("dataset.reward", str),
    "reward_weights": ("dataset.reward_weights", _names),
    "reward_style": ("dataset.reward_style", str),
    "dataset_split": ("dataset.split", str),
    "max_prompt_length": ("dataset.max_prompt_length", int),
    "chat": ("dataset.chat", _bool),
    "eval_every": ("eval.every", int),
    "eval_task": ("eval.task", str),
    "eval_split": ("eval.split", float),
    "eval_prompts": ("eval.prompts", int),
    "eval_samples": ("eval.samples", int),
    "eval_temperature": ("eval.temperature", float),
    "report_to": ("tracking.report_to", _names),
    "run_name": ("tracking.run_name", str),
    "log_completions": ("tracking.log_completions", int),
    "tools": ("agents.tools", _names),
    "environment": ("agents.environment", str),
    "max_tool_calls": ("agents.max_tool_calls", int),
    "tool_wall_s": ("agents.tool_wall_s", float),
    "tool_cpu_s": ("agents.tool_cpu_s", float),
    "tool_memory_mb": ("agents.tool_memory_mb", int),
    "tool_procs": ("agents.tool_procs", int),
}
# On/off flags of `echo-hub start` that take no value: given is on (flag name -> dotted HubConfig field).
START_SWITCHES: dict[str, str] = {"allow_lossy_prompts": "dataset.allow_lossy_prompts"}
# Flags that may be given several times, adding up (`--reward a --reward b` is `--reward a,b`,
# `--reward-weights 1 --reward-weights 0.5` is `--reward-weights 1,0.5`, `--tools m:f --tools m:g` is `--tools m:f,m:g`).
REPEATED_FLAGS = frozenset({"reward", "reward_weights", "tools"})
# TRL's names for the same settings (GRPOConfig and transformers' TrainingArguments), accepted as flags and as flat
# hub.toml keys. --epsilon sets the lower clip range only: eps_high keeps its own default (DAPO's 0.28).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "group_size": ("num_generations",),
    "max_new_tokens": ("max_completion_length",),
    "lr": ("learning_rate",),
    "steps": ("max_steps",),
    "eps_low": ("epsilon",),
    "eps_high": ("epsilon_high",),
    "grad_clip": ("max_grad_norm",),
    "checkpoint_every": ("save_steps",),
    "lr_scheduler": ("lr_scheduler_type",),
    # TRL's vllm_importance_sampling_cap is its older name of clip_max (deprecated in TRL 1.6, still taken there).
    "rollout_is_mode": ("vllm_importance_sampling_mode",),
    "rollout_is_threshold": ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"),
    "rollout_is_threshold_lower": ("vllm_importance_sampling_clip_min",),
    "environment": ("environment_factory",),
    "max_tool_calls": ("max_tool_calling_iterations",),
}
# One example per command, at the end of its --help.
EXAMPLES: dict[str, str] = {
    "start": "echo-hub start --task train.jsonl --num-generations 8 --max-steps 500 --learning-rate 1e-5 \\\n"
    "    --lr-scheduler cosine --warmup-ratio 0.1 --report-to tensorboard --log-completions 4",
    "config": "echo-hub config > hub.toml && echo-hub start --config hub.toml",
    "status": "echo-hub status --data-dir echo2-data",
    "plan": "echo-hub plan --fleet fleet.toml --t-train 2.0 --t-bcast 5.0",
    "dashboard": "echo-hub dashboard --data-dir echo2-data",
    "eval": "echo-hub eval --model echo2-data/final --eval-prompts 200",
    "report": "echo-hub report --data-dir echo2-data   # writes echo2-data/report.png",
}


def _flags(flag: str) -> list[str]:
    """A START_FLAGS entry's command-line spellings: its own, then TRL's."""
    return ["--" + name.replace("_", "-") for name in (flag, *FLAG_ALIASES.get(flag, ()))]


def _flat_keys() -> dict[str, str]:
    """The flat hub.toml keys (every flag's name, TRL's too) -> the dotted HubConfig field each sets."""
    return {name: dotted for flag, (dotted, _) in START_FLAGS.items() for name in (flag, *FLAG_ALIASES.get(flag, ()))}


def start_flags_by_field() -> dict[str, list[str]]:
    """Each dotted HubConfig field -> the `echo-hub start` flags that set it (the configuration reference's)."""
    out = {dotted: _flags(flag) for flag, (dotted, _) in START_FLAGS.items()}
    return out | {dotted: ["--" + flag.replace("_", "-")] for flag, dotted in START_SWITCHES.items()}


def _add_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with its example."""
    return sub.add_parser(
        name, help=help, description=help, epilog=f"example:\n  {EXAMPLES[name]}", formatter_class=EXAMPLE_FORMAT
    )


# The flags of `echo-hub eval`: what picks the policy's prompts and how they are sampled.
EVAL_FLAGS = (
    "task",
    "seed",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "dtype",
    "prompt_column",
    "answer_column",
    "reward",
    "reward_weights",
    "reward_style",
    "dataset_split",
    "chat",
    "eval_task",
    "eval_split",
    "eval_prompts",
    "eval_samples",
    "eval_temperature",
)


def _start_parser(sub: argparse._SubParsersAction) -> None:
    p = _add_parser(sub, "start", "run the hub (and, by default, local volunteer nodes)")
    from hub.config import HubConfig
    from shared.config import flag_help

    p.add_argument(
        "--config",
        type=Path,
        help="hub.toml: any field of `echo-hub config` (flat keys like staleness = 4 work too); flags override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the configuration this start would run with (defaults < --config < flags) as TOML, and exit",
    )
    for flag, (dotted, kind) in START_FLAGS.items():
        p.add_argument(
            *_flags(flag),
            dest=flag,
            type=kind,
            default=None,
            help=flag_help(HubConfig, dotted),
            action="append" if flag in REPEATED_FLAGS else "store",
        )
    for flag, dotted in START_SWITCHES.items():
        p.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            action="store_const",
            const=True,
            default=None,
            help=flag_help(HubConfig, dotted, switch=True),
        )
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live progress display")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run even if DATA_DIR holds one (the old run is renamed DATA_DIR.old-<time>)",
    )
    resume.add_argument(
        "--resume-anyway",
        action="store_true",
        help="resume DATA_DIR's run even though its model, task or training settings (lr, group "
        "size, staleness...) differ from this start's",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="echo-hub",
        description="echo2 hub: central GRPO learner that signs policy snapshots and buys rollouts from volunteer nodes.",
    )
    parser.add_argument("--version", action="version", version=f"echo-hub {package_version('echo2')}")
    sub = parser.add_subparsers(dest="command", required=True)
    _start_parser(sub)
    _add_parser(sub, "config", "print an example hub.toml: every field, what it does and its default, commented out")

    status = _add_parser(sub, "status", "print nodes, leases, versions, throughput and cost of a hub")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--hub", help="multiaddr of a running hub (with /p2p/<id>)")
    where.add_argument("--data-dir", type=Path, default=None, help="read DATA_DIR/status.json (default ./echo2-data)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument(
        "--key",
        type=Path,
        default=None,
        help="with --hub: ask as this identity (the hub's DATA_DIR/hub.key, or a key listed in "
        "trust.status_operators, sees nodes' prices and costs; others see them hidden)",
    )

    from hub.cli.plan import add_plan_arguments

    add_plan_arguments(_add_parser(sub, "plan", "capacity planning for a fleet, without running anything"))

    from tui.cli import add_dashboard_arguments

    add_dashboard_arguments(_add_parser(sub, "dashboard", "live terminal dashboard of a hub"))

    ev = _add_parser(sub, "eval", "evaluate a saved policy (DATA_DIR/final, a checkpoint) on held-out prompts")
    from hub.config import HubConfig
    from shared.config import flag_help

    ev.add_argument("--model", type=Path, required=True, help="policy directory (save_pretrained layout)")
    ev.add_argument(
        "--config",
        type=Path,
        help="hub.toml of the run: its task, sampling and eval settings (default: "
        "the echo2.toml a run saves beside each policy, when MODEL has one)",
    )
    for flag in EVAL_FLAGS:
        dotted, kind = START_FLAGS[flag]
        ev.add_argument(
            *_flags(flag),
            dest=flag,
            type=kind,
            default=None,
            help=flag_help(HubConfig, dotted),
            action="append" if flag in REPEATED_FLAGS else "store",
        )
    ev.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ev.add_argument("--json", action="store_true", help="print the result as one JSON line")

    report = _add_parser(sub, "report", "plot reward, loss, KL, staleness and bubble ratio from metrics.jsonl")
    report.add_argument("--data-dir", type=Path, default=Path("echo2-data"), help="the hub's data dir")
    report.add_argument("--out", type=Path, default=None, help="PNG path (default DATA_DIR/report.png)")
    return parser


def prepare_start(config, fresh: bool, anyway: bool):
    """Every check of `echo-hub start` (UserError on a mistake, nothing written), then the data dir lock. None:
    the run already did the steps asked, and says so."""
    from hub.cli.preflight import Started, check_resume, check_start, move_aside
    from shared.default_model import default_model_dir
    from shared.layout import FINAL_DIR, HUB_LOCK_FILE
    from shared.lock import lock_data_dir
    from shared.precision import check_device
    from shared.tool_model import embedded_recipe

    model = check_start(config)
    check_device(config.learner.device, "--device")
    check_device(config.local_device, "--local-device")
    model_dir = config.model or default_model_dir(recipe=embedded_recipe(config.task))
    resume = None if fresh else check_resume(config, model_dir, anyway)
    if resume is not None and resume.finished:
        print(
            f"echo-hub: nothing to do: the run is at step {resume.step}; pass --steps M > {resume.step} to train "
            f"on (its final policy: {config.data_dir / FINAL_DIR})"
        )
        return None
    if fresh and config.data_dir.exists() and any(config.data_dir.iterdir()):
        lock_data_dir(config.data_dir, HUB_LOCK_FILE, "hub").close()  # refused while another hub runs on it
        aside = move_aside(config.data_dir, keep_key=config.key is None)
        print(f"echo-hub: --fresh: the old run is now in {aside} (the hub key stays: same address)", file=sys.stderr)
    return Started(lock=lock_data_dir(config.data_dir, HUB_LOCK_FILE, "hub"), resume=resume, model=model)


def _given(args: argparse.Namespace, flag: str) -> object:
    """A flag's value; a repeated list flag's values (one tuple each time it is given) as one tuple."""
    value = getattr(args, flag)
    if isinstance(value, list) and all(isinstance(v, tuple) for v in value):
        return tuple(item for v in value for item in v)
    return value


def _eval(args: argparse.Namespace) -> int:
    """`echo-hub eval`: its config is --config, else the run's saved beside the policy (and it says so), else the
    defaults; flags override it."""
    from hub.cli.eval import check_eval, run_eval, saved_run_config
    from hub.config import HubConfig, with_task_defaults, with_user_model_defaults
    from shared.config import ConfigError, load_config

    overrides = {START_FLAGS[flag][0]: _given(args, flag) for flag in EVAL_FLAGS}
    saved = None if args.config is not None else saved_run_config(args.model)
    try:
        config = load_config(HubConfig, args.config or saved, overrides, aliases=_flat_keys())
        # Without a run's config the policy is all there is to go by: a model of the user's samples as TRL's would.
        base = config.model if args.config is not None or saved is not None else args.model
        config, defaults = with_user_model_defaults(config, _own_model(base, config.task), fields=("sampling.max_new_tokens",))
        config = with_task_defaults(config)  # --task calc is a tool-using run's task: refused below, in one line
        model, task = check_eval(config, args.model)
    except (ConfigError, UserError) as exc:
        print(f"echo-hub eval: {f'{saved}: ' if saved else ''}{exc}", file=sys.stderr)
        return 2
    if defaults is not None:
        print(f"echo-hub eval: {defaults}", file=sys.stderr, flush=True)
    return run_eval(config, model, task, args.device, args.json, saved)


def _config() -> int:
    """`echo-hub config`: hub.toml with every default commented out, so that a `model = ...` added to it still takes
    the user-model defaults for every line left commented; each of those says its value for a model of the user's."""
    from operator import attrgetter

    from hub.config import USER_MODEL_DEFAULTS, HubConfig
    from shared.config import example_toml

    toy = HubConfig()
    notes = {
        dotted: f"a --model of your own: {value:g}"
        for dotted, value in USER_MODEL_DEFAULTS.items()
        if attrgetter(dotted)(toy) != value
    }
    print(example_toml(HubConfig, "hub.toml for `echo-hub start --config hub.toml`", notes), end="")
    return 0


def _own_model(model: Path | None, task: str) -> bool:
    """Whether --model names a model of the user's, not the embedded one `task` trains (None, or its cache directory)."""
    from shared.default_model import default_model_dir
    from shared.tool_model import embedded_recipe

    return model is not None and model.resolve() != default_model_dir(recipe=embedded_recipe(task)).resolve()


def start_config(args: argparse.Namespace) -> HubConfig:
    """The config `echo-hub start` runs with, from its parsed flags: defaults < --config < flags; ConfigError (one
    line) on a mistake."""
    from hub.config import HubConfig
    from shared.config import load_config

    overrides = {dotted: _given(args, flag) for flag, (dotted, _) in START_FLAGS.items()}
    overrides |= {dotted: getattr(args, flag) for flag, dotted in START_SWITCHES.items()}
    return load_config(HubConfig, args.config, overrides, aliases=_flat_keys())


def effective_start_config(args: argparse.Namespace) -> tuple[HubConfig, str | None]:
    """`start_config` with what it left unset filled as the start fills it: TRL's defaults for a model of the user's,
    then the embedded tool task's own settings; and the line that says which TRL defaults it took (None: none)."""
    from hub.config import with_task_defaults, with_user_model_defaults

    config = start_config(args)
    config, defaults = with_user_model_defaults(config, own_model=_own_model(config.model, config.task))
    return with_task_defaults(config), defaults


def _start(args: argparse.Namespace, reexec: bool) -> int:
    """`echo-hub start`: a mistake is one line and exit 2; so is a disk that fills while the hub starts (one that
    fills while it runs, run_hub stops the run for). `reexec`: run this command line again with Python's objects in
    glibc's heap (shared.memory.use_c_allocator) once its flags are known to be right."""
    from hub.training.ranks import rank_env
    from shared.checks import disk_full, free_space
    from shared.config import ConfigError
    from shared.memory import tune_malloc, use_c_allocator

    env = rank_env()
    try:
        if reexec:
            # Checked before the re-exec (no thread yet, nothing written): a mistake costs one start-up, not two. A
            # --config that can be read once only (a pipe, <(...)) is left to the process that runs.
            if args.config is None or args.config.is_file():
                start_config(args)
            use_c_allocator()
        config, defaults = effective_start_config(args)
        # Before any thread: glibc fixes its arena limit when a thread first needs an arena, and the checks, the
        # tokenizer and torch start threads before the run does.
        tune_malloc()
        if args.print_config:
            from shared.config import config_toml

            print(config_toml(config, "echo-hub start's effective configuration (load it with --config)"), end="")
            if defaults is not None:  # stdout is the file; the start's line says where its values came from
                print(f"echo-hub: {defaults}", file=sys.stderr, flush=True)
            return 0
        if env is not None and env.rank > 0:  # a learner rank of a sharded learner: rank 0 runs the hub
            from hub.cli.run import run_learner_rank

            return run_learner_rank(config, env)
        if defaults is not None:  # before the checks: a refusal naming a default's value should find it explained
            print(f"echo-hub: {defaults}", flush=True)
        started = prepare_start(config, fresh=args.fresh, anyway=args.resume_anyway)
    except (ConfigError, UserError) as exc:
        print(f"echo-hub: {exc}", file=sys.stderr)
        return 2
    if started is None:
        return 0
    if config.local_nodes:
        from hub.cli.local_nodes import start_node_server

        start_node_server()  # it imports the nodes' modules while this process imports the learner's
    from hub.cli.run import run_hub

    try:
        return run_hub(config, progress=not args.no_progress, resume=started.resume, lock=started.lock, model=started.model)
    except Exception as exc:
        if disk_full(exc) is None:
            raise
        print(
            f"echo-hub: the disk of --data-dir {config.data_dir} is full ({free_space(config.data_dir)}); free some "
            "space, or pass another --data-dir",
            file=sys.stderr,
            flush=True,
        )
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":
        from shared.signals import CtrlCWatch, ctrl_c_handled

        with CtrlCWatch() as ctrl_c:
            try:
                # The command line itself runs again in glibc's heap; a test's hub, forked with its argv, keeps the
                # server's allocator.
                return _start(args, reexec=argv is None)
            except BaseException as exc:  # Ctrl-C before the run's own handler takes over (a check, the model build)
                if not ctrl_c.stopped(exc):
                    raise
        ctrl_c_handled()
        print("echo-hub: stopped by Ctrl-C; start it again to go on", file=sys.stderr, flush=True)
        return 130
    if args.command == "config":
        return _config()
    if args.command == "eval":
        return _eval(args)
    try:
        return _inspect(args)
    except UserError as exc:
        print(f"echo-hub {args.command}: {exc}", file=sys.stderr)
        return 2


def _inspect(args: argparse.Namespace) -> int:
    """The commands that look at a run (status, plan, dashboard, report); a UserError is the caller's one line."""
    if args.command == "status":
        from hub.cli.status import run_status

        return run_status(hub=args.hub, data_dir=args.data_dir, as_json=args.json, key=args.key)
    if args.command == "plan":
        from hub.cli.plan import run_plan

        return run_plan(args)
    if args.command == "dashboard":
        from tui.cli import run_dashboard

        return run_dashboard(args)
    if args.command == "report":
        from hub.cli.report import write_report

        print(f"wrote {write_report(args.data_dir, args.out)}")
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
