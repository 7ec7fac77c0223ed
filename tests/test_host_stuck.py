"""PROCESS_STUCK: tasks in uninterruptible sleep, on fixture procfs trees with a test clock, and a real one.

The fixture trees write what the kernel shows: `<pid>/task/<tid>/stat` for the walk and `<tid>/{stat,
schedstat,wchan,stack}` (the kernel answers /proc/<tid> for any thread, listed or not). The real test
puts a process in `D` on a FUSE mount that stops answering (tests/fuse_stall.py) under a real daemon.
"""

from __future__ import annotations

import errno
import re
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI, need_root

from checks.host import HostCheck
from checks.host.config import HostConfig
from checks.host.parse import parse_stack, parse_task_stat
from robustd.api.v1 import robustd_pb2 as pb
from robustd.check import CheckContext
from robustd.config import ConfigError
from robustd.model import Finding
from robustd.roots import Roots

STACK = ("[<0>] request_wait_answer+0xaa/0x210\n[<0>] __fuse_simple_request+0x120/0x330\n"
         "[<0>] fuse_lookup_name+0xbf/0x220\n[<0>] fuse_lookup+0x75/0x1b0\n")


def stat_line(tid: int, comm: str, state: str, start: int) -> str:
    """A /proc/<pid>/stat line as the kernel writes it (52 fields); start is field 22."""
    fields = [state, "1", str(tid), str(tid), "0", "-1", "4194304"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    return f"{tid} ({comm}) " + " ".join(fields) + "\n"


class Proc:
    """A fixture procfs under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(exist_ok=True)

    def task(self, pid: int, tid: int, comm: str, state: str, start: int = 100, wchan: str = "request_wait_answer",
             ran: str = "16511467 295985 4") -> None:
        line = stat_line(tid, comm, state, start)
        (self.root / str(pid) / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
        (self.root / str(pid) / "task" / str(tid) / "stat").write_text(line)
        d = self.root / str(tid)
        d.mkdir(exist_ok=True)
        (d / "stat").write_text(line)
        (d / "schedstat").write_text(ran + "\n")
        (d / "wchan").write_text(wchan)
        (d / "stack").write_text(STACK)

    def gone(self, pid: int, *tids: int) -> None:
        import shutil
        for n in (pid, *tids):
            shutil.rmtree(self.root / str(n), ignore_errors=True)


class Clocked:
    """The host check on a fixture tree with a clock the test moves; only PROCESS_STUCK is looked at."""

    def __init__(self, tmp: Path, **cfg: Any) -> None:
        self.proc = Proc(tmp / "proc")
        (tmp / "sys").mkdir()
        (self.proc.root / "mounts").write_text("rootfs / rootfs rw 0 0\n")
        self.now = 1000.0
        config = HostConfig(disks=[], **{"dstate_after": "30s", "dstate_scan_every": "10s", **cfg})
        self.ctx = CheckContext(name="host", node_name="n", roots=Roots(sys=str(tmp / "sys"), proc=str(self.proc.root)),
                                config=config, state_dir=str(tmp), clock=lambda: self.now)
        self.check = HostCheck()

    def at(self, t: float) -> Finding | None:
        self.now = 1000.0 + t
        found = [f for f in self.check.poll(self.ctx) if f.code == "PROCESS_STUCK"]
        assert len(found) <= 1 and all(f.component == "host" for f in found)
        return found[0] if found else None


# -- parsers ------------------------------------------------------------------------------------------
def test_parse_task_stat_takes_the_comm_up_to_the_last_paren() -> None:
    st = parse_task_stat(stat_line(4242, "a) (b c", "D", 98765))
    assert (st.pid, st.comm, st.state, st.start) == (4242, "a) (b c", "D", 98765)
    real = Path("/proc/self/stat").read_text()
    assert parse_task_stat(real).state == "R"
    for bad in ("", "12 (x) S 1 2", "not a stat line"):
        with pytest.raises(ValueError):
            parse_task_stat(bad)


def test_parse_stack_keeps_the_function_names() -> None:
    assert parse_stack(STACK, 3) == ["request_wait_answer", "__fuse_simple_request", "fuse_lookup_name"]
    assert parse_stack("", 3) == []


def test_config_keys_are_validated_with_key_and_line() -> None:
    from robustd.checkset import config_schema, discover_checks
    from robustd.config import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config("checks:\n  host:\n    dstate_after: 0s\n    dstate_scan_every: 5\n    dstate_max_tasks: 0\n",
                     "t.yaml", config_schema(discover_checks()))
    text = str(e.value)
    assert "t.yaml:3: checks.host.dstate_after: must be greater than zero" in text
    assert "t.yaml:4: checks.host.dstate_scan_every: " in text and "no unit" in text
    assert "t.yaml:5: checks.host.dstate_max_tasks: " in text
    cfg = HostConfig()
    assert (cfg.dstate_after, cfg.dstate_scan_every) == (300.0, 10.0)


# -- timing on fixture trees --------------------------------------------------------------------------
def test_a_task_in_d_longer_than_dstate_after_is_stuck_and_clears(tmp_path: Path) -> None:
    c = Clocked(tmp_path)
    c.proc.task(1, 1, "systemd", "S")
    c.proc.task(4242, 4242, "python3", "D")
    assert c.at(0) is None  # first seen in D
    assert c.at(20) is None
    f = c.at(30)
    assert f is not None
    assert f.evidence["count"] == "1" and f.evidence["oldest_pid"] == "4242"
    assert f.evidence["oldest_comm"] == "python3" and f.evidence["oldest_wchan"] == "request_wait_answer"
    assert f.evidence["oldest_stack"].startswith("request_wait_answer < __fuse_simple_request < fuse_lookup_name")
    assert f.evidence["oldest_stuck_s"] == "30" and "oldest_tid" not in f.evidence
    assert f.message == ("1 task in uninterruptible sleep (D) for over 30s: "
                         "pid 4242 (python3) 30s in request_wait_answer")

    # Out of D: the scan between polls is rate-limited, so the finding stays until the next scan.
    c.proc.task(4242, 4242, "python3", "S")
    assert c.at(35) is not None
    assert c.at(40) is None
    c.proc.task(4242, 4242, "python3", "D")  # back in D: its clock starts again
    assert c.at(50) is None and c.at(70) is None
    assert c.at(80) is not None


def test_a_frozen_task_is_not_stuck(tmp_path: Path) -> None:
    """`docker pause` (cgroup v1's freezer) leaves every task of the container in D in the freezer's wait."""
    c = Clocked(tmp_path)
    c.proc.task(4242, 4242, "python3", "D", wchan="__refrigerator")
    c.proc.task(4243, 4243, "python3", "D", wchan="do_freezer_trap")
    assert c.at(0) is None and c.at(60) is None
    c.proc.task(4244, 4244, "python3", "D")  # a stuck one beside them is still reported, alone
    assert c.at(70) is None
    f = c.at(110)
    assert f is not None and f.evidence["count"] == "1" and f.evidence["oldest_pid"] == "4244"


def test_a_task_that_runs_between_scans_is_not_stuck(tmp_path: Path) -> None:
    """Heavy I/O: in D at every sample, but its schedstat moves, so it is not one long sleep."""
    c = Clocked(tmp_path)
    for i, t in enumerate(range(0, 60, 10)):
        c.proc.task(77, 77, "dd", "D", ran=f"{1000 + i} 5 {10 + i}")
        assert c.at(t) is None
    c.proc.task(77, 77, "dd", "D", ran="1005 5 15")  # it stopped running at t=50
    assert c.at(70) is None
    assert c.at(80) is not None  # 30 s since t=50


def test_pid_reuse_and_vanishing_do_not_carry_over(tmp_path: Path) -> None:
    c = Clocked(tmp_path)
    c.proc.task(500, 500, "cat", "D", start=100)
    assert c.at(0) is None
    c.proc.task(500, 500, "other", "D", start=2000)  # the pid exited and was reused: a new task
    assert c.at(20) is None
    assert c.at(40) is None  # 20 s for the new one
    f = c.at(50)
    assert f is not None and f.evidence["oldest_comm"] == "other" and f.evidence["oldest_stuck_s"] == "30"
    c.proc.gone(500)  # vanished
    assert c.at(60) is None
    c.proc.task(500, 500, "other", "D", start=2000)
    assert c.at(70) is None  # not remembered from before it vanished


def test_a_stuck_thread_names_its_process(tmp_path: Path) -> None:
    c = Clocked(tmp_path)
    c.proc.task(900, 900, "python3", "S")
    c.proc.task(900, 913, "pt_autograd_0", "D", wchan="uvm_wait")
    c.at(0)
    f = c.at(30)
    assert f is not None
    e = f.evidence
    assert (e["oldest_pid"], e["oldest_tid"], e["oldest_wchan"]) == ("900", "913", "uvm_wait")
    assert "pid 900 thread 913 (pt_autograd_0) 30s in uvm_wait" in f.message


def test_several_stuck_tasks_are_one_condition_naming_the_oldest(tmp_path: Path) -> None:
    c = Clocked(tmp_path, dstate_after="45s")
    for i in range(5):
        c.proc.task(100 + i, 100 + i, f"w{i}", "D", wchan=f"wait{i}")
        assert c.at(10 * i) is None
    f = c.at(75)  # seen first at 0, 10, 20, 30 (over 45 s) and 40 (35 s: not yet)
    assert f is not None
    assert f.evidence["count"] == "4" and f.evidence["pids"] == "100,101,102,103"
    assert f.message == ("4 tasks in uninterruptible sleep (D) for over 45s: pid 100 (w0) 1m15s in wait0; "
                         "pid 101 (w1) 1m05s in wait1; pid 102 (w2) 55s in wait2; 1 more")
    c.proc.task(100, 100, "w0", "S")
    f = c.at(85)
    assert f is not None and f.evidence["oldest_pid"] == "101" and f.evidence["count"] == "4"  # 104 joined
    for i in range(5):
        c.proc.task(100 + i, 100 + i, f"w{i}", "R")
    assert c.at(95) is None


def test_the_walk_is_bounded_and_resumes_and_keeps_the_known(tmp_path: Path) -> None:
    """dstate_max_tasks=2 of 6 tasks: the stuck one at the end is found by the third scan and then re-read
    every scan on top of the walk."""
    c = Clocked(tmp_path, dstate_max_tasks=2, dstate_after="20s")
    for pid in (10, 11, 12, 13, 14):
        c.proc.task(pid, pid, "idle", "S")
    c.proc.task(15, 15, "stuck", "D")
    assert c.at(0) is None and c.at(10) is None  # 10,11 then 12,13
    assert c.at(20) is None  # 14,15: found at t=20
    assert c.at(30) is None and c.at(40) is not None  # the walk went on to 10,11 and 12,13 meanwhile


# -- a real process in D under a real daemon ---------------------------------------------------------
def mounted(short_tmp: Path) -> Any:
    """A FuseStall mounted on short_tmp/fuse (root; fails under CI=true when the kernel refuses)."""
    need_root("mounting a FUSE file system")
    from fuse_stall import FuseStall

    mnt = short_tmp / "fuse"
    mnt.mkdir()
    try:
        return FuseStall(mnt)
    except OSError as e:
        (pytest.fail if IN_CI else pytest.skip)(f"cannot mount FUSE here: {e}")


def test_a_real_process_stuck_on_a_fuse_mount_is_reported_and_clears(make_daemon: Any, short_tmp: Path) -> None:
    from test_host_check import cond, wait_polled

    fs = mounted(short_tmp)
    with fs:
        d = make_daemon({
            "policy": {"codes": {"PROCESS_STUCK": {"clear_after": "1s"}}},
            "checks": {"kernel": {"enabled": False},
                       # The real /proc: the host's own disks and memory are not under test here.
                       "host": {"enabled": True, "interval": "200ms", "disks": [], "psi_some_avg10": 100,
                                "psi_full_avg10": 100, "min_available_percent": 0,
                                "dstate_after": "2s", "dstate_scan_every": "500ms"}},
        })
        d.start()
        wait_polled(d, "host")
        pid = fs.stall()
        t0 = time.monotonic()  # in D from here (give or take the scan that saw it first)
        v = d.wait_for(lambda v: cond(v, "PROCESS_STUCK", "host") is not None, timeout=8)
        took = time.monotonic() - t0
        c = cond(v, "PROCESS_STUCK", "host")
        assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_NONE)
        assert took >= 1.9, f"raised {took:.1f}s after it entered D, before dstate_after (2s)"
        assert str(pid) in c.evidence["pids"].split(","), c.evidence
        assert re.search(rf"pid {pid} \(python[^)]*\) \S+ in request_wait_answer", c.message), c.message
        if c.evidence["oldest_pid"] == str(pid):  # unless another task on this machine was stuck first
            assert c.evidence["oldest_wchan"] == "request_wait_answer", c.evidence
            assert "fuse_lookup" in c.evidence.get("oldest_stack", "fuse_lookup"), c.evidence  # where readable

        fs.release()  # the lookup is answered: the process leaves D and exits
        assert fs.child is not None and fs.child.returncode == errno.ENOENT  # its stat got the answer
        d.wait_for(lambda v: cond(v, "PROCESS_STUCK", "host") is None, timeout=8)


def test_the_fuse_stall_cleans_up_a_process_left_stuck(short_tmp: Path) -> None:
    """What a failing test leaves (a child in D, the mount up) is gone after the `with`."""
    from fuse_stall import state

    fs = mounted(short_tmp)
    with pytest.raises(RuntimeError), fs:
        pid = fs.stall()
        raise RuntimeError("the test failed here")
    assert state(pid) == ""  # killed and reaped
    assert str(short_tmp / "fuse") not in Path("/proc/self/mounts").read_text()
