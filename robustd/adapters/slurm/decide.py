"""The Slurm decisions as pure functions: what to do with this node, given its verdict, Slurm's view and our state.

Ownership is the whole safety story. robustd owns a node's drain only while the node's reason
starts with `slurm.reason_prefix`: it never drains a node someone else took out, never rewrites
another reason, and resumes only a node whose current reason is still its own. Someone who
resumes robustd's drain while the fault stands is respected until a new fault event (a
condition change with a higher seq) arrives. Resumes are rationed (`max_resumes` in 24 h, then
the node is held as flapping), and a drain first passes the circuit breaker, so a bad rule or a
fleet-wide event cannot empty a partition.

Nothing here reads a clock, a file or a process: `now` and every input are arguments, so each rule
is tested with plain values (tests/test_slurm_rules.py).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace

from robustd.adapters.common.model import Cond
from robustd.adapters.slurm.config import SlurmConfig, plain_char
from robustd.adapters.slurm.model import (
    FLAP_WINDOW,
    AgentState,
    DrainRecord,
    NodeView,
    SelfCheck,
    Suppression,
)
from robustd.model import Severity

REASON_MAX = 256  # characters of a reason robustd writes (sinfo shows them whole; keep them readable)


@dataclass(frozen=True)
class Health:
    """The node's verdict as the rules see it: is it bad enough to drain, and for which conditions."""

    faults: tuple[Cond, ...]  # CRITICAL conditions whose action is in drain_actions, worst first
    seq: int  # the verdict's (or the agent's table's) seq
    boot_id: str
    # (component, code, seq) of faults the agent read as stale news (an event older than slurm.max_event_age):
    # they keep a drain robustd holds, but never start one.
    stale: frozenset[tuple[str, str, int]] = frozenset()

    @property
    def bad(self) -> bool:
        return bool(self.faults)

    @property
    def worst(self) -> Cond | None:
        return self.faults[0] if self.faults else None

    @property
    def newest_fault_seq(self) -> int:
        return max((c.seq for c in self.faults), default=0)


def drain_worthy(c: Cond, cfg: SlurmConfig) -> bool:
    return c.severity is Severity.CRITICAL and c.action in cfg.drain_actions


def assess(conditions: list[Cond] | tuple[Cond, ...], cfg: SlurmConfig, seq: int, boot_id: str,
           stale: frozenset[tuple[str, str, int]] = frozenset()) -> Health:
    """Drain-worthy conditions, worst first: most drastic action, then the oldest change (a stable reason)."""
    faults = [c for c in conditions if drain_worthy(c, cfg)]
    faults.sort(key=lambda c: (-c.action, c.seq, c.component, c.code))
    held = frozenset((c.component, c.code, c.seq) for c in faults) & stale
    return Health(faults=tuple(faults), seq=seq, boot_id=boot_id, stale=held)


class Do(enum.Enum):
    NOTHING = "nothing"
    WAIT = "wait"  # drained by robustd, verdict OK, hold-down running: look again at `wake_at`
    DRAIN = "drain"  # take the node out (mode drain | down | reboot); the breaker is asked first
    RESUME = "resume"
    SET_REASON = "set_reason"  # keep it drained, with a new robustd reason (flapping, self-check FAIL)
    SELF_CHECK = "self_check"  # run slurm.resume_check before a rebooted node may resume


@dataclass(frozen=True)
class Plan:
    do: Do
    reason: str = ""
    mode: str = ""  # for DRAIN
    note: str = ""  # what happened, for the log (one line)
    wake_at: float | None = None
    flapping: bool = False  # for DRAIN and SET_REASON: past max_resumes, the node is held as flapping
    cancel_reboot: bool = False  # for RESUME: a reboot robustd asked for is still pending


def clean(text: str) -> str:
    """A reason Slurm, sinfo and a terminal all take: printable ASCII, no quotes, bounded."""
    out = "".join(ch if plain_char(ch) else "?" for ch in text)
    return out if len(out) <= REASON_MAX else out[:REASON_MAX - 3] + "..."


def fault_text(h: Health) -> str:
    c = h.worst
    if c is None:
        return "no fault"
    more = f" +{len(h.faults) - 1} more" if len(h.faults) > 1 else ""
    return f"{c.code} on {c.component} (action {c.action.name}, seq {c.seq}){more}"


def _flapping_reason(prefix: str, resumes: int, what: str) -> str:
    return clean(f"{prefix} flapping: {resumes} resumes in 24h, held drained; {what}")


def drain_reason(cfg: SlurmConfig, h: Health, mode: str, flapping: bool, resumes: int) -> str:
    p = cfg.reason_prefix
    if flapping:
        return _flapping_reason(p, resumes, fault_text(h))
    if mode == "reboot":
        return clean(f"{p} reboot for {fault_text(h)}")
    return clean(f"{p} {fault_text(h)}")


def recent_resumes(st: AgentState, now: float) -> list[float]:
    return [t for t in st.resumes if now - t < FLAP_WINDOW]


def respected(st: AgentState, h: Health) -> bool:
    """Someone resumed robustd's drain while a fault stood, and no fault event came since: leave the node be."""
    return bool(st.respect_until_seq) and h.newest_fault_seq <= st.respect_until_seq


def _adopt(node: NodeView, h: Health, cfg: SlurmConfig, now: float) -> DrainRecord:
    """A drain with robustd's prefix that the state does not know (a hook made it, or the state was lost)."""
    reboot = node.reboot_pending or node.reason.startswith(f"{cfg.reason_prefix} reboot")
    mode = "reboot" if reboot else ("down" if node.state == "DOWN" else "drain")
    return DrainRecord(reason=node.reason, mode=mode, seq=h.newest_fault_seq, at=now, boot_id="")


def kept_drained(cfg: SlurmConfig, reason: str) -> str:
    """Why a drain with robustd's prefix is not resumed when the live verdict is good ("" when it is): the
    controller's hold during a job-level diagnosis (released by that hook), or the FAIL of a diagnosis (the
    node epilog's `diagnostic <id> FAIL after job`, the controller's `job <id> diagnosis FAIL` / `preflight`),
    held until an operator resumes the node."""
    rest = reason.removeprefix(cfg.reason_prefix).strip()
    if rest.startswith("diagnosing after job "):
        return "held by the controller's job-level diagnosis; that hook releases it"
    if _DIAGNOSED.match(rest):
        return "drained for a failed diagnosis; an operator resumes it (the live verdict cannot see what it found)"
    return ""


_DIAGNOSED = re.compile(r"(?:diagnostic \S+ FAIL after job |job \S+ (?:diagnosis|preflight) FAIL: )")


def _rebooted(d: DrainRecord, node: NodeView, h: Health) -> bool:
    """Did the reboot robustd asked for happen? The daemon's boot id changed (or, adopted, Slurm says it is done)."""
    if d.boot_id:
        return bool(h.boot_id) and h.boot_id != d.boot_id
    return not node.reboot_pending


def _released(st: AgentState) -> None:
    """The drain is over (the last self-check stays on record: `robustctl slurm status` shows it)."""
    st.drain = None
    st.ok_since = None
    st.flapping = False


def decide(cfg: SlurmConfig, h: Health, node: NodeView, st: AgentState, now: float) -> tuple[Plan, AgentState]:
    """What to do now, and the state as observed (before the action; see `applied`)."""
    st = st.copy()
    prefix = cfg.reason_prefix
    ours = node.out_of_service and node.reason.startswith(prefix)

    if node.out_of_service and not ours:
        note = ""
        if st.drain is not None:
            note = (f"{node.name} is now held by someone else ({node.describe()}); robustd no longer owns its drain "
                    "and will not resume it")
            _released(st)
        if not h.bad:
            st.suppressed = None
        return Plan(Do.NOTHING, note=note), st

    if ours and (why := kept_drained(cfg, node.reason)):
        # Not the live verdict's to undo: the hold is the controller hook's, a diagnosis's FAIL stands for what
        # the stop-time tests found (a slow link no live check sees) until an operator resumes the node.
        note = "" if st.drain is not None and st.drain.reason == node.reason else f"{node.name}: {why}"
        if st.drain is None or st.drain.reason != node.reason:
            st.drain = _adopt(node, h, cfg, now)
        st.ok_since = None
        st.suppressed = None
        return Plan(Do.NOTHING, note=note), st

    if ours:
        note = ""
        if st.drain is None:
            st.drain = _adopt(node, h, cfg, now)
            note = f"{node.name} is drained with robustd's prefix ({node.reason!r}): taking it as robustd's drain"
        st.suppressed = None
        if h.bad:
            st.ok_since = None
            return Plan(Do.NOTHING, note=note), st
        cancel = False
        if st.drain.mode == "reboot":
            if _rebooted(st.drain, node, h):
                if cfg.resume_check:
                    sc = st.self_check
                    if sc is None or sc.boot_id != h.boot_id or sc.outcome not in ("PASS", "FAIL"):
                        return Plan(Do.SELF_CHECK, note=note), st
                    if sc.outcome == "FAIL":
                        return Plan(Do.NOTHING, note=note), st  # held: its reason names the report
            else:
                cancel = node.reboot_pending  # the fault was cleared (acknowledged) before the reboot happened
        if st.flapping:
            return Plan(Do.NOTHING, note=note), st
        if st.ok_since is None:
            st.ok_since = now
        due = st.ok_since + cfg.resume_after
        if now < due:
            return Plan(Do.WAIT, note=note, wake_at=due), st
        recent = recent_resumes(st, now)
        if cfg.max_resumes == 0:
            return Plan(Do.NOTHING, note=note or f"{node.name}: slurm.max_resumes is 0: an operator resumes it"), st
        if len(recent) >= cfg.max_resumes:
            reason = _flapping_reason(prefix, len(recent), f"last: {st.drain.reason.removeprefix(prefix).strip()}")
            return Plan(Do.SET_REASON, reason=reason, note=note, flapping=True), st
        return Plan(Do.RESUME, note=note, cancel_reboot=cancel), st

    # In service.
    note = ""
    if st.drain is not None:
        if h.bad:
            st.respect_until_seq = h.newest_fault_seq
            note = (f"{node.name} was resumed by someone else while {fault_text(h)} stands: respected until a new "
                    "fault event")
        else:
            note = f"{node.name} was resumed by someone else"
        if st.flapping:
            st.resumes = []  # an operator's resume of a flapping node starts the count again
        _released(st)
    st.ok_since = None
    if not h.bad:
        st.respect_until_seq = 0
        st.suppressed = None
        return Plan(Do.NOTHING, note=note), st
    if respected(st, h):
        return Plan(Do.NOTHING, note=note), st
    fresh = tuple(c for c in h.faults if (c.component, c.code, c.seq) not in h.stale)
    if not fresh:
        return Plan(Do.NOTHING, note=note or f"{node.name}: not draining for {fault_text(h)}: stale news (read "
                    f"later than slurm.max_event_age after it happened)"), st
    h = replace(h, faults=fresh)
    recent = recent_resumes(st, now)
    flapping = bool(recent) and len(recent) >= cfg.max_resumes
    worst = h.worst
    assert worst is not None
    mode = "reboot" if worst.action in cfg.reboot_on else cfg.on_critical
    return Plan(Do.DRAIN, reason=drain_reason(cfg, h, mode, flapping, len(recent)), mode=mode, note=note,
                flapping=flapping), st


def applied(plan: Plan, st: AgentState, h: Health, now: float) -> AgentState:
    """The state after `plan` was carried out in Slurm."""
    st = st.copy()
    if plan.do is Do.DRAIN:
        st.drain = DrainRecord(reason=plan.reason, mode=plan.mode, seq=h.newest_fault_seq, at=now, boot_id=h.boot_id)
        st.flapping = plan.flapping
        st.suppressed = None
        st.ok_since = None
        st.self_check = None
        st.respect_until_seq = 0
    elif plan.do is Do.RESUME:
        st.resumes = [*recent_resumes(st, now), now]
        _released(st)
    elif plan.do is Do.SET_REASON and st.drain is not None:
        st.drain = replace(st.drain, reason=plan.reason)
        st.flapping = st.flapping or plan.flapping
    return st


def breaker(cfg: SlurmConfig, node: NodeView, rows: list[tuple[str, str, str]], fault: str,
            now: float) -> Suppression | None:
    """The circuit breaker: may robustd drain one more node of each of this node's partitions?

    `rows` are (node, partition, reason) for the nodes of those partitions (one sinfo call). The
    allowance is max(min_drains, floor(max_drained_fraction x partition size)); when the nodes already
    drained by robustd (other than this one) reach it in any partition, the drain is suppressed.
    """
    for part in node.partitions:
        members = {n for n, p, _ in rows if p == part}
        members.add(node.name)
        drained = {n for n, p, r in rows if p == part and n != node.name and r.startswith(cfg.reason_prefix)}
        allowance = max(cfg.min_drains, math.floor(cfg.max_drained_fraction * len(members) + 1e-9))
        if len(drained) >= allowance:
            return Suppression(partition=part, drained=len(drained), size=len(members), allowance=allowance,
                               fault=fault, since=now)
    return None


def suppressed(st: AgentState, sup: Suppression) -> AgentState:
    """Record a suppressed drain, keeping when it started if it stands already."""
    st = st.copy()
    if st.suppressed is not None:
        sup = replace(sup, since=st.suppressed.since)
    st.suppressed = sup
    return st


def self_checked(cfg: SlurmConfig, st: AgentState, result: SelfCheck) -> tuple[Plan, AgentState]:
    """The resume check's outcome: a FAIL holds the node with the report id in its reason."""
    st = st.copy()
    st.self_check = result
    if result.outcome == "FAIL":
        reason = clean(f"{cfg.reason_prefix} self-check FAIL after reboot, report {result.report_id}: {result.message}")
        return Plan(Do.SET_REASON, reason=reason,
                    note=f"self-check {result.report_id} FAILED: the node stays drained"), st
    return Plan(Do.NOTHING, note=f"self-check {result.report_id or '-'}: {result.outcome}"
                                 + (f" ({result.message})" if result.message else "")), st


def diagnosis_plan(cfg: SlurmConfig, node: NodeView, report_id: str, summary: str, job: str) -> Plan:
    """The epilog's diagnostics FAILed: drain with the report id, unless the node is out of service already."""
    if node.out_of_service:
        return Plan(Do.NOTHING, note=f"diagnostic {report_id} FAILED; {node.name} is already out of service "
                                     f"({node.describe()})")
    reason = clean(f"{cfg.reason_prefix} diagnostic {report_id} FAIL after job {job}: {summary}")
    return Plan(Do.DRAIN, reason=reason, mode=cfg.on_critical, note=f"diagnostic {report_id} FAILED after job {job}")
