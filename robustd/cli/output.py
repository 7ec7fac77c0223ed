"""Everything robustctl writes goes through here: terminal-safe text, and a reader that goes away.

`robustctl ... | head -c 10` closes the pipe while robustctl may still be writing. Like other Unix
tools robustctl then says nothing, but it does not die of SIGPIPE: Python ignores that signal, and
turning it back on would also kill robustctl when a gRPC peer hangs up mid-write. Instead a write
that fails with EPIPE points the stream at /dev/null (so no later write, and no flush at exit, can
fail or print "Exception ignored") and reports the reader gone. The verb runs to its end and keeps
its exit status: a broken pipe never turns `status`'s CRITICAL into OK or an error, whether or not
the reader happened to take the output before it left. Only `watch`, which never ends by itself,
stops when nobody reads it.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from robustd.cli.render import plain, printable, terminal


def out(text: str, *, exact: bool = False, colour: bool = False) -> bool:
    """Print one block of output on stdout; False when stdout's reader is gone.

    Human text passes `terminal` as a last line of defence (its renderers already escaped each
    field); `exact=True` is for JSON, which is ASCII with its own escapes and must stay the data.
    `colour=True` lets through the severity colours render.paint added, and only when everything
    else in the block is already terminal-safe; otherwise the whole block is escaped, colours and all
    (a renderer forgot a field: the operator sees every escape, none acts).
    """
    if exact:
        return write(text + "\n", sys.stdout)
    if colour:
        bare = plain(text)
        return write((text if terminal(bare) == bare else terminal(text)) + "\n", sys.stdout)
    return write(terminal(text) + "\n", sys.stdout)


def width(wide: bool = False, stream: IO[str] | None = None) -> int | None:
    """How wide a table may be, for every table robustctl prints; None: never cut a cell.

    `--wide` never cuts. Otherwise COLUMNS, when set, is the width asked for (as for ls); else a terminal's
    own width; else (a pipe, a file) None: nobody's screen limits it, so `status | grep` sees whole messages.
    """
    if wide:
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def use_colour(stream: IO[str]) -> bool:
    """Colour only for a person: `stream` is a terminal, NO_COLOR (https://no-color.org) is unset or
    empty, and TERM is not `dumb`. Pipes, files and `watch | grep` get plain text."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def err(line: str, *, end: str = "\n", cr: bool = False) -> bool:
    """One line on stderr, outside text in it escaped (gRPC status details come from the server).

    `cr` starts the line with a carriage return that redraws a progress line on a terminal.
    """
    return write(("\r" if cr else "") + printable(line) + end, sys.stderr)


def write(text: str, stream: IO[str]) -> bool:
    """Write and flush; on EPIPE send `stream` to /dev/null and return False, printing nothing."""
    try:
        stream.write(text)
        stream.flush()
        return True
    except BrokenPipeError:
        discard(stream)
        return False


def discard(stream: IO[str]) -> None:
    """Point the stream's file descriptor at /dev/null: what is still buffered, and any later write, vanish."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
