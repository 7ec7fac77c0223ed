"""robustd-k8s's state file: its Watch position, the Events it has still to post and has posted, and the
quarantine it holds.

Saved through the adapters' common StateFile (written to a temporary file, fsynced, renamed; a corrupt
file set aside), so a crash leaves the old state or the new, never half. The Watch position
and the Events still to post are saved together: after a restart the Watch resumes after the saved
seq and every robustd event after it becomes an Event exactly once. Node conditions are not kept
here: the Node itself holds them, and the agent reads them back at start (so lastTransitionTime
survives a restart, and a conditions edit by someone else is seen).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from robustd.adapters.common.model import Table
from robustd.adapters.common.statefile import StateFile
from robustd.adapters.k8s.families import EventSpec

log = logging.getLogger("robustd.k8s")

STATE_VERSION = 1
MAX_PENDING = 1000  # Events waiting for the API server; beyond it the oldest are dropped (and said so)
MAX_SERIES = 256  # Event series remembered for de-duplication


@dataclass
class Series:
    """One Event object on the server, counted up when the same event happens again (as kubelet does)."""

    name: str
    count: int
    first: float
    last: float


@dataclass
class Quarantine:
    """The cordon and taint robustd put on the node."""

    action: str  # the taint's value: the name of robustd's action (REBOOT, HW_INSPECT, ...)
    fault: str  # "<code> on <component>"
    since: float  # wall clock
    pre_existing_cordon: bool  # someone else had cordoned the node: robustd leaves the cordon when it releases


@dataclass
class K8sState:
    node: str = ""
    table: Table | None = None  # the Watch position (its seq is the last robustd event handled)
    events_seq: int = 0  # every robustd event up to this seq has its Event posted (or needed none)
    pending: list[EventSpec] = field(default_factory=list)
    series: dict[str, Series] = field(default_factory=dict)  # "<type>|<reason>|<message>" -> the Event object
    quarantine: Quarantine | None = None
    ok_since: float | None = None  # no quarantine-worthy condition since (wall clock)
    suppressed: str = ""  # the fault a QuarantineSuppressed Event was posted for

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "node": self.node, "watch": self.table.to_json() if self.table else None,
                "events_seq": self.events_seq, "pending": [asdict(e) for e in self.pending],
                "series": {k: asdict(s) for k, s in self.series.items()},
                "quarantine": asdict(self.quarantine) if self.quarantine else None,
                "ok_since": self.ok_since, "suppressed": self.suppressed}

    @classmethod
    def from_json(cls, data: Any) -> K8sState:
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} robustd-k8s state")
        try:
            return cls(node=str(data.get("node", "")), table=Table.from_json(data.get("watch")),
                       events_seq=int(data.get("events_seq", 0)),
                       pending=[EventSpec(**e) for e in data.get("pending", [])][-MAX_PENDING:],
                       series={str(k): Series(**v) for k, v in list(data.get("series", {}).items())[-MAX_SERIES:]},
                       quarantine=Quarantine(**data["quarantine"]) if data.get("quarantine") else None,
                       ok_since=float(data["ok_since"]) if data.get("ok_since") is not None else None,
                       suppressed=str(data.get("suppressed", "")))
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed robustd-k8s state: {e}") from None


class K8sStateFile(StateFile[K8sState]):
    """robustd-k8s's state file (robustd.adapters.common.statefile)."""

    def __init__(self, path: str):
        super().__init__(path, K8sState.from_json, K8sState, owner="robustd-k8s")
