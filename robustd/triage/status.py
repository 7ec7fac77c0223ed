"""A job's exit status as every edge hands it to the judge: an exit code 0..255 and a signal's `SIG...` name.

One place for the rules, used by `robustctl triage`, `Diagnostics.Triage` and the Slurm epilog, so all
three mean the same thing. A negative code (Python's `-9` for a child killed by SIGKILL) is refused
rather than guessed at: such a process has no exit code, only a signal. Signals are Linux's names
(aliases such as SIGIOT give the usual name, SIGABRT), numbers 1..64, and real-time ones as `kill -l`
names them (SIGRTMIN+n / SIGRTMAX-n).
"""

from __future__ import annotations

import contextlib
import signal as _signal

from robustd import bounds

MAX_SIGNAL_TEXT = 32


def exit_code(value: int | None) -> int | None:
    """An exit code as shells and schedulers report it, 0..255; None: not given. ValueError otherwise."""
    if value is None:
        return None
    if value < 0:
        raise ValueError(f"exit code {value} is negative: a process killed by a signal has no exit code; "
                         f"give the signal instead (e.g. {_example(-value)})")
    if value > 255:
        raise ValueError(f"exit code {value} is out of range (0..255)")
    return value


def _example(n: int) -> str:
    try:
        return signal_name(str(n)) or "SIGKILL"
    except ValueError:
        return "SIGKILL"


def signal_name(text: str | int | None) -> str | None:
    """"SIGKILL" for "SIGKILL", "KILL", "kill", "9"; None for "" or None; ValueError (quoting it) otherwise."""
    value = "" if text is None else str(text).strip()
    if not value:
        return None
    if len(value) > MAX_SIGNAL_TEXT:
        raise ValueError(f"unknown signal {bounds.echo(value)}")
    rtmin, rtmax = int(_signal.SIGRTMIN), int(_signal.SIGRTMAX)
    if value.isascii() and value.isdigit():
        n = int(value)
        if rtmin < n < rtmax:
            return f"SIGRTMIN+{n - rtmin}" if n - rtmin <= (rtmax - rtmin) // 2 else f"SIGRTMAX-{rtmax - n}"
        try:
            return _signal.Signals(n).name
        except ValueError:
            raise ValueError(f"unknown signal {bounds.echo(value)}: not a signal number "
                             f"(1..{rtmax}, as `kill -l` lists them)") from None
    name = value.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    for base, sign in (("SIGRTMIN+", 1), ("SIGRTMAX-", -1)):
        if name.startswith(base) and name[len(base):].isdigit() and 0 < int(name[len(base):]) < rtmax - rtmin:
            return signal_name(str((rtmin if sign > 0 else rtmax) + sign * int(name[len(base):])))
    member = _signal.Signals.__members__.get(name)
    if member is None:
        raise ValueError(f"unknown signal {bounds.echo(value)} (a name such as SIGKILL, KILL or SIGSEGV, "
                         "or a number)")
    return member.name


def exit_signal(code: int | None, signal: str | None) -> str | None:
    """The signal that ended the job: the one named, or a shell's 128+N exit status."""
    sig = signal_name(signal)
    if sig is None and code is not None and 128 < code < 128 + 65:
        with contextlib.suppress(ValueError):
            sig = signal_name(str(code - 128))
    return sig
