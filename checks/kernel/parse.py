"""The kernel check's parser of /dev/kmsg records (`prio,seq,ts_usec,flags;message`), a pure function of bytes.

Non-printable bytes in the message arrive escaped as `\\xNN` (a multi-line printk therefore arrives
as one record with `\\x0a` inside); the record's dictionary lines (starting with a space) are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
