"""robustctl against a real daemon: output, JSON and exit codes for each verb, faults injected via /dev/kmsg."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Daemon, inject_kmsg

# Unique PCI buses per test: the kernel log is shared by every daemon on this host.
XID13 = "NVRM: Xid (PCI:0000:{bus}:00): 13, pid=1, name=python, Graphics Engine Exception"
XID79 = "NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def gpu(bus: str) -> str:
    return f"gpu/0000:{bus}:00.0"


def has(component: str, code: str) -> Any:
    return lambda v: any(c.component == component and c.code == code for c in v.conditions)


def raise_xid(d: Daemon, line: str, bus: str, code: str) -> None:
    inject_kmsg(line.format(bus=bus))
    d.wait_for(has(gpu(bus), code))


def robustctl(*args: str) -> subprocess.CompletedProcess[str]:
    """robustctl with no daemon fixture, for the tests that need none."""
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", *args], capture_output=True,
                          text=True, timeout=30, cwd=REPO, stdin=subprocess.DEVNULL)


# Start robustctl with SIGINT's disposition set on purpose (exec keeps an ignored signal ignored), so
# a test never depends on what the suite inherited: `make test &` in a script starts with SIGINT ignored.
_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
                "os.execv(sys.executable, [sys.executable, '-m', 'robustd.cli.robustctl', *sys.argv[2:]])")


class Lines:
    """A robustctl subprocess whose stdout lines are read with a timeout."""

    def __init__(self, d: Daemon, *args: str, sigint: str = "SIG_DFL"):
        cmd = [sys.executable, "-c", _WITH_SIGINT, sigint, "--socket", d.socket, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO)
        self.q: queue.Queue[str] = queue.Queue()
        self._stopped: tuple[int, str] | None = None
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.q.put(line)

    def next_json(self, timeout: float = 10.0) -> dict[str, Any]:
        try:
            return json.loads(self.q.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no line within {timeout}s; stderr so far: {self.stop()[1]}") from None

    def until(self, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.next_json(max(deadline - time.monotonic(), 0.01))
            if pred(ev):
                return ev

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Stop with `sig` (SIGTERM: a signal the test controls, whatever the suite inherited); (status, stderr).
        A second call (a failed assertion's message, then the test's cleanup) returns what the first read."""
        if self._stopped is not None:
            return self._stopped
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        assert self.proc.stderr is not None and self.proc.stdout is not None
        err = self.proc.stderr.read()
        self.proc.stderr.close()
        self.pump.join(5)
        self.proc.stdout.close()
        self._stopped = (self.proc.returncode, err)
        return self._stopped


def test_status_clean_node_is_ok(daemon: Daemon) -> None:
    r = daemon.robustctl("status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("node test-node: OK")
    assert "0 conditions" in r.stdout


def test_status_warning_after_xid13(daemon: Daemon) -> None:
    raise_xid(daemon, XID13, "d1", "XID_13")
    r = daemon.robustctl("status")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "WARNING (action RESTART_JOB)" in r.stdout.splitlines()[0]
    row = next(line for line in r.stdout.splitlines() if gpu("d1") in line)
    assert "XID_13" in row and row.startswith("WARNING")


def test_status_critical_after_xid79_and_json(daemon: Daemon) -> None:
    raise_xid(daemon, XID79, "d2", "XID_79")
    r = daemon.robustctl("status")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CRITICAL (action REBOOT)" in r.stdout.splitlines()[0]
    row = next(line for line in r.stdout.splitlines() if gpu("d2") in line)
    assert "XID_79" in row and "sticky" in row and "ago" in row

    for args in (("--json", "status"), ("status", "--json")):
        r = daemon.robustctl(*args)
        assert r.returncode == 2, r.stderr
        v = json.loads(r.stdout)
        assert v["node"] == "test-node"
        assert v["severity"] == "SEVERITY_CRITICAL" and v["action"] == "ACTION_REBOOT"
        c = next(c for c in v["conditions"] if c["component"] == gpu("d2"))
        assert c["code"] == "XID_79" and c["severity"] == "SEVERITY_CRITICAL" and c["sticky"] is True
        assert c["last_seen"].endswith("Z") and "T" in c["last_seen"]  # RFC 3339
        assert isinstance(v["seq"], int) and v["seq"] >= c["seq"] > 0


def test_events_since_lists_raised(daemon: Daemon) -> None:
    raise_xid(daemon, XID79, "d3", "XID_79")
    r = daemon.robustctl("events", "--since", "1h")
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if gpu("d3") in line)
    assert "RAISED" in row and "XID_79" in row and "CRITICAL" in row

    r = daemon.robustctl("events", "--since", "1h", "--component", gpu("d3"), "--min-severity", "critical", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    events = json.loads(r.stdout)["events"]
    assert [e["kind"] for e in events] == ["EVENT_KIND_RAISED"]
    assert events[0]["condition"]["code"] == "XID_79"


def test_checks_lists_kernel(daemon: Daemon) -> None:
    r = daemon.robustctl("checks")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[:10] == ["NAME", "ENABLED", "MODE", "INTERVAL", "STATUS", "LAST", "RUN", "LAST",
                                     "DURATION", "RUNS"]
    assert any(line.split()[0] == "kernel" for line in r.stdout.splitlines()[1:])
    checks = json.loads(daemon.robustctl("checks", "--json").stdout)["checks"]
    kernel = next(c for c in checks if c["name"] == "kernel")
    assert kernel["enabled"] is True and kernel["status"].startswith("CHECK_STATUS_")


def test_ack_clears_and_restores_previous_severity(daemon: Daemon) -> None:
    raise_xid(daemon, XID13, "d4", "XID_13")
    raise_xid(daemon, XID79, "d5", "XID_79")
    assert daemon.robustctl("status").returncode == 2

    r = daemon.robustctl("ack", gpu("d5"), "XID_79", "--reason", "test")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CLEARED" in r.stdout and gpu("d5") in r.stdout and "XID_79" in r.stdout
    r = daemon.robustctl("status")
    assert r.returncode == 1, r.stdout
    assert gpu("d5") not in r.stdout and gpu("d4") in r.stdout


def test_ack_missing_condition_exits_4(daemon: Daemon) -> None:
    r = daemon.robustctl("ack", gpu("d6"), "XID_79")
    assert r.returncode == 4
    assert "NOT_FOUND" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_watch_json_snapshot_then_live(daemon: Daemon) -> None:
    raise_xid(daemon, XID13, "d7", "XID_13")
    w = Lines(daemon, "watch", "--json")
    try:
        snap = w.until(lambda e: e["condition"]["component"] == gpu("d7"))
        assert snap["snapshot"] is True and snap["kind"] == "EVENT_KIND_RAISED"
        inject_kmsg(XID79.format(bus="d8"))
        live = w.until(lambda e: e["condition"]["component"] == gpu("d8"))
        assert live["snapshot"] is False and live["kind"] == "EVENT_KIND_RAISED"
        assert live["condition"]["code"] == "XID_79" and live["seq"] > snap["seq"]
    finally:
        rc, err = w.stop()
    assert rc == 0 and err == ""


def test_watch_resumes_across_daemon_restart(daemon: Daemon) -> None:
    raise_xid(daemon, XID13, "d9", "XID_13")
    w = Lines(daemon, "watch", "--json")
    seen: list[dict[str, Any]] = []

    def note(e: dict[str, Any], component: str) -> bool:
        seen.append(e)
        return e["condition"]["component"] == component

    try:
        w.until(lambda e: note(e, gpu("d9")))
        daemon.restart()
        raise_xid(daemon, XID79, "da", "XID_79")
        w.until(lambda e: note(e, gpu("da")), timeout=20)
        inject_kmsg(XID79.format(bus="db"))
        w.until(lambda e: note(e, gpu("db")))
    finally:
        rc, err = w.stop()
    assert rc == 0
    assert "reconnect" in err and "Traceback" not in err
    live = [e["seq"] for e in seen if not e["snapshot"]]
    assert live == sorted(set(live)), f"a live event printed twice or out of order: {live}"
    assert [e["condition"]["component"] for e in seen].count(gpu("d9")) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_watch_stops_cleanly_when_started_with_sigint_ignored(daemon: Daemon, sig: int) -> None:
    """A background job of a non-interactive shell inherits SIGINT ignored; Ctrl-C and SIGTERM still stop watch."""
    bus = "dc" if sig == signal.SIGINT else "dd"
    raise_xid(daemon, XID13, bus, "XID_13")
    w = Lines(daemon, "watch", sigint="SIG_IGN")
    try:
        line = w.q.get(timeout=10)  # the snapshot: robustctl is up and watching
        assert gpu(bus) in line and "[snapshot]" in line
    finally:
        rc, err = w.stop(sig)
    assert (rc, err) == (0, ""), "a clean stop: status 0, no traceback"


def test_watch_from_seq_ahead_of_log_exits_4(daemon: Daemon) -> None:
    r = daemon.robustctl("watch", "--from-seq", "999999")
    assert r.returncode == 4
    assert "OUT_OF_RANGE" in r.stderr or "ahead" in r.stderr
    assert "Traceback" not in r.stderr


def _connected(pid: int) -> bool:
    """`pid` holds a connected Unix socket (state 03 in /proc/net/unix): robustctl has reached the daemon."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    return any(len(r.split()) >= 7 and r.split()[5] == "03" and r.split()[6] in inodes for r in rows)


def test_watch_from_seq_1_on_an_empty_log_waits_for_the_first_event(daemon: Daemon) -> None:
    """from_seq = head + 1 on an empty log is "nothing yet": the RPC and robustctl stream from there (it was
    OUT_OF_RANGE, so a client that starts from 1 on a fresh node failed until the first fault)."""
    from robustd.api.v1 import robustd_pb2 as pb

    assert daemon.verdict().seq == 0

    call = daemon.stub().Watch(pb.WatchRequest(from_seq=1), timeout=20)
    assert dict(call.initial_metadata())["robustd-head-seq"] == "0"
    w = Lines(daemon, "watch", "--json", "--from-seq", "1")
    try:
        # The first event only once robustctl is connected (its probe, then at once its Watch): raised before,
        # it is at or below the from_seq robustctl asks for and rightly not sent.
        deadline = time.monotonic() + 30
        while not _connected(w.proc.pid):
            assert w.proc.poll() is None, f"robustctl exited {w.proc.returncode}"
            assert time.monotonic() < deadline, "robustctl never connected"
            time.sleep(0.05)
        time.sleep(0.5)
        assert w.proc.poll() is None, f"robustctl exited {w.proc.returncode}"
        raise_xid(daemon, XID79, "d7", "XID_79")
        assert w.next_json()["seq"] == 1
        assert next(call).seq == 1
    finally:
        call.cancel()
        rc, err = w.stop() if w.proc.stdout is not None and not w.proc.stdout.closed else (w.proc.returncode, "")
    assert (rc, err) == (0, ""), err


def test_unreachable_daemon_exits_3(tmp_path: Path) -> None:
    sock = tmp_path / "missing.sock"
    r = robustctl("--socket", str(sock), "status")
    assert r.returncode == 3
    assert r.stderr.strip() == (f"robustctl: cannot reach robustd at unix://{sock}: No such file or directory (is "
                                "robustd running? give its socket with --socket PATH or ROBUSTD_SOCKET=PATH)")
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr


def test_refused_socket_exits_3(tmp_path: Path) -> None:
    """A stale socket file left by a crashed daemon: nobody listens, connect is refused."""
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    r = robustctl("--socket", str(path), "--timeout", "2s", "checks")
    assert r.returncode == 3, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "cannot reach robustd" in r.stderr


@pytest.mark.parametrize("args", [(), ("bogus",), ("ack", "gpu/x"), ("events", "--since", "5x"),
                                  ("--timeout", "0s", "status"), ("--socket", "a", "--address", "b", "status")])
def test_usage_error_exits_64(args: tuple[str, ...]) -> None:
    r = robustctl(*args)
    assert r.returncode == 64, r.stderr
    assert r.stderr.startswith("usage: robustctl") and "Traceback" not in r.stderr


def test_env_socket_default(daemon: Daemon) -> None:
    env = {**os.environ, "ROBUSTD_SOCKET": daemon.socket}
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "status"], capture_output=True, text=True,
                       timeout=30, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode in (0, 1, 2), r.stderr
    assert r.stdout.startswith("node test-node:")


def test_render_without_daemon() -> None:
    """The pure renderers: relative times, line width, the summary line's wording."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.cli import render

    assert render.relative(Timestamp(seconds=1000), now=1003.5) == "3s ago"
    assert render.relative(Timestamp(seconds=1000), now=1000 + 7200 + 59) == "2h ago"
    assert render.relative(Timestamp(), now=5.0) == "never"
    c = pb.Condition(component="gpu/0000:3b:00.0", code="XID_79", severity=pb.SEVERITY_CRITICAL,
                     action=pb.ACTION_REBOOT, message="x" * 500, count=2, sticky=True, last_seen=Timestamp(seconds=990))
    v = pb.Verdict(node="n1", severity=pb.SEVERITY_CRITICAL, action=pb.ACTION_REBOOT, conditions=[c], seq=7)
    text = render.verdict_text(v, now=1000.0, width=100)
    lines = text.splitlines()
    assert lines[0] == "node n1: CRITICAL (action REBOOT), 1 condition, seq 7"
    assert all(len(line) <= 100 for line in lines) and lines[2].endswith("...")
    assert "10s ago" in lines[2] and "sticky" in lines[2]
    assert render.verdict_summary(pb.Verdict(node="n1", severity=pb.SEVERITY_OK, action=pb.ACTION_NONE)) \
        == "node n1: OK, 0 conditions, seq 0"
    assert json.loads(render.to_json(v))["conditions"][0]["action"] == "ACTION_REBOOT"


def test_a_verdict_or_event_list_cut_at_the_message_limit_says_so() -> None:
    """A verdict abridged to fit listen.max_message_bytes, or a ListEvents page cut at it, must not read as
    the whole story to the operator."""
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.cli import render

    v = pb.Verdict(node="n1", severity=pb.SEVERITY_CRITICAL, action=pb.ACTION_REBOOT, conditions_omitted=12,
                   conditions_trimmed=3)
    assert "TOO BIG TO SEND WHOLE: 12 conditions left out, 3 shown without evidence or message" in \
        render.verdict_summary(v)
    ev = pb.Event(seq=41, kind=pb.EVENT_KIND_RAISED, condition=pb.Condition(component="host", code="X"))
    text = render.events_text(pb.ListEventsResponse(events=[ev], truncated=True, next_after_seq=41), width=100)
    assert "cut at the message limit: 1 event shown; newer ones follow seq 41" in text
    assert "cut at" not in render.events_text(pb.ListEventsResponse(events=[ev]), width=100)
