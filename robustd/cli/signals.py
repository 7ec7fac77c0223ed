"""The signals that end a verb, as exceptions: SIGINT as KeyboardInterrupt, SIGTERM as `Terminated`.

Both are BaseException, so no `except Exception` swallows them and every `finally` on the way out runs —
that is where a verb cancels what it started on the daemons (`diag run`, `fleet diagnose`). A scheduler
stops a tool with SIGTERM (Slurm at an epilog's time limit, systemd at a unit's stop), an operator with
Ctrl-C: both must leave nothing running.
"""

from __future__ import annotations

import signal
from types import FrameType

EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class Terminated(BaseException):
    """SIGTERM arrived: like KeyboardInterrupt, not an Exception, so no `except Exception` swallows it."""


def stop(signum: int, frame: FrameType | None) -> None:
    """SIGINT or SIGTERM: unwind the verb. A second signal is ignored so that it cannot break the cleanup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated
