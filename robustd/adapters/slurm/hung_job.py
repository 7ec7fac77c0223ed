"""A hung job's leftovers: find the job's processes still alive and save their stacks (Tracer.CaptureStacks).

The Slurm epilog calls `capture_hang` when triage says `hang`; the capture lands in <state_dir>/stacks.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import time
from typing import Any

from robustd import atomicfile
from robustd.adapters.common import client
from robustd.config import TracerConfig
from robustd.roots import Roots

log = logging.getLogger("robustd.slurm")

MAX_JOB_PIDS = 64  # a hung job's leftover processes whose stacks are captured
MAX_PROC_READ = 1 << 20  # bytes of one process's environ or cgroup read when looking for the job's processes
STACKS_KEEP = 50  # capture files kept in <state_dir>/stacks (the newest)
JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")  # a job id (or array job_task) Slurm could have handed us


def _read_small(path: str, limit: int = MAX_PROC_READ) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def _ancestors(roots: Roots, pid: int) -> set[int]:
    """`pid` and its parents: the epilog and the slurmd that runs it carry SLURM_JOB_ID too."""
    out = {pid}
    for _ in range(32):
        stat_text = _read_small(roots.proc_path(str(pid), "stat"), 4096)
        try:
            pid = int(stat_text[stat_text.rindex(b")") + 2:].split()[1])
        except (ValueError, IndexError):
            break
        if pid <= 1 or pid in out:
            break
        out.add(pid)
    return out


def job_pids(roots: Roots, job: str, own: int, limit: int = MAX_JOB_PIDS) -> list[int]:
    """The job's processes still alive: in its cgroup (`.../job_<id>/...`, proctrack/cgroup) or with
    SLURM_JOB_ID=<id> in their environment (any proctrack); never the epilog itself, its parents or slurmstepd."""
    if not JOB_ID.fullmatch(job):
        return []
    in_cgroup = re.compile(rb"/job_" + re.escape(job.encode()) + rb"(?:/|$)", re.M)
    marker = b"SLURM_JOB_ID=" + job.encode()
    skip = _ancestors(roots, own)
    try:
        entries = os.listdir(roots.proc)
    except OSError:
        return []
    found = []
    for pid in sorted(int(e) for e in entries if e.isdigit()):
        if pid in skip:
            continue
        entry = str(pid)
        if not in_cgroup.search(_read_small(roots.proc_path(entry, "cgroup"))) \
                and marker not in _read_small(roots.proc_path(entry, "environ")).split(b"\0"):
            continue
        if not _read_small(roots.proc_path(entry, "cmdline"), 4096):
            continue  # a zombie or a kernel thread: nothing to capture
        if _read_small(roots.proc_path(entry, "comm"), 64).strip() == b"slurmstepd":
            continue
        found.append(pid)
        if len(found) >= limit:
            break
    return sorted(found)


def capture_hang(job: str, socket: str, roots: Roots, tracer: TracerConfig, state_dir: str, budget: float) -> None:
    """Tracer.CaptureStacks of the hung job's leftover processes, saved under <state_dir>/stacks, within
    `budget` seconds; the path is logged. Only training processes are traced (the daemon's rule): the daemon
    names the others it refuses (NotTraceable), and the rest are captured."""
    pids = job_pids(roots, job, os.getpid())
    if not pids:
        log.warning("job %s: triage says hang; no process of the job is left to capture", job)
        return
    waves = 1 + len(pids) // max(1, tracer.concurrency)
    timeout = min(max(1.0, budget - 5), tracer.timeout * waves + 10)
    want = list(pids)
    resp = None
    for _ in range(2):
        try:
            resp = client.capture_stacks(socket, want, timeout)
            break
        except client.NotTraceable as e:
            rest = [p for p in want if p not in set(e.pids)]
            if e.pids and rest:  # trace the rest of the job's processes
                want = rest
                continue
            err: Exception = e
        except client.CaptureRefused as e:
            err = e
        except client.Unreachable as e:
            log.warning("job %s: triage says hang, but its stacks cannot be captured: %s", job, e)
            return
        log.warning("job %s: triage says hang; stack capture of its %d processes (pids %s) failed: %s",
                    job, len(pids), ",".join(map(str, pids[:16])), str(err)[:300])
        return
    if resp is None:
        return
    try:
        path = save_stacks(state_dir, job, resp)
    except OSError as e:
        log.warning("job %s: stacks captured but not saved: %s", job, e)
        return
    failed = sum(1 for p in resp.processes if p.error)
    log.warning("job %s: triage says hang: stacks of %d of its processes captured (%d not), saved to %s",
                job, len(resp.processes) - failed, failed, path)


def save_stacks(state_dir: str, job: str, resp: Any) -> str:
    """The capture as JSON in <state_dir>/stacks/job-<id>-<time>.json (0600); the newest STACKS_KEEP are kept."""
    from robustd.cli.render import to_json

    folder = os.path.join(state_dir, "stacks")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"job-{job}-{time.strftime('%Y%m%dT%H%M%S')}.json")
    atomicfile.write_bytes(path, to_json(resp).encode(), mode=0o600)
    old = sorted(glob.glob(os.path.join(glob.escape(folder), "job-*.json")), key=os.path.getmtime, reverse=True)
    for stale in old[STACKS_KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(stale)
    return path
