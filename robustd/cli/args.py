"""argparse plumbing shared by robustctl's verbs and their sub-verbs (diag, fleet, sim)."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar

from robustd.durations import parse_duration

AddGlobals = Callable[[argparse.ArgumentParser, bool], None]
Verb = Callable[..., argparse.ArgumentParser]  # (name, help_text, example="") -> the verb's parser
T = TypeVar("T")


def examples(*commands: str) -> str:
    """An epilog of example command lines, kept as written by `--help` and the man pages."""
    return ("example:" if len(commands) == 1 else "examples:") + "".join(f"\n  {c}" for c in commands)


def verbs(parent: argparse.ArgumentParser, dest: str, add_globals: AddGlobals) -> Verb:
    """A factory of sub-commands under `parent`, each accepting the global options too.

    `example` (one command line, or several separated by newlines) becomes the verb's `--help` epilog.
    A `local` verb (it reads files, never a daemon) accepts the daemon's options, which it ignores, but its
    --help (and so the man page and completion) offers only --json of them.
    """
    sub = parent.add_subparsers(dest=dest, metavar=dest.upper(), required=True)

    def verb(name: str, help_text: str, example: str = "", local: bool = False) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=examples(*example.splitlines()) if example else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_globals(v, False)
        if local:  # still accepted (scripts pass --socket to every verb), no longer offered
            for action in v._actions:
                if action.option_strings and "--json" not in action.option_strings and action.dest != "help":
                    action.help = argparse.SUPPRESS
        return v

    return verb


def argument_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse type from a parser that raises ValueError: its message becomes the usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    return convert


# An argparse type: `500ms`, `10s`, `5m`, `1h`, `30d` → seconds (a usage error otherwise).
duration = argument_type(parse_duration, "duration")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `minimum` (a usage error otherwise)."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be " + ("zero or more" if minimum == 0
                                                                      else f"at least {minimum}"))
        return value

    convert.__name__ = "whole number"
    return convert


def positive_duration(text: str, what: str = "") -> float:
    """`duration`, more than zero; `what` names the value in the error (`timeout '0' must be ...`)."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be more than zero".lstrip())
    return value


def positive(what: str) -> Callable[[str], float]:
    """An argparse type: `positive_duration` naming `what` in its error (`--poll '0' must be ...`)."""
    def convert(text: str) -> float:
        return positive_duration(text, what)

    convert.__name__ = "duration"
    return convert
