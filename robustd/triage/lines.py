"""One log line as the judge sees it: who printed it (a rank prefix), when (a timestamp), what.

Launchers prefix merged output with the rank that printed it: torchrun's `[rank3]:` and
`[default3]:` (its --tee / log-line prefix), srun --label's `  3: `, mpirun --tag-output's
`[1,3]<stderr>:`, and pdsh (DeepSpeed's multi-node launcher) an IP address before any of those.
The body after the prefix is what rules match. A rank may also be named inside the line (c10's
`[PG 0 Rank 3]`, NCCL's "on rank 3", Megatron's "Rank 3:") or by the file (`rank3.log`).

Timestamps are those the usual loggers print: ISO dates (Python logging, DeepSpeed, Slurm,
torchrun's failure summary), glog/c10 (`E0501 12:34:56.789`, as ProcessGroupNCCL prints), mmengine
(`05/01 12:34:56`) and syslog (`May  1 12:34:56`). They are reduced to seconds within a year: years are missing from
glog and syslog stamps, and only the order of a job's failures matters, never the date.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(
    rb"\A(?:(?P<host>[^\s\[\]:]{1,64}:? )(?=\[(?:rank|default)[0-9]))?"  # pdsh's host, NeMo-Run's task name
    rb"(?:\[[0-9]{1,6},(?P<mpi>[0-9]{1,6})\]<std(?:out|err)>: ?"
    rb"|(?:\x20{0,6}(?P<label>[0-9]{1,6}): (?=\[(?:rank|default)[0-9]|\S))?"  # srun --label
    rb"(?:\[default(?P<local>[0-9]{1,6})\]: ?)?"  # torchrun --tee: the local rank
    rb"(?:\[rank(?P<rank>[0-9]{1,6})\]: ?)?)")  # torch >= 2.4 (TORCH_LOGS prefix): the global rank
_IN_LINE_RANK = re.compile(
    rb"\[(?:PG [^\]]{0,120}?)?Rank (?P<a>[0-9]{1,6})\]|\bon rank (?P<b>[0-9]{1,6})\b|\bRank (?P<c>[0-9]{1,6}):"
    rb"|\brank *[:=] *(?P<d>[0-9]{1,6})\b|\[rank(?P<e>[0-9]{1,6})\]|\btask (?P<f>[0-9]{1,6}): "
    rb"|\blocal_rank: (?P<g>[0-9]{1,6})\b")  # srun's task id is the rank; torchrun's local rank is all there is
_FILE_RANK = re.compile(r"(?:^|[^a-z])rank[_-]?([0-9]{1,6})(?:[^0-9]|$)", re.IGNORECASE)
_ANSI = re.compile(rb"\x1b\[[0-9;?]{0,32}[A-Za-z]")

_ISO = re.compile(rb"(?<![0-9])[0-9]{4}-([0-9]{2})-([0-9]{2})[T _]([0-9]{2}):([0-9]{2}):([0-9]{2})"
                  rb"(?:[.,]([0-9]{1,9}))?")
_GLOG = re.compile(rb"(?:\A|[\[\s])[IWEF]([0-9]{2})([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?")
_MMDD = re.compile(rb"(?<![0-9/])([0-9]{2})/([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2})(?![0-9])")  # mmengine
_SYSLOG = re.compile(rb"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) {1,2}([0-9]{1,2}) "
                     rb"([0-9]{2}):([0-9]{2}):([0-9]{2})")
_MONTHS = {m: i for i, m in enumerate(b"Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
STAMP_WINDOW = 120  # bytes of a body searched for a timestamp: loggers put it in front


def split_prefix(line: bytes) -> tuple[bytes, int | None, bytes]:
    """(the launcher's prefix, the rank it names or None, the body after it)."""
    return split_prefix_weighted(line)[:3]


def split_prefix_weighted(line: bytes) -> tuple[bytes, int | None, bytes, int]:
    """split_prefix and the rank's weight: 2 for a global rank, 1 for a local rank or srun's label."""
    m = _PREFIX.match(line)
    if not m or not m.end():
        return b"", None, line, 0
    global_rank = m.group("rank") or m.group("mpi")
    r = global_rank or m.group("local") or m.group("label")
    return line[:m.end()], (int(r) if r is not None else None), line[m.end():], (2 if global_rank else 1)


def clean(body: bytes) -> bytes:
    """The body without terminal colours and a trailing CR (what rules match)."""
    if b"\x1b" in body:
        body = _ANSI.sub(b"", body)
    return body.rstrip(b"\r")


def rank_in(body: bytes) -> tuple[int, int] | None:
    """(rank, weight) named inside a line: weight 2 for a global rank, 1 for srun's task or a local rank."""
    m = _IN_LINE_RANK.search(body)
    if not m:
        return None
    name = m.lastgroup or ""
    return int(m.group(name)), (1 if name in ("f", "g") else 2)


def rank_of_file(name: str) -> int | None:
    m = _FILE_RANK.search(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def _seconds(month: int, day: int, h: bytes, m: bytes, s: bytes, frac: bytes | None) -> float | None:
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    hh, mm, ss = int(h), int(m), int(s)
    if hh > 23 or mm > 59 or ss > 60:
        return None
    f = int(frac) / 10 ** len(frac) if frac else 0.0
    return ((month * 32 + day) * 86400 + hh * 3600 + mm * 60 + ss) + f


def stamp(body: bytes) -> float | None:
    """Seconds within a year of the first timestamp near the line's start, or None."""
    head = body[:STAMP_WINDOW]
    if not any(c in head for c in (b":",)):
        return None
    m = _ISO.search(head)
    if m:
        return _seconds(int(m.group(1)), int(m.group(2)), *m.group(3, 4, 5, 6))
    m = _GLOG.search(head)
    if m:
        return _seconds(int(m.group(1)), int(m.group(2)), *m.group(3, 4, 5, 6))
    m = _MMDD.search(head)
    if m:
        return _seconds(int(m.group(1)), int(m.group(2)), *m.group(3, 4, 5), None)
    m = _SYSLOG.search(head)
    if m:
        return _seconds(_MONTHS[m.group(1)], int(m.group(2)), *m.group(3, 4, 5), None)
    return None
