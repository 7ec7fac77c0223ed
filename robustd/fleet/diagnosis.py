"""A job-level diagnosis on plain types: what each host's runs showed, who is to blame, the public JSON.

robustd/fleet/diagnose.py runs the phases against the daemons and turns their reports into the plain
`RunOutcome`s here; everything that decides — a local FAIL, who the all-gather's witnesses name, the
ring's pairs (rings.py), the outcome and the exit code — is a pure function of them, tested with plain
data. The JSON of `Diagnosis.to_json` is a public contract (README "Stop-time diagnostics").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from robustd.cli import exitcodes
from robustd.fleet.rings import PairResult

PHASES = ("local", "inter", "pairs")
COLLECTIVE = "all_gather"  # the test the inter and pairs phases run; never part of the local phase

# Exit codes of `robustctl fleet diagnose` (Diagnosis.exit_code).
EXIT_PASS = exitcodes.OK
EXIT_SUSPECTS = exitcodes.SUSPECTS  # a host or a link is named
EXIT_UNREACHABLE = exitcodes.UNREACHABLE  # no host or link named, and the only gap is hosts that did not answer
EXIT_INCOMPLETE = exitcodes.INCOMPLETE  # could not run in full: a test or a collective failed where it had to run


@dataclass(frozen=True)
class Target:
    """A host to diagnose: `host` as `fleet status` takes it (HOST[:PORT], unix:PATH, a socket path), and
    `addr`, the address the other hosts reach it at for the collectives."""

    host: str
    addr: str


@dataclass(frozen=True)
class Result:
    """The parts of one TestResult that judging needs."""

    test: str
    component: str
    status: str  # PASS, FAIL, SKIPPED, ERROR
    message: str = ""
    busbw_gbps: float | None = None
    peer_rank: int | None = None  # all_gather: the node rank a `node/...` result is about
    cause: str = ""  # all_gather: why it could not run (`rendezvous`, `harness`), when it says


@dataclass(frozen=True)
class RunOutcome:
    """One host's Run in one phase.

    `state`: `done` (the report came), `refused` (the daemon answered the Run with an error: busy, GPUs in
    use, not authorized, a bad request), `unreachable` (contact lost), `hung` (still running at the phase's
    deadline: cancelled there), `cancelled` (by the caller, Ctrl-C).
    """

    state: str
    report_id: str = ""
    outcome: str = ""  # the report's: PASS, FAIL, ERROR, CANCELLED
    message: str = ""  # the report's message, or the error
    results: tuple[Result, ...] = ()


@dataclass(frozen=True)
class Suspect:
    host: str
    kind: str  # host, link, unreachable
    reason: str
    peers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "kind": self.kind, "reason": self.reason, "peers": list(self.peers)}


@dataclass
class HostRecord:
    """One row of the diagnosis: what each phase said of this host."""

    host: str
    addr: str
    node: str = ""  # the daemon's node name (GetVerdict), when it answered
    local: str = "SKIPPED"  # PASS, FAIL, ERROR, HUNG, UNREACHABLE, SKIPPED (did not take part)
    inter: str = "SKIPPED"
    pairs: str = "SKIPPED"
    busbw_gbps: float | None = None  # its lowest pair's bus bandwidth (the all-gather's without pairs)
    reports: list[str] = field(default_factory=list)  # every report id it made for this diagnosis
    notes: list[str] = field(default_factory=list)  # why it was not (fully) diagnosed

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "addr": self.addr, "local": self.local, "inter": self.inter,
                "pairs": self.pairs, "busbw_gbps": self.busbw_gbps, "reports": list(self.reports)}


@dataclass
class PhaseRecord:
    name: str
    seconds: float = 0.0
    outcome: str = "SKIPPED"  # PASS, FAIL, ERROR, CANCELLED, SKIPPED

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 3), "outcome": self.outcome}


@dataclass(frozen=True)
class PhaseProgress:
    """What the progress callback is told: a phase started, is running (about once a second), finished."""

    phase: str  # local, inter, pairs
    state: str  # started, running, finished
    seconds: float = 0.0  # since the phase started
    done: int = 0  # runs finished (in this round, for pairs)
    total: int = 0  # runs started
    round: int = 0  # pairs: the round (1-based) and how many there are
    rounds: int = 0
    outcome: str = ""  # when finished


@dataclass
class Diagnosis:
    run_id: str
    hosts: list[HostRecord]
    phases: list[PhaseRecord]
    suspects: list[Suspect] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what could not be judged, for people (not in the JSON)
    gaps: bool = False  # something other than an unreachable host could not be diagnosed
    cancelled: bool = False

    @property
    def outcome(self) -> str:
        """FAIL when a host or a link is named; ERROR when nothing is but something could not be diagnosed
        (a host unreachable, a test that could not run, a cancel); PASS otherwise."""
        if any(s.kind in ("host", "link") for s in self.suspects):
            return "FAIL"
        if self.gaps or self.cancelled or any(s.kind == "unreachable" for s in self.suspects):
            return "ERROR"
        return "PASS"

    @property
    def exit_code(self) -> int:
        out = self.outcome
        if out == "PASS":
            return EXIT_PASS
        if out == "FAIL":
            return EXIT_SUSPECTS
        return EXIT_INCOMPLETE if self.gaps or self.cancelled else EXIT_UNREACHABLE

    def to_json(self) -> dict[str, Any]:
        """The public object: outcome, suspects, hosts, phases, seconds (and the run id the reports carry)."""
        return {"outcome": self.outcome, "run_id": self.run_id, "suspects": [s.to_json() for s in self.suspects],
                "hosts": [h.to_json() for h in self.hosts], "phases": [p.to_json() for p in self.phases],
                "seconds": round(self.seconds, 3)}


# ---- the local phase ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalVerdict:
    column: str  # PASS, FAIL, ERROR, HUNG, UNREACHABLE, SKIPPED
    reason: str = ""
    suspect: bool = False  # a FAIL: evidence against the host
    excluded: bool = False  # left out of the collectives


def _status_of(results: Sequence[Result]) -> str:
    statuses = {r.status for r in results}
    for s in ("FAIL", "ERROR", "PASS"):
        if s in statuses:
            return s
    return "SKIPPED"


def judge_local(run: RunOutcome) -> LocalVerdict:
    """The node-local tests of one host: a FAIL names it and leaves it out of what follows; an ERROR (a test
    that could not run) is reported, not blamed; a daemon that refused, hung or went away is left out."""
    if run.state == "unreachable":
        return LocalVerdict("UNREACHABLE", run.message, excluded=True)
    if run.state == "refused":
        return LocalVerdict("ERROR", f"the daemon refused the local tests: {run.message}", excluded=True)
    if run.state == "hung":
        return LocalVerdict("HUNG", "the local tests did not finish by the phase's deadline (cancelled)",
                            excluded=True)
    if run.state == "cancelled":
        return LocalVerdict("ERROR", "cancelled", excluded=True)
    local = [r for r in run.results if r.test != COLLECTIVE]  # a level's all_gather: SKIPPED, no rendezvous
    status = _status_of(local)
    if status == "FAIL":
        return LocalVerdict("FAIL", "local tests failed: " + "; ".join(
            f"{r.test} {r.component}: {r.message}" for r in local if r.status == "FAIL"), suspect=True,
            excluded=True)
    if run.outcome == "CANCELLED":
        return LocalVerdict("ERROR", f"the run was cancelled on the daemon: {run.message}")
    if status == "ERROR":
        return LocalVerdict("ERROR", "a local test could not run: " + "; ".join(
            f"{r.test} {r.component}: {r.message}" for r in local if r.status == "ERROR"))
    return LocalVerdict(status)


# ---- the collectives ------------------------------------------------------------------------------

MAX_SAID = 300  # characters of one daemon's message in a pair's reason


def _cut(message: str) -> str:
    return message if len(message) <= MAX_SAID else message[:MAX_SAID - 3] + "..."


def _rendezvous_error(r: Result) -> bool:
    """The all-gather's own ERROR saying its ranks could not meet: the data plane, not the harness."""
    return r.status == "ERROR" and (r.cause == "rendezvous" or r.message.startswith("ranks could not rendezvous"))


def collective_column(run: RunOutcome | None) -> str:
    """A host's run in a collective, as its row shows it."""
    if run is None:
        return "SKIPPED"
    if run.state == "done":
        return {"PASS": "PASS", "FAIL": "FAIL"}.get(run.outcome, "ERROR")
    return {"hung": "HUNG", "unreachable": "UNREACHABLE"}.get(run.state, "ERROR")


@dataclass
class InterJudgement:
    columns: dict[int, str] = field(default_factory=dict)  # rank → the host's row value
    blamed: dict[int, str] = field(default_factory=dict)  # rank → why (named by most of its peers)
    witnesses: dict[int, list[int]] = field(default_factory=dict)  # rank → the ranks that named it
    errors: dict[int, str] = field(default_factory=dict)  # rank → why its run told nothing
    busbw_gbps: dict[int, float] = field(default_factory=dict)
    outcome: str = "SKIPPED"


def judge_inter(runs: Sequence[RunOutcome | None]) -> InterJudgement:
    """One all-gather across every remaining host (rank = position in `runs`).

    A host is blamed when most of the other hosts whose reports came back name it FAIL (a crash, wrong
    bytes it sent, late, never joined) — with three hosts or more only: two hosts cannot tell each other
    apart. Pairs (rings.py) decide between a machine and a link; this is what a quick pass has.
    """
    out = InterJudgement()
    m = len(runs)
    said: dict[int, dict[int, str]] = {}  # accused → witness → message
    for r, run in enumerate(runs):
        out.columns[r] = collective_column(run)
        if run is None:
            continue
        if run.state != "done":
            out.errors[r] = {"hung": "did not finish by the phase's deadline (cancelled)"}.get(
                run.state, run.message or run.state)
            continue
        for x in run.results:
            if x.test != COLLECTIVE:
                continue
            if x.status == "FAIL" and x.peer_rank is not None and x.peer_rank != r and 0 <= x.peer_rank < m:
                said.setdefault(x.peer_rank, {})[r] = x.message
            elif x.status == "ERROR" and x.component == "host":
                out.errors[r] = x.message
            if x.status == "PASS" and x.busbw_gbps is not None:
                out.busbw_gbps[r] = x.busbw_gbps
    answered = [r for r, run in enumerate(runs) if run is not None and run.state == "done"]
    never_ran = {r for r, run in enumerate(runs) if run is None or run.state in ("refused", "unreachable")}
    if m >= 3:
        for k, by in sorted(said.items()):
            if k in never_ran:
                continue  # "never joined": its daemon refused the run or went away, no evidence of its hardware
            others = [r for r in answered if r != k]
            if others and len(by) * 2 > len(others):
                first = by[min(by)]
                out.blamed[k] = (f"the all-gather across {m} hosts: {first} (said by {len(by)} of the "
                                 f"{len(others)} other hosts that answered)")
                out.witnesses[k] = sorted(by)
    cols = set(out.columns.values())
    out.outcome = ("PASS" if cols == {"PASS"} else "FAIL" if cols & {"FAIL", "HUNG"} or out.blamed else "ERROR")
    return out


def pair_result(pair: tuple[int, int], runs: tuple[RunOutcome | None, RunOutcome | None],
                names: Mapping[int, str] | None = None) -> PairResult:
    """What one pair's all-gather showed (`runs`: the two hosts' runs, the rendezvous master's first).

    Bad: a FAIL on either side, a rendezvous that could not complete, a run that hung. Untested: a daemon
    that refused or went away (whatever the other side saw of it), the harness that could not run: no
    evidence about the link or either host.
    """
    def name(h: int) -> str:
        return names.get(h, f"host {h}") if names is not None else f"host {h}"

    never_ran = [f"{name(h)}: {run.message or run.state}" if run is not None else f"{name(h)}: not started"
                 for h, run in zip(pair, runs, strict=True) if run is None or run.state not in ("done", "hung")]
    if never_ran:  # what the other saw (never joined) is explained: a refusal is no evidence about the link
        return PairResult(pair, untested=True, why="; ".join(never_ran))
    bad: list[str] = []
    untested: list[str] = []
    busbw: list[float] = []
    for host, run in zip(pair, runs, strict=True):
        who = name(host)
        if run is None:
            continue  # (never_ran above)
        if run.state == "hung":
            bad.append(f"{who} did not finish by the phase's deadline (cancelled)")
            continue
        ag = [x for x in run.results if x.test == COLLECTIVE]
        fails = [x.message for x in ag if x.status == "FAIL"]
        rdv = [x.message for x in ag if _rendezvous_error(x)]
        if fails or rdv:
            bad.append(f"{who} saw: {'; '.join(_cut(m) for m in fails + rdv)}")
        elif any(x.status == "ERROR" for x in ag) or not ag:
            untested.append(f"{who}: " + ("; ".join(x.message for x in ag if x.status == "ERROR")
                                          or run.message or "no all_gather result"))
        else:
            busbw += [x.busbw_gbps for x in ag if x.status == "PASS" and x.busbw_gbps is not None][:1]
    if bad:
        return PairResult(pair, bad=True, why="; ".join(bad))
    if untested:
        return PairResult(pair, untested=True, why="; ".join(untested))
    if len(busbw) < 2:
        return PairResult(pair, untested=True, why="no bus bandwidth figure")
    return PairResult(pair, busbw_gbps=sum(busbw) / len(busbw))
