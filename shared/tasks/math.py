"""The "math" reward: answer equivalence with math-verify, for `math:FILE.jsonl` tasks and any dataset.

Scoring extracts the completion's final answer ourselves (the content of the last complete
\\boxed{...}, else the last number such as -3, 1,000, 2.5 or 3/4) and compares it with the gold
answer via math_verify.parse/verify. math-verify's own timeouts use signal.alarm, which raises in
any thread but the main one (and the hub scores in worker threads), so they are disabled
(parsing_timeout=None, timeout_seconds=None) and the candidate is instead made cheap before sympy
sees it: at most MAX_ANSWER_CHARS characters, only whitelisted LaTeX commands, no factorials,
no nested exponents, a bounded product of exponent literals (10,000 for rational arithmetic, 16
once a variable, root or function appears), at most 3 variables, brackets nested at most
MAX_NESTING_DEPTH deep and no function (\\sin, \\exp, ...) applied to another. An answer failing the
guard scores 0.0. Within the guard's limits a comparison stays well under a second; without the guard,
answers such as (x+y+z)^{99}, 99999999! or 9^{9^{9^{9}}} hang sympy indefinitely, a tower
\\exp(\\exp(\\exp(\\exp(\\exp(1))))) ran for minutes and a 13-deep \\sin for 6-12 s (the corpus of such
answers: tests/data/hostile_math_answers.txt). The guard is a heuristic, not a proof: what it misses is
bounded by the check's CPU budget (shared/tasks/budget.py), which counts the overrun against the node.
"""

from __future__ import annotations

import re
import threading

from shared.tasks.base import Prompt

MAX_ANSWER_CHARS = 100
MAX_VARIABLES = 3
# Product of all integer literals in exponents: bounds the degree sympy may expand. Rational
# arithmetic stays cheap for huge powers (2^{10000}); anything with a variable, root or function
# does not: (x+y+z)^{99}, (\sqrt{2}+\sqrt{3}+\sqrt{5})^{1000} and \sin(1)^{1000} all hang.
MAX_EXPONENT_PRODUCT_RATIONAL = 10_000
MAX_EXPONENT_PRODUCT_OTHER = 16
# Brackets ({, (, [ and \{) open at once: an honest answer such as \left(\frac{\sqrt{3}}{2}, 1\right) needs 3;
# sympy's cost grows with every level of a nested expression (a 13-deep \sin: 6-12 s).
MAX_NESTING_DEPTH = 5
# Functions whose argument may not hold another: sympy evaluates a tower of them (\exp(\exp(\exp(...))))
# symbolically and numerically for minutes.
FUNCTION_COMMANDS = frozenset(["sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "log", "ln", "exp"])
ALLOWED_LATEX_COMMANDS = frozenset(
    [
        "frac",
        "dfrac",
        "tfrac",
        "sqrt",
        "pi",
        "cdot",
        "times",
        "div",
        "pm",
        "mp",
        "left",
        "right",
        "text",
        "textbf",
        "textrm",
        "mathrm",
        "mathbf",
        "mbox",
        "infty",
        "circ",
        "degree",
        "quad",
        "qquad",
        "le",
        "leq",
        "ge",
        "geq",
        "lt",
        "gt",
        "ne",
        "neq",
        "approx",
        "in",
        "notin",
        "cup",
        "cap",
        "setminus",
        "emptyset",
        "varnothing",
        "sin",
        "cos",
        "tan",
        "cot",
        "sec",
        "csc",
        "arcsin",
        "arccos",
        "arctan",
        "log",
        "ln",
        "exp",
        "dots",
        "ldots",
        "cdots",
        "mathbb",
        "displaystyle",
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "varepsilon",
        "theta",
        "lambda",
        "mu",
        "sigma",
        "phi",
        "varphi",
        "omega",
    ]
)
_RATIONAL_COMMANDS = frozenset(["frac", "dfrac", "tfrac", "cdot", "times", "div", "pm", "mp", "left", "right"])
# LaTeX escapes and spacing commands that are single non-letter characters after the backslash.
_ALLOWED_SYMBOL_COMMANDS = frozenset("{}%$,;:! ")

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")
_COMMAND_RE = re.compile(r"\\([A-Za-z]+|.)")
_TEXT_GROUP_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{[^{}]*\}")
_INT_RE = re.compile(r"\d+")


def _balanced_group(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at text[open_index], or None when it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None


def extract_final_answer(completion: str) -> str | None:
    """The last complete \\boxed{...} content, else the last number, else None."""
    for match in reversed(list(_BOXED_RE.finditer(completion))):
        content = _balanced_group(completion, match.end() - 1)
        if content is not None and content.strip():
            return content.strip()
    numbers = _NUMBER_RE.findall(completion)
    if numbers:
        return numbers[-1].replace(",", "").replace(" ", "")
    return None


def _exponent_groups(answer: str) -> list[str] | None:
    """The exponent text after each ^, or None when an exponent nests another ^ or is unterminated."""
    groups = []
    i = answer.find("^")
    while i >= 0:
        j = i + 1
        while j < len(answer) and answer[j] == " ":
            j += 1
        if j >= len(answer):
            return None
        if answer[j] == "{":
            group = _balanced_group(answer, j)
            if group is None or "^" in group:
                return None
            groups.append(group)
        else:
            match = _INT_RE.match(answer, j)
            groups.append(match.group() if match else answer[j])
        i = answer.find("^", j)
    return groups


_TOKEN_RE = re.compile(r"\\(?:[A-Za-z]+|.)|\s+|.", re.DOTALL)
_OPENING = frozenset(["{", "(", "[", "\\{"])  # \{ opens a set: sympy nests it as deep as any bracket
_CLOSING = frozenset(["}", ")", "]", "\\}"])


def _nesting_ok(answer: str) -> bool:
    """Brackets (set braces \\{ too) nested at most MAX_NESTING_DEPTH deep, and no function applied to another:
    none inside the bracket that opens its argument, nor as its argument (\\sin\\sin x)."""
    stack: list[bool] = []  # per open bracket: whether it holds a function's argument
    after_function = False  # the last token that was not space, \left or an exponent was a function
    tokens = _TOKEN_RE.findall(answer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token.isspace() or token == "\\left":
            continue
        if after_function and token in "^_":  # \sin^{2}(x), \log_2 8: an exponent or base, then the argument
            if i < len(tokens) and tokens[i] == "{":
                depth = 0
                while i < len(tokens):
                    depth += {"{": 1, "}": -1}.get(tokens[i], 0)
                    i += 1
                    if depth == 0:
                        break
            else:
                i += 1
            continue
        name = token[1:] if token.startswith("\\") else None
        if name in FUNCTION_COMMANDS:
            if after_function or any(stack):
                return False
            after_function = True
            continue
        if token in _OPENING:
            stack.append(after_function)
            if len(stack) > MAX_NESTING_DEPTH:
                return False
        elif token in _CLOSING and stack:
            stack.pop()
        after_function = False
    return True


def is_cheap_to_verify(answer: str) -> bool:
    """Whether sympy can parse and compare `answer` in bounded time (see the module docstring)."""
    if len(answer) > MAX_ANSWER_CHARS or "**" in answer or not _nesting_ok(answer):
        return False
    commands = _COMMAND_RE.findall(answer)
    if any(c not in ALLOWED_LATEX_COMMANDS and c not in _ALLOWED_SYMBOL_COMMANDS for c in commands):
        return False
    if "!" in answer.replace("\\!", ""):
        return False
    groups = _exponent_groups(answer)
    if groups is None:
        return False
    product = 1
    for group in groups:
        for literal in _INT_RE.findall(group):
            product *= max(1, int(literal))
    plain = _COMMAND_RE.sub(" ", _TEXT_GROUP_RE.sub(" ", answer))
    variables = {c for c in plain if c.isalpha()}
    if len(variables) > MAX_VARIABLES:
        return False
    rational = not variables and all(c in _RATIONAL_COMMANDS or c in _ALLOWED_SYMBOL_COMMANDS for c in commands)
    return product <= (MAX_EXPONENT_PRODUCT_RATIONAL if rational else MAX_EXPONENT_PRODUCT_OTHER)


def _parse_latex(answer: str) -> list:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"${answer}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def answers_match(gold: list, candidate: str) -> bool:
    """Whether `candidate` (an extracted answer) is equivalent to the parsed gold; False on any failure."""
    from math_verify import verify

    if not is_cheap_to_verify(candidate):
        return False
    try:
        parsed = _parse_latex(candidate)
        return bool(parsed) and bool(verify(gold, parsed, timeout_seconds=None))
    except Exception:  # noqa: BLE001 -- math-verify/sympy raise many unrelated types on junk; junk scores 0
        return False


class MathReward:
    """1.0 iff a completion's final answer is equivalent to the prompt's gold answer; gold answers are
    parsed once and cached (scoring runs in several worker threads)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._gold: dict[str, list] = {}
        self._gold_lock = threading.Lock()

    def _parsed_gold(self, prompt: Prompt) -> list:
        with self._gold_lock:
            gold = self._gold.get(prompt.id)
        if gold is None:
            gold = _parse_latex(prompt.answer or "")
            if not gold:
                raise ValueError(f"{self.source}: gold answer {prompt.answer!r} of {prompt.id} does not parse")
            with self._gold_lock:
                self._gold[prompt.id] = gold
        return gold

    def score(self, prompt: Prompt, completion: str) -> float:
        gold = self._parsed_gold(prompt)
        candidate = extract_final_answer(completion)
        if candidate is None:
            return 0.0
        return 1.0 if answers_match(gold, candidate) else 0.0
