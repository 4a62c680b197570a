"""The command lines' parser: argparse whose unknown flag is one line, with the closest known flag, and exit 2.

`echo-hub` and `echo-node` build their parsers (and so their subcommands' parsers) from `FlagParser`; each
subcommand's help ends with an example of it (`EXAMPLE_FORMAT` keeps its line breaks).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

# A subcommand's help keeps its example's line breaks.
EXAMPLE_FORMAT = argparse.RawDescriptionHelpFormatter


# How alike a name and a known one must be (difflib's ratio, leading dashes left out) to be offered: a typo is
# (--learnin-rate 0.96, --hubb 0.86, statsu 0.83); another word is not (--quiet and --beta 0.44, --dry-run and
# --lora-rank 0.5), and naming it would mislead.
CLOSE_RATIO = 0.7


def closest(name: str, known: Sequence[str]) -> str | None:
    """The known name `name` most likely meant: itself with dashes for underscores, else the closest spelling
    (CLOSE_RATIO), else None."""
    dashed = name.replace("_", "-")
    if dashed in known:
        return dashed
    bare = {k.lstrip("-"): k for k in known}
    found = difflib.get_close_matches(dashed.lstrip("-"), list(bare), n=1, cutoff=CLOSE_RATIO)
    return bare[found[0]] if found else None


def unknown_flag_message(extras: Sequence[str], known: Sequence[str]) -> str:
    """One line on the first argument argparse could not place, with the closest known flag when there is one."""
    flag = next((arg for arg in extras if arg.startswith("-")), None)
    if flag is None:
        return f"unexpected argument {extras[0]!r}; see --help"
    name = flag.split("=", 1)[0]
    guess = closest(name, known)
    return f"unknown flag {name}; " + (f"did you mean {guess}?" if guess else "see --help")


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser `parsed` went through."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(parsed, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], parsed)
    return parser


class FlagParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose unknown flags and commands are one line naming the closest known one, and
    exit 2."""

    def _check_value(self, action, value):  # noqa: ANN001, ANN202 -- argparse's own hook for choices
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            guess = closest(value, list(action.choices))
            self.exit(
                2,
                f"{self.prog}: unknown command {value!r}; "
                + (f"did you mean {guess}?\n" if guess else f"one of {', '.join(action.choices)}\n"),
            )
        super()._check_value(action, value)

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 -- argparse's own signature
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = _chosen(self, parsed)
            known = [option for action in parser._actions for option in action.option_strings]
            self.exit(2, f"{parser.prog}: {unknown_flag_message(extras, known)}\n")
        return parsed
