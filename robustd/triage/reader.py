"""Read a log for triage: its last `tail` bytes only, whatever its size.

A job log can be many GiB (a rank that printed a warning every step); the root cause of a
failure is near its end, so only the tail is read: one seek and one bounded read, never a scan
of the whole file. The first partial line of a tail is dropped by the judge (LogText.whole).
"""

from __future__ import annotations

import os

from robustd.triage.model import MAX_LOG_BYTES, MAX_NAME, LogText


def read_log(path: str, tail: int = MAX_LOG_BYTES, name: str | None = None) -> LogText:
    """The last `tail` bytes of `path` (OSError as the OS gives it: the caller names the file)."""
    if tail <= 0:
        raise ValueError("tail must be positive")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - tail) if size else 0
        if start:
            f.seek(start)
        data = f.read(tail)
    return LogText(name=(name or path)[:MAX_NAME], data=data, offset=start, whole=start == 0)
