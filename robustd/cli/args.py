"""argparse plumbing shared by robustctl's verbs and their sub-verbs (diag, fleet, sim)."""

from __future__ import annotations

import argparse
from typing import Callable

from robustd.durations import parse_duration

AddGlobals = Callable[[argparse.ArgumentParser, bool], None]
Verb = Callable[[str, str], argparse.ArgumentParser]


def verbs(parent: argparse.ArgumentParser, dest: str, add_globals: AddGlobals) -> Verb:
    """A factory of sub-commands under `parent`, each accepting the global options too."""
    sub = parent.add_subparsers(dest=dest, metavar=dest.upper(), required=True)

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help_text, description=help_text)
        add_globals(v, False)
        return v

    return verb


def duration(text: str) -> float:
    """An argparse type: `500ms`, `10s`, `5m`, `1h`, `30d` → seconds (a usage error otherwise)."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_duration(text: str, what: str = "") -> float:
    """`duration`, more than zero; `what` names the value in the error (`timeout '0' must be ...`)."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be more than zero".lstrip())
    return value
