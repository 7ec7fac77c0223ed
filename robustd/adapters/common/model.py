"""The node's conditions as an adapter keeps them: plain values in robustd's own enums.

An adapter follows the daemon's verdict as a GetVerdict snapshot moved forward by Watch events (`Table`).
Severity and action stay robustd.model's Severity and Action from the wire to the decision; only the words
an adapter writes into a scheduler (a Slurm reason, a node condition's message) spell their names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from robustd.model import Action, EventKind, Severity

RAISED, UPDATED, CLEARED = EventKind.RAISED, EventKind.UPDATED, EventKind.CLEARED  # robustd.v1.EventKind


def severity_of(value: int) -> Severity:
    """A wire Severity; OK for a value this version does not know (UNSPECIFIED included)."""
    try:
        return Severity(value)
    except ValueError:
        return Severity.OK


def action_of(value: int) -> Action:
    """A wire Action; NONE for a value this version does not know (UNSPECIFIED included)."""
    try:
        return Action(value)
    except ValueError:
        return Action.NONE


@dataclass(frozen=True)
class Cond:
    """One standing condition, as much of it as an adapter's rules need."""

    component: str
    code: str
    severity: Severity
    action: Action
    seq: int  # its last change

    @property
    def key(self) -> tuple[str, str]:
        return (self.component, self.code)


@dataclass
class Table:
    """The node's standing conditions as of `seq`: a GetVerdict snapshot moved forward by Watch events.

    An event at or below `seq` is already in the table and is ignored, so a snapshot taken while
    events were queued, or events replayed after a reconnect, never apply twice.
    """

    seq: int = 0
    boot_id: str = ""
    conditions: dict[tuple[str, str], Cond] = field(default_factory=dict)

    def apply(self, kind: int, cond: Cond, seq: int) -> bool:
        """One event; False when it was already reflected (seq not above the table's)."""
        if seq <= self.seq:
            return False
        self.seq = seq
        if kind == CLEARED:
            self.conditions.pop(cond.key, None)
        else:
            self.conditions[cond.key] = cond
        return True

    def to_json(self) -> dict[str, Any]:
        """As saved in a state file: severities and actions by name."""
        return {"seq": self.seq, "boot_id": self.boot_id,
                "conditions": [[c.component, c.code, c.severity.name, c.action.name, c.seq]
                               for c in self.conditions.values()]}

    @classmethod
    def from_json(cls, data: Any) -> Table | None:
        """A saved table; None when it is not one. A name this version does not know reads as OK / NONE."""
        if not isinstance(data, dict):
            return None
        try:
            conds = [Cond(str(c[0]), str(c[1]), Severity.__members__.get(str(c[2]), Severity.OK),
                          Action.__members__.get(str(c[3]), Action.NONE), int(c[4]))
                     for c in data.get("conditions", [])]
            return cls(seq=int(data["seq"]), boot_id=str(data.get("boot_id", "")),
                       conditions={c.key: c for c in conds})
        except (KeyError, IndexError, TypeError, ValueError):
            return None
