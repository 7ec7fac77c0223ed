"""The daemon end to end: real process, real Unix socket, real /dev/kmsg, real SIGKILL."""

from __future__ import annotations

import os
import queue
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Daemon, bdf, cond, eventually, inject_kmsg, need_root, plugin_env
from grpc_health.v1 import health_pb2, health_pb2_grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc


def xid(addr: str, n: int, msg: str = "fault") -> str:
    return f"NVRM: Xid (PCI:{addr}): {n}, pid=4242, name=python, {msg}"


class Watcher:
    """A Watch stream read on a thread into a queue, as a scheduler would hold one open."""

    def __init__(self, d: Daemon, from_seq: int = 0):
        self.channel = d.channel()
        self.call = pb_grpc.NodeHealthStub(self.channel).Watch(pb.WatchRequest(from_seq=from_seq))
        self.events: queue.Queue[pb.Event | Exception] = queue.Queue()
        self.head = dict(self.call.initial_metadata()).get("robustd-head-seq")  # the stream is registered
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.call:
                self.events.put(ev)
        except Exception as e:  # noqa: BLE001 - handed to the test
            self.events.put(e)

    def next(self, timeout: float = 5.0) -> pb.Event:
        item = self.events.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def until(self, pred: Any, timeout: float = 5.0) -> pb.Event:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.next(max(0.01, deadline - time.monotonic()))
            if pred(ev):
                return ev

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def test_xid79_turns_node_critical_on_verdict_and_watch_within_a_second(daemon: Daemon) -> None:
    w = Watcher(daemon)
    try:
        addr = bdf()
        t0 = time.monotonic()
        inject_kmsg(xid(addr, 79, "GPU has fallen off the bus."))
        ev = w.until(lambda e: e.condition.code == "XID_79")
        assert time.monotonic() - t0 < 1.0
        assert ev.kind == pb.EVENT_KIND_RAISED and not ev.snapshot
        v = daemon.verdict()
        c = cond(v, "XID_79", f"gpu/{addr}.0")
        assert c is not None, v
        assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)
        assert c.sticky and c.action == pb.ACTION_REBOOT and c.source == "kernel"
        assert v.seq == ev.seq and c.seq == ev.seq
    finally:
        w.close()


def test_application_xid13_warns_and_does_not_evict(daemon: Daemon) -> None:
    addr = bdf()
    inject_kmsg(xid(addr, 13, "Graphics Exception: ESR 0x515e48=0x1f030000"))
    v = daemon.wait_for(lambda v: cond(v, "XID_13") is not None)
    c = cond(v, "XID_13")
    assert c is not None and c.component == f"gpu/{addr}.0"
    assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_RESTART_JOB)
    assert v.severity == pb.SEVERITY_WARNING  # the node stays in its job


def test_aer_and_hung_task_lines_raise_their_conditions(daemon: Daemon) -> None:
    inject_kmsg("pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:17:00.0",
                "INFO: task python3:31337 blocked for more than 120 seconds.")
    v = daemon.wait_for(lambda v: len(v.conditions) >= 2)
    aer = cond(v, "PCIE_AER_FATAL", "pcie/0000:17:00.0")
    hung = cond(v, "HUNG_TASK", "host")
    assert aer is not None and aer.severity == pb.SEVERITY_CRITICAL, v
    assert hung is not None and hung.severity == pb.SEVERITY_WARNING, v
    assert hung.evidence["pid"] == "31337"


def test_sigkill_restart_resumes_watch_without_gap_or_duplicate_and_reboot_clears_sticky(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    gpu = bdf()
    w = Watcher(d)
    inject_kmsg(xid(gpu, 79, "GPU has fallen off the bus."), xid(bdf(), 13, "first"))
    seen = [w.until(lambda e: e.condition.code == "XID_79"), w.until(lambda e: e.condition.code == "XID_13")]
    last = seen[-1].seq
    d.kill()  # mid-stream: the watcher's stream breaks
    with pytest.raises(grpc.RpcError):
        w.until(lambda e: False, timeout=5)
    w.close()

    missed = [bdf(), bdf()]
    inject_kmsg(*(xid(a, 31, "MMU Fault while down") for a in missed))  # logged while robustd is down
    d.start()
    w2 = Watcher(d, from_seq=last)
    try:
        got = [w2.next(), w2.next()]
        assert [e.condition.component for e in got] == [f"gpu/{a}.0" for a in missed]
        assert [e.seq for e in got] == [last + 1, last + 2]
        assert all(e.kind == pb.EVENT_KIND_RAISED and e.condition.code == "XID_31" for e in got)
        try:  # exactly those: no duplicate of what we had seen
            extra = w2.next(timeout=1.5)
        except queue.Empty:
            pass
        else:
            raise AssertionError(f"unexpected event after the missed ones:\n{extra}")
    finally:
        w2.close()
    v = d.verdict()
    assert cond(v, "XID_79", f"gpu/{gpu}.0") is not None  # sticky survives SIGKILL and restart

    d.restart()  # same boot, nothing new: no event repeats
    assert d.verdict().seq == v.seq

    d.stop()
    d.reboot()
    d.start()
    v2 = d.verdict()
    assert cond(v2, "XID_79") is None
    cleared = d.stub().ListEvents(pb.ListEventsRequest(component=f"gpu/{gpu}.0"), timeout=5).events
    assert [e.kind for e in cleared] == [pb.EVENT_KIND_RAISED, pb.EVENT_KIND_CLEARED]
    assert cleared[-1].condition.evidence["cleared_by"] == "reboot"


def test_watch_snapshot_then_live_and_out_of_range(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon({"retention": {"max_events": 2}})
    d.start()
    addrs = [bdf() for _ in range(4)]
    inject_kmsg(*(xid(a, 79, "GPU has fallen off the bus.") for a in addrs[:3]))
    v = d.wait_for(lambda v: len(v.conditions) == 3)
    w = Watcher(d, from_seq=0)
    try:
        snap = [w.next() for _ in range(3)]
        assert all(e.snapshot for e in snap)
        assert sorted(e.seq for e in snap) == sorted(c.seq for c in v.conditions)
        inject_kmsg(xid(addrs[3], 79, "GPU has fallen off the bus."))
        live = w.next()
        assert not live.snapshot and live.seq == v.seq + 1
    finally:
        w.close()
    d.restart()  # retention prunes at start: only the newest 2 events remain
    stub = d.stub()
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.Watch(pb.WatchRequest(from_seq=1), timeout=5)))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "re-snapshot" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.Watch(pb.WatchRequest(from_seq=10_000), timeout=5)))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert len(d.verdict().conditions) == 4  # pruning history never drops a standing condition


def test_list_events_filters_and_invalid_arguments(daemon: Daemon) -> None:
    a, b = bdf(), bdf()
    inject_kmsg(xid(a, 13, "app fault"), xid(b, 79, "GPU has fallen off the bus."),
                "Out of memory: Killed process 999 (python) total-vm:1kB, anon-rss:1kB, file-rss:0kB, "
                "shmem-rss:0kB, UID:0 pgtables:4kB oom_score_adj:0")
    daemon.wait_for(lambda v: len(v.conditions) == 3)
    stub = daemon.stub()
    gpus = stub.ListEvents(pb.ListEventsRequest(component="gpu/"), timeout=5).events
    assert {e.condition.code for e in gpus} == {"XID_13", "XID_79"}
    crit = stub.ListEvents(pb.ListEventsRequest(min_severity=pb.SEVERITY_CRITICAL), timeout=5).events
    assert [e.condition.code for e in crit] == ["XID_79"]
    last = stub.ListEvents(pb.ListEventsRequest(limit=1), timeout=5)
    assert len(last.events) == 1 and last.events[0].seq == last.head_seq
    future = pb.ListEventsRequest()
    future.since.FromSeconds(int(time.time()) + 3600)
    assert list(stub.ListEvents(future, timeout=5).events) == []
    for bad in (pb.ListEventsRequest(limit=-1), pb.ListEventsRequest(limit=10**6)):
        with pytest.raises(grpc.RpcError) as err:
            stub.ListEvents(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Acknowledge(pb.AcknowledgeRequest(code="XID_79"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Acknowledge(pb.AcknowledgeRequest(component="gpu/none", code="XID_79"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    ack = stub.Acknowledge(pb.AcknowledgeRequest(component=f"gpu/{b}.0", code="XID_79", reason="reseated"), timeout=5)
    assert ack.event.kind == pb.EVENT_KIND_CLEARED and ack.event.condition.evidence["reason"] == "reseated"
    assert cond(daemon.verdict(), "XID_79") is None


def test_health_service_reflection_and_socket_mode(daemon: Daemon) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    with daemon.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert h.Check(health_pb2.HealthCheckRequest(service="robustd.node"), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        inject_kmsg(xid(bdf(), 79, "GPU has fallen off the bus."))
        daemon.wait_for(lambda v: v.severity == pb.SEVERITY_CRITICAL)
        deadline = time.monotonic() + 5
        while h.Check(health_pb2.HealthCheckRequest(service="robustd.node"), timeout=5).status != \
                health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(iter(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5)))
        names = {s.name for s in reply.list_services_response.service}
        assert {"robustd.v1.NodeHealth", "robustd.v1.Evidence", "grpc.health.v1.Health"} <= names
        assert h.Check(health_pb2.HealthCheckRequest(service="robustd.v1.Evidence"), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def checks_by_name(d: Daemon) -> dict[str, pb.CheckInfo]:
    return {c.name: c for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks}


def test_hanging_and_raising_checks_are_reported_and_others_keep_their_interval(make_daemon: Any,
                                                                                   short_tmp: Path) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}, "hang": {"interval": "200ms", "timeout": "300ms"},
                                "boom": {"interval": "200ms"}, "tick": {"interval": "100ms"}}},
                    env=plugin_env(short_tmp))
    d.start()
    v = d.wait_for(lambda v: cond(v, "CHECK_TIMEOUT") is not None and cond(v, "CHECK_ERROR") is not None)
    hang, boom = cond(v, "CHECK_TIMEOUT", "check/hang"), cond(v, "CHECK_ERROR", "check/boom")
    assert hang is not None and boom is not None
    assert "Input/output error" in boom.message and boom.severity == pb.SEVERITY_WARNING
    before = checks_by_name(d)["tick"].runs
    time.sleep(2.0)
    info = checks_by_name(d)
    assert info["tick"].runs - before >= 15, info["tick"]  # ~20 expected at 100ms despite the stuck neighbour
    assert info["tick"].status == pb.CHECK_STATUS_OK
    assert info["hang"].status == pb.CHECK_STATUS_TIMEOUT and info["hang"].runs == 0
    assert info["boom"].status == pb.CHECK_STATUS_ERROR and info["boom"].failures >= 5
    assert info["kernel"].status == pb.CHECK_STATUS_DISABLED
    # The stuck worker is not reused: a single poll thread, still blocked.
    assert info["hang"].failures >= 1


def test_quiet_polls_still_count_and_a_resolved_poll_clears_what_another_check_raised(make_daemon: Any,
                                                                                     short_tmp: Path) -> None:
    """A poll that finds nothing new does not wake the event loop (issue 15), yet ListChecks counts it, and a
    poll saying "resolved" every time still clears the condition once another source has raised it."""
    mark = short_tmp / "mark"
    d = make_daemon({"checks": {"kernel": {"enabled": False}, "hang": {"enabled": False}, "boom": {"enabled": False},
                                "tick": {"interval": "100ms", "resolve": True},
                                "mark": {"interval": "100ms", "mark_file": str(mark)}}},
                    env=plugin_env(short_tmp))
    d.start()
    eventually(lambda: checks_by_name(d)["tick"].runs >= 5, 10, "the first quiet polls")
    before = checks_by_name(d)["tick"]
    time.sleep(1.0)
    after = checks_by_name(d)["tick"]
    assert after.runs - before.runs >= 6 and after.status == pb.CHECK_STATUS_OK, after
    assert after.last_run.seconds >= before.last_run.seconds
    def clears() -> int:
        events = d.stub().ListEvents(pb.ListEventsRequest(component="host"), timeout=5).events
        return sum(e.kind == pb.EVENT_KIND_CLEARED for e in events)

    for n in range(3):
        mark.write_text(f"{n}\n")
        eventually(lambda want=n + 1: clears() == want, 10, f"clear #{n + 1}", detail=d.log)
    events = d.stub().ListEvents(pb.ListEventsRequest(component="host"), timeout=5).events
    kinds = [e.kind for e in events if e.condition.code == "TICK_FLAG"]
    assert kinds == [pb.EVENT_KIND_RAISED, pb.EVENT_KIND_CLEARED] * 3, kinds
    cleared = [e for e in events if e.kind == pb.EVENT_KIND_CLEARED]
    assert all(e.condition.evidence["cleared_by"] == "resolved" for e in cleared), cleared
    assert cond(d.verdict(), "TICK_FLAG") is None


def test_sighup_reload_applies_good_config_and_keeps_running_one_on_bad(make_daemon: Any, short_tmp: Path) -> None:
    flag = short_tmp / "flag"
    d = make_daemon({"checks": {"kernel": {"enabled": False}, "tick": {"interval": "1s", "flag_file": str(flag)}}},
                    env=plugin_env(short_tmp))
    d.start()
    assert checks_by_name(d)["tick"].interval.ToMilliseconds() == 1000
    good = dict(d.config)
    d.config_path.write_text("checks:\n  tick:\n    interval: 1s\n    surprise: 3\n")  # unknown key, line 4
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while "reload rejected" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert "checks.tick.surprise" in d.log() and ":4:" in d.log()
    assert d.proc is not None and d.proc.poll() is None
    assert checks_by_name(d)["tick"].interval.ToMilliseconds() == 1000
    d.write_config({**good, "checks": {**good["checks"], "tick": {"interval": "250ms", "flag_file": str(flag)}}})
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while checks_by_name(d)["tick"].interval.ToMilliseconds() != 250:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    flag.write_text("x")  # the reloaded check is really running
    d.wait_for(lambda v: cond(v, "TICK_FLAG", "host") is not None)


@pytest.mark.parametrize("libsystemd", [True, False], ids=["systemd-python", "without-systemd-python"])
def test_sd_notify_ready_watchdog_status_stopping(make_daemon: Any, short_tmp: Path, libsystemd: bool) -> None:
    import socket as so

    path = str(short_tmp / "notify.sock")
    sock = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    if not libsystemd:  # a host where the systemd-python wheel does not load: the datagram fallback
        shim = short_tmp / "shim" / "systemd"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('systemd-python is not usable here')\n")
        env["PYTHONPATH"] = str(shim.parent)
        env.update(JOURNAL_STREAM="8:12345", INVOCATION_ID="0" * 32)  # as under systemd: journald is wanted
    d = make_daemon({"checks": {"kernel": {"enabled": False}}}, env=env)
    d.start(wait=False)
    got: list[str] = []
    try:
        while not any("READY=1" in m for m in got):
            got.append(sock.recv(4096).decode())
        # READY=1 means answering: the socket is bound and the API responds at once.
        assert os.path.exists(d.socket)
        assert d.verdict().node == "test-node"
        assert any("STATUS=" in m for m in got)
        dogs = 0
        t0 = time.monotonic()
        while dogs < 3:
            if "WATCHDOG=1" in sock.recv(4096).decode():
                dogs += 1
        assert time.monotonic() - t0 < 3.0  # every ~0.5s (half of WATCHDOG_USEC)
        d.signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in got):
            got.append(sock.recv(4096).decode())
        assert d.proc is not None and d.proc.wait(10) == 0
    finally:
        sock.close()


def test_daemon_refuses_bad_config_at_start(make_daemon: Any) -> None:
    d = make_daemon({"retention": {"max_age": "forever"}})
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(30) == 1
    assert "retention.max_age" in d.log() and "invalid duration" in d.log()


def test_prometheus_metrics_show_conditions_severity_and_checks(make_daemon: Any) -> None:
    import socket as so
    import urllib.request

    need_root("writing /dev/kmsg")
    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon({"metrics": {"address": f"127.0.0.1:{port}"}})
    d.start()
    addr = bdf()
    inject_kmsg(xid(addr, 79, "GPU has fallen off the bus."))
    d.wait_for(lambda v: v.severity == pb.SEVERITY_CRITICAL)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'robustd_node_severity{node="test-node"} 2.0' in text
    assert f'robustd_condition{{action="REBOOT",code="XID_79",component="gpu/{addr}.0",sticky="true"}} 2.0' in text
    assert 'robustd_check_runs_total{check="kernel"}' in text
    assert "robustd_events_total 1.0" in text


def test_reboot_fixable_fault_that_survives_two_reboots_escalates_to_hw_inspect(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon()
    addr = bdf()
    component = f"gpu/{addr}.0"
    actions = []
    for boot in range(3):
        if boot:
            d.stop()
            d.reboot()
        d.start()
        assert cond(d.verdict(), "XID_48", component) is None  # the reboot cleared the last boot's condition
        inject_kmsg(xid(addr, 48, "DBE (double bit error) ECC error"))
        c = cond(d.wait_for(lambda v: cond(v, "XID_48", component) is not None), "XID_48", component)
        assert c is not None
        actions.append(c.action)
    assert actions == [pb.ACTION_RESET_GPU, pb.ACTION_RESET_GPU, pb.ACTION_HW_INSPECT]
    assert "2 earlier boots" in c.evidence["escalated"]


def test_emulated_hardware_is_labelled_in_every_verdict(make_daemon: Any, short_tmp: Path) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}, "hang": {"enabled": False}, "boom": {"enabled": False},
                                "tick": {"interval": "100ms", "emulated_label": "fake sensor board"}}},
                    env=plugin_env(short_tmp))
    d.start()
    v = d.wait_for(lambda v: len(v.emulated) > 0)
    assert list(v.emulated) == ["tick: fake sensor board"]
    r = d.robustctl("status")
    assert r.returncode == 0 and "EMULATED: tick: fake sensor board (not real hardware)" in r.stdout
