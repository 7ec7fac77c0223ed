"""Diagnostic reports stored by an earlier robustd still show after an upgrade.

Versions up to the plain-types refactor kept each report as a serialized `robustd.v1.DiagnosticReport`
in a table `diagnostics`; robustd now keeps JSON (robustd/diagnostics/model.py) and moves the old rows
on start. The old format is written here as that code wrote it, so the test keeps holding it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

# The previous version's table, as its store.py created it.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS diagnostics (
    id TEXT PRIMARY KEY,
    started REAL NOT NULL,
    outcome INTEGER NOT NULL,
    report BLOB NOT NULL  -- a serialized robustd.v1.DiagnosticReport
);
CREATE INDEX IF NOT EXISTS diagnostics_started ON diagnostics (started);
"""


def _ts(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def _old_store(state_dir: str, reports: list[pb.DiagnosticReport]) -> None:
    """A state directory as the previous version left it: the report row of each, protobuf bytes."""
    Path(state_dir).mkdir(parents=True)
    with sqlite3.connect(Path(state_dir) / "robustd.db") as db:
        db.executescript(OLD_SCHEMA)
        for r in reports:
            db.execute("INSERT OR REPLACE INTO diagnostics VALUES (?, ?, ?, ?)",
                       (r.id, r.started.ToNanoseconds() / 1e9, r.outcome, r.SerializeToString()))


FAILED = pb.DiagnosticReport(
    id="diag-20250301-101500-a1b2c3", outcome=pb.OUTCOME_FAIL, severity=pb.SEVERITY_CRITICAL,
    action=pb.ACTION_RESET_GPU, suspects=["gpu/index2"], node="test-node", tests=["eud", "all_to_all"],
    started=_ts(1740824100.25), finished=_ts(1740824160.5), message="",
    results=[pb.TestResult(test="eud", component="gpu/index2", status=pb.RESULT_FAIL,
                           message="EUD failed: ISOLATE", figures={"duration_s": 58.5},
                           details={"severity": "CRITICAL", "action": "RESET_GPU", "dcgm_error": "81"}),
             pb.TestResult(test="eud", component="gpu/index0", status=pb.RESULT_PASS, message="EUD passed"),
             pb.TestResult(test="all_to_all", component="host", status=pb.RESULT_SKIPPED,
                           message="an earlier test failed (stop_on_failure)")])
RUNNING = pb.DiagnosticReport(id="diag-20250302-080000-d4e5f6", outcome=pb.OUTCOME_RUNNING, node="test-node",
                              tests=["minigpt"], started=_ts(1740902400.0))


def test_reports_of_the_previous_version_show_after_start(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    _old_store(d.state_dir, [FAILED, RUNNING])
    d.start()

    stub = pb_grpc.DiagnosticsStub(d.channel())
    assert stub.Get(pb.GetDiagnosticRequest(id=FAILED.id), timeout=5) == FAILED  # every field, as stored
    listed = stub.List(pb.ListDiagnosticsRequest(), timeout=5).reports
    assert [r.id for r in listed] == [RUNNING.id, FAILED.id]  # newest first
    # A run the old daemon left RUNNING is closed like any other on start.
    assert (listed[0].outcome, listed[0].message) == (pb.OUTCOME_ERROR, "the daemon stopped during this run")

    r = d.robustctl("diag", "list")
    assert r.returncode == 0 and FAILED.id in r.stdout and RUNNING.id in r.stdout and "FAIL" in r.stdout, r
    r = d.robustctl("diag", "show", FAILED.id)
    assert r.returncode == 2 and "gpu/index2" in r.stdout and "EUD failed: ISOLATE" in r.stdout, r

    d.stop()  # the old table is gone: the rows are JSON now, and survive the next start as they are
    with sqlite3.connect(Path(d.state_dir) / "robustd.db") as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        stored = dict(db.execute("SELECT id, report FROM diagnostic_reports").fetchall())
    assert "diagnostics" not in tables
    assert json.loads(stored[FAILED.id])["results"][0]["details"]["dcgm_error"] == "81"
    d.start()
    assert pb_grpc.DiagnosticsStub(d.channel()).Get(pb.GetDiagnosticRequest(id=FAILED.id), timeout=5) == FAILED
