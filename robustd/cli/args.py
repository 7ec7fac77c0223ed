"""argparse plumbing shared by robustctl's verbs and their sub-verbs (diag, fleet, sim)."""

from __future__ import annotations

import argparse
from typing import Callable

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
