"""Stack capture of this node's training processes with py-spy: the engine of the Tracer service.

Only training processes are ever traced — those the GPU check saw holding NVML compute contexts and
those whose command line matches `tracer.process_patterns` — so a caller of CaptureStacks can never
point py-spy at an arbitrary process. Each capture is a `py-spy dump --json` child with its own
deadline: a process py-spy cannot read (exited, not Python, no permission) or one that makes py-spy
hang costs that process's entry an error, never the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from robustd.config import TracerConfig
from robustd.roots import Roots

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
MAX_ANCESTRY = 16  # parent links followed to tell the daemon's own descendants
_STDERR_KEEP = 4096


@dataclass(frozen=True)
class Target:
    """A training process chosen for capture, with the rank information its environment gives."""

    pid: int
    command: str
    selected_by: str  # "gpu" or "pattern:<regex>"
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None


@dataclass
class Capture:
    target: Target
    threads: list[dict[str, Any]] = field(default_factory=list)  # py-spy's JSON threads
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0


class NotTraceable(LookupError):
    """A selector named a pid or rank that is not one of this node's training processes (which ones: `pids`,
    `ranks`, so the API can say so in a structured status, not only in its text)."""

    def __init__(self, message: str, pids: Sequence[int] = (), ranks: Sequence[int] = ()):
        super().__init__(message)
        self.pids = tuple(pids)
        self.ranks = tuple(ranks)


class NoPySpy(RuntimeError):
    """The py-spy binary is missing."""


def find_py_spy(configured: str | None) -> str:
    """`tracer.py_spy`, else the py-spy installed beside the daemon's interpreter (the package's venv), else $PATH."""
    if configured:
        if not os.access(configured, os.X_OK):
            raise NoPySpy(f"tracer.py_spy: {configured} is not an executable")
        return configured
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("py-spy")
    if found is None:
        raise NoPySpy("py-spy is not installed (pip install py-spy, or set tracer.py_spy)")
    return found


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return None


def _command(roots: Roots, pid: int) -> str | None:
    raw = _read(roots.proc_path(str(pid), "cmdline"))
    if not raw:
        return None  # kernel thread, zombie, or exited
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def rank_info(roots: Roots, pid: int) -> dict[str, int]:
    """RANK, LOCAL_RANK and WORLD_SIZE from the process's environment, the ones present and numeric."""
    raw = _read(roots.proc_path(str(pid), "environ")) or b""
    out: dict[str, int] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name.decode("ascii", "replace") in RANK_VARS:
            with contextlib.suppress(ValueError):
                out[name.decode()] = int(value)
    return out


def _parent(roots: Roots, pid: int) -> int | None:
    stat = _read(roots.proc_path(str(pid), "stat"))
    if stat is None:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm)": state, then ppid
    except (ValueError, IndexError):
        return None


def _is_ours(roots: Roots, pid: int, own: int) -> bool:
    """Whether `pid` is the daemon or descends from it (py-spy; the diagnostics' torch children and their
    rank processes, which hold GPU contexts too): never a training process."""
    for _ in range(MAX_ANCESTRY):
        if pid == own:
            return True
        parent = _parent(roots, pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def select(roots: Roots, cfg: TracerConfig, gpu_pids: Iterable[int], own_pid: int | None = None) -> list[Target]:
    """The training processes: NVML compute processes, then command-line matches; by rank, then pid."""
    own = os.getpid() if own_pid is None else own_pid
    chosen: dict[int, tuple[str, str]] = {}
    if cfg.gpu_processes:
        for pid in gpu_pids:
            cmd = _command(roots, pid)
            if cmd is not None and not _is_ours(roots, pid, own):
                chosen[pid] = (cmd, "gpu")
    if cfg.process_patterns:
        patterns = [(p, re.compile(p)) for p in cfg.process_patterns]
        for entry in os.listdir(roots.proc):
            if not entry.isdigit() or int(entry) in chosen:
                continue
            pid = int(entry)
            cmd = _command(roots, pid)
            if cmd is None or _is_ours(roots, pid, own):
                continue
            for text, rx in patterns:
                if rx.search(cmd):
                    chosen[pid] = (cmd, f"pattern:{text}")
                    break
    targets = []
    for pid, (cmd, why) in chosen.items():
        info = rank_info(roots, pid)
        targets.append(Target(pid, cmd, why, info.get("RANK"), info.get("LOCAL_RANK"), info.get("WORLD_SIZE")))
    targets.sort(key=lambda t: (t.rank is None, t.rank if t.rank is not None else 0, t.pid))
    return targets[:cfg.max_processes]


def narrow(targets: Sequence[Target], pids: Sequence[int], ranks: Sequence[int]) -> list[Target]:
    """Apply a selector; every pid and rank it names must be a training process (else NotTraceable)."""
    if not pids and not ranks:
        return list(targets)
    by_pid = {t.pid: t for t in targets}
    missing = [p for p in pids if p not in by_pid]
    if missing:
        raise NotTraceable(f"pid {', '.join(map(str, missing))}: not a training process on this node "
                           "(traced: GPU compute processes and tracer.process_patterns matches)", pids=missing)
    have_ranks = {t.rank for t in targets}
    missing = [r for r in ranks if r not in have_ranks]
    if missing:
        raise NotTraceable(f"rank {', '.join(map(str, missing))}: no training process on this node has that RANK",
                           ranks=missing)
    return [t for t in targets if t.pid in set(pids) or (t.rank is not None and t.rank in set(ranks))]


async def capture_one(py_spy: str, target: Target, native: bool, timeout: float) -> Capture:
    """One `py-spy dump --json` child under a deadline; killed (its whole session) when it runs over."""
    argv = [py_spy, "dump", "--json", "--pid", str(target.pid)] + (["--native"] if native else [])
    start = time.monotonic()
    out = Capture(target)
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    start_new_session=True)
    except OSError as e:
        out.error = f"cannot run {py_spy}: {e.strerror or e}"
        return out
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError) as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(e, asyncio.CancelledError):
            raise
        out.timed_out = True
        out.error = f"py-spy did not finish within {timeout:g} s"
        out.seconds = time.monotonic() - start
        return out
    out.seconds = time.monotonic() - start
    if proc.returncode != 0:
        lines = [ln.strip() for ln in stderr[-_STDERR_KEEP:].decode("utf-8", "replace").splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        out.error = f"py-spy: {reason.removeprefix('Error: ')}"
        return out
    try:
        threads = json.loads(stdout)
        if not isinstance(threads, list):
            raise ValueError("not a list of threads")
    except ValueError as e:
        out.error = f"py-spy printed unreadable JSON: {e}"
        return out
    out.threads = threads
    return out


async def capture_all(py_spy: str, targets: Sequence[Target], native: bool, timeout: float,
                      concurrency: int) -> list[Capture]:
    """Every target at once, at most `concurrency` py-spy children at a time; results in target order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(t: Target) -> Capture:
        async with gate:
            return await capture_one(py_spy, t, native, timeout)

    return list(await asyncio.gather(*(one(t) for t in targets)))


def is_native(frame: dict[str, Any]) -> bool:
    """py-spy gives a native (--native) frame the shared object or binary it is in as `module`."""
    return bool(frame.get("module")) and not str(frame.get("filename") or "").endswith(".py")
