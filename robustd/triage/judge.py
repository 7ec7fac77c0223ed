"""Name the root cause of a failed job from its logs and exit status.

A job failure is a cascade: one rank's ECC error or KeyError is followed, on every other rank,
by aborted NCCL communicators, watchdog timeouts and a launcher's "child failed" summary. The
loudest lines are the consequences, so the judge looks for the *first* failure:

1. Every log is scanned for failure lines (scan.py): rule matches and unexplained tracebacks.
2. Causes decide over symptoms, symptoms over context (rules.yaml `tier`).
3. Among the lines of the deciding tier, the earliest in time wins. Lines within
   `SAME_TIME` seconds of the earliest (or without any timestamp, so not provably later) are
   one cluster, and the class with the highest `priority` in it wins: a GPU fault explains a
   CUDA error printed in the same second, never the reverse. Symptoms in one file are taken in
   the file's order first (a watchdog timeout before the abort it causes).
4. The exit status decides when the logs hold nothing: 0 means the job succeeded, a signal
   from outside (TERM, INT, HUP) means it was stopped, anything else is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence

from robustd.triage.model import MAX_EVIDENCE, MAX_EVIDENCE_TEXT, MAX_LOGS, Evidence, LogText, Triage
from robustd.triage.rules import RuleSet, shipped
from robustd.triage.scan import Hit, scan
from robustd.triage.status import exit_signal

SAME_TIME = 2.0  # seconds: loggers buffer and round; closer than this is "at the same time"
MAX_RANKS = 4096
_STOPPED = {"SIGTERM", "SIGINT", "SIGHUP"}  # sent by an operator or the scheduler (scancel, time limit)
_TIERS = ("cause", "symptom", "context")
# A SIGKILL that no line explains is taken for the OOM killer's: the kernel's and the container runtime's
# (Kubernetes OOMKilled, exit 137) print nothing in the job's own log, while the others who stop a job
# (scancel, a time limit, preemption, a pod's eviction) send SIGTERM first or print a banner, and a
# launcher that kills its children says so. Not proven, so infra unknown.
_BARE_SIGKILL = ("killed with no line saying why, most often by the host's or the container's OOM killer (its "
                 "own line is in the kernel log or the pod's status, OOMKilled, not in the job's log); infra unknown")


def triage(logs: Sequence[LogText], exit_code: int | None = None, signal: str | None = None,
           rules: RuleSet | None = None) -> Triage:
    """The class, infra, next step and evidence for a job that ended with `exit_code`/`signal`."""
    rules = rules or shipped()
    sig = exit_signal(exit_code, signal)
    partial = tuple(log.name for log in logs[:MAX_LOGS] if not log.whole)
    hits = [] if succeeded(exit_code, sig) else [h for i, log in enumerate(logs[:MAX_LOGS])
                                                 for h in scan(log, i, rules)]
    return judge(hits, partial, exit_code, sig, rules, bool(logs))


def succeeded(exit_code: int | None, sig: str | None) -> bool:
    return exit_code == 0 and sig is None


def judge(hits: list[Hit], partial: tuple[str, ...], exit_code: int | None, sig: str | None, rules: RuleSet,
          any_log: bool) -> Triage:
    """The answer from the failure lines of every log (scan.py), however they were read."""
    if succeeded(exit_code, sig):
        return Triage("unknown", "unlikely", "none", reason="the job exited 0: nothing to triage", partial=partial)
    if sig == "SIGKILL":
        hits = _killed(hits)
    for tier in _TIERS:
        tiered = [h for h in hits if h.tier == tier]
        if tiered:
            return _answer(_first(tiered, tier), tiered, hits, partial, exit_code, sig)
    return _no_evidence(rules, exit_code, sig, partial, any_log)


def _killed(hits: list[Hit]) -> list[Hit]:
    """SIGKILL with the shell's `Killed` line or an OOM message: the host's OOM killer (a cause)."""
    for h in hits:
        if h.klass == "oom_host" and h.tier == "symptom":
            h.tier = "cause"
    return hits


def _first(hits: list[Hit], tier: str) -> Hit:
    timed = [h.ts for h in hits if h.ts is not None]
    earliest = min(timed) if timed else None
    cluster = [h for h in hits if h.ts is None or earliest is None or h.ts <= earliest + SAME_TIME]
    if tier != "cause":  # in one file, a consequence follows its cause: keep each file's first
        firsts: dict[int, Hit] = {}
        for h in sorted(cluster, key=lambda h: (h.log, h.line)):
            firsts.setdefault(h.log, h)
        cluster = list(firsts.values())
    # Within the cluster time no longer orders (closer than SAME_TIME, or unknown): the class's priority
    # does, then the order the logs were given in and the line's place in its log.
    return min(cluster, key=lambda h: (-h.priority, h.log, h.line))


def _clip(text: bytes) -> str:
    s = text.decode("utf-8", "replace")
    s = "".join(ch if ch.isprintable() else " " for ch in s).strip()
    return s if len(s) <= MAX_EVIDENCE_TEXT else s[:MAX_EVIDENCE_TEXT - 1] + "…"


def _evidence(root: Hit, same: list[Hit]) -> tuple[Evidence, ...]:
    out = [Evidence(root.name, root.line, _clip(root.text), root.offset, root.rank, root.rule)]
    out += [Evidence(root.name, line, _clip(text), offset, root.rank, root.rule) for line, offset, text in root.extra]
    # Then the same class elsewhere: one line per (log, rank) first, so that every rank shows, then more.
    seen = {(root.log, root.rank)}
    first: list[Hit] = []
    rest: list[Hit] = []
    for h in same:
        (rest if (h.log, h.rank) in seen else first).append(h)
        seen.add((h.log, h.rank))
    for h in first + rest:
        if len(out) >= MAX_EVIDENCE:
            break
        out.append(Evidence(h.name, h.line, _clip(h.text), h.offset, h.rank, h.rule))
    return tuple(out)


def _answer(root: Hit, tiered: list[Hit], hits: list[Hit], partial: tuple[str, ...], exit_code: int | None,
            sig: str | None) -> Triage:
    # The same class at any tier: the first NCCL WARN of a socket failure is worth showing beside the
    # "internal error" that decided, and a SIGKILL's rank comes from the launcher's table.
    same = sorted((h for h in hits if h.klass == root.klass and h is not root),
                  key=lambda h: (_TIERS.index(h.tier), h.ts is None, h.ts or 0.0, h.log, h.line))
    weight = max((h.rank_weight for h in (root, *same) if h.rank is not None), default=0)
    ranks = sorted({h.rank for h in (root, *same) if h.rank is not None and h.rank_weight == weight})[:MAX_RANKS]
    if not ranks:  # a line without a rank: the launcher's failure table in the same log may name one
        named = {h.rank for h in hits if h.log == root.log and h.rule == "child-failed" and h.rank is not None
                 and h.rank_weight == 2}
        ranks = sorted(named) if len(named) == 1 else []
    where = f"rank {root.rank}, " if root.rank is not None else ""
    reason = f"{root.description} ({where}{root.name}:{root.line})"
    later = [h for h in hits if h.klass != root.klass and h.tier != "context"]
    if later:
        classes = ", ".join(sorted({h.klass for h in later}))
        reason += f"; {len(later)} other failure line{'s' if len(later) != 1 else ''} ({classes}) judged consequences"
    infra = root.infra
    user = _user_side(root, hits)
    if user is not None:
        infra = "unknown"
        reason += f"; infra unknown, not {root.infra}: the logs show a user-side cause too ({user.description}, " \
                  f"{user.name}:{user.line})"
    if exit_code is not None or sig:
        reason += f"; job {_status(exit_code, sig)}"
    return Triage(klass=root.klass, infra=infra, next=root.next,
                  level=root.level if root.next == "diagnose" else None, evidence=_evidence(root, same),
                  ranks=tuple(ranks), reason=reason, partial=partial)


def _user_side(root: Hit, hits: list[Hit]) -> Hit | None:
    """For a hang, the job's own exception anywhere in the logs: the stall may be the job's, not the machine's.

    Most job hangs are infrastructure (ByteRobust's incident table: 21 of 26), so a hang is infra
    `likely`, unless a rank raised an exception of its own (one that was not handled): a rank that
    died of a KeyError leaves the others waiting in a collective just as a dead link does.
    """
    if root.klass != "hang":
        return None
    return next((h for h in hits if h.klass == "user_code" and h.tier != "context"), None)


def _no_evidence(rules: RuleSet, exit_code: int | None, sig: str | None, partial: tuple[str, ...],
                 any_log: bool) -> Triage:
    seen = "no failure line in the logs" if any_log else "no logs"
    if sig in _STOPPED:
        return Triage("unknown", "unlikely", "none", reason=f"{seen}; stopped by {sig} from outside "
                      "(scancel, a time limit, preemption)", partial=partial)
    if sig == "SIGKILL":  # nothing printed: see _BARE_SIGKILL
        spec = rules.classes["oom_host"]
        return Triage("oom_host", "unknown", spec.next, level=spec.level if spec.next == "diagnose" else None,
                      reason=f"{seen}; {_status(exit_code, sig)}: {_BARE_SIGKILL}", partial=partial)
    spec = rules.classes["unknown"]
    return Triage("unknown", spec.infra, spec.next, level=spec.level if spec.next == "diagnose" else None,
                  reason=f"{seen}; {_status(exit_code, sig, unknown='exit status unknown')}", partial=partial)


def _status(exit_code: int | None, sig: str | None, unknown: str = "") -> str:
    """`exit 1`, `exit 137, SIGKILL`, `SIGKILL`; `unknown` when neither is known."""
    code = f"exit {exit_code}" if exit_code is not None else unknown
    return ", ".join(part for part in (code, sig) if part)
