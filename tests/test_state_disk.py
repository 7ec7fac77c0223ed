"""A state disk that hangs or is read-only: the API keeps answering from memory, robustd says its own
machinery is the problem (STATE_UNWRITABLE on check/store, never a hardware verdict), and nothing that
was decided is lost when the disk comes back. Real ext4 on a loop device frozen with fsfreeze, real
read-only tmpfs remounts, real SQLite, real daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Daemon, bdf, cond, free_port, inject_kmsg, need_root, plugin_env, tmpfs
from grpc_health.v1 import health_pb2, health_pb2_grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc


@pytest.fixture
def ext4_disk(short_tmp: Path) -> Iterator[Path]:
    """A small ext4 file system on a loop device; always thawed and unmounted afterwards."""
    need_root("loop devices, mount and fsfreeze")
    image, mnt = short_tmp / "disk.img", short_tmp / "disk"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    yield mnt
    subprocess.run(["fsfreeze", "-u", str(mnt)], check=False, capture_output=True)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tmpfs_disk(short_tmp: Path) -> Iterator[Path]:
    with tmpfs(short_tmp / "ro", "16m") as mnt:
        yield mnt


def tick_daemon(make_daemon: Any, short_tmp: Path, state_dir: Path, flag: Path, **config: Any) -> Daemon:
    return make_daemon({"state_dir": str(state_dir),
                        "checks": {"kernel": {"enabled": False}, "hang": {"enabled": False},
                                   "boom": {"enabled": False}, "tick": {"interval": "100ms", "flag_file": str(flag)}},
                        "policy": {"codes": {"TICK_FLAG": {"severity": "CRITICAL", "action": "REBOOT",
                                                           "clear_after": "1s"}}}, **config},
                       env=plugin_env(short_tmp))


def quick_verdict(d: Daemon, within: float = 1.0) -> pb.Verdict:
    t0 = time.monotonic()
    with d.channel() as ch:
        v = pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=within)
    assert time.monotonic() - t0 < within
    return v


def codes(v: pb.Verdict) -> dict[str, pb.Condition]:
    return {c.code: c for c in v.conditions}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_a_frozen_state_disk_never_stalls_the_api_and_loses_nothing(make_daemon: Any, ext4_disk: Path,
                                                                    short_tmp: Path) -> None:
    flag, port = short_tmp / "flag", free_port()
    d = tick_daemon(make_daemon, short_tmp, ext4_disk / "state", flag, metrics={"address": f"127.0.0.1:{port}"})
    d.start()
    before = d.stub().Watch(pb.WatchRequest(from_seq=quick_verdict(d).seq))  # a scheduler's open stream
    subprocess.run(["fsfreeze", "-f", str(ext4_disk)], check=True)
    try:
        flag.touch()  # a fault appears while every write to the state disk blocks
        deadline = time.monotonic() + 15
        while True:  # the API answers all along; within ~STUCK_AFTER it says the log is stuck
            v = quick_verdict(d)
            if "not responding" in v.event_log_error and "STATE_UNWRITABLE" in codes(v):
                break
            assert time.monotonic() < deadline, f"{v}\n{d.log()}"
            time.sleep(0.2)
        assert codes(v)["TICK_FLAG"].severity == pb.SEVERITY_CRITICAL  # the verdict tells the truth now
        own = codes(v)["STATE_UNWRITABLE"]
        assert own.component == "check/store" and own.severity == pb.SEVERITY_WARNING
        assert own.action == pb.ACTION_NONE  # robustd's own trouble: never a hardware action
        assert v.severity == pb.SEVERITY_CRITICAL and v.action == pb.ACTION_REBOOT  # from TICK_FLAG alone
        r = d.robustctl("status", timeout=10)
        assert r.returncode == 2 and "EVENT LOG NOT WRITABLE" in r.stdout, r.stdout + r.stderr
        with d.channel() as ch:  # a new Watch gets its snapshot from memory at once
            stream = pb_grpc.NodeHealthStub(ch).Watch(pb.WatchRequest(from_seq=0), timeout=3)
            snap = [next(stream) for _ in range(2)]
            assert {e.condition.code for e in snap} == {"TICK_FLAG", "STATE_UNWRITABLE"}
            stream.cancel()
        checks = d.stub().ListChecks(pb.ListChecksRequest(), timeout=1)
        assert {c.name for c in checks.checks} >= {"tick"}
        assert "robustd_event_log_writable 0.0" in scrape(port)
    finally:
        subprocess.run(["fsfreeze", "-u", str(ext4_disk)], check=True)

    v = d.wait_for(lambda v: v.event_log_error == "" and "STATE_UNWRITABLE" not in codes(v), timeout=10)
    flag_seq = codes(v)["TICK_FLAG"].seq
    assert flag_seq >= 1
    got = next(e for e in before if e.condition.code == "TICK_FLAG")  # the open stream gets it, with its seq
    assert got.kind == pb.EVENT_KIND_RAISED and got.seq == flag_seq
    before.cancel()
    events = d.stub().ListEvents(pb.ListEventsRequest(), timeout=5).events
    kinds = [(e.kind, e.condition.code) for e in events]
    assert (pb.EVENT_KIND_RAISED, "TICK_FLAG") in kinds
    assert (pb.EVENT_KIND_RAISED, "STATE_UNWRITABLE") in kinds and (pb.EVENT_KIND_CLEARED, "STATE_UNWRITABLE") in kinds
    assert "robustd_event_log_writable 1.0" in scrape(port)
    d.restart()  # it is really on disk
    assert [c.code for c in d.verdict().conditions] == ["TICK_FLAG"]


def test_sigterm_with_a_frozen_state_disk_still_stops_promptly(make_daemon: Any, ext4_disk: Path,
                                                               short_tmp: Path) -> None:
    flag = short_tmp / "flag"
    d = tick_daemon(make_daemon, short_tmp, ext4_disk / "state", flag)
    d.start()
    subprocess.run(["fsfreeze", "-f", str(ext4_disk)], check=True)
    try:
        flag.touch()
        d.wait_for(lambda v: "TICK_FLAG" in codes(v), timeout=5)
        time.sleep(0.5)  # the write of TICK_FLAG is stuck in the kernel now
        assert d.proc is not None
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        # The main thread finishes within its budget even though the writer thread cannot: it says so.
        while "stopping with" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert "stopping with" in d.log() and "not written to the event log" in d.log(), d.log()
        assert took < 2.5, took
    finally:
        subprocess.run(["fsfreeze", "-u", str(ext4_disk)], check=True)
    assert d.proc.wait(10) == 0  # the process itself leaves once the kernel lets the stuck thread go
    d.start()  # the standing fault is seen again by its check and written this time
    d.wait_for(lambda v: "TICK_FLAG" in codes(v) and codes(v)["TICK_FLAG"].seq > 0, timeout=5)


def xid(addr: str, n: int) -> str:
    return f"NVRM: Xid (PCI:{addr}): {n}, pid=4242, name=python, frozen-disk test"


def answers_within(call: Any, within: float = 1.0) -> Any:
    """`call()`'s answer, or its error (UNAVAILABLE saying the log is unreadable, or a refusal of its own), within
    `within` seconds."""
    t0 = time.monotonic()
    try:
        out = call(within + 1.0)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # the log could not be read in time: it says so
            assert "unreadable" in (e.details() or ""), e.details()
        else:  # an answer of its own (no such report; no diagnostic on a disk that does not answer)
            assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), (e.code(), e.details())
        out = e
    took = time.monotonic() - t0
    assert took < within, f"answered after {took:.2f}s"
    return out


def first_event(stream: Any) -> pb.Event:
    return next(iter(stream))


def test_a_frozen_state_disk_keeps_every_read_rpc_within_a_second_and_the_kernel_log_judged(
        make_daemon: Any, ext4_disk: Path) -> None:
    need_root("writing /dev/kmsg")
    gpu_a, gpu_b, gpu_c = bdf(), bdf(), bdf()
    d = make_daemon({"state_dir": str(ext4_disk / "state")})
    d.start()
    inject_kmsg(xid(gpu_a, 13), xid(gpu_a, 31))
    head = d.wait_for(lambda v: cond(v, "XID_31") is not None and v.seq >= 2).seq
    subprocess.run(["fsfreeze", "-f", str(ext4_disk)], check=True)
    try:
        inject_kmsg(xid(gpu_b, 79))  # a reboot-class fault while every write blocks
        deadline = time.monotonic() + 5
        while (c := cond(quick_verdict(d), "XID_79", f"gpu/{gpu_b}.0")) is None:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert c.severity == pb.SEVERITY_CRITICAL and c.sticky
        ch = d.channel()
        node, diag = pb_grpc.NodeHealthStub(ch), pb_grpc.DiagnosticsStub(ch)
        healthz = health_pb2_grpc.HealthStub(ch)
        for _ in range(2):  # the second time a read may still be stuck: refused at once, not queued
            answers_within(lambda t: node.ListEvents(pb.ListEventsRequest(), timeout=t))
            answers_within(lambda t: node.ListEvents(pb.ListEventsRequest(after_seq=1, limit=5), timeout=t))
            answers_within(lambda t: first_event(node.Watch(pb.WatchRequest(from_seq=head - 1), timeout=t)))
            answers_within(lambda t: diag.List(pb.ListDiagnosticsRequest(), timeout=t))
            got = answers_within(lambda t: diag.Get(pb.GetDiagnosticRequest(id="no-such-run"), timeout=t))
            assert isinstance(got, grpc.RpcError) and got.code() in (grpc.StatusCode.NOT_FOUND,
                                                                     grpc.StatusCode.UNAVAILABLE)
            answers_within(lambda t: diag.ListGoldens(pb.ListGoldensRequest(), timeout=t))
            checks = answers_within(lambda t: node.ListChecks(pb.ListChecksRequest(), timeout=t))
            assert "kernel" in {c.name for c in checks.checks}
            assert answers_within(lambda t: healthz.Check(health_pb2.HealthCheckRequest(), timeout=t)).status == \
                health_pb2.HealthCheckResponse.SERVING
            snap = answers_within(lambda t: first_event(node.Watch(pb.WatchRequest(from_seq=0), timeout=t)))
            assert snap.snapshot  # a snapshot comes from memory
        inject_kmsg(xid(gpu_c, 79))  # the kernel log is still read and judged
        deadline = time.monotonic() + 5
        while cond(v := quick_verdict(d), "XID_79", f"gpu/{gpu_c}.0") is None:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert cond(v, "XID_79", f"gpu/{gpu_b}.0") is not None
        r = d.robustctl("events", timeout=10)  # an operator is told why, at once
        assert r.returncode != 0 and "unreadable" in r.stderr, r.stdout + r.stderr
        deadline = time.monotonic() + 15  # once the disk is known not to answer, no diagnostic starts on it
        while "not responding" not in quick_verdict(d).event_log_error:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.2)
        got = answers_within(lambda t: first_event(diag.Run(pb.RunRequest(tests=["all_to_all"]), timeout=t)))
        assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "state disk is not responding" in (got.details() or "")
        ch.close()
    finally:
        subprocess.run(["fsfreeze", "-u", str(ext4_disk)], check=True)
    v = d.wait_for(lambda v: v.event_log_error == "" and "STATE_UNWRITABLE" not in codes(v), timeout=15)
    events = d.stub().ListEvents(pb.ListEventsRequest(limit=1000), timeout=5).events
    raised = {e.condition.component for e in events if e.kind == pb.EVENT_KIND_RAISED and e.condition.code == "XID_79"}
    assert raised == {f"gpu/{gpu_b}.0", f"gpu/{gpu_c}.0"}  # nothing decided while frozen was lost


def test_sigterm_on_a_frozen_state_disk_removes_the_socket_at_once_and_exits_0_after_the_thaw(
        make_daemon: Any, ext4_disk: Path, short_tmp: Path) -> None:
    need_root("writing /dev/kmsg")
    notify_path = str(short_tmp / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    d = make_daemon({"state_dir": str(ext4_disk / "state")}, env={"NOTIFY_SOCKET": notify_path})
    d.start()
    inject_kmsg(xid(bdf(), 13))
    d.wait_for(lambda v: "XID_13" in codes(v) and v.seq >= 1)
    subprocess.run(["fsfreeze", "-f", str(ext4_disk)], check=True)
    thawed = False
    try:
        inject_kmsg(xid(bdf(), 79))
        d.wait_for(lambda v: "XID_79" in codes(v))
        with d.channel() as ch, pytest.raises(grpc.RpcError):  # a read of the log sleeps in the kernel now
            pb_grpc.NodeHealthStub(ch).ListEvents(pb.ListEventsRequest(), timeout=1.5)
        time.sleep(0.3)  # and the write of XID_79 is stuck in the kernel on the writer thread
        while True:  # what the daemon told systemd so far
            try:
                notify.settimeout(0.05)
                notify.recv(4096)
            except TimeoutError:
                break
        assert d.proc is not None
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        notify.settimeout(2.0)
        assert "STOPPING=1" in notify.recv(4096).decode()
        while os.path.exists(d.socket):
            assert time.monotonic() - t0 < 2.0, f"the socket is still there after 2s\n{d.log()}"
            time.sleep(0.02)
        with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
            s.connect(d.socket)  # no new calls
        time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
        assert "not written to the event log" in d.log(), d.log()
        subprocess.run(["fsfreeze", "-u", str(ext4_disk)], check=True)
        thawed, t1 = True, time.monotonic()
        code = d.proc.wait(5)
        took = time.monotonic() - t1
    finally:
        notify.close()
        if not thawed:
            subprocess.run(["fsfreeze", "-u", str(ext4_disk)], check=True)
    assert code == 0, d.log()
    assert took < 1.0, f"gone {took:.2f}s after the thaw"
    assert "Traceback" not in d.log() and "exiting now" not in d.log(), d.log()


def test_a_read_only_state_dir_at_start_starts_degraded_and_writes_once_writable(make_daemon: Any,
                                                                                 tmpfs_disk: Path,
                                                                                 short_tmp: Path) -> None:
    flag, port = short_tmp / "flag", free_port()
    d = tick_daemon(make_daemon, short_tmp, tmpfs_disk / "state", flag, metrics={"address": f"127.0.0.1:{port}"})
    d.start()
    flag.touch()
    d.wait_for(lambda v: "TICK_FLAG" in codes(v) and codes(v)["TICK_FLAG"].seq > 0)
    d.stop()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_disk)], check=True)
    try:
        d.start()  # used to die with an uncaught sqlite3.OperationalError
        v = d.wait_for(lambda v: "STATE_UNWRITABLE" in codes(v), timeout=5)
        assert "TICK_FLAG" in codes(v)  # what the log held is still known (read-only) and still seen
        assert "read-only" in v.event_log_error.lower() or "readonly" in v.event_log_error.lower(), v
        assert codes(v)["STATE_UNWRITABLE"].component == "check/store"
        assert "cannot be written" in d.log() and "Traceback" not in d.log()
        assert "robustd_event_log_writable 0.0" in scrape(port)
        flag.unlink()  # the fault goes away while the log cannot be written: the verdict follows at once
        d.wait_for(lambda v: "TICK_FLAG" not in codes(v), timeout=15)
        old = d.stub().ListEvents(pb.ListEventsRequest(), timeout=5).events  # reads what the log held
        assert [(e.kind, e.condition.code) for e in old][:1] == [(pb.EVENT_KIND_RAISED, "TICK_FLAG")]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs_disk)], check=True)
    v = d.wait_for(lambda v: v.event_log_error == "" and "STATE_UNWRITABLE" not in codes(v), timeout=10)
    events = d.stub().ListEvents(pb.ListEventsRequest(), timeout=5).events
    assert (pb.EVENT_KIND_CLEARED, "TICK_FLAG") in [(e.kind, e.condition.code) for e in events]
    d.restart()
    assert "TICK_FLAG" not in codes(d.verdict())


def test_a_fresh_read_only_state_dir_starts_with_an_empty_verdict_and_says_why(make_daemon: Any, tmpfs_disk: Path,
                                                                              short_tmp: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_disk)], check=True)
    d = tick_daemon(make_daemon, short_tmp, tmpfs_disk / "state", short_tmp / "flag")
    d.start()
    v = d.wait_for(lambda v: "STATE_UNWRITABLE" in codes(v), timeout=5)
    assert [c.code for c in v.conditions] == ["STATE_UNWRITABLE"] and v.severity == pb.SEVERITY_WARNING
    try:
        d.stub().ListEvents(pb.ListEventsRequest(), timeout=5)  # answers (nothing to read yet)
    except grpc.RpcError as e:  # pragma: no cover - shown on failure
        raise AssertionError(f"ListEvents failed: {e.code()} {e.details()}") from None
    r = d.robustctl("status")
    assert r.returncode == 1 and "EVENT LOG NOT WRITABLE" in r.stdout, r.stdout + r.stderr
