"""Stop-time diagnostics on plain types: what a run asks for, one test's result, the report, a golden.

The manager, the child launcher and the event log's SQLite file use these; only robustd/api/ turns
them into protobuf messages and back (robustd/api/diagnostics_convert.py). A report is stored as the
JSON of `report_to_json`: enum members by name, times in seconds since the epoch.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from robustd.model import Action, Severity


class Outcome(enum.IntEnum):
    """A report's outcome (the numbers are the API's)."""

    PASS = 1  # no fault found: restart the job in place
    FAIL = 2  # see severity, action and suspects
    CANCELLED = 3
    ERROR = 4  # the diagnostic itself could not run properly
    RUNNING = 5


class Status(enum.IntEnum):
    """One test result's status (the numbers are the API's)."""

    PASS = 1
    FAIL = 2
    SKIPPED = 3  # with a reason in message; never a PASS
    ERROR = 4


class Phase(enum.IntEnum):
    """A progress message's phase (the numbers are the API's)."""

    STARTED = 1
    PROGRESS = 2
    FINISHED = 3  # `results` holds the test's results
    DONE = 4  # the last message; `report` holds the final report


@dataclass
class TestResult:
    """One verdict of one test on one component (`gpu/<bus id>`, `node/<name>`, `rank/<n>` or `host`)."""

    __test__ = False  # not a pytest class

    test: str
    component: str
    status: Status
    message: str = ""
    figures: dict[str, float] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)


@dataclass
class Report:
    """A run's report: RUNNING while it runs, then its outcome; kept in the event log's database."""

    id: str
    outcome: Outcome
    node: str = ""
    tests: list[str] = field(default_factory=list)  # what was asked, in order
    started: float | None = None
    finished: float | None = None
    severity: Severity | None = None  # set when the run finishes
    action: Action | None = None
    suspects: list[str] = field(default_factory=list)
    results: list[TestResult] = field(default_factory=list)
    message: str = ""
    run_id: str = ""  # the caller's tag (RunRequest.run_id, else its rendezvous's run_id)


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one all_gather meet (from the scheduler)."""

    master_addr: str
    master_port: int
    world_size: int  # nodes
    node_rank: int
    run_id: str = ""


@dataclass(frozen=True)
class RunRequest:
    """What a caller asks a run to do: tests or a level, on which GPUs, within what time."""

    tests: tuple[str, ...] = ()
    level: str = ""
    gpus: tuple[str, ...] = ()  # bus ids; empty: all
    stop_on_failure: bool = True
    timeout: float | None = None  # seconds; None: diagnostics.timeout
    force: bool = False  # run even while GPU compute processes are alive
    rendezvous: Rendezvous | None = None
    test_faults_json: str = ""  # test-only fault injection (diagnostics.test_faults)
    run_id: str = ""  # the caller's tag, kept in the report (a job id, a fleet diagnosis's run id)

    @property
    def tag(self) -> str:
        """The report's run id: the request's own, else its rendezvous's (the job the collective belongs to)."""
        return self.run_id or (self.rendezvous.run_id if self.rendezvous is not None else "")


@dataclass(frozen=True)
class Progress:
    """One message of a run's stream."""

    id: str
    phase: Phase
    test: str = ""
    percent: float = 0.0
    message: str = ""
    results: tuple[TestResult, ...] = ()
    report: Report | None = None


@dataclass(frozen=True)
class Golden:
    """A MiniGPT node digest known to be right for one (device, driver, torch, model, steps) key."""

    key: str
    digest: str
    report_id: str
    recorded_at: float


def report_to_json(r: Report) -> str:
    return json.dumps({
        "id": r.id, "outcome": r.outcome.name, "node": r.node, "tests": list(r.tests), "started": r.started,
        "finished": r.finished, "severity": r.severity.name if r.severity is not None else None,
        "action": r.action.name if r.action is not None else None, "suspects": list(r.suspects),
        "results": [{"test": x.test, "component": x.component, "status": x.status.name, "message": x.message,
                     "figures": dict(x.figures), "details": dict(x.details)} for x in r.results],
        "message": r.message, "run_id": r.run_id}, sort_keys=True)


def report_from_json(text: str) -> Report:
    d: dict[str, Any] = json.loads(text)
    return Report(
        id=d["id"], outcome=Outcome[d["outcome"]], node=d.get("node", ""), tests=list(d.get("tests", [])),
        started=d.get("started"), finished=d.get("finished"),
        severity=Severity[d["severity"]] if d.get("severity") else None,
        action=Action[d["action"]] if d.get("action") else None, suspects=list(d.get("suspects", [])),
        results=[TestResult(test=x["test"], component=x["component"], status=Status[x["status"]],
                            message=x.get("message", ""), figures=dict(x.get("figures", {})),
                            details=dict(x.get("details", {}))) for x in d.get("results", [])],
        message=d.get("message", ""), run_id=d.get("run_id", ""))
