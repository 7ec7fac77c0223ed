"""The host check's parsers: the mount table, PSI, meminfo and sysfs counters, pure functions of text."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import NamedTuple

_OCTAL = re.compile(r"\\([0-7]{3})")


class Mount(NamedTuple):
    source: str
    point: str
    fstype: str
    options: tuple[str, ...]

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    """The kernel writes blanks, tabs, newlines and backslashes in mount fields as \\040 etc."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """`/proc/mounts` lines (`source point fstype options dump pass`) in order; bad lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        out.append(Mount(_unescape(parts[0]), _unescape(parts[1]), parts[2], tuple(parts[3].split(","))))
    return out


def mount_for(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount a path lives on: the longest mount point above it; the last of stacked mounts wins."""
    path = os.path.normpath(path)
    best: Mount | None = None
    for m in mounts:
        point = os.path.normpath(m.point)
        if (path == point or point == os.sep or path.startswith(point + os.sep)) and (
                best is None or len(point) >= len(os.path.normpath(best.point))):
            best = m
    return best


class Psi(NamedTuple):
    avg10: float
    avg60: float
    avg300: float
    total: int


def parse_psi(text: str) -> dict[str, Psi]:
    """`some avg10=1.00 avg60=0.50 avg300=0.10 total=1234` (and `full …`) → {"some": Psi, "full": Psi}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        try:
            values = dict(p.split("=", 1) for p in parts[1:])
            out[parts[0]] = Psi(float(values["avg10"]), float(values["avg60"]), float(values["avg300"]),
                                int(values["total"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"not a PSI line: {line!r}") from e
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """`MemTotal:  1024 kB` → {"MemTotal": 1024} (kB; unitless lines such as HugePages_Total as is)."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts:
            try:
                out[key.strip()] = int(parts[0])
            except ValueError:
                continue
    return out


def parse_count(text: str) -> int:
    """A sysfs counter: decimal (`ce_count`) or hex (`ioerr_cnt` is written as `0x1f`)."""
    return int(text.strip(), 0)


class TaskStat(NamedTuple):
    """What the stuck-process scan needs of `/proc/<pid>/stat`."""

    pid: int
    comm: str
    state: str  # R, S, D, Z, T, t, X, I, …
    start: int  # field 22, clock ticks after boot: with the pid, one task (a reused pid has a new one)


def parse_task_stat(text: str) -> TaskStat:
    """`1234 (python3) D 1 … ` → TaskStat; the comm may hold blanks and `)`, so the last `)` ends it."""
    head, sep, tail = text.rpartition(")")
    pid, paren, comm = head.partition(" (")
    rest = tail.split()
    if not sep or not paren or len(rest) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    return TaskStat(int(pid), comm, rest[0], int(rest[19]))  # rest[0] is field 3, rest[19] field 22


def parse_stack(text: str, frames: int) -> list[str]:
    """`/proc/<pid>/stack` (`[<0>] request_wait_answer+0xaa/0x210`) → the first `frames` function names."""
    out = []
    for line in text.splitlines():
        symbol = line.split()[-1] if line.split() else ""
        name = symbol.partition("+")[0]
        if name:
            out.append(name)
        if len(out) >= frames:
            break
    return out
