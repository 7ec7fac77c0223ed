"""argparse plumbing shared by robustctl's verbs and their sub-verbs (diag, fleet, sim)."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar

from robustd.durations import parse_duration

AddGlobals = Callable[[argparse.ArgumentParser, bool], None]
Verb = Callable[[str, str], argparse.ArgumentParser]
T = TypeVar("T")


def verbs(parent: argparse.ArgumentParser, dest: str, add_globals: AddGlobals) -> Verb:
    """A factory of sub-commands under `parent`, each accepting the global options too."""
    sub = parent.add_subparsers(dest=dest, metavar=dest.upper(), required=True)

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help_text, description=help_text)
        add_globals(v, False)
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


def positive_duration(text: str, what: str = "") -> float:
    """`duration`, more than zero; `what` names the value in the error (`timeout '0' must be ...`)."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be more than zero".lstrip())
    return value
