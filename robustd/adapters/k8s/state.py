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
MAX_RECENT = 50  # decisions kept for `robustd-k8s --status`
MAX_SEEN = 10_000  # news times kept (one per standing condition)
DECISIONS = ("condition", "event", "cordon", "uncordon", "stale")  # the kinds counted, in --status order


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
    shadow: bool = False  # decided in shadow mode: nothing of it is on the Node, so a release writes nothing


@dataclass
class Decision:
    """One thing robustd-k8s decided to write (act) or would have written (shadow), as logged."""

    at: float  # wall clock
    mode: str  # act | shadow
    kind: str  # one of DECISIONS
    text: str  # act's words: "cordon gpu-1: XID_79 on gpu/... (action REBOOT)"; shadow logs "would " + text

    @property
    def words(self) -> str:
        """As logged and shown: a write shadow did not make is "would ..."; a stale fault is ignored in both."""
        return ("would " if self.mode == "shadow" and self.kind != "stale" else "") + self.text


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
    # The wall-clock time of the news each standing condition was last read from ("component|code": the
    # Watch event's `at`, or a snapshot's last_seen): older than k8s.max_event_age, it cordons nothing.
    seen: dict[str, float] = field(default_factory=dict)
    stale: str = ""  # the fault last logged as too old to cordon for
    decisions: dict[str, dict[str, int]] = field(default_factory=dict)  # mode -> kind -> count
    recent: list[Decision] = field(default_factory=list)  # the newest MAX_RECENT, oldest first

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "node": self.node, "watch": self.table.to_json() if self.table else None,
                "events_seq": self.events_seq, "pending": [asdict(e) for e in self.pending],
                "series": {k: asdict(s) for k, s in self.series.items()},
                "quarantine": asdict(self.quarantine) if self.quarantine else None,
                "ok_since": self.ok_since, "suppressed": self.suppressed, "seen": self.seen, "stale": self.stale,
                "decisions": self.decisions, "recent": [asdict(d) for d in self.recent]}

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
                       suppressed=str(data.get("suppressed", "")),
                       seen={str(k): float(v) for k, v in list(data.get("seen", {}).items())[-MAX_SEEN:]},
                       stale=str(data.get("stale", "")),
                       decisions={str(m): {str(k): int(n) for k, n in kinds.items()}
                                  for m, kinds in data.get("decisions", {}).items()},
                       recent=[Decision(**d) for d in data.get("recent", [])][-MAX_RECENT:])
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed robustd-k8s state: {e}") from None


class K8sStateFile(StateFile[K8sState]):
    """robustd-k8s's state file (robustd.adapters.common.statefile)."""

    def __init__(self, path: str):
        super().__init__(path, K8sState.from_json, K8sState, owner="robustd-k8s")
