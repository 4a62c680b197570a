"""Task loading by spec and the math task: JSONL validation, answer extraction and math-verify scoring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shared.tasks import BUILTIN_TASKS, load_task
from shared.tasks.base import RewardError, Task
from shared.tasks.budget import OverBudget, cpu_budget
from shared.tasks.dataset import MathTask
from shared.tasks.math import _parse_latex, answers_match, extract_final_answer, is_cheap_to_verify

DATA = Path(__file__).parent / "data"
MATH_FILE = DATA / "math_small.jsonl"


@pytest.fixture(scope="module")
def math_task() -> MathTask:
    return MathTask(MATH_FILE)


# --- MathTask: file -----------------------------------------------------------------------


def test_math_task_reads_prompts_with_line_number_ids(math_task):
    prompts = math_task.prompts()
    assert [p.id for p in prompts] == ["math-1", "math-2", "math-4", "math-5"]
    assert [p.answer for p in prompts] == ["\\frac{1}{2}", "2", "1000", "x^2+2x+1"]
    assert prompts[1].text == "What is 1 + 1?"
    assert "frac" not in repr(prompts[0])  # the gold answer stays out of logs
    assert [p.id for p in MathTask(MATH_FILE).prompts()] == [p.id for p in prompts]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no prompts (empty dataset)"),
        ("\n  \n", "no prompts (empty dataset)"),
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"\n', ":2: not valid JSON"),
        ('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n', ":3: no column 'answer'"),
        ('{"answer": "1"}\n', ":1: no column 'prompt'"),
        ('{"prompt": "a", "answer": ""}\n', ":1: 'answer' must be a non-empty string or a number"),
        ('{"prompt": "", "answer": "1"}\n', ":1: 'prompt' is empty"),
        ('["a", "1"]\n', ":1: expected a JSON object, got list"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        MathTask(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_unparseable_gold_answer_is_reported(tmp_path):
    path = tmp_path / "gold.jsonl"
    path.write_text('{"prompt": "a", "answer": "\\\\"}\n')
    task = MathTask(path)
    with pytest.raises(RewardError, match="gold answer .* of math-1 does not parse"):
        task.reward(task.get("math-1"), "\\boxed{1}")


# --- MathTask: answers and rewards --------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("so \\boxed{2}.", "2"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}} done 7", "\\frac{1}{2}"),
        ("\\boxed{4} and finally \\boxed{3", "4"),
        ("We get 3 apples, then 12.5 more", "12.5"),
        ("total: 1,234,567 coins", "1234567"),
        ("ratio 3 / 4", "3/4"),
        ("minus -7", "-7"),
        ("no answer at all", None),
        ("\\boxed{   }", None),
    ],
)
def test_extract_final_answer(completion, answer):
    assert extract_final_answer(completion) == answer


@pytest.mark.parametrize(
    ("prompt_id", "completion", "reward"),
    [
        ("math-1", "The answer is \\boxed{0.5}.", 1.0),
        ("math-1", "Half of one is 1/2", 1.0),
        ("math-1", "\\boxed{\\frac{2}{4}}", 1.0),
        ("math-1", "\\boxed{\\dfrac{1}{2}}", 1.0),
        ("math-1", "\\boxed{0.6}", 0.0),
        ("math-1", "0.5, no wait: \\boxed{3} (not 0.5)", 0.0),
        ("math-2", "\\boxed{2}", 1.0),
        ("math-2", "1 + 1 = 2", 1.0),
        ("math-2", "\\boxed{3}", 0.0),
        ("math-2", "2 apples, or rather 3", 0.0),
        ("math-4", "It is 1,000.", 1.0),
        ("math-4", "\\boxed{1000}", 1.0),
        ("math-4", "\\boxed{100}", 0.0),
        ("math-5", "\\boxed{(x+1)^2}", 1.0),
        ("math-5", "\\boxed{x^{2} + 2x + 1}", 1.0),
        ("math-5", "\\boxed{x^2+1}", 0.0),
    ],
)
def test_math_reward(math_task, prompt_id, completion, reward):
    assert math_task.reward(math_task.get(prompt_id), completion) == reward


JUNK = [
    "",
    "no numbers here",
    "\\boxed{}",
    "\\boxed{",
    "}}}{{{\\boxed{\\boxed{",
    "\\boxed{\\frac{1}{}}",
    "\x00\xff\ufffd",
    "x" * 100_000,
    "\\boxed{" + "(" * 5000 + "}",
    "\\boxed{" + "1" * 5000 + "}",
    "\\boxed{2**99999999}",
    "\\boxed{99999999!}",
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{(x+y+z)^{99}}",
    "\\boxed{\\cos^{999}(x)+\\sin^{999}(x)}",
    "\\boxed{\\prod_{k=1}^{99999999} k}",
    "\\boxed{\\binom{100000000}{50000000}}",
    "\\boxed{\\Gamma(99999999)}",
    "\\boxed{3^{99999999}}",
    "\\boxed{(\\sqrt{2}+\\sqrt{3}+\\sqrt{5})^{1000}}",
    "\\boxed{\\sin(1)^{1000}+\\cos(1)^{1000}}",
    # at the guard's limits: accepted, compared, wrong
    "\\boxed{(x+y+z)^{16}}",
    "\\boxed{(\\sqrt{2}+\\sqrt{3}+\\sqrt{5})^{16}}",
    "\\boxed{\\sin(1)^{16}+\\cos(1)^{16}}",
    "\\boxed{((x+y)^{4})^{4}}",
    "\\boxed{(3^{100})^{100}}",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("completion", JUNK, ids=range(len(JUNK)))
def test_junk_completions_score_zero_without_raising(math_task, completion):
    for prompt in math_task.prompts():
        assert math_task.reward(prompt, completion) == 0.0


@pytest.mark.parametrize(
    ("answer", "cheap"),
    [
        ("\\frac{1}{2}", True),
        ("2^{10}", True),
        ("(2^{99})^{99}", True),
        ("\\frac{7}{3}^{999}", True),
        ("(x+1)^{16}", True),
        ("(x+1)^{17}", False),
        ("\\sqrt{2}^{17}", False),
        ("x^2+y^2+z^2", True),
        ("\\text{east}", True),
        ("3\\!", True),
        ("2^{100000}", False),
        ("(x+1)^{999}", False),
        ("a+b+c+d", False),
        ("5!", False),
        ("2^{2^{2}}", False),
        ("2^", False),
        ("\\int_0^1 x", False),
        ("1" * 101, False),
        ("\\sin x \\cos x", True),
        ("\\sin(x)\\cos(x)", True),
        ("\\sin\\cos x", False),
        ("\\log_{2}(\\ln 8)", False),
        ("((((1))))", True),
        ("((((((1))))))", False),
        ("\\{1, \\{2\\}\\}", True),
        ("\\{\\{\\{\\{\\{\\{1\\}\\}\\}\\}\\}\\}", False),
    ],
)
def test_is_cheap_to_verify(answer, cheap):
    assert is_cheap_to_verify(answer) is cheap


def corpus(name: str) -> list[str]:
    """The answers of a corpus file in tests/data (one a line, # starts a comment)."""
    return [line for line in (DATA / name).read_text().splitlines() if line.strip() and not line.startswith("#")]


HOSTILE = corpus("hostile_math_answers.txt")
HONEST = corpus("honest_math_answers.txt")


@pytest.mark.parametrize("answer", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_answers_are_refused_before_sympy_sees_them(math_task, answer):
    """Round four: \\exp(\\exp(\\exp(\\exp(\\exp(1))))) passed the guard and ran math-verify for minutes; a 13-deep
    \\sin took 6-12 s. Each such answer scores 0 without being parsed."""
    assert not is_cheap_to_verify(answer)
    for prompt in math_task.prompts():
        assert math_task.reward(prompt, f"So the answer is \\boxed{{{answer}}}.") == 0.0


@pytest.mark.parametrize("answer", HONEST, ids=range(len(HONEST)))
def test_honest_answers_of_the_math_tasks_kind_still_verify(answer):
    assert is_cheap_to_verify(answer)
    assert answers_match(_parse_latex(answer), answer)


@pytest.mark.timeout(60)
def test_a_tower_the_guard_would_miss_is_stopped_by_the_checks_cpu_budget():
    """The guard is a heuristic: on a check worker's main thread the CPU budget interrupts what it misses (here
    the tower, parsed and verified unguarded, which ran for minutes)."""
    from math_verify import verify

    gold = _parse_latex("2")
    with pytest.raises(OverBudget):
        with cpu_budget(0.5):
            verify(gold, _parse_latex(HOSTILE[0]), timeout_seconds=None)


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "busy"])
def test_a_reward_that_swallows_the_interrupt_is_interrupted_again_and_still_over_budget(busy):
    """Busy: three processes per core compete for the CPU, as on a loaded hub. A CPU interval timer (ITIMER_PROF)
    never fired there; the budget's watchdog reads the thread's CPU clock."""
    interrupts = 0
    handler = signal.getsignal(signal.SIGPROF)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1) if busy else 0)]
    try:
        with pytest.raises(OverBudget):
            with cpu_budget(0.05):
                start = time.thread_time()
                while True:
                    try:
                        # The busy loop's own back-edge, where the interpreter runs signal handlers, is inside the try.
                        while time.thread_time() - start < 1.0:
                            sum(range(1000))
                        break
                    except BaseException:  # noqa: BLE001 -- a hostile or careless reward
                        interrupts += 1
        # Over: the handler given back, and no interrupt after it, however much CPU follows.
        assert signal.getsignal(signal.SIGPROF) is handler
        after = time.thread_time()
        while time.thread_time() - after < 0.3:
            sum(range(1000))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert interrupts > 1


def test_in_a_thread_the_budget_is_measured_when_the_check_returns():
    outcome = []

    def check(spin_s: float) -> None:
        try:
            with cpu_budget(0.05):
                start = time.thread_time()
                while time.thread_time() - start < spin_s:
                    pass
            outcome.append("within")
        except OverBudget:
            outcome.append("over")

    for spin_s in (0.3, 0.0):
        thread = threading.Thread(target=check, args=(spin_s,))
        thread.start()
        thread.join(timeout=30)
    assert outcome == ["over", "within"]


def test_reward_works_in_worker_thread(math_task):
    """math-verify's default signal-based timeout raises outside the main thread; ours must not."""
    results: list[float] = []
    prompt = math_task.get("math-1")
    thread = threading.Thread(target=lambda: results.append(math_task.reward(prompt, "\\boxed{0.5}")))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0]


# --- load_task ----------------------------------------------------------------------------


def test_load_builtin_reverse():
    pytest.importorskip("shared.tasks.reverse")
    task = load_task("reverse")
    assert type(task).__name__ == "ReverseTask" and isinstance(task, Task)
    assert "reverse" in BUILTIN_TASKS


def test_load_math_spec():
    task = load_task(f"math:{MATH_FILE}")
    assert isinstance(task, MathTask) and len(task.prompts()) == 4


def test_load_module_class(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))
    task = load_task("tiny_tasks:EchoTask")
    assert task.reward(task.get("echo-0"), "hello") == 1.0
    # A task written per completion is scored a group at a time all the same.
    assert list(task.rewards(task.get("echo-0"), ["hello", "bye"])) == [1.0, 0.0]
    assert task.reward_name == "tiny_tasks:EchoTask.reward"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuch", "builtin tasks are calc, reverse"),
        ("math:", "expected 'math:PATH.jsonl'"),
        ("math:/nonexistent/problems.jsonl", "no such file"),
        (":EchoTask", "expected 'module.path:ClassName'"),
        ("tiny_tasks:", "expected 'module.path:ClassName'"),
        ("no_such_module_xyz:Foo", "cannot import module 'no_such_module_xyz'"),
        ("tiny_tasks:Missing", "has no attribute 'Missing'"),
        ("tiny_tasks:NotATask", "not a subclass"),
        ("tiny_tasks:NOT_A_CLASS", "not a subclass"),
        ("tiny_tasks:AbstractTask", "abstract (does not implement rewards)"),
        ("tiny_tasks:NeedsArgsTask", "requires arguments ['size']"),
    ],
)
def test_bad_specs_give_clear_errors(monkeypatch, spec, message):
    monkeypatch.syspath_prepend(str(DATA))
    with pytest.raises(ValueError) as info:
        load_task(spec)
    assert message in str(info.value)
    assert spec.strip() in str(info.value)
