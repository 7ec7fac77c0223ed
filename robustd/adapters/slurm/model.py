"""Plain values the Slurm rules work on besides the node's conditions (robustd.adapters.common.model):
Slurm's view of the node and the agent's state.

No gRPC, no subprocesses, no clock: the rules (rules.py) are functions of these, and the tests build
them by hand. The agent's state is what it did and why (the drain it holds, its resumes, a suppressed
drain); it is saved as JSON in the state file the agent and the robustctl hooks share (AgentStateFile).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from robustd.adapters.common.model import Table
from robustd.adapters.common.statefile import StateFile

FLAP_WINDOW = 86400.0  # resumes counted for max_resumes: the last 24 hours
STATE_VERSION = 1


@dataclass(frozen=True)
class NodeView:
    """One Slurm node as `scontrol show node` reports it."""

    name: str
    state: str  # the base state: IDLE, ALLOCATED, MIXED, DOWN, FUTURE, ...
    flags: frozenset[str] = frozenset()  # DRAIN, REBOOT_REQUESTED, REBOOT_ISSUED, NOT_RESPONDING, FAIL, ...
    reason: str = ""  # without Slurm's trailing " [user@time]"; "" when there is none
    partitions: tuple[str, ...] = ()
    addr: str = ""  # NodeAddr: where the node is reached ("" when Slurm did not say; the name then)

    @property
    def out_of_service(self) -> bool:
        """Drained, draining, down or failing: someone (robustd or not) took it out of the schedule."""
        return "DRAIN" in self.flags or "FAIL" in self.flags or self.state in ("DOWN", "FUTURE")

    @property
    def reboot_pending(self) -> bool:
        return bool({"REBOOT_REQUESTED", "REBOOT_ISSUED"} & self.flags)

    def describe(self) -> str:
        state = "+".join([self.state, *sorted(self.flags)])
        return f"{state}, reason {self.reason!r}" if self.reason else state


@dataclass(frozen=True)
class DrainRecord:
    """A drain robustd made (or found with its prefix and adopted)."""

    reason: str
    mode: str  # drain | down | reboot
    seq: int  # the newest fault event it answered
    at: float  # wall clock
    boot_id: str  # the daemon's boot id then ("" when adopted without one)


@dataclass(frozen=True)
class Suppression:
    """SLURM_DRAIN_SUPPRESSED: a drain the circuit breaker refused."""

    partition: str
    drained: int  # nodes of the partition already drained by robustd
    size: int
    allowance: int
    fault: str  # the condition it would have drained for
    since: float

    def text(self) -> str:
        return (f"SLURM_DRAIN_SUPPRESSED: not draining for {self.fault}: partition {self.partition} already has "
                f"{self.drained} of {self.size} nodes drained by robustd (allowance {self.allowance})")


@dataclass(frozen=True)
class SelfCheck:
    """The resume check after a reboot robustd asked for."""

    boot_id: str
    outcome: str  # PASS | FAIL | ERROR | CANCELLED | UNREACHABLE
    report_id: str
    at: float
    message: str = ""


SHADOW_RECENT = 20  # the would-decisions kept in the state file (the counts keep the rest)


@dataclass
class Shadow:
    """slurm.mode shadow: the state robustd would have reached had it acted (decided by the same rules, on
    Slurm's real node with this would-be drain laid over it), and its would-decisions, counted by kind
    (drain, down, reboot, resume, set_reason) with the last SHADOW_RECENT of them in the log's words."""

    state: AgentState
    counts: dict[str, int] = field(default_factory=dict)
    recent: list[dict[str, Any]] = field(default_factory=list)  # {"at": wall clock, "kind": ..., "text": ...}

    def record(self, kind: str, text: str, at: float) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.recent = [*self.recent, {"at": at, "kind": kind, "text": text}][-SHADOW_RECENT:]

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state.to_json(), "counts": dict(self.counts), "recent": list(self.recent)}

    @classmethod
    def from_json(cls, data: Any) -> Shadow:
        if not isinstance(data, dict):
            raise ValueError("shadow: not an object")
        recent = [{"at": float(r["at"]), "kind": str(r["kind"]), "text": str(r["text"])}
                  for r in data.get("recent", [])][-SHADOW_RECENT:]
        return cls(state=AgentState.from_json(data.get("state")),
                   counts={str(k): int(v) for k, v in dict(data.get("counts", {})).items()}, recent=recent)


@dataclass
class AgentState:
    """What robustd did to this node and why; shared by the agent and the hooks through the state file."""

    node: str = ""
    drain: DrainRecord | None = None
    ok_since: float | None = None  # the verdict has been below the drain threshold since (wall clock)
    resumes: list[float] = field(default_factory=list)  # robustd's resumes (wall clock), for max_resumes
    flapping: bool = False
    respect_until_seq: int = 0  # someone resumed robustd's drain while a fault stood: leave faults up to this seq
    suppressed: Suppression | None = None
    self_check: SelfCheck | None = None
    table: Table | None = None  # the agent's Watch position (its seq is the last event handled)
    # Faults read as stale news ([component, code, seq]: no new drain for them) and how many such events were read.
    stale: list[tuple[str, str, int]] = field(default_factory=list)
    stale_events: int = 0
    shadow: Shadow | None = None  # slurm.mode shadow: what robustd would have done (the fields above: what it did)

    def copy(self) -> AgentState:
        return copy.deepcopy(self)

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "node": self.node,
                "drain": asdict(self.drain) if self.drain else None, "ok_since": self.ok_since,
                "resumes": self.resumes, "flapping": self.flapping, "respect_until_seq": self.respect_until_seq,
                "suppressed": asdict(self.suppressed) if self.suppressed else None,
                "self_check": asdict(self.self_check) if self.self_check else None,
                "watch": self.table.to_json() if self.table else None,
                "stale": [list(k) for k in self.stale], "stale_events": self.stale_events,
                "shadow": self.shadow.to_json() if self.shadow else None}

    @classmethod
    def from_json(cls, data: Any) -> AgentState:
        """Raises ValueError on a document that is not a state file of this version."""
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} robustd-slurm state")
        try:
            return cls(node=str(data.get("node", "")),
                       drain=DrainRecord(**data["drain"]) if data.get("drain") else None,
                       ok_since=float(data["ok_since"]) if data.get("ok_since") is not None else None,
                       resumes=[float(t) for t in data.get("resumes", [])],
                       flapping=bool(data.get("flapping", False)),
                       respect_until_seq=int(data.get("respect_until_seq", 0)),
                       suppressed=Suppression(**data["suppressed"]) if data.get("suppressed") else None,
                       self_check=SelfCheck(**data["self_check"]) if data.get("self_check") else None,
                       table=Table.from_json(data.get("watch")),
                       stale=[(str(k[0]), str(k[1]), int(k[2])) for k in data.get("stale", [])],
                       stale_events=int(data.get("stale_events", 0)),
                       shadow=Shadow.from_json(data["shadow"]) if data.get("shadow") else None)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"malformed robustd-slurm state: {e}") from None


class AgentStateFile(StateFile[AgentState]):
    """robustd-slurm's state file, shared by the agent and the hooks (robustd.adapters.common.statefile)."""

    def __init__(self, path: str):
        super().__init__(path, AgentState.from_json, AgentState, owner="robustd-slurm",
                         aside="robustd's drains are still recognised by their reason prefix")
