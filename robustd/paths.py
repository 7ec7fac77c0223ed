"""Path-valued config fields, made absolute once, when the config is loaded.

A relative path in robustd.yaml (`state_dir: ./var` in the dev configs) means "relative to where
robustd was started". Resolving it at load, not at each use, keeps that meaning when something
else interprets the string later: a `file://` rendezvous URL built from `./var` parses as `/var`,
and a child process started in another working directory would look somewhere else.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import AfterValidator


def absolute(path: str) -> str:
    """`path` made absolute against the current working directory (`~` is not expanded).

    An empty value is refused: it names no file, and resolved it would silently mean the working directory
    (`kmsg_path: ""` would stream from wherever robustd was started)."""
    if not path:
        raise ValueError("an empty path names no file")
    return os.path.abspath(path)


def absolute_if_path(command: str) -> str:
    """A value with a `/` is a path and is made absolute; a bare name (looked up later, e.g. on $PATH) stays."""
    if not command:
        raise ValueError("an empty name names no program")
    return absolute(command) if "/" in command else command


AbsPath = Annotated[str, AfterValidator(absolute)]
"""A file or directory path; relative ones are resolved against the working directory at load."""

NameOrPath = Annotated[str, AfterValidator(absolute_if_path)]
"""A program or handle name (looked up on $PATH or in its directory when used), or a path, resolved like AbsPath."""
