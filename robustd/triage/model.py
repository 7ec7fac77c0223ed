"""What a triage reads and what it answers: plain types, no I/O.

The answer's field names are the public `robustctl triage --json` keys (class, infra, next, level,
evidence, ranks) and the names of `Diagnostics.Triage`'s response fields; the values of `klass`,
`infra` and `next` are the vocabularies below, which callers (the Slurm epilog, a Kubernetes
controller) branch on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The failure classes, in no particular order (see rules.yaml for what each means).
CLASSES = ("gpu_hw", "nccl", "hang", "cuda", "nan", "oom_gpu", "oom_host", "storage", "launcher",
           "user_code", "unknown")
INFRA = ("likely", "unlikely", "unknown")  # is a machine, network or storage fault the probable cause?
NEXT = ("diagnose", "restart", "rollback", "none")

MAX_LOG_BYTES = 1 << 20  # default tail read of each log (`robustctl triage --tail`)
MAX_LOGS = 1024  # logs in one triage (files on the command line, entries in a TriageRequest)
MAX_NAME = 256  # characters of a log's name kept (a path, or the name a caller gave)
MAX_EVIDENCE = 8  # lines in an answer's evidence
MAX_EVIDENCE_TEXT = 512  # characters of one evidence line


@dataclass(frozen=True)
class LogText:
    """One log, or its tail: `data` starts at byte `offset` of the file, and `whole` says nothing was left out."""

    name: str
    data: bytes
    offset: int = 0
    whole: bool = True


@dataclass(frozen=True)
class Evidence:
    """A line that decided the answer: the log's name, its line number, its text (clipped).

    `line` counts from the file's first line when the whole file was read, else from the first
    complete line of the tail that was read (`offset` is then the exact byte offset of the line in
    the file either way).
    """

    file: str
    line: int
    text: str
    offset: int = 0
    rank: int | None = None
    rule: str = ""


@dataclass(frozen=True)
class Triage:
    """The answer: class, whether infrastructure is to blame, the next step and why."""

    klass: str
    infra: str
    next: str
    level: str | None = None  # with next == "diagnose": the stop-time tests, comma-separated, in order
    evidence: tuple[Evidence, ...] = ()
    ranks: tuple[int, ...] = ()  # the ranks the root cause was seen on, when the logs carry ranks
    reason: str = ""  # one line an operator reads: what was found and why it decides
    partial: tuple[str, ...] = field(default=())  # logs read only from their tail (line numbers count from there)
