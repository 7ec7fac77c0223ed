"""`robustctl triage`: why did this job fail, is the machine to blame, and what next — from its logs.

    robustctl triage [--exit-code N] [--signal NAME] [--tail SIZE] [--json] LOGFILE...

A pure local call (robustd.triage; no daemon, no root): each LOGFILE is read from its end, only its
last `--tail` bytes (default 1 MiB), whatever its size. A directory stands for its regular files
(sorted by name, not recursive). Anything else that is not a regular file (a pipe, `/dev/stdin`,
`<(kubectl logs ...)`) is read to its end keeping only its last `--tail` bytes. `--json` prints the
public object (class, infra, next, level, evidence, ranks, reason, partial); the text form is for
people. Exit 0 with an answer, 2 when a log cannot be read (one line naming it), 64 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from collections.abc import Sequence

from robustd.cli import exitcodes, output
from robustd.cli.args import argument_type
from robustd.triage.model import MAX_LOG_BYTES, MAX_LOGS, MAX_NAME, LogText
from robustd.triage.reader import read_log
from robustd.triage.render import to_json, to_text

EXIT_UNREADABLE = exitcodes.UNREADABLE  # a log that cannot be read
MAX_TAIL = 1 << 30  # --tail per log
_CHUNK = 1 << 16
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes, or a size with a binary unit: 512, 64K, 64KiB, 1M, 1MiB, 1G, 1GiB (K = KiB). ValueError otherwise."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, KiB, M, MiB, G or GiB)")
    value = int(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{text!r}: the tail must be at least one byte")
    if value > MAX_TAIL:
        raise ValueError(f"{text!r}: at most 1GiB of each log is read")
    return value


_size = argument_type(parse_size, "size")


def _exit_code(text: str) -> int:
    from robustd.triage.status import exit_code

    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    try:
        return exit_code(value)  # type: ignore[return-value]  # not None for an int
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _signal(text: str) -> str:
    from robustd.triage.status import signal_name

    try:
        name = signal_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if name is None:
        raise argparse.ArgumentTypeError("an empty signal name")
    return name


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("--exit-code", type=_exit_code, default=None, metavar="N",
                   help="the job's exit code, 0..255 (137: what a shell reports for a SIGKILLed child)")
    v.add_argument("--signal", type=_signal, default=None, metavar="NAME",
                   help="the signal that ended the job: SIGKILL, KILL or 9")
    v.add_argument("--tail", type=_size, default=MAX_LOG_BYTES, metavar="SIZE",
                   help="read only the last SIZE of each log (bytes, or K/KiB/M/MiB/G/GiB; default 1MiB)")
    v.add_argument("logs", nargs="+", metavar="LOGFILE",
                   help="rank logs, torchrun output, the scheduler's job output; a directory: its regular files")


def paths(args: Sequence[str]) -> list[str]:
    """The logs to read: files as given, directories as their regular files (sorted), each once."""
    out: dict[str, None] = {}
    for arg in args:
        st = os.stat(arg)  # OSError names the path: exit 2
        if stat.S_ISDIR(st.st_mode):
            for name in sorted(os.listdir(arg)):
                full = os.path.join(arg, name)
                try:
                    if stat.S_ISREG(os.stat(full).st_mode):
                        out[full] = None
                except FileNotFoundError:
                    continue  # removed meanwhile, or a dangling link: not a regular file
        else:
            out[arg] = None
        if len(out) > MAX_LOGS:
            raise ValueError(f"more than {MAX_LOGS} logs: name fewer files")
    return list(out)


def read(path: str, tail: int) -> LogText:
    """The last `tail` bytes of one log: a seek for a regular file, a bounded read to the end of anything else.

    An OSError always names the path (a failed read, EIO, carries no file name of its own).
    """
    try:
        return _read(path, tail)
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise


def _read(path: str, tail: int) -> LogText:
    with open(path, "rb") as f:
        if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return read_log(path, tail=tail)
        buf = bytearray()
        total = 0
        while chunk := f.read(_CHUNK):
            buf += chunk
            total += len(chunk)
            if len(buf) >= 2 * tail:
                del buf[:len(buf) - tail]
    if len(buf) > tail:
        del buf[:len(buf) - tail]
    offset = total - len(buf)
    return LogText(name=path[:MAX_NAME], data=bytes(buf), offset=offset, whole=offset == 0)


def run(args: argparse.Namespace) -> int:
    from robustd.triage import triage, triage_files  # the judge and its rule file: only when triaging
    from robustd.triage.rules import SHIPPED as RULES
    from robustd.triage.rules import RuleError

    files = paths(args.logs)
    try:
        if all(stat.S_ISREG(os.stat(p).st_mode) for p in files):
            # Regular files: read and scanned by worker processes when there is much to read.
            answer = triage_files(files, tail=args.tail, exit_code=args.exit_code, signal=args.signal)
        else:
            logs = [read(p, args.tail) for p in files]
            answer = triage(logs, exit_code=args.exit_code, signal=args.signal)
    except RuleError as e:  # the installed rule file is broken: a packaging fault, said in one line
        raise OSError(0, f"the triage rules cannot be used: {e.problems[0]}", RULES) from None
    if args.json:
        output.out(json.dumps(to_json(answer), indent=2), exact=True)
    else:
        output.out(to_text(answer))
    return 0
