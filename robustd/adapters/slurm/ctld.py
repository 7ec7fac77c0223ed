"""The controller hooks' decisions (EpilogSlurmctld, PrologSlurmctld) as pure functions (issue 29, WIP).

After a failed multi-node job, `robustctl slurm epilog-ctld` holds the job's nodes (a drain with the reason
`<prefix> diagnosing after job <id>`), runs the job-level diagnosis (robustd.fleet.diagnose) over their
daemons, then drains each suspect with `<prefix> job <id> diagnosis <outcome>: <reason>` (through the circuit
breaker) and releases every other node it held. The ownership rules are the agent's (decide.py):

- a node out of service with someone else's reason is never held, drained nor released;
- a node out of service with robustd's prefix (a fault drain, another job's hold) is left to its owner: this
  hook releases only the holds it made, and only while the node still carries exactly that hold's reason;
- a node Slurm could not report is left as Slurm has it;
- a diagnosis that could not run releases every node held: robustd failing never leaves a fleet drained;
- an unreachable node (its daemon did not answer) is never drained for that; its hold is released.

Nothing here reads a clock, a file or a process: the hook (robustd/cli/slurm.py → hooks) gathers Slurm's
views and the Diagnosis and carries the actions out; tests/test_slurm_ctld.py feeds plain data.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.decide import breaker, clean
from robustd.adapters.slurm.jobs import NO_DIAGNOSIS, job_failed
from robustd.adapters.slurm.model import NodeView, Suppression
from robustd.fleet.diagnosis import Suspect

MIN_NODES = 2  # fewer: the node epilog's job


@dataclass(frozen=True)
class JobEnd:
    """What the controller's environment says of the job: its id, whether it failed, its nodes (expanded)."""

    job: str
    failed: bool | None  # None: no exit status could be read
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class TriageSummary:
    """The triage verdict the gate needs (robustd.triage.Triage or Diagnostics.Triage's answer), and where it
    came from (`logs`: the controller read the job's output; `node <name>`: a node epilog left it)."""

    klass: str
    infra: str  # likely, unlikely, unknown
    next: str  # diagnose, restart, rollback, none
    source: str = "logs"


class Step(enum.Enum):
    HOLD = "hold"  # drain with the hold reason for the time of the diagnosis
    RELEASE = "release"  # resume a node this hook held
    DRAIN = "drain"  # a suspect: drain (rewrite the hold's reason) with the diagnosis's reason
    LEAVE = "leave"  # change nothing (someone else's, unknown to Slurm, not held by this hook, ...)


@dataclass(frozen=True)
class Action:
    node: str
    step: Step
    reason: str = ""  # HOLD, DRAIN: the Slurm reason written
    note: str = ""  # one log line


def job_end(env: Mapping[str, str], expand: Callable[[str], list[str]]) -> JobEnd:
    """The controller's environment: SLURM_JOB_ID, SLURM_JOB_EXIT_CODE / _CODE2 (read as the node epilog reads
    them) and SLURM_JOB_NODELIST, expanded by `expand` (`scontrol show hostnames`; its SlurmError propagates)."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    return JobEnd(job=env.get("SLURM_JOB_ID", "?").strip() or "?", failed=job_failed(env),
                  nodes=tuple(dict.fromkeys(expand(nodelist))) if nodelist else ())


def hold_reason(cfg: SlurmConfig, job: str) -> str:
    return clean(f"{cfg.reason_prefix} diagnosing after job {job}")


def is_hold(cfg: SlurmConfig, reason: str) -> bool:
    """Any job's hold (a temporary drain): not counted by the breaker."""
    return reason.startswith(f"{cfg.reason_prefix} diagnosing after job ")


def gate(job: JobEnd, triage: TriageSummary | None) -> tuple[bool, str]:
    """Is this job's end worth a job-level diagnosis? (yes/no, why: the log line)."""
    if job.failed is None:
        return False, f"job {job.job}: no exit status in the environment; not diagnosing"
    if not job.failed:
        return False, f"job {job.job} succeeded"
    if len(job.nodes) < MIN_NODES:
        return False, (f"job {job.job} ran on {len(job.nodes)} node{'' if len(job.nodes) == 1 else 's'}: "
                       "the node epilog diagnoses it")
    if triage is None:
        return True, f"job {job.job} failed on {len(job.nodes)} nodes; triage unknown (infra unknown): diagnosing"
    said = f"triage ({triage.source}) says {triage.klass}, infra {triage.infra}, next {triage.next}"
    if triage.klass in NO_DIAGNOSIS or triage.infra not in ("likely", "unknown") or triage.next != "diagnose":
        return False, f"job {job.job}: not diagnosing: {said}"
    return True, f"job {job.job} failed on {len(job.nodes)} nodes: {said}: diagnosing"


def holds(cfg: SlurmConfig, job: JobEnd, views: Mapping[str, NodeView | None],
          unreachable: Mapping[str, str] | None = None) -> list[Action]:
    """Step 2: hold each node of the job that nobody else owns and whose robustd answers (`unreachable`: node →
    why not; such a node stays as Slurm has it: nothing could be learnt of it); leave the rest as they are."""
    out = []
    reason = hold_reason(cfg, job.job)
    for name in job.nodes:
        v = views.get(name)
        if v is None:
            out.append(Action(name, Step.LEAVE, note=f"{name}: Slurm did not report it; left as it is"))
        elif unreachable and name in unreachable:
            out.append(Action(name, Step.LEAVE, note=f"{name}: its robustd did not answer ({unreachable[name]}); "
                                                     "not held, left as Slurm has it"))
        elif v.out_of_service and not v.reason.startswith(cfg.reason_prefix):
            out.append(Action(name, Step.LEAVE, note=f"{name} is held by someone else ({v.describe()}); "
                                                     "not held, not released"))
        elif v.out_of_service:
            out.append(Action(name, Step.LEAVE, note=f"{name} is already out with robustd's reason "
                                                     f"({v.reason!r}); left to it"))
        else:
            out.append(Action(name, Step.HOLD, reason=reason, note=f"{name} held: {reason}"))
    return out


def still_held(cfg: SlurmConfig, job: str, view: NodeView | None) -> bool:
    """The node carries exactly this job's hold: the hook still owns it."""
    return view is not None and "DRAIN" in view.flags and view.reason == hold_reason(cfg, job)


@dataclass(frozen=True)
class Finding:
    """A suspect of the diagnosis, by Slurm node name (robustd.fleet.diagnosis.Suspect mapped by the hook)."""

    node: str
    kind: str  # host, link, unreachable
    reason: str
    peers: tuple[str, ...] = ()


def findings(suspects: Sequence[Suspect], node_of: Mapping[str, str]) -> list[Finding]:
    """Diagnosis.suspects (host = the target string the hook dialled) as node names; a link's peers too, and
    the targets a reason names ("with 10.1.0.7:7070: bus bandwidth ..."), so `sinfo -R` speaks Slurm's names."""
    def named(text: str) -> str:
        for target in sorted(node_of, key=len, reverse=True):  # the longest first: one may end another
            text = text.replace(target, node_of[target])
        return text

    return [Finding(node_of.get(s.host, s.host), s.kind, named(s.reason), tuple(node_of.get(p, p) for p in s.peers))
            for s in suspects]


def _blamed(found: Sequence[Finding]) -> dict[str, str]:
    """Node → why it is drained: a host suspect, or either end of a bad link (one cannot tell which end)."""
    out: dict[str, str] = {}
    for f in found:
        if f.kind == "host":
            out.setdefault(f.node, f.reason)
        elif f.kind == "link":
            for n in (f.node, *f.peers):
                out.setdefault(n, f"link {f.node}-{','.join(f.peers)}: {f.reason}")
    return out


def _breaker(cfg: SlurmConfig, v: NodeView, reason: str, counted: list[tuple[str, str, str]],
             now: float) -> Suppression | None:
    """The circuit breaker for one more drain; a drain it allows counts (in `counted`) for the next one."""
    sup = breaker(cfg, v, list(counted), reason, now)
    if sup is None:
        counted += [(v.name, p, reason) for p in v.partitions]
    return sup


def settle(cfg: SlurmConfig, job: str, held: Sequence[str], outcome: str | None, found: Sequence[Finding],
           views: Mapping[str, NodeView | None], rows: Sequence[tuple[str, str, str]], now: float,
           why_not: str = "") -> list[Action]:
    """Step 4: after the diagnosis, for each node this hook held: drain a suspect, release the others.

    `outcome` None: the diagnosis could not run (`why_not`): every hold is released. `views`: Slurm's view of
    each held node right now; a node whose reason is no longer this hold's was taken by someone meanwhile and
    is left. `rows`: sinfo (node, partition, reason) of the held nodes' partitions, for the breaker; holds
    (any job's) do not count as robustd's drains there, the drains decided here do, in order.
    """
    out: list[Action] = []
    blamed = _blamed(found) if outcome is not None else {}
    unreachable = {f.node for f in found if f.kind == "unreachable"}
    counted = [r for r in rows if not is_hold(cfg, r[2])]
    for name in held:
        v = views.get(name)
        if v is None:
            out.append(Action(name, Step.LEAVE, note=f"{name}: Slurm did not report it; its hold stays for an "
                                                     "operator or robustd-slurm"))
            continue
        if not still_held(cfg, job, v):
            out.append(Action(name, Step.LEAVE, note=f"{name} was changed meanwhile ({v.describe()}); left"))
            continue
        if outcome is None:
            out.append(Action(name, Step.RELEASE, note=f"{name} released: the diagnosis could not run"
                              + (f" ({why_not})" if why_not else "")))
            continue
        if name in blamed:
            reason = clean(f"{cfg.reason_prefix} job {job} diagnosis {outcome}: {blamed[name]}")
            if sup := _breaker(cfg, v, reason, counted, now):
                out.append(Action(name, Step.RELEASE, note=f"{sup.text()}; {name} released"))
                continue
            out.append(Action(name, Step.DRAIN, reason=reason, note=f"{name} drained: {reason}"))
        elif name in unreachable:
            out.append(Action(name, Step.RELEASE, note=f"{name} released: its robustd did not answer, nothing "
                                                       "known against it"))
        else:
            out.append(Action(name, Step.RELEASE, note=f"{name} released: diagnosis {outcome}, not a suspect"))
    return out


def preflight(cfg: SlurmConfig, job: str, outcome: str | None, found: Sequence[Finding],
              views: Mapping[str, NodeView | None], rows: Sequence[tuple[str, str, str]],
              now: float) -> list[Action]:
    """prolog-ctld: drain each suspect that is in service (nothing is held before a job); the rest are left.

    The hook exits non-zero (Slurm requeues the job) only when one of these drains was carried out; a
    diagnosis that could not run (`outcome` None) drains nothing, so the job starts (fail open).
    """
    if outcome is None:
        return []
    out: list[Action] = []
    counted = [r for r in rows if not is_hold(cfg, r[2])]
    for name, why in _blamed(found).items():
        v = views.get(name)
        if v is None or v.out_of_service:
            out.append(Action(name, Step.LEAVE, note=f"{name} is a suspect but "
                              + ("Slurm did not report it" if v is None else f"already out ({v.describe()})")))
            continue
        reason = clean(f"{cfg.reason_prefix} job {job} preflight {outcome}: {why}")
        if sup := _breaker(cfg, v, reason, counted, now):
            out.append(Action(name, Step.LEAVE, note=f"{sup.text()}; {name} stays in service"))
            continue
        out.append(Action(name, Step.DRAIN, reason=reason, note=f"{name} drained before job {job}: {reason}"))
    return out
