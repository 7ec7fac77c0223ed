"""A real ring-buffer overrun: the reader gets EPIPE, counts it, and keeps reading."""

from __future__ import annotations

import os
import uuid

from conftest import KMSG, need_root

from checks.kernel.kmsg import KmsgReader


def _oldest_seq() -> int:
    with KmsgReader(KMSG) as r:
        first = r.read_available()[:1]
    return first[0].seq if first else -1


def _write(line: str) -> None:
    # One open per line: the kernel rate-limits writes per open file (printk_devkmsg=ratelimit).
    fd = os.open(KMSG, os.O_WRONLY)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def test_reader_survives_epipe_when_the_ring_wraps_past_it() -> None:
    need_root("flooding /dev/kmsg")
    token = uuid.uuid4().hex
    with KmsgReader(KMSG) as reader:  # positioned at the oldest record; we do not read yet
        start = _oldest_seq()
        filler = f"robustd-test overrun filler {token} " + "x" * 800
        for i in range(100_000):  # stop as soon as the ring has dropped our position
            _write(f"{filler} {i}")
            if i % 256 == 255 and _oldest_seq() > start:
                break
        else:
            raise AssertionError("the kernel ring never wrapped after 80 MB of lines")
        _write(f"robustd-test overrun end {token}")
        got = reader.read_available()
    assert reader.overruns >= 1
    assert got and got[0].seq > start
    assert got[-1].message == f"robustd-test overrun end {token}"  # nothing after the overrun is lost
    seqs = [r.seq for r in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
