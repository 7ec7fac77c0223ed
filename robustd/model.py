"""The vocabulary every part of robustd shares: findings, conditions, events.

Checks produce `Finding`s; the policy turns them into `Condition`s; every change of a
condition is an `Event`. Nothing here knows about schedulers, gRPC or SQLite.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Mapping


class Severity(enum.IntEnum):
    """Whether the node may keep training. Ordered: a larger value is worse."""

    OK = 1
    WARNING = 2
    CRITICAL = 3


class Action(enum.IntEnum):
    """What would fix the fault. Ordered from least to most drastic."""

    NONE = 1
    RESTART_JOB = 2
    RESET_GPU = 3
    REBOOT = 4
    HW_INSPECT = 5


class FindingKind(enum.Enum):
    """How a finding relates to time.

    OCCURRENCE: one happening (a kernel log line); each one counts.
    STATE: a level seen by a poll; repeated while it lasts, counted once per appearance.
    RESOLVED: the fault is observed gone (e.g. "Link up"); clears a non-sticky condition.
    """

    OCCURRENCE = "occurrence"
    STATE = "state"
    RESOLVED = "resolved"


class EventKind(enum.IntEnum):
    RAISED = 1
    UPDATED = 2
    CLEARED = 3


@dataclass(frozen=True)
class Finding:
    """One observation by one check.

    `severity` and `action` are hints from the check (e.g. the Fatal word of an SXid line);
    the policy's code table, when it names the code, wins over them.
    """

    component: str
    code: str
    message: str = ""
    evidence: Mapping[str, str] = field(default_factory=dict)
    kind: FindingKind = FindingKind.OCCURRENCE
    severity: Severity | None = None
    action: Action | None = None
    at: float | None = None  # when it happened, if the source says (wall clock, seconds)


@dataclass(frozen=True)
class Condition:
    """The policy's standing judgement on one (component, code)."""

    component: str
    code: str
    severity: Severity
    action: Action
    message: str
    evidence: Mapping[str, str]
    first_seen: float
    last_seen: float
    count: int
    sticky: bool
    source: str = ""  # the check that reported it
    boot_id: str = ""
    seq: int = 0  # seq of this condition's last change (0 until committed)
    changed_at: float = 0.0  # wall time of that change

    @property
    def key(self) -> tuple[str, str]:
        return (self.component, self.code)

    def with_seq(self, seq: int, at: float) -> Condition:
        return replace(self, seq=seq, changed_at=at)


@dataclass(frozen=True)
class Event:
    """One change of a condition. `seq` is 0 until the store commits it."""

    kind: EventKind
    condition: Condition
    at: float
    seq: int = 0


@dataclass(frozen=True)
class FindingBatch:
    """What one check hands the daemon at once: findings and, for stream checks, a cursor.

    The cursor (e.g. the last kmsg sequence number handled) is committed in the same
    transaction as the events the findings cause, so a restart neither loses nor repeats them.
    """

    check: str
    findings: tuple[Finding, ...] = ()
    cursor: Mapping[str, str] | None = None


def worst(conditions: list[Condition]) -> tuple[Severity, Action]:
    """The node verdict: the worst severity and, among those, the most drastic action."""
    if not conditions:
        return Severity.OK, Action.NONE
    top = max(c.severity for c in conditions)
    action = max(c.action for c in conditions if c.severity == top)
    return top, action
