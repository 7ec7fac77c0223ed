"""robustd's conditions in Kubernetes' words: one node condition per family, one Event per change.

Pure functions of plain values (robustd.adapters.common.model.Cond, the `k8s:` config): no client, no
clock. A family groups components by what an operator would look at (GPU, network, PCIe, ...); its
node condition is True while a condition of the family at or above `k8s.condition_severity` stands.
Kubernetes' own conditions (Ready, MemoryPressure, ...) are never produced here: every type carries
`k8s.condition_prefix`, and only types with that prefix are ever written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from robustd.adapters.common.model import CLEARED, RAISED, UPDATED, Cond
from robustd.adapters.k8s.config import K8sConfig
from robustd.model import Severity

FAMILIES = ("GPUProblem", "NetworkProblem", "PCIeProblem", "MemoryProblem", "DiskProblem", "ThermalProblem",
            "KernelProblem", "DiagnosticsFailed", "AgentProblem")
_PREFIXES = (("gpu/", "GPUProblem"), ("nvswitch/", "GPUProblem"), ("nic/", "NetworkProblem"),
             ("ib/", "NetworkProblem"), ("pcie/", "PCIeProblem"), ("memory/", "MemoryProblem"),
             ("disk/", "DiskProblem"), ("check/", "AgentProblem"))
MAX_MESSAGE = 1024  # a node condition's message, and an event's: what an operator reads, bounded
MAX_REASON = 128
UNREACHABLE = "RobustdUnreachable"


@dataclass(frozen=True)
class NodeCondition:
    """What one of robustd's node conditions should say (times are the reconciler's business)."""

    type: str
    status: str  # True | False | Unknown
    reason: str
    message: str


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the Node for one of robustd's events."""

    seq: int
    type: str  # Warning | Normal
    reason: str
    message: str
    # Set when `seq` alone does not name the Event: several from one snapshot share its seq.
    tag: str = ""


def family(component: str, code: str) -> str:
    """The family a condition belongs to; robustd's stop-time test failures go to DiagnosticsFailed whatever
    their component, a thermal sensor (`host/<chip>/<sensor>`) to ThermalProblem, the rest of `host` and any
    component this version does not know to KernelProblem."""
    if code.startswith("DIAG_"):
        return "DiagnosticsFailed"
    for prefix, fam in _PREFIXES:
        if component.startswith(prefix):
            return fam
    if component.startswith("host/") and component.count("/") >= 2:
        return "ThermalProblem"
    return "KernelProblem"


def camel(code: str) -> str:
    """XID_79 -> Xid79, GPU_ECC_DBE -> GpuEccDbe: a condition reason is one CamelCase word."""
    word = "".join(p[:1].upper() + p[1:].lower() for p in code.replace("-", "_").split("_") if p)
    word = "".join(ch for ch in word if ch.isascii() and ch.isalnum())
    return (word or "Unknown")[:64]


def _rank(c: Cond) -> tuple[int, int, int]:
    return (c.severity, c.action, c.seq)


def _clip(text: str, limit: int = MAX_MESSAGE) -> str:
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def counts(c: Cond, cfg: K8sConfig) -> bool:
    """Whether a condition makes its family's node condition True."""
    return c.severity >= cfg.condition_severity


def desired(conditions: list[Cond], cfg: K8sConfig) -> list[NodeCondition]:
    """One node condition per family, in FAMILIES order."""
    by_family: dict[str, list[Cond]] = {f: [] for f in FAMILIES}
    for c in conditions:
        if counts(c, cfg):
            by_family[family(c.component, c.code)].append(c)
    out = []
    for fam, conds in by_family.items():
        ctype = cfg.condition_prefix + fam
        if not conds:
            out.append(NodeCondition(ctype, "False", f"No{fam}",
                                     f"robustd reports no {fam} at or above {cfg.condition_severity.name}"))
            continue
        conds.sort(key=_rank, reverse=True)
        codes = list(dict.fromkeys(c.code for c in conds))
        reason = camel(codes[0]) + (f"And{len(codes) - 1}More" if len(codes) > 1 else "")
        parts = [f"{c.code} on {c.component} ({c.severity.name}, action {c.action.name})" for c in conds[:16]]
        more = f"; +{len(conds) - 16} more" if len(conds) > 16 else ""
        out.append(NodeCondition(ctype, "True", reason[:MAX_REASON], _clip("; ".join(parts) + more)))
    return out


def unknown(cfg: K8sConfig, why: str) -> list[NodeCondition]:
    """Every family Unknown: robustd has not answered (as the node lifecycle controller does for a silent
    kubelet). Not a hardware verdict."""
    return [NodeCondition(cfg.condition_prefix + fam, "Unknown", UNREACHABLE, _clip(why)) for fam in FAMILIES]


def event_for(kind: int, c: Cond, seq: int, prev: Cond | None = None) -> EventSpec | None:
    """The Event for a robustd event at or above WARNING; None for the rest. An UPDATED one (`prev`: the
    condition before it) has an Event only when its severity or action changed, not for a mere repeat."""
    if kind == UPDATED and prev is not None:
        if (prev.severity, prev.action) == (c.severity, c.action) or max(prev.severity, c.severity) < Severity.WARNING:
            return None
        action = c.action.name if prev.action == c.action else f"{prev.action.name} -> {c.action.name}"
        return EventSpec(seq, "Warning" if c.severity >= Severity.WARNING else "Normal", c.code[:MAX_REASON],
                         _clip(f"{c.code} updated on {c.component}: {prev.severity.name} -> {c.severity.name}, "
                               f"action {action}"))
    if kind not in (RAISED, UPDATED, CLEARED) or c.severity < Severity.WARNING:
        return None
    if kind != CLEARED:  # an UPDATED of a condition not seen before is news of it
        return EventSpec(seq, "Warning", c.code[:MAX_REASON],
                         _clip(f"{c.code} raised on {c.component}: {c.severity.name}, action {c.action.name}"))
    return EventSpec(seq, "Normal", c.code[:MAX_REASON], _clip(f"{c.code} cleared on {c.component}"))


def snapshot_events(before: Iterable[Cond] | None, after: Iterable[Cond], seq: int) -> list[EventSpec]:
    """The Events for what a new snapshot (GetVerdict at `seq`) says against the table before it, as the
    Watch events in between would have had them: raised, changed, cleared. `before` None is a first start:
    every standing condition is news. A raised or changed condition's Event carries its own seq (so a
    restart that lost the state file finds it posted already); a cleared one, whose clearing seq the
    snapshot does not tell, the snapshot's seq and a tag of its own."""
    old = {c.key: c for c in before or ()}
    new = {c.key: c for c in after}
    out: list[EventSpec] = []
    for key, c in sorted(new.items(), key=lambda kv: kv[1].seq):
        prev = old.get(key)
        spec = event_for(RAISED, c, c.seq) if prev is None else event_for(UPDATED, c, c.seq, prev)
        if spec is not None:
            out.append(spec)
    for key, c in old.items():
        spec = None if key in new else event_for(CLEARED, c, seq)
        if spec is not None:
            tag = hashlib.sha256(f"{c.component}\0{c.code}".encode()).hexdigest()[:12]
            out.append(EventSpec(seq, spec.type, spec.reason, spec.message, tag=tag))
    return out


def skipped_event(after_seq: int, seq: int, why: str, posted: int) -> EventSpec:
    """The Event that says robustd-k8s could not read robustd's events after `after_seq` (`why`), and that the
    `posted` Events from the new snapshot at `seq` stand in for them: a fault raised and cleared in between has none."""
    return EventSpec(seq, "Normal", "EventsSkipped", _clip(
        f"robustd-k8s could not read robustd's events after seq {after_seq} ({why}); {posted} Events for what changed "
        f"up to seq {seq} come from a new snapshot: a fault raised and cleared in between has none"), tag="skipped")


def quarantine_for(conditions: list[Cond], cfg: K8sConfig) -> Cond | None:
    """The condition that asks for quarantine: CRITICAL with one of k8s.quarantine.actions (the most drastic)."""
    hits = [c for c in conditions if c.severity is Severity.CRITICAL and c.action in cfg.quarantine.actions]
    return max(hits, key=_rank) if hits else None
