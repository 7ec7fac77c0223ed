"""robustctl on a terminal and off it: severities in colour only for a person, NO_COLOR honoured, --wide.

A real pty (pty.openpty) stands in for the operator's terminal, so robustctl's own isatty() decides;
the same commands with stdout on a pipe must print no escape sequence at all. Kernel text with control
characters stays escaped whether or not the severities are coloured.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest
from conftest import REPO, Daemon, inject_kmsg

from robustd.api.v1 import robustd_pb2 as pb
from robustd.cli import output, render

ROBUSTCTL = [sys.executable, "-m", "robustd.cli.robustctl"]
RED = "\x1b[1;31mCRITICAL\x1b[0m"
SGR = re.compile(r"\x1b\[[0-9;]*m")
COMPONENT = "gpu/0000:e6:00.0"
# The detail of an Xid line, copied into the condition's message: a colour change and a window title.
HOSTILE = "GPU has \x1b[32mfallen\x1b]0;pwned\x07 off the bus; " + "long detail " * 12
HOSTILE_SHOWN = r"GPU has \x1b[32mfallen\x1b]0;pwned\x07 off the bus;"


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    return {**base, "COLUMNS": "250", "TERM": "xterm-256color", **extra}


def on_pty(cmd: Sequence[str], environ: dict[str, str], until: str | None = None, timeout: float = 60) -> str:
    """Run `cmd` with stdout and stderr on a new pty; its output (CRLF made LF).

    With `until`, stop the command (SIGTERM) once that text has appeared: for `watch`, which never ends.
    """
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=environ, cwd=REPO)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the pty has closed it
                break
            if not data:
                break
            out += data
            if until is not None and until in out.decode(errors="replace"):
                proc.terminate()
                until = None
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    return out.decode(errors="replace").replace("\r\n", "\n")


def piped(cmd: Sequence[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, cwd=REPO, timeout=60,
                          stdin=subprocess.DEVNULL)


def unsafe_outside_our_colours(text: str) -> list[str]:
    """Escape and control characters left once robustctl's own severity colours are taken out."""
    return [f"U+{ord(ch):04X}" for ch in SGR.sub("", text) if ch != "\n" and (ord(ch) < 0x20 or ord(ch) == 0x7f)]


@pytest.fixture
def critical(daemon: Daemon) -> Daemon:
    inject_kmsg(f"NVRM: Xid (PCI:0000:e6:00): 79, pid=1, name=python, {HOSTILE}")
    daemon.wait_for(lambda v: any(c.component == COMPONENT for c in v.conditions))
    return daemon


@pytest.mark.parametrize("verb", ["status", "events"])
def test_severity_is_coloured_on_a_terminal_only(critical: Daemon, verb: str) -> None:
    cmd = [*ROBUSTCTL, "--socket", critical.socket, verb]
    shown = on_pty(cmd, env())
    row = next(line for line in shown.splitlines() if COMPONENT in line)
    assert RED in row, shown  # the severity, in red, on the condition's row
    assert HOSTILE_SHOWN in row and unsafe_outside_our_colours(shown) == [], shown  # kernel text still escaped
    assert set(SGR.findall(shown)) == {"\x1b[1;31m", "\x1b[0m"}, shown  # nothing but our red, then reset

    r = piped(cmd, env())  # a pipe: no colour at all
    assert "\x1b" not in r.stdout and "CRITICAL" in r.stdout and HOSTILE_SHOWN in r.stdout, r.stdout

    plain = on_pty(cmd, env(NO_COLOR="1"))  # https://no-color.org: any non-empty value
    assert "\x1b" not in plain and "CRITICAL" in plain and HOSTILE_SHOWN in plain, plain


def test_watch_colours_on_a_terminal_and_escapes_kernel_text(critical: Daemon) -> None:
    shown = on_pty([*ROBUSTCTL, "--socket", critical.socket, "watch"], env(), until=COMPONENT)
    line = next(line for line in shown.splitlines() if COMPONENT in line)
    assert RED in line and HOSTILE_SHOWN in line and unsafe_outside_our_colours(line) == [], line
    plain = on_pty([*ROBUSTCTL, "--socket", critical.socket, "watch"], env(NO_COLOR="yes"), until=COMPONENT)
    assert "\x1b" not in plain and COMPONENT in plain, plain


def test_wide_prints_the_whole_message(critical: Daemon) -> None:
    full = "off the bus; " + "long detail " * 11 + "long detail"
    for verb in ("status", "events"):
        cut = piped([*ROBUSTCTL, "--socket", critical.socket, verb], env())
        row = next(line for line in cut.stdout.splitlines() if COMPONENT in line)
        assert row.endswith("...") and len(row) <= 250 and full not in row, row
        wide = piped([*ROBUSTCTL, "--socket", critical.socket, verb, "--wide"], env())
        row = next(line for line in wide.stdout.splitlines() if COMPONENT in line)
        assert row.endswith(full) and len(row) > 250, row


def test_coloured_renderers_still_escape_and_a_forgotten_field_loses_the_colour(
        capsys: pytest.CaptureFixture[str]) -> None:
    evil = "e\x1b[1;31m\x1b]0;t\x07\n\u202e"  # raw SGR too: it must not pass as one of ours
    cond = pb.Condition(component="gpu/" + evil, code="C" + evil, severity=pb.SEVERITY_WARNING, message=evil)
    verdict = pb.Verdict(node=evil, severity=pb.SEVERITY_WARNING, conditions=[cond])
    event = pb.Event(seq=1, condition=cond)
    for text in (render.verdict_text(verdict, 0.0, None, colour=True), render.event_line(event, colour=True),
                 render.events_text(pb.ListEventsResponse(events=[event]), None, colour=True)):
        assert "\x1b[33mWARNING\x1b[0m" in text
        assert unsafe_outside_our_colours(text) == [] and r"e\x1b[1;31m\x1b]0;t\x07\n\u202e" in text, repr(text)
        output.out(text, colour=True)
        assert capsys.readouterr().out == text + "\n"  # printed as rendered

    output.out("\x1b[33mWARNING\x1b[0m  " + evil, colour=True)  # a field a renderer forgot to escape
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and shown.startswith(r"\x1b[33mWARNING\x1b[0m  e\x1b[1;31m\x1b]0;t"), repr(shown)
