"""SIGHUP applies every section that can change at run time, and names the keys that need a restart.

A reload used to copy a fixed list of sections: a change to `diagnostics` or `tracer` was dropped
without a word, so an operator believed a new diagnostic level or tracer pattern was live when it was not.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Daemon, need_root

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc


def reload(d: Daemon, config: dict[str, Any]) -> str:
    """Write `config` over the current one, SIGHUP, and return the log line that says what was applied."""
    before = d.log().count("config reloaded from")
    d.write_config(config)
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log().count("config reloaded from") == before:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    return [line for line in d.log().splitlines() if "config reloaded from" in line][-1]


def start_run(d: Daemon, **req: Any) -> grpc.StatusCode | None:
    """The status Run answers with at once (None: it started), cancelling a run that started."""
    ch = d.channel()
    stub = pb_grpc.DiagnosticsStub(ch)
    call = stub.Run(pb.RunRequest(**req), timeout=30)
    try:
        first = next(call)
    except grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()
    stub = pb_grpc.DiagnosticsStub(d.channel())
    stub.Cancel(pb.CancelDiagnosticRequest(id=first.id), timeout=30)
    return None


def test_sighup_applies_diagnostics_changes(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    assert start_run(d, level="smoke") == grpc.StatusCode.INVALID_ARGUMENT  # no such level yet
    line = reload(d, {"diagnostics": {"levels": {"smoke": ["all_to_all"]}}})
    assert "applied diagnostics" in line, line
    assert start_run(d, level="smoke") is None  # the new level is live


def test_sighup_applies_tracer_changes(make_daemon: Any, short_tmp: Path) -> None:
    need_root("py-spy attaching to another process")
    marker = f"reload-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)", marker])
    try:
        d = make_daemon({"checks": {"kernel": {"enabled": False}}, "tracer": {"gpu_processes": False}})
        d.start()
        tracer = pb_grpc.TracerStub(d.channel())
        before = tracer.CaptureStacks(pb.CaptureRequest(), timeout=30)
        assert proc.pid not in [p.pid for p in before.processes]
        line = reload(d, {"tracer": {"process_patterns": [marker]}})
        assert "applied tracer" in line, line
        after = tracer.CaptureStacks(pb.CaptureRequest(), timeout=30)
        assert [p.pid for p in after.processes] == [proc.pid], after
    finally:
        proc.kill()
        proc.wait(5)


@pytest.mark.parametrize("change, key", [({"listen": {"max_connections": 17}}, "listen.max_connections"),
                                         ({"node_name": "renamed"}, "node_name")])
def test_sighup_names_each_key_that_needs_a_restart(make_daemon: Any, change: dict[str, Any], key: str) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    line = reload(d, change)
    assert "no changes to apply" in line, line
    assert f"{key} changed: that takes effect at the next restart" in d.log()
    assert d.verdict().node == "test-node"  # still the running value


def test_sighup_logs_each_key_added_removed_and_changed(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}},
                     "policy": {"clear_after": "2m", "codes": {"XID_13": {"severity": "WARNING"}}}})
    d.start()
    del d.config["policy"]["codes"]["XID_13"]  # removed from the file
    line = reload(d, {"policy": {"clear_after": "5m"},  # changed
                      "diagnostics": {"levels": {"smoke": ["all_to_all"]}}})  # added
    assert "applied diagnostics, policy" in line, line
    [changes] = [x for x in d.log().splitlines() if "config changes:" in x]
    assert "added diagnostics.levels.smoke=[\"all_to_all\"]" in changes, changes
    assert "removed policy.codes.XID_13" in changes, changes
    assert "changed policy.clear_after: 2m -> 5m" in changes, changes
    assert "removed diagnostics.levels.quick" in changes  # the file's levels replace the built-in ones
    assert "node_name" not in changes and "listen" not in changes  # what did not change is not listed

    line = reload(d, {})  # the same file again
    assert "no changes to apply" in line, line
    assert d.log().count("config changes: no keys changed") == 1
