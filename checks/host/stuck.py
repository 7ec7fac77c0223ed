"""Tasks stuck in uninterruptible sleep (`D`): PROCESS_STUCK on `host`.

A task in `D` waits in the kernel and no signal but (for TASK_KILLABLE) SIGKILL ends it: a GPU driver
call that never returns, a read from an NFS server that is gone, a FUSE daemon that stopped answering.
The kernel's hung-task detector says so only in part: where it is built and enabled it logs a task
blocked past hung_task_timeout_secs (the kernel-log rule HUNG_TASK), but only `hung_task_warnings` times
a boot (10 by default, then never again), and a log line cannot say that the task is *still* stuck or
that it got free. This condition holds while the task stays stuck and clears when it does not.

The scan, at most every `checks.host.dstate_scan_every` (10 s; the check polls every second and reuses
the last scan's finding in between):

- reads `<proc>/<pid>/task/<tid>/stat` of every thread, not only the processes' main threads: a
  training process's main thread usually waits on a futex (`S`) while a worker thread is the one stuck
  in the driver. At most `dstate_max_tasks` stat files a scan; past that the walk resumes where it
  stopped on the next scan, and the tasks already found in `D` are re-read first, every scan, so a
  large node is covered over a few scans and a stuck task is never forgotten for want of budget;
- keys each task by (tid, start time: stat field 22), so a reused pid starts afresh;
- counts a task as stuck from the first scan that found it in `D` *and not run since*: its
  `<proc>/<tid>/schedstat` (CPU time, run-queue wait, times run) must not change between scans, as the
  kernel's hung-task detector compares context-switch counts. A task doing heavy I/O is in `D` at many
  samples but runs in between: its schedstat moves and its clock restarts. A task seen out of `D`, or
  gone, is dropped. Without schedstat (CONFIG_SCHED_INFO off) being in `D` at every scan is enough;
- reads each file with one bounded read (4 KiB) and takes a task that vanished mid-read as gone;
- never reads `cmdline` or `environ`: those take the task's mmap lock, which a task stuck in a page
  fault on a dead mount holds, and the reader (this daemon, or `ps`) would hang with it. The command is
  the stat comm. `stack` is read only for the oldest stuck task (it takes the task's exec lock,
  killably; a task stuck in execve holds that lock, and the poll's deadline then reports the check).

Several stuck tasks are one condition naming the count and the oldest three (message) and the oldest's
wait channel and stack (evidence, bounded). It clears `clear_after` after no task stays stuck.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from checks.host.config import HostConfig
from checks.host.parse import TaskStat, parse_stack, parse_task_stat
from robustd.durations import format_duration
from robustd.model import Finding, FindingKind
from robustd.roots import Roots

CODE = "PROCESS_STUCK"
_READ = 4096  # bytes of one stat, schedstat, wchan or stack read
FROZEN = frozenset({"__refrigerator", "refrigerator", "do_freezer_trap"})  # the freezer's waits, not a stuck task
_MAX_WCHANS = 256  # stuck tasks whose wait channel is read to leave the frozen out, per finding
_NAMED = 3  # stuck tasks the message names
_LISTED = 10  # stuck pids the evidence lists
_FRAMES = 8  # stack frames in evidence


@dataclass
class _Stuck:
    pid: int  # the process (thread group) the task belongs to
    comm: str
    since: float  # the first scan that found it in D without having run since
    ran: str | None  # its schedstat then; a change means it ran


def _read(path: str) -> str:
    """One bounded read; OSError when the task is gone (ENOENT, ESRCH) or the file is not readable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _READ).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class StuckTasks:
    """The scan's state between polls: tasks in D by (tid, start), the walk's cursor, the last finding."""

    def __init__(self) -> None:
        self._stuck: dict[tuple[int, int], _Stuck] = {}
        self._cursor = 0  # the walk resumes at the first pid above this
        self._last_scan: float | None = None
        self._findings: list[Finding] = []

    def poll(self, roots: Roots, cfg: HostConfig, now: float) -> list[Finding]:
        """The PROCESS_STUCK finding (or none), scanning `/proc` if the last scan is old enough."""
        if self._last_scan is not None and 0 <= now - self._last_scan < cfg.dstate_scan_every:
            return self._findings
        self._last_scan = now
        self._scan(roots, cfg, now)
        self._findings = self._finding(roots, cfg, now)
        return self._findings

    # -- the scan ------------------------------------------------------------------------------
    def _scan(self, roots: Roots, cfg: HostConfig, now: float) -> None:
        budget = cfg.dstate_max_tasks
        seen: set[int] = set()
        for (tid, start), old in list(self._stuck.items()):  # the known ones first, whatever the budget
            budget -= 1
            st = self._stat(roots.proc_path(str(tid), "stat"))
            if st is None or st.start != start or st.state != "D":
                del self._stuck[(tid, start)]  # gone, reused, or out of D (a reused one in D: the walk finds it)
            else:
                seen.add(tid)
                self._note(roots, old.pid, st, now)
        try:
            pids = sorted(int(n) for n in os.listdir(roots.proc) if n.isdigit())
        except OSError:
            return
        first = next((i for i, p in enumerate(pids) if p > self._cursor), 0)
        done = False  # a pid walked this scan (the first one is walked whole, however many threads it has)
        for pid in pids[first:] + pids[:first]:
            try:
                tids = [int(n) for n in os.listdir(roots.proc_path(str(pid), "task")) if n.isdigit()]
            except OSError:
                continue  # gone meanwhile
            if done and len(tids) > budget:
                return  # does not fit: the next scan starts with it
            for tid in tids:
                if tid in seen:
                    continue
                budget -= 1
                st = self._stat(roots.proc_path(str(pid), "task", str(tid), "stat"))
                if st is not None and st.state == "D":
                    self._note(roots, pid, st, now)
            self._cursor, done = pid, True
        else:
            self._cursor = 0  # walked them all: start at the beginning next time

    @staticmethod
    def _stat(path: str) -> TaskStat | None:
        try:
            return parse_task_stat(_read(path))
        except (OSError, ValueError):
            return None  # vanished mid-read, or a zombie's torn line

    def _note(self, roots: Roots, pid: int, st: TaskStat, now: float) -> None:
        """A task found in D: keep its clock if it has not run since the last scan, else restart it."""
        try:
            ran: str | None = _read(roots.proc_path(str(st.pid), "schedstat")).strip()
        except OSError:
            ran = None
        key = (st.pid, st.start)
        old = self._stuck.get(key)
        if old is None or old.ran != ran:
            self._stuck[key] = _Stuck(pid=pid, comm=st.comm, since=now, ran=ran)

    # -- the finding ---------------------------------------------------------------------------
    def _finding(self, roots: Roots, cfg: HostConfig, now: float) -> list[Finding]:
        stuck = sorted(((k, s) for k, s in self._stuck.items() if now - s.since >= cfg.dstate_after),
                       key=lambda ks: (ks[1].since, ks[0]))
        # A frozen task (a paused container, cgroup v1's freezer) sleeps in D by the operator's choice.
        stuck = [ks for i, ks in enumerate(stuck) if i >= _MAX_WCHANS or self._wchan(roots, ks[0][0]) not in FROZEN]
        if not stuck:
            return []

        def who(tid: int, s: _Stuck) -> str:
            return f"pid {s.pid}" + (f" thread {tid}" if tid != s.pid else "") + f" ({s.comm})"

        named = []
        for (tid, _), s in stuck[:_NAMED]:
            named.append(f"{who(tid, s)} {_age(now - s.since)} in {self._wchan(roots, tid)}")
        more = f"; {len(stuck) - _NAMED} more" if len(stuck) > _NAMED else ""
        (tid, _), oldest = stuck[0]
        evidence = {"count": str(len(stuck)), "pids": ",".join(str(s.pid) for _, s in stuck[:_LISTED]),
                    "oldest_pid": str(oldest.pid), "oldest_comm": oldest.comm,
                    "oldest_wchan": self._wchan(roots, tid), "oldest_stuck_s": str(int(now - oldest.since))}
        if tid != oldest.pid:
            evidence["oldest_tid"] = str(tid)
        try:
            frames = parse_stack(_read(roots.proc_path(str(tid), "stack")), _FRAMES)
        except OSError:
            frames = []  # not root, or a kernel without CONFIG_STACKTRACE
        if frames:
            evidence["oldest_stack"] = " < ".join(frames)
        n = len(stuck)
        message = (f"{n} task{'s' if n > 1 else ''} in uninterruptible sleep (D) for over "
                   f"{format_duration(cfg.dstate_after)}: " + "; ".join(named) + more)
        return [Finding(component="host", code=CODE, kind=FindingKind.STATE, message=message, evidence=evidence)]

    @staticmethod
    def _wchan(roots: Roots, tid: int) -> str:
        """The kernel function it waits in; `?` where the kernel hides it (`0`) or the task is gone."""
        try:
            w = _read(roots.proc_path(str(tid), "wchan")).strip()
        except OSError:
            return "?"
        return w if w and w != "0" else "?"
