"""Reading /dev/kmsg: one record per read(2), pushed by the kernel, no polling.

The record format is `prio,seq,ts_usec,flags[,...];message\n` followed by optional dictionary
lines that start with a space (`checks/kernel/parse.py` reads one; this module joins continuation
fragments and keeps the reader's place). Timestamps follow the kernel's local_clock, which tracks
CLOCK_MONOTONIC (not wall time, not suspend-inclusive).

Sequence numbers are consecutive, one per record. When a reader falls behind, the kernel's ring
overwrites records it has not read yet and the next read(2) fails EPIPE; the reader then goes on
from the oldest record still held. The gap in the sequence numbers says exactly how many records
were lost, and the reader keeps that as `Overrun`s for its owner to report.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from dataclasses import dataclass, replace

from checks.kernel.parse import KmsgRecord, parse_record

# One record is at most ~8 KiB of text plus dictionary; a short buffer makes read(2) fail EINVAL.
READ_SIZE = 65536
# A continuation fragment ('c') is held this long for its '+' pieces before it is let through.
FRAGMENT_HOLD_S = 1.0
# A joined continuation stops growing here (8x the kernel's 1,024-byte record): '+' records
# that keep coming must not make one message without bound.
MAX_JOINED_CHARS = 8192
# Overruns kept for `take_overruns` when nobody takes them; the counters go on counting.
MAX_PENDING_OVERRUNS = 64


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
            message = (p.message + rec.message)[:MAX_JOINED_CHARS]
            self._pending = replace(p, seq=rec.seq, message=message)
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


@dataclass(frozen=True)
class Overrun:
    """One gap in what a reader saw: the records between `after_seq` and `next_seq` are gone."""

    after_seq: int  # the last record read before the gap; -1 if none had been read yet
    next_seq: int  # the first record read after it

    @property
    def lost(self) -> int | None:
        """How many records were overwritten unread; None when nothing had been read before."""
        return max(0, self.next_seq - self.after_seq - 1) if self.after_seq >= 0 else None


class KmsgReader:
    """A non-blocking reader of a kmsg device, positioned at the oldest record still held.

    `read_available` drains what is there now; pair `fileno()` with `loop.add_reader` to be
    woken as records arrive. An overrun (EPIPE, or any gap in the sequence numbers: the ring
    wrapped past us) is counted in `overruns`, the records it cost in `records_lost`, it is
    queued for `take_overruns`, and reading goes on from the oldest available record.
    """

    def __init__(self, path: str):
        self.path = path
        self.overruns = 0  # gaps seen since open
        self.records_lost = 0  # records those gaps cost (where the count is known)
        self.last_seq = -1  # seq of the last record read
        self._broken = False  # EPIPE seen; the next record read closes the gap
        self._overruns: deque[Overrun] = deque(maxlen=MAX_PENDING_OVERRUNS)  # the counters keep the rest
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._joiner = Joiner()

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: reader is closed")
        return self._fd

    def read_available(self, limit: int | None = None) -> list[KmsgRecord]:
        """Every record readable now (until EAGAIN, or `limit` records read), fragments joined.

        With a `limit` the device stays readable when there is more, so an event loop calls
        again after its other work: a flood of records never holds the loop for long.
        """
        fd = self.fileno()
        out: list[KmsgRecord] = []
        n = 0
        while limit is None or n < limit:
            try:
                raw = self._read(fd)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self._broken = True
                continue
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    break
                raise
            if not raw:
                break
            n += 1
            rec = parse_record(raw)
            if rec is not None:
                self._note_seq(rec.seq)
                out += self._joiner.add(rec)
        if self._joiner.holding and time.monotonic() - self._joiner.since >= FRAGMENT_HOLD_S:
            out += self._joiner.flush()
        return out

    def _read(self, fd: int) -> bytes:
        """One record as read(2) returns it (a seam for tests that script EPIPE)."""
        return os.read(fd, READ_SIZE)

    def _note_seq(self, seq: int) -> None:
        """Count a gap before `seq`, if there is one; a seq at or below the last is a re-read."""
        if self._broken or (self.last_seq >= 0 and seq > self.last_seq + 1):
            gap = Overrun(after_seq=self.last_seq, next_seq=seq)
            self._overruns.append(gap)
            self.overruns += 1
            self.records_lost += gap.lost or 0
            self._broken = False
        self.last_seq = max(self.last_seq, seq)

    def take_overruns(self) -> list[Overrun]:
        """The overruns noticed since the last call, oldest first."""
        out = list(self._overruns)
        self._overruns.clear()
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
