"""Diagnostics' plain types (robustd/diagnostics/model.py) ↔ protobuf: the only place they meet.

Also reads the reports earlier versions stored as serialized `DiagnosticReport`s, so that
`migrate_reports` can move them to the JSON the event log keeps now.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from robustd.api.convert import ts
from robustd.api.requests import duration
from robustd.api.v1 import robustd_pb2 as pb
from robustd.diagnostics.model import (
    Golden,
    Outcome,
    Progress,
    Rendezvous,
    Report,
    RunRequest,
    Status,
    TestResult,
    report_to_json,
)
from robustd.model import Action, Severity
from robustd.store import Store

log = logging.getLogger("robustd.diag")


def run_request(req: pb.RunRequest) -> RunRequest:
    """The request as the manager takes it; raises requests.Invalid for a timeout no Duration can be."""
    rv = req.rendezvous if req.HasField("rendezvous") else None
    return RunRequest(
        tests=tuple(req.tests), level=req.level, gpus=tuple(req.gpus),
        stop_on_failure=req.stop_on_failure if req.HasField("stop_on_failure") else True,
        timeout=duration(req.timeout, "timeout") if req.HasField("timeout") else None, force=req.force,
        rendezvous=None if rv is None else Rendezvous(master_addr=rv.master_addr, master_port=rv.master_port,
                                                      world_size=rv.world_size, node_rank=rv.node_rank,
                                                      run_id=rv.run_id),
        test_faults_json=req.test_faults_json, run_id=req.run_id)


def result(x: TestResult) -> pb.TestResult:
    return pb.TestResult(test=x.test, component=x.component, status=int(x.status), message=x.message,
                         figures=x.figures, details=x.details)


def report(r: Report) -> pb.DiagnosticReport:
    return pb.DiagnosticReport(
        id=r.id, outcome=int(r.outcome), severity=int(r.severity or 0), action=int(r.action or 0),
        suspects=r.suspects, results=[result(x) for x in r.results], node=r.node, tests=r.tests,
        started=ts(r.started), finished=ts(r.finished), message=r.message, run_id=r.run_id)


def progress(p: Progress) -> pb.DiagnosticProgress:
    return pb.DiagnosticProgress(id=p.id, test=p.test, phase=int(p.phase), percent=p.percent, message=p.message,
                                 results=[result(x) for x in p.results],
                                 report=None if p.report is None else report(p.report))


def golden(g: Golden) -> pb.Golden:
    return pb.Golden(key=g.key, digest=g.digest, report_id=g.report_id, recorded_at=ts(g.recorded_at))


def _seconds(msg: pb.DiagnosticReport, name: str) -> float | None:
    return getattr(msg, name).ToNanoseconds() / 1e9 if msg.HasField(name) else None


def report_from_pb(m: pb.DiagnosticReport) -> Report:
    """A report as an earlier robustd stored it; values it did not set (or no longer known) read as such."""
    return Report(
        id=m.id, outcome=Outcome(m.outcome) if m.outcome in Outcome._value2member_map_ else Outcome.ERROR,
        node=m.node, tests=list(m.tests), started=_seconds(m, "started"), finished=_seconds(m, "finished"),
        severity=Severity(m.severity) if m.severity in Severity._value2member_map_ else None,
        action=Action(m.action) if m.action in Action._value2member_map_ else None, suspects=list(m.suspects),
        results=[TestResult(test=x.test, component=x.component,
                            status=Status(x.status) if x.status in Status._value2member_map_ else Status.ERROR,
                            message=x.message, figures=dict(x.figures), details=dict(x.details))
                 for x in m.results],
        message=m.message, run_id=m.run_id)


def legacy_report(blob: bytes) -> tuple[str, str] | None:
    """(outcome name, JSON) of a report stored as a serialized DiagnosticReport, or None if unreadable."""
    try:
        r = report_from_pb(pb.DiagnosticReport.FromString(blob))
    except (DecodeError, ValueError):
        return None
    return r.outcome.name, report_to_json(r)


def migrate_reports(store: Store) -> None:
    """At start, before anything else writes: reports of earlier versions become JSON rows."""
    moved, unreadable = store.migrate_reports(legacy_report)
    if moved or unreadable:
        log.info("moved %d diagnostic reports of an earlier robustd to JSON%s", moved,
                 f"; {unreadable} could not be read and were dropped" if unreadable else "")
