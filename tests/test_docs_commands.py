"""The docs' commands run as written: every ```bash block of README.md and docs/*.md that holds an `echo-hub` or
`echo-node` command is run (or, where its block is marked `check`, parsed), so that no line of the docs fails a
reader. The rules (markers, what a run changes to stay short) are docs/CONTRIBUTING.md's "Commands in the docs"."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_docs import DOCS, ROOT

# A marker: an HTML comment on the line before a block's opening fence, alone or ending the paragraph before it.
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[\w-]+)(?P<arg>[^>]*?)\s*-->")
MARKER_KINDS = ("check", "file")
OPENING_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
CLOSING_FENCE = re.compile(r"^\s*```\s*$")
# A value the reader fills in (`<hub ip>`): one word, whatever it holds.
PLACEHOLDER = re.compile(r"<[^<>\n]+>")
# echo2's own programs, and the module each runs as; any other program of a block (a venv, pip, pytest) is the
# reader's environment, not run.
PROGRAMS = {"echo-hub": "hub.cli", "echo-node": "node.cli"}
START = ("echo-hub", "start")
MAIN_JOB = START  # the README's main job, `echo-hub start` as is: run once per session, its data dir shared
DATA_DIR = "echo2-data"  # the default --data-dir, which the docs' later commands read
RUN_STEPS = 2
# The reader's own model in the docs (`--model /models/Qwen3-0.6B`): a run takes the embedded default model with a
# chat template instead, and a --max-new-tokens its 64-token context holds.
READERS_MODELS = "/models/"
RUN_MAX_NEW_TOKENS = "10"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
DASHBOARDS = (("echo-hub", "dashboard"), ("echo-node", "dashboard"))
# Above the longest run (a hub's 2 steps: 20 to 60 s on a 2-core machine, 130 s on one loaded four times over); a
# command that never ends by itself belongs in a `check` block.
RUN_TIMEOUT_S = 240
OUTPUT_SHOWN_CHARS = 3000


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language, text and marker (kind, argument) if any."""

    page: Path
    line: int  # the opening fence's, from 1
    lang: str
    text: str
    marker: tuple[str, str] | None

    @property
    def name(self) -> str:
        """Its page, as the repository names it."""
        return str(self.page.relative_to(ROOT)) if self.page.is_relative_to(ROOT) else self.page.name

    @property
    def where(self) -> str:
        return f"{self.name}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One echo2 command of a block, as the reader types it (continuation lines joined)."""

    block: Block
    line: int  # the page line it starts on
    argv: tuple[str, ...]  # program name first (echo-hub, echo-node), whatever path the block typed it with

    @property
    def where(self) -> str:
        return f"{self.block.name}:{self.line}: `{shlex.join(self.argv)}`"


def _marker(line: str) -> tuple[str, str] | None:
    found = MARKER.search(line)
    return None if found is None else (found["kind"], found["arg"].strip().removeprefix(":").strip())


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, with the marker on the last non-blank line before it."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = OPENING_FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        end = next(j for j in range(i + 1, len(lines)) if CLOSING_FENCE.match(lines[j]))
        indent = len(opening["indent"])
        text = "\n".join(line[indent:] for line in lines[i + 1 : end])
        out.append(Block(page, i + 1, opening["lang"], text, _marker(before)))
        i = end + 1
    return out


def _echo2_argv(words: list[str]) -> tuple[str, ...] | None:
    """The echo2 command in a shell command's words (also `torchrun ... -m hub.cli ...`); None for another program."""
    if not words:
        return None
    if Path(words[0]).name in PROGRAMS:
        return (Path(words[0]).name, *words[1:])
    modules = {module: name for name, module in PROGRAMS.items()}
    if words[0] == "torchrun" and "-m" in words:
        at = words.index("-m")
        if at + 1 < len(words) and words[at + 1] in modules:
            return (modules[words[at + 1]], *words[at + 2 :])
    return None


def commands(block: Block) -> list[Command]:
    """The echo2 commands of a bash block, in order: lines ending in `\\` joined, comments dropped, `&&` chains split."""
    if block.lang != "bash":
        return []
    out = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        first, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        words = shlex.split(PLACEHOLDER.sub(lambda found: found[0].replace(" ", "-"), text), comments=True)
        chain: list[list[str]] = [[]]
        for word in words:
            if word == "&&":
                chain.append([])
            else:
                chain[-1].append(word)
        out += [Command(block, block.line + 1 + first, argv) for part in chain if (argv := _echo2_argv(part))]
    return out


def command_blocks() -> list[Block]:
    return [block for page in DOCS for block in blocks(page) if commands(block)]


# -- check: the flags parsed and the config validated, as `echo-hub start --print-config` does -------------------


def check(command: Command) -> str | None:
    """The mistake `command`'s flags make (the parser's or the config's one line), or None."""
    from hub.cli.main import build_parser as hub_parser
    from hub.cli.main import start_config
    from node.cli import build_parser as node_parser
    from node.cli import join_config
    from shared.config import ConfigError

    name, *args = command.argv
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            parsed = (hub_parser() if name == "echo-hub" else node_parser()).parse_args(args)
            if (name, parsed.command) == START:
                start_config(parsed)
            elif (name, parsed.command) == ("echo-node", "join"):
                join_config(parsed)
    except SystemExit as exc:
        return f"exit {exc.code}: {said.getvalue().strip()}"
    except ConfigError as exc:
        return str(exc)
    return None


# -- run: the command itself, in the page's directory, shortened --------------------------------------------------


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `echo-hub start`'s `flag` (a START_FLAGS name, spelled as given or as TRL's alias) set to
    `value`: replaced where given, appended where not."""
    from hub.cli.main import _flags

    spellings = _flags(flag)
    for i, word in enumerate(argv[:-1]):
        if word in spellings:
            return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, spellings[0], value]


def shortened(argv: tuple[str, ...], chat_model: Path) -> list[str]:
    """What a run executes of a command: `echo-hub start` for RUN_STEPS steps on a loopback port of its own, without
    the live display, the reader's model replaced by the test's; a dashboard rendered once to an SVG."""
    out = list(argv)
    if tuple(out[:2]) == START:
        out = _set_flag(out, "steps", str(RUN_STEPS))
        out = _set_flag(out, "listen", "/ip4/127.0.0.1/tcp/0")
        out.append("--no-progress")
        model = next((out[i + 1] for i, word in enumerate(out[:-1]) if word == "--model"), "")
        if model.startswith(READERS_MODELS):
            out = _set_flag(out, "model", str(chat_model))
            out = _set_flag(out, "max_new_tokens", RUN_MAX_NEW_TOKENS)
    if tuple(out[:2]) in DASHBOARDS:
        out += ["--screenshot", "dashboard.svg"]
    return out


@dataclass(frozen=True)
class Ran:
    returncode: int
    output: str


def execute(argv: list[str], cwd: Path) -> Ran:
    """Run an echo2 command line in `cwd` as the installed entry point would (its module, this interpreter)."""
    name, *args = argv
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", PROGRAMS[name], *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Ran(-1, f"still running after {RUN_TIMEOUT_S} s: a command that runs until stopped needs a check marker")
    return Ran(done.returncode, done.stdout + done.stderr)


def failure(command: Command, ran: Ran) -> str | None:
    """What went wrong with a run (an exit status other than 0, a traceback), naming the page, line and command."""
    if ran.returncode == 0 and "Traceback" not in ran.output:
        return None
    return f"{command.where} exited {ran.returncode}:\n{ran.output[-OUTPUT_SHOWN_CHARS:]}"


def write_readers_files(page: Path, where: Path) -> None:
    """What a reader has beside the docs' commands: their data (a TRL JSONL, a verl parquet), a hub.toml (the example
    config), and the page's `file` blocks saved under their names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.tasks.reverse import ReverseTask

    prompts = ReverseTask().prompts()[:48]
    with (where / "train.jsonl").open("w") as out:
        for i, p in enumerate(prompts):
            row = {"prompt": p.text, "answer": p.answer, "kind": "free" if i % 4 == 0 else "word"}
            out.write(json.dumps(row) + "\n")
    verl = [
        {
            "data_source": "reverse",
            "prompt": [{"role": "user", "content": p.answer[::-1]}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(prompts)
    ]
    pq.write_table(pa.Table.from_pylist(verl), where / "train.parquet")
    shutil.copy(ROOT / "docs" / "hub.example.toml", where / "hub.toml")
    for block in blocks(page):
        if block.marker is not None and block.marker[0] == "file":
            (where / block.marker[1]).write_text(block.text + "\n")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """The embedded default model with a chat template of its characters (`abc` -> `abc>`, its task's prompt)."""
    model = tmp_path_factory.mktemp("chat-model") / "model"
    shutil.copytree(default_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=2))
    return model


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A directory every xdist worker of this session shares."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def main_job(session_dir: Path, chat_model: Path) -> tuple[Path, Ran]:
    """(its directory, how it ran) of the README's main job, run once per session whichever worker asks first."""
    home = session_dir / "docs-main-job"
    with open(session_dir / "docs-main-job.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = home / "ran.json"
        if not result.exists():
            home.mkdir(exist_ok=True)
            ran = execute(shortened(MAIN_JOB, chat_model), home)
            result.write_text(json.dumps({"returncode": ran.returncode, "output": ran.output}))
        return home, Ran(**json.loads(result.read_text()))


def marked(kind: str | None) -> list[Block]:
    """The command blocks with a marker of `kind` (None: with none)."""
    return [block for block in command_blocks() if (block.marker[0] if block.marker else None) == kind]


@pytest.mark.parametrize("block", marked("check"), ids=lambda block: block.where)
def test_the_docs_checked_commands_parse(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `check` block's commands (a GPU, a remote hub, a run that never ends) parse, in the reader's directory."""
    write_readers_files(block.page, tmp_path)
    monkeypatch.chdir(tmp_path)
    mistakes = [f"{c.where}: {mistake}" for c in commands(block) if (mistake := check(c)) is not None]
    assert not mistakes, "\n".join(mistakes)


@pytest.mark.slow
@pytest.mark.parametrize("block", marked(None), ids=lambda block: block.where)
def test_the_docs_commands_run_as_written(block: Block, tmp_path: Path, chat_model: Path, session_dir: Path) -> None:
    """A block's commands run, in order, in one directory with the reader's files (and, when they read echo2-data
    and start no hub of their own, a copy of the main job's)."""
    cmds = commands(block)
    write_readers_files(block.page, tmp_path)
    starts = any(c.argv[:2] == START for c in cmds)
    if not starts and any(DATA_DIR in c.argv for c in cmds):
        home, ran = main_job(session_dir, chat_model)
        assert ran.returncode == 0, f"the main job (`echo-hub start`) failed, so {block.where} has no {DATA_DIR}"
        shutil.copytree(home / DATA_DIR, tmp_path / DATA_DIR)
    for c in cmds:
        ran = main_job(session_dir, chat_model)[1] if c.argv == MAIN_JOB else execute(shortened(c.argv, chat_model), tmp_path)
        assert (mistake := failure(c, ran)) is None, mistake


# -- the rules themselves --------------------------------------------------------------------------------------


def test_every_marker_is_understood() -> None:
    """A misspelt marker would run, or skip, a block unseen: each one is a known kind with its argument."""
    wrong = []
    for page in DOCS:
        for block in blocks(page):
            if block.marker is None:
                continue
            kind, arg = block.marker
            if kind not in MARKER_KINDS or not arg:
                wrong.append(
                    f"{block.where}: docs-test marker {kind!r} {arg!r} (kinds: {', '.join(MARKER_KINDS)}, each "
                    "with a reason or a file name)"
                )
            elif kind == "check" and not commands(block):
                wrong.append(f"{block.where}: a check marker on a block with no echo2 command")
    assert not wrong, "\n".join(wrong)
    assert command_blocks(), "no command block found: the extraction broke"


PAGE = """# A page

Set up, then run: <!-- docs-test: check: needs a GPU -->

```bash
python3 -m venv .venv && pip install -e . && echo-hub start --steps 3 \\
    --lr 1e-5   # the learning rate
~/venv/bin/echo-node join --hub /ip4/<hub ip>/tcp/4077 --price 0.35
torchrun --nnodes 2 -m hub.cli start --no-such-flag
```

<!-- docs-test: file my.py -->
```python
x = 1
```

- In a list:

  ```bash
  echo-hub status --data-dir echo2-data
  ```
"""


def test_blocks_markers_and_commands_are_read_as_a_reader_types_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    gpu, file, listed = blocks(page)
    assert (gpu.line, gpu.marker, file.marker, listed.marker) == (5, ("check", "needs a GPU"), ("file", "my.py"), None)
    assert file.text == "x = 1" and listed.text == "echo-hub status --data-dir echo2-data"
    assert [(c.line, c.argv) for c in commands(gpu)] == [
        (6, ("echo-hub", "start", "--steps", "3", "--lr", "1e-5")),
        (8, ("echo-node", "join", "--hub", "/ip4/<hub-ip>/tcp/4077", "--price", "0.35")),
        (9, ("echo-hub", "start", "--no-such-flag")),
    ]
    assert commands(file) == [] and [c.line for c in commands(listed)] == [20]


def test_a_command_that_fails_is_named_by_page_line_and_text(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    start, join, wrong = commands(blocks(page)[0])
    assert check(start) is None and check(join) is None
    mistake = check(wrong)
    assert mistake is not None and "--no-such-flag" in mistake
    assert wrong.where == "page.md:9: `echo-hub start --no-such-flag`"
    said = failure(wrong, Ran(2, "echo-hub: unrecognized arguments: --no-such-flag\n"))
    assert said is not None and said.startswith("page.md:9: `echo-hub start --no-such-flag` exited 2:")
    assert failure(start, Ran(0, "Traceback (most recent call last):\n")) is not None
    assert failure(start, Ran(0, "final policy: echo2-data/final\n")) is None


def test_a_run_is_shortened_to_steps_a_loopback_port_and_the_test_model() -> None:
    model = Path("/tmp/chat")
    assert shortened(("echo-hub", "start", "--max-steps", "500", "--listen", "/ip4/0.0.0.0/tcp/4077"), model) == [
        "echo-hub", "start", "--max-steps", "2", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-progress",
    ]  # fmt: skip
    assert shortened(("echo-hub", "start", "--model", "/models/Qwen3-0.6B"), model)[2:] == [
        "--model", "/tmp/chat", "--steps", "2", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-progress",
        "--max-new-tokens", "10",
    ]  # fmt: skip
    assert shortened(("echo-hub", "dashboard", "--data-dir", "d"), model)[-2:] == ["--screenshot", "dashboard.svg"]
    assert shortened(("echo-hub", "status"), model) == ["echo-hub", "status"]


def test_a_checked_command_reads_the_pages_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file a page shows is validated with the command that loads it: a misspelt key is a mistake."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: file node.toml -->\n```toml\nhub = 'x'\nprise = 0.35\n```\n\n"
        "<!-- docs-test: check: a remote hub -->\n```bash\necho-node join --config node.toml\n```\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    write_readers_files(page, work)
    monkeypatch.chdir(work)
    (join,) = commands(blocks(page)[1])
    mistake = check(join)
    assert mistake is not None and "prise" in mistake and "price" in mistake, mistake
