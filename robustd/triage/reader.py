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
        return read_tail(f.fileno(), tail, name or path)


def read_tail(fd: int, tail: int, name: str) -> LogText:
    """The last `tail` bytes of the regular file open on `fd` (left open), as log `name`.

    For callers that must open the file their own way (the Slurm epilog opens a job's log as root
    only through a checked O_PATH descriptor).
    """
    size = os.fstat(fd).st_size
    start = max(0, size - tail)
    chunks, pos = [], start
    while pos < start + tail:
        chunk = os.pread(fd, start + tail - pos, pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return LogText(name=name[:MAX_NAME], data=b"".join(chunks), offset=start, whole=start == 0)
