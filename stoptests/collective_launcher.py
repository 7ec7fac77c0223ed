"""The launcher shared by the two stop-time collectives (all_to_all.py, all_gather.py).

It starts one worker process per local rank (collective_worker.py), each joined to the launcher by a
socketpair, follows every rank's phase, and at the deadline (the spec's ``timeout`` less a small
margin) kills every worker that is still running; the test's own module then judges what it saw. Bus bandwidth follows
nccl-tests: ``algbw = bytes / time``, ``busbw = algbw * (n-1)/n``.

Workers are forked from the launcher once it has loaded torch (``worker_start: fork``, the default), so
a node pays for loading torch once, not once per rank and once more for the all-gather's store: about
3 s of CPU each on a CPU host, which on a busy machine decided whether a short collective timeout went
to loading torch or to the test (bench/diag_startup.py). Only torch is loaded before the fork, not CUDA
(each worker initialises its own device, as DataLoader workers do) and no thread has started. Where torch
cannot be loaded here, or with ``worker_start: exec``, each worker is its own interpreter (``python -m
stoptests.collective_worker --worker-fd N``), and one whose torch fails says so as before.

Attribution, common to both tests: a rank that crashes (non-zero exit, or an error outside a
collective) is the suspect; a rank that never reached the phase the others wait in when the
deadline comes is the suspect; a wrong byte names the rank that SENT it (unless one receiver got
wrong bytes from every sender, which names that receiver). Ranks that are no suspect PASS ("no
fault attributed") even when the test stopped early; their ``details.completed`` then says false.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from stoptests.collective_worker import P_ITER, P_SPAWNED, worker_main
from stoptests.protocol import (
    MAX_LOCAL_RANKS,
    SpecError,
    bounded_float,
    bounded_int,
    bounded_str,
    cannot_run,
    emit_progress,
    load_spec,
    rank_component,
    spec_faults,
    spec_gpus,
    spec_timeout,
)

WORKER_START = ("fork", "exec")

REPO = Path(__file__).resolve().parent.parent.parent

DEFAULT_TIMEOUT = 60.0
DEFAULT_CPU_RANKS = 4
# Payload per rank and iteration, iterations and untimed warm-up iterations, by backend.
DEFAULTS = {
    "all_to_all": {"gloo": {"size_mb": 4.0, "iterations": 10, "warmup": 2},
                   "nccl": {"size_mb": 128.0, "iterations": 20, "warmup": 5}},
    "all_gather": {"gloo": {"size_mb": 2.0, "iterations": 5, "warmup": 1},
                   "nccl": {"size_mb": 32.0, "iterations": 20, "warmup": 5}},
}
MB = 1 << 20
# Bounds on what a spec may ask for: each sizes a list, a loop or a buffer here.
MAX_NODES = 65536  # rendezvous world_size (the daemon's diagnostics.max_world_size is lower)
MAX_GLOBAL_RANKS = 1 << 18  # nodes x local ranks: every launcher polls each one's phase
MAX_SIZE_MB = 1 << 16
MAX_ITERATIONS = 100_000


class Forked:
    """A forked worker, waited for as a Popen is (wait, kill, returncode: -N for a signal)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -9  # reaped elsewhere: gone
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def load_torch() -> str | None:
    """Import torch and torch.distributed here, in the launcher, for its workers to fork with; None when
    loaded, else why not (the workers are then started as their own interpreters and say why themselves)."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load is the same: no torch to fork with
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class Rank:
    index: int  # local rank
    component: str
    proc: subprocess.Popen[bytes] | Forked | None = None
    conn: Connection | None = None
    pos: int = P_SPAWNED
    exit_code: int | None = None
    error: tuple[str, int, str] | None = None  # (kind, pos, text)
    result: dict[str, Any] | None = None
    killed_at_deadline: bool = False
    names: list[Any] | None = None

    @property
    def crashed(self) -> bool:
        """Died on its own (not killed by us), other than by an error inside a collective."""
        if self.killed_at_deadline or self.exit_code in (None, 0):
            return False
        return self.error is None or self.error[0] != "collective"


@dataclass
class Verdict:
    status: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def route_interface(addr: str) -> str | None:
    """The interface this host would reach `addr` through (no packet is sent), or None."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == local for a in addrs):
                return name
    except (OSError, ImportError):
        pass
    return None


def _settings(spec: dict[str, Any], test: str, backend: str) -> tuple[float, int, int]:
    d = DEFAULTS[test][backend]
    size_mb = bounded_float(spec.get("size_mb") or None, "size_mb", d["size_mb"], 1e-6, MAX_SIZE_MB)
    iterations = bounded_int(spec.get("iterations") or None, "iterations", int(d["iterations"]), 1, MAX_ITERATIONS)
    warmup = bounded_int(spec.get("warmup"), "warmup", int(d["warmup"]), 0, MAX_ITERATIONS)
    return size_mb, iterations, warmup


def _backend(spec: dict[str, Any]) -> str:
    backend = str(spec.get("backend") or "auto")
    if backend not in ("gloo", "nccl"):
        backend = "nccl" if spec.get("gpus") else "gloo"
    return backend


class Launcher:
    def __init__(self, spec: dict[str, Any], t0: float):
        """Raises SpecError for a spec this launcher cannot run (the daemon records an ERROR)."""
        self.spec = spec
        self.test = spec["test"]
        self.timeout = spec_timeout(spec, DEFAULT_TIMEOUT)
        self.t0 = t0
        self.deadline = t0 + max(1.0, self.timeout - min(5.0, max(1.0, 0.1 * self.timeout)))
        self.backend = _backend(spec)
        self.gpus = spec_gpus(spec)
        self.faults = dict(spec_faults(spec))
        self.node = bounded_str(spec.get("node"), "node", "", 256)
        self.worker_start = bounded_str(spec.get("worker_start") or None, "worker_start", "fork", 8)
        if self.worker_start not in WORKER_START:
            raise SpecError(f"worker_start must be one of {', '.join(WORKER_START)}, not {self.worker_start!r}")
        self.size_mb, self.iterations, self.warmup = _settings(spec, self.test, self.backend)
        self.total = self.iterations  # verified iterations (then as many timed ones)
        if self.gpus:
            n = len(self.gpus)
        elif self.test == "all_gather":
            n = 1
        else:
            n = bounded_int(spec.get("cpu_ranks") or None, "cpu_ranks", DEFAULT_CPU_RANKS, 1, MAX_LOCAL_RANKS)
        if self.backend == "nccl" and not self.gpus:
            raise SpecError("backend nccl needs GPUs in spec.gpus")
        self.ranks = [Rank(i, rank_component(spec, i)) for i in range(n)]
        self.progress_shown = -1.0

    # -- workers ---------------------------------------------------------------------------------
    def spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.gpus:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA indices = NVML indices
        else:
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        master = (self.spec.get("rendezvous") or {}).get("master_addr")
        if self.test == "all_gather" and master and not env.get("GLOO_SOCKET_IFNAME"):
            iface = route_interface(str(master))
            if iface:
                env["GLOO_SOCKET_IFNAME"] = iface  # gloo would otherwise use whatever the hostname resolves to
        if self.worker_start == "fork":
            os.environ.update(env)  # before torch loads: what the workers read, they read from here
            if load_torch() is None:
                self._fork_all()
                return
        for r in self.ranks:
            mine, theirs = socket.socketpair()
            r.proc = subprocess.Popen([sys.executable, "-m", "stoptests.collective_worker", "--worker-fd",
                                       str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                      stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env, cwd=REPO)
            theirs.close()
            r.conn = Connection(mine.detach())

    def _fork_all(self) -> None:
        """Fork one worker per rank from this process (torch loaded, no thread started yet)."""
        sys.stdout.flush()  # what is buffered here must not be written once more by every child
        sys.stderr.flush()
        for r in self.ranks:
            mine, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:  # the worker
                code = 4
                try:
                    os.dup2(2, 1)  # stdout is the launcher's result protocol: a worker's prints go to stderr
                    mine.close()
                    for other in self.ranks:
                        if other.conn is not None:
                            other.conn.close()
                    with contextlib.suppress(OSError):
                        os.chdir(REPO)  # where an exec'd worker runs
                    code = worker_main(theirs.detach())
                finally:
                    with contextlib.suppress(Exception):
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(code)
            theirs.close()
            r.proc = Forked(pid)
            r.conn = Connection(mine.detach())

    def base_cfg(self, r: Rank, words: int) -> dict[str, Any]:
        return {"test": self.test, "launcher_pid": os.getpid(), "backend": self.backend, "total": self.total,
                "warmup": self.warmup, "iterations": self.iterations, "words": words, "faults": self.faults,
                "local_rank": r.index,
                "device_index": int(self.gpus[r.index].get("index", r.index)) if self.gpus else None,
                "deadline_in": max(0.0, self.deadline - time.monotonic()), "node": self.node}

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks if r.exit_code is None]

    def pump(self, timeout: float) -> None:
        """Read whatever the workers said within `timeout`; notice the ones that exited."""
        live = {r.conn: r for r in self.alive() if r.conn is not None}
        if not live:
            time.sleep(max(0.0, timeout))
            return
        for conn in wait(list(live), timeout=max(0.0, timeout)):
            r = live[conn]
            while True:
                try:
                    if not conn.poll():
                        break
                    msg = conn.recv()
                except (EOFError, OSError):
                    self.reap(r)
                    break
                self.on_message(r, msg)

    def on_message(self, r: Rank, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "pos":
            r.pos = msg[1]
        elif kind == "error":
            r.error = (msg[1], msg[2], msg[3])
        elif kind == "result":
            r.result = msg[1]
        elif kind == "names":
            r.names = msg[1]

    def reap(self, r: Rank) -> None:
        assert r.proc is not None
        try:
            r.exit_code = r.proc.wait(5)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.exit_code = r.proc.wait()
        if r.conn is not None:
            r.conn.close()
            r.conn = None

    def kill_all(self, at_deadline: bool) -> None:
        for r in self.alive():
            if r.proc is not None:
                r.proc.kill()
        for r in self.alive():
            if r.proc is not None:
                r.proc.wait()
            if r.conn is not None:
                try:  # the last words it said before the kill
                    while r.conn.poll():
                        self.on_message(r, r.conn.recv())
                except (EOFError, OSError):
                    pass
                r.conn.close()
                r.conn = None
            r.killed_at_deadline = at_deadline
            r.exit_code = -9

    def show_progress(self, start: float, span: float, label: str) -> None:
        done = min((max(0, r.pos - P_ITER + 1) // 2 for r in self.ranks), default=0)
        pct = start + span * min(1.0, done / max(1, self.total))
        if pct >= self.progress_shown + 5 or (done == self.total and pct > self.progress_shown):
            self.progress_shown = pct
            emit_progress(round(pct, 1), f"{label}: iteration {done}/{self.total} done on every rank")

    def supervise(self, start: float, span: float, label: str, extra: Any = None) -> str:
        """Run until every worker exits ('done'), one crashes (plus a grace period) or the deadline."""
        crash_seen: float | None = None
        while self.alive():
            now = time.monotonic()
            if now >= self.deadline:
                self.kill_all(at_deadline=True)
                return "deadline"
            if crash_seen is None and any(r.crashed or (r.error and r.error[0] == "local") for r in self.ranks):
                crash_seen = now
            if crash_seen is not None and now - crash_seen > 3.0:
                self.kill_all(at_deadline=False)
                return "crash"
            self.pump(min(0.2, self.deadline - now))
            if extra is not None:
                extra()
            self.show_progress(start, span, label)
        return "done"

    # -- judging ---------------------------------------------------------------------------------
    @staticmethod
    def bad_data_suspects(bad: list[dict[str, Any]], senders: list[int], receivers: list[int]
                          ) -> dict[int, str]:
        """Global rank -> reason, from (sender, receiver) pairs with wrong bytes."""
        by_sender: dict[int, list[dict[str, Any]]] = defaultdict(list)
        by_receiver: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for b in bad:
            by_sender[b["sender"]].append(b)
            by_receiver[b["receiver"]].append(b)
        out: dict[int, str] = {}
        blamed_receivers = set()
        for rcv, items in by_receiver.items():
            others = [s for s in senders if s != rcv]
            got_bad_from = {b["sender"] for b in items if b["sender"] != rcv}
            if len(others) >= 2 and got_bad_from >= set(others):
                blamed_receivers.add(rcv)
                out[rcv] = f"received wrong bytes from every sender ({len(others)}): this rank's receive path"
        for snd, items in by_sender.items():
            real = [b for b in items if b["receiver"] not in blamed_receivers]
            if not real:
                continue
            b = real[0]
            out.setdefault(snd, f"sent wrong bytes: rank {b['receiver']} got 0x{b['got']:02x} instead of "
                                f"0x{b['expected']:02x} at byte {b['offset']} of its chunk in iteration "
                                f"{b['iteration']}" + (f" (and {len(real) - 1} more receivers)" if len(real) > 1
                                                       else ""))
        return out

    def still_starting(self, lag: set[int], positions: dict[int, int]) -> bool:
        """Whether every laggard is a worker that had not begun to run: on CPU ranks (gloo) nothing lies
        between its start and torch loaded but robustd's own start-up (a loaded host, a slow disk), which
        is no evidence about the machine's devices; an NCCL rank initialises its GPU in that phase."""
        return bool(lag) and self.backend != "nccl" and all(positions[g] == P_SPAWNED for g in lag)

    def laggards(self, positions: dict[int, int]) -> tuple[set[int], int]:
        if not positions:
            return set(), 0
        top = max(positions.values())
        low = min(positions.values())
        if top == low:
            return set(), top
        return {g for g, p in positions.items() if p == low}, top

    def figures(self, result: dict[str, Any], n: int) -> dict[str, Any]:
        """nccl-tests' figures from a rank's timed loop: from its median iteration where it has one (CPU
        ranks, collective_worker.py), else from the whole loop."""
        per = result.get("median_iteration_s")
        dur = max(float(per) if per else result["duration_s"] / max(1, result["iterations"]), 1e-9)
        algbw = result["bytes"] / dur / 1e9
        busbw = algbw * (n - 1) / n if n > 1 else algbw
        return {"busbw_gbps": round(busbw, 4), "algbw_gbps": round(algbw, 4),
                "duration_s": round(result["duration_s"], 4), "bytes": int(result["bytes"])}



def child_main(test: str, run: Callable[[dict[str, Any], float], int], argv: list[str] | None = None) -> None:
    """The entry of a collective's child module: run `test` from ``--spec`` and exit without torch's teardown."""
    t0 = time.monotonic()
    try:
        spec = load_spec(list(sys.argv[1:] if argv is None else argv))
        if spec.get("test", test) != test:
            code = cannot_run(f"stoptests.{test} runs {test}, not {str(spec.get('test'))[:40]!r}")
        else:
            code = run({**spec, "test": test}, t0)
    except SpecError as e:
        code = cannot_run(f"bad spec: {e}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the workers are gone; skip torch's slow interpreter teardown
