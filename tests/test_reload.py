"""SIGHUP applies every section that can change at run time, and names the keys that need a restart.

A reload used to copy a fixed list of sections: a change to `diagnostics` or `tracer` was dropped
without a word, so an operator believed a new diagnostic level or tracer pattern was live when it was not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Daemon, eventually, free_port, need_root
from test_config import GAP_IDS, GAPS, problem_line, write_gap
from test_security import pki  # noqa: F401 - real certificates, made once per module

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
    line = reload(d, {"diagnostics": {"levels": {"smoke": ["all_to_all"], "quick": ["minigpt"]}}})
    assert "applied diagnostics" in line, line
    # merged over the built-in levels, and said so: the file's quick replaces the built-in one
    assert "diagnostics levels full, quick, smoke, standard (built in: standard, full; from the config: quick, " \
           "smoke)" in line, line
    assert start_run(d, level="smoke") is None  # the new level is live
    assert start_run(d, level="full") is None  # and the built-in levels the file does not mention stay


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
    assert "diagnostics.levels.quick" not in changes  # the file's levels merge over the built-in ones (issue 31)
    assert "node_name" not in changes and "listen" not in changes  # what did not change is not listed

    line = reload(d, {})  # the same file again
    assert "no changes to apply" in line, line
    assert d.log().count("config changes: no keys changed") == 1


def rejected(d: Daemon, before: int, *shown: str, timeout: float = 10.0) -> str:
    """Wait for reload rejection number `before + 1` in the log and return the log; each of `shown` in it."""
    deadline = time.monotonic() + timeout
    while d.log().count("reload rejected; the running config stays") <= before:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    text = d.log()
    for words in shown:
        assert words in text, text
    return text


def keeps_answering(d: Daemon, seconds: float) -> None:
    """GetVerdict answers within 1 s, again and again for `seconds` (the event loop is not held)."""
    end = time.monotonic() + seconds
    with d.channel() as ch:
        stub = pb_grpc.NodeHealthStub(ch)
        while time.monotonic() < end:
            assert stub.GetVerdict(pb.GetVerdictRequest(), timeout=1.0).node == "test-node"
            time.sleep(0.1)


def test_sighup_refuses_each_value_once_taken_and_keeps_the_running_config(make_daemon: Any,
                                                                          pki: Path) -> None:  # noqa: F811
    """Every entry of test_config's GAPS, written over the running config: the reload is refused with the line
    `--check-config` prints, logged, and the daemon runs on as before (no "Task exception was never retrieved"
    for a file that is not UTF-8, no loop held by a FIFO)."""
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    for (text, key, line, words), name in zip(GAPS, GAP_IDS, strict=True):
        before = d.log().count("reload rejected; the running config stays")
        write_gap(d.config_path, text, pki)
        d.signal(signal.SIGHUP)
        log = rejected(d, before)
        assert f"{problem_line(d.config_path, key, line)}" in log and words in log, (name, log)
        keeps_answering(d, 0.2)
    assert "Task exception was never retrieved" not in d.log() and "Traceback" not in d.log()
    line = reload(d, {})  # the daemon's own config again: taken, and nothing had changed
    assert "no changes to apply" in line, line


def test_sighup_with_a_tls_file_replaced_by_a_fifo_keeps_the_daemon_answering(make_daemon: Any,
                                                                             pki: Path) -> None:  # noqa: F811
    """A FIFO where listen.tls.cert was (an operator's mistake, or a hostile file) used to hold the event loop
    in open(2) until someone wrote to it: every client of the daemon hung with it."""
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    cert, key = d.root / "server.pem", d.root / "server.key"
    shutil.copy(pki / "server.pem", cert)
    shutil.copy(pki / "server.key", key)
    d.write_config({"listen": {"tcp": f"127.0.0.1:{free_port()}", "tls": {"cert": str(cert), "key": str(key)}}})
    d.start()
    before = d.log().count("reload rejected; the running config stays")
    cert.unlink()
    os.mkfifo(cert)
    d.signal(signal.SIGHUP)
    keeps_answering(d, 1.5)
    rejected(d, before, f"listen.tls.cert: not a regular file (a FIFO) (got '{cert}')")
    keeps_answering(d, 0.2)


def test_sighup_on_a_config_that_never_finishes_reading_gives_up_in_time(make_daemon: Any) -> None:
    """The config file itself a FIFO that nobody writes: the read waits in a thread, the daemon answers, the
    reload is refused after RELOAD_READ_TIMEOUT (10 s), and a reload while that read still waits is refused at once
    (stuck reads never pile up); once the read ends, reloads work again."""
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    before = d.log().count("reload rejected; the running config stays")
    d.config_path.unlink()
    os.mkfifo(d.config_path)
    d.signal(signal.SIGHUP)
    keeps_answering(d, 1.5)
    rejected(d, before, f"{d.config_path}: reading it and the files it names took longer than 10s",
             timeout=15)  # robustd.daemon.RELOAD_READ_TIMEOUT
    d.signal(signal.SIGHUP)
    rejected(d, before + 1, f"{d.config_path}: the previous reload is still reading it")
    keeps_answering(d, 0.2)

    def feed() -> None:  # the waiting read gets a file at last (and its result is dropped: it came too late)
        with open(d.config_path, "w") as fifo:
            fifo.write("node_name: too-late\n")

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive()
    eventually(lambda: "the reload's read that overran has ended" in d.log(), 10, "the late read to end")
    d.config_path.unlink()
    line = reload(d, {})
    assert "no changes to apply" in line, line
    assert d.verdict().node == "test-node"
