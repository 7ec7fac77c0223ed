"""A state disk that hangs or is read-only: the API keeps answering from memory, robustd says its own
machinery is the problem (STATE_UNWRITABLE on check/store, never a hardware verdict), and nothing that
was decided is lost when the disk comes back. Real ext4 on a loop device frozen with fsfreeze, real
read-only tmpfs remounts, real SQLite, real daemon."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Daemon, free_port, need_root, plugin_env, tmpfs

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
