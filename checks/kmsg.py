"""Reading /dev/kmsg: one record per read(2), pushed by the kernel, no polling.

The record format is `prio,seq,ts_usec,flags[,...];message\n` followed by optional dictionary
lines that start with a space. Non-printable bytes in the message arrive escaped as `\\xNN`
(a multi-line printk therefore arrives as one record with `\\x0a` inside). Timestamps follow the
kernel's local_clock, which tracks CLOCK_MONOTONIC (not wall time, not suspend-inclusive).
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, replace

# One record is at most ~8 KiB of text plus dictionary; a short buffer makes read(2) fail EINVAL.
READ_SIZE = 65536
# A continuation fragment ('c') is held this long for its '+' pieces before it is let through.
FRAGMENT_HOLD_S = 1.0

_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    """One logical kernel log record."""

    seq: int
    ts_usec: int  # microseconds since boot, CLOCK_MONOTONIC-like
    facility: int  # 0 kernel, 1 user (lines written to /dev/kmsg by programs), ...
    level: int  # 0 emerg .. 7 debug
    message: str  # unescaped; may contain "\n" for multi-line printks
    flags: str = "-"  # '-' complete, 'c' starts a continuation, '+' continues one

    def lines(self) -> list[str]:
        """The message split into lines, as a multi-line rule sees them."""
        return self.message.split("\n")


def unescape(text: bytes) -> str:
    """Undo the kernel's `\\xNN` escaping; invalid UTF-8 is replaced, never fatal."""
    return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), text).decode("utf-8", "replace")


def parse_record(raw: bytes) -> KmsgRecord | None:
    """Parse one record as read(2) returns it; None if it is not in kmsg form."""
    first = raw.split(b"\n", 1)[0]  # dictionary lines (" KEY=value") follow the first newline
    head, sep, body = first.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    try:
        prio, seq, ts = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    flag = fields[3][:1].decode("ascii", "replace") or "-"
    return KmsgRecord(seq=seq, ts_usec=ts, facility=prio >> 3, level=prio & 7,
                      message=unescape(body), flags=flag)


class Joiner:
    """Joins continuation fragments (older kernels: 'c' then '+' records) into one record.

    A 'c' record is held until a record that is not '+' arrives, or until `flush`; the
    joined record keeps the first fragment's timestamp and the last fragment's seq.
    """

    def __init__(self) -> None:
        self._pending: KmsgRecord | None = None
        self.since = 0.0  # time.monotonic() when the held fragment arrived

    @property
    def holding(self) -> bool:
        return self._pending is not None

    def add(self, rec: KmsgRecord) -> list[KmsgRecord]:
        """Records complete now that `rec` arrived (zero, one or two)."""
        if rec.flags == "+" and self._pending is not None:
            p = self._pending
            self._pending = replace(p, seq=rec.seq, message=p.message + rec.message)
            return []
        out = self.flush()
        if rec.flags == "c":
            self._pending, self.since = rec, time.monotonic()
        else:
            out.append(replace(rec, flags="-") if rec.flags == "+" else rec)
        return out

    def flush(self) -> list[KmsgRecord]:
        if self._pending is None:
            return []
        rec, self._pending = self._pending, None
        return [replace(rec, flags="-")]


class KmsgReader:
    """A non-blocking reader of a kmsg device, positioned at the oldest record still held.

    `read_available` drains what is there now; pair `fileno()` with `loop.add_reader` to be
    woken as records arrive. An overrun (EPIPE: the ring wrapped past us) is counted in
    `overruns` and reading goes on from the oldest available record.
    """

    def __init__(self, path: str):
        self.path = path
        self.overruns = 0
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._joiner = Joiner()

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: reader is closed")
        return self._fd

    def read_available(self) -> list[KmsgRecord]:
        """Every record readable now (until EAGAIN), continuation fragments joined."""
        fd = self.fileno()
        out: list[KmsgRecord] = []
        while True:
            try:
                raw = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self.overruns += 1
                continue
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    break
                raise
            if not raw:
                break
            rec = parse_record(raw)
            if rec is not None:
                out += self._joiner.add(rec)
        if self._joiner.holding and time.monotonic() - self._joiner.since >= FRAGMENT_HOLD_S:
            out += self._joiner.flush()
        return out

    @property
    def holding(self) -> bool:
        """True while a continuation fragment waits for its '+' pieces."""
        return self._joiner.holding

    def flush(self) -> list[KmsgRecord]:
        """Release a held continuation fragment (call when no more fragments are expected)."""
        return self._joiner.flush()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> KmsgReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
