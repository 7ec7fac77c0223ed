"""The README's code blocks, as a newcomer runs them: in order, as written, in one shell, against `make run`.

Every fenced block of README.md carries a marker on the line before its opening fence, so that a new block
has to be classified by whoever adds it:

    <!-- readme-test: run -->               each command runs, in the README's order
    <!-- readme-test: transcript -->        the lines that start with "$ " run; the rest is their output
    <!-- readme-test: skip: WHY -->         not run here, and why (a synopsis, a config file, a real cluster)

Commands run one by one in a single bash session (so `export`, `cd` and `&` behave as at a prompt), with the
working directory a scratch copy of the checkout (links to its files; its own run/ and var/) where the test
has started `make run` itself: a line `make run` is that daemon, `make test` is the suite that runs this.
A command passes when its exit status is the one its own comment documents ("exit code 2", "exit 0 OK, 1
WARNING, 2 CRITICAL": any of those), else 0, and it printed no Python traceback and no "command not found".
A command whose comment says it runs "until Ctrl-C" gets SIGINT after a few seconds, as a user would send.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!-- readme-test: (run|transcript|skip: .+) -->$")
EXIT_RE = re.compile(r"\bexits?(?: code| status)? (?=\d)([^;(]*)")  # "exit 0 OK, 1 WARNING" up to ; or (
FIXTURE_COMMANDS = ("make run", "make test")  # the test's own daemon, the suite itself
INTERRUPT_AFTER = 3.0  # seconds a command that runs until Ctrl-C is left running


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    kind: str  # run, transcript, skip: WHY, or "" (no marker)
    text: list[str]


@dataclass
class Command:
    line: int  # where it starts in README.md
    text: str  # as written (continuations joined)
    allowed: frozenset[int]

    @property
    def until_interrupted(self) -> bool:
        return "until Ctrl-C" in _comment(self.text)


def blocks(readme: str) -> list[Block]:
    out: list[Block] = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start = i
            m = MARKER.match(lines[i - 1]) if i > 0 else None
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(Block(start + 1, m.group(1) if m else "", lines[i + 1:j]))
            i = j + 1
        else:
            i += 1
    return out


def expected_codes(text: str) -> frozenset[int]:
    """The exit statuses a command's trailing comment documents; {0} when it names none."""
    comment = _comment(text)
    codes: set[int] = set()
    for m in EXIT_RE.finditer(comment):
        codes.update(int(x) for x in re.findall(r"\b\d+\b", m.group(1)))
    return frozenset(codes or {0})


def _comment(text: str) -> str:
    """The shell comment of a command line: what follows a # outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[i + 1:]
    return ""


def commands(block: Block) -> list[Command]:
    out: list[Command] = []
    pending: list[str] = []
    first = 0
    for k, raw in enumerate(block.text):
        line = raw
        if block.kind == "transcript" and not pending:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not pending:
            first = block.line + 1 + k
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        text = "\n".join(pending) if len(pending) == 1 else " ".join(p.strip() for p in pending)
        pending = []
        if text.split("#")[0].strip() in FIXTURE_COMMANDS:
            continue
        out.append(Command(first, text, expected_codes(text)))
    return out


class Session:
    """One bash, fed one command at a time; each command's output goes to its own files."""

    def __init__(self, cwd: Path, env: dict[str, str], scratch: Path):
        self.scratch = scratch
        self.n = 0
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)

    def run(self, command: Command, timeout: float) -> tuple[int | None, str, str]:
        """(exit status or None on timeout, stdout, stderr) of the command, run as typed at the prompt."""
        cmd = command.text
        if command.until_interrupted:  # the user's Ctrl-C: SIGINT to the command, its status kept
            cmd = f"timeout --preserve-status -s INT {INTERRUPT_AFTER:g} {cmd}"
        self.n += 1
        o, e, rc = (self.scratch / f"{self.n}.{x}" for x in ("out", "err", "rc"))
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{{\n{cmd}\n}} >{shlex.quote(str(o))} 2>{shlex.quote(str(e))} </dev/null\n"
                              f"echo $? >{shlex.quote(str(rc))}.tmp && mv {shlex.quote(str(rc))}.tmp "
                              f"{shlex.quote(str(rc))}\n")
        self.proc.stdin.flush()
        end = time.monotonic() + timeout
        while not rc.exists():
            if time.monotonic() > end or self.proc.poll() is not None:
                return None, _read(o), _read(e)
            time.sleep(0.05)
        return int(rc.read_text().strip() or "-1"), _read(o), _read(e)

    def close(self) -> None:
        """End the shell and whatever it left in the background (`watch &`, a job with `&`)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def problems(cmd: Command, rc: int | None, out: str, err: str) -> str | None:
    """Why a command did not run as the README says, or None."""
    if rc is None:
        return "did not finish in time"
    if "Traceback (most recent call last)" in err or "Traceback (most recent call last)" in out:
        return "printed a Python traceback"
    if "command not found" in err:
        return "a command is not installed: " + err.strip().splitlines()[-1]
    if rc not in cmd.allowed:
        return f"exit status {rc}, the README documents {sorted(cmd.allowed)}"
    return None
