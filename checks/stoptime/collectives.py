"""Stop-time collectives: intra-machine all-to-all and inter-machine all-gather with verified payloads.

    python -m checks.stoptime.collectives --spec SPEC.json      (spec.test: all_to_all | all_gather)

Layout (see PROTOCOL.md for the spec and the stdout protocol):

* The **launcher** (this module run with ``--spec``) starts one **worker** process per local rank
  (``python -m checks.stoptime.collectives --worker-fd N``), each joined to the launcher by a
  socketpair. Workers report every phase change ("entering iteration k", "done iteration k",
  verification failures, errors) over it, so the launcher always knows where each rank is.
  At the deadline (the spec's ``timeout`` less a small margin) the launcher kills every worker
  that is still running and still reports a verdict. Workers die with the launcher (PDEATHSIG).
* **all_to_all**: one rank per GPU (``backend`` nccl) or ``cpu_ranks`` ranks (gloo on CPU), a
  FileStore rendezvous in ``work_dir``. Rank s sends rank r, in iteration k, a chunk whose every
  byte is a function of (s, r, k); every receiver checks every byte it got. Bus bandwidth follows
  nccl-tests: ``algbw = bytes / time`` (bytes = one rank's send buffer), ``busbw = algbw * (n-1)/n``.
* **all_gather**: every node's child joins one process group through ``spec.rendezvous``. The
  launcher of node rank 0 hosts the TCPStore on ``master_port``; every launcher checks its node in
  (name and local rank count), waits for the others, then hands its workers their global ranks
  (``node_rank * local_ranks + local_rank``; one rank per node on CPU). Workers publish their phase
  in the store, so every node can tell which peer is late. Names are exchanged with an
  all-gather of JSON (torch's ``all_gather_object`` needs numpy, which is not installed); then every
  rank all-gathers chunks that are a function of (sender global rank, iteration) and checks every
  peer's chunk. ``bytes`` = the gathered output per iteration,
  ``busbw = algbw * (n-1)/n``.

Attribution: a rank that crashes (non-zero exit, or an error outside a collective) is the suspect;
a rank that never reached the phase the others wait in when the deadline comes is the suspect; a
wrong byte names the rank that SENT it (unless one receiver got wrong bytes from every sender,
which names that receiver). Ranks that are no suspect PASS ("no fault attributed") even when the
test stopped early; their ``details.completed`` then says false.

torch is imported only by the launcher of all_gather (for the TCPStore) and by the workers: never
by the daemon, which runs this module as a child process.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from checks.stoptime.child import (
    ERROR,
    FAIL,
    MAX_LOCAL_RANKS,
    PASS,
    SKIPPED,
    SpecError,
    bounded_float,
    bounded_int,
    bounded_str,
    cannot_run,
    emit_progress,
    emit_result,
    load_spec,
    rank_component,
    spec_faults,
    spec_gpus,
    spec_timeout,
)

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
M32 = 0xFFFFFFFF
# Bounds on what a spec may ask for: each sizes a list, a loop or a buffer here.
MAX_NODES = 65536  # rendezvous world_size (the daemon's diagnostics.max_world_size is lower)
MAX_GLOBAL_RANKS = 1 << 18  # nodes x local ranks: every launcher polls each one's phase
MAX_SIZE_MB = 1 << 16
MAX_ITERATIONS = 100_000

# Phases a worker goes through, as comparable positions ("how far did this rank get").
P_SPAWNED, P_STARTED, P_INIT, P_READY, P_NAMES, P_PREPARED = 0, 1, 2, 3, 4, 5
P_ITER = 10  # entering iteration k: P_ITER + 2k; done iteration k: P_ITER + 2k + 1


def p_verify(total: int) -> int:
    return P_ITER + 2 * (total + 1)


def p_reported(total: int) -> int:
    return p_verify(total) + 1


def p_finished(total: int) -> int:
    return p_verify(total) + 2


def describe(pos: int, total: int) -> str:
    """Words for a position; `total` verified iterations, then the timed bandwidth loop."""
    if pos >= P_ITER and pos < p_verify(total):
        k, done = divmod(pos - P_ITER, 2)
        what = f"verified iteration {k + 1}/{total}" if k < total else "the timed bandwidth loop"
        return ("done with " if done else "inside ") + what
    names = {P_SPAWNED: "starting (not yet running)", P_STARTED: "started (torch loaded)",
             P_INIT: "joining the process group", P_READY: "in the process group",
             P_NAMES: "node names exchanged", P_PREPARED: "payloads prepared, before the first collective"}
    if pos in names:
        return names[pos]
    if pos in (p_verify(total), p_reported(total)):
        return "done, reported"
    if pos >= p_finished(total):
        return "finished"
    return f"phase {pos}"


# --------------------------------------------------------------------------------------------------
# payloads (pure functions of their seeds; the same on CPU and GPU, on every machine)

def seed_of(*parts: int) -> int:
    h = 0x811C9DC5
    for p in parts:
        h = ((h ^ (p & M32)) * 0x01000193) & M32
        h ^= h >> 16
        h = (h * 0x7FEB352D) & M32
        h ^= h >> 15
    return h


def a2a_seed(sender: int, receiver: int, iteration: int) -> int:
    return seed_of(0xA2A, sender, receiver, iteration)


def ag_seed(sender: int, iteration: int) -> int:
    return seed_of(0xA6, sender, iteration)


def pattern(torch: Any, seed: int, words: int, device: Any = "cpu", out: Any = None) -> Any:
    """`words` int64 words that depend on `seed` and on their index (no overflow: every product < 2**63)."""
    a = torch.arange(words, dtype=torch.int64, device=device) if out is None else \
        torch.arange(words, dtype=torch.int64, device=device, out=out)
    a.mul_(0x61C88647).add_(seed).bitwise_and_(M32)
    a.bitwise_xor_(a >> 15).mul_(0x7FEB352D).bitwise_and_(M32)
    a.bitwise_xor_(a >> 13).mul_(0x6C8E9CF5).bitwise_and_(M32)
    a.bitwise_xor_(a >> 16)
    hi = (a * 0x27D4EB2F + 0x165667B1).bitwise_and_(0x7FFFFFFF)
    return a.bitwise_or_(hi << 32)


def first_difference(torch: Any, got: Any, want: Any) -> tuple[int, int, int] | None:
    """(byte offset, expected byte, received byte) of the first wrong byte, or None when equal."""
    if torch.equal(got, want):
        return None
    word = int((got != want).nonzero()[0][0])
    gb, wb = got[word:word + 1].view(torch.uint8).cpu(), want[word:word + 1].view(torch.uint8).cpu()
    for i in range(8):
        if int(gb[i]) != int(wb[i]):
            return word * 8 + i, int(wb[i]), int(gb[i])
    return word * 8, 0, 0


# --------------------------------------------------------------------------------------------------
# worker

def gather_json(torch: Any, dist: Any, obj: Any, world: int, device: Any) -> list[Any]:
    """all_gather_object without numpy (torch's needs it): JSON bytes, padded to the longest."""
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(sizes, size)
    longest = int(sizes.max())
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    out = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, buf.to(device))
    raw = bytes(out.cpu().tolist())
    return [json.loads(raw[i * longest:i * longest + int(sizes[i])]) for i in range(world)]


class _Collective(Exception):
    """An exception raised inside a torch.distributed call (a peer's fault more often than ours)."""


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def worker_main(fd: int) -> int:
    conn = Connection(fd)
    cfg = conn.recv()
    _die_with_parent(cfg["launcher_pid"])
    store_box: list[Any] = []
    pos_now = [P_SPAWNED]

    def phase(p: int) -> None:
        conn.send(("pos", p))
        if store_box:  # all_gather: publish it for the other nodes too (best effort)
            try:
                store_box[0].add(f"pos/{cfg['grank']}", p - pos_now[0])
            except Exception:  # noqa: BLE001
                store_box.clear()
        pos_now[0] = p

    try:
        run_worker(cfg, conn, phase, store_box)
    except _Collective as e:
        conn.send(("error", "collective", pos_now[0], str(e.__cause__ or e)[-1500:]))
        return 3
    except BaseException as e:  # noqa: BLE001 - everything else is this rank's own failure
        conn.send(("error", "local", pos_now[0], f"{type(e).__name__}: {e}"[-1500:]))
        traceback.print_exc()
        return 4
    return 0


def run_worker(cfg: dict[str, Any], conn: Connection, phase: Any, store_box: list[Any]) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    test, rank, world, total, warmup = cfg["test"], cfg["rank"], cfg["world"], cfg["total"], cfg["warmup"]
    faults = cfg["faults"]
    nccl = cfg["backend"] == "nccl"
    if nccl:
        torch.cuda.set_device(cfg["device_index"])
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    phase(P_STARTED)
    timeout = timedelta(seconds=max(5.0, cfg["deadline_in"] + 5.0))  # the launcher's deadline comes first

    def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise _Collective(str(e)) from e

    phase(P_INIT)
    if test == "all_to_all":
        # A FileStore object, not a file:// URL: a relative path in a URL parses as a host name
        # (file://./var/x is /var/x), and every rank then waits for a file nobody creates. The path
        # is absolute: run_all_to_all makes it from an absolute work directory.
        file_store = run(dist.FileStore, cfg["file_store"], world)
        file_store.set_timeout(timeout)
        run(dist.init_process_group, cfg["backend"], store=file_store, rank=rank, world_size=world, timeout=timeout)
    else:
        store = run(dist.TCPStore, cfg["master_addr"], cfg["master_port"], is_master=False,
                    timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(cfg["prefix"], store)
        prefixed.add(f"pos/{rank}", P_INIT)
        store_box.append(prefixed)
        run(dist.init_process_group, cfg["backend"], store=dist.PrefixStore("pg", prefixed),
            rank=rank, world_size=world, timeout=timeout)
    phase(P_READY)

    words = cfg["words"]
    kill = faults.get("kill") if isinstance(faults.get("kill"), dict) else None
    delay = faults.get("delay") if isinstance(faults.get("delay"), dict) else None
    k_fault = total // 2
    me = cfg["local_rank"] if test == "all_gather" else rank  # faults name local ranks

    if test == "all_gather":
        names = run(gather_json, torch, dist, {"node": cfg["node"], "node_rank": cfg["node_rank"], "rank": rank},
                    world, device)
        conn.send(("names", names))
        phase(P_NAMES)
        send = torch.empty(words, dtype=torch.int64, device=device)
        recv = torch.empty(world * words, dtype=torch.int64, device=device)

        def fill(k: int) -> None:
            pattern(torch, ag_seed(rank, k), words, device, out=send)
            if faults.get("corrupt_node") and k == k_fault:
                send.view(torch.uint8)[(words * 8) // 2 + 5] ^= 1 << 2

        def collective() -> None:
            dist.all_gather_into_tensor(recv, send)

        def chunk(s: int) -> tuple[Any, int]:
            return recv[s * words:(s + 1) * words], s
    else:
        send = torch.empty((world, words), dtype=torch.int64, device=device)
        recv = torch.empty((world, words), dtype=torch.int64, device=device)
        flip = faults.get("flip_bit") if isinstance(faults.get("flip_bit"), dict) else None

        def fill(k: int) -> None:
            for j in range(world):
                pattern(torch, a2a_seed(rank, j, k), words, device, out=send[j])
            if flip is not None and int(flip.get("rank", -1)) == rank and k == k_fault:
                send[(rank + 1) % world].view(torch.uint8)[(words * 8) // 2 + 3] ^= 1 << 3

        def collective() -> None:
            dist.all_to_all_single(recv, send)

        def chunk(s: int) -> tuple[Any, int]:
            return recv[s], s

    def seed(s: int, k: int) -> int:
        return a2a_seed(s, rank, k) if test == "all_to_all" else ag_seed(s, k)

    # Verified iterations: fill the send buffer with iteration k's payload, run the collective, check
    # every received byte. Then the bandwidth loop: `warmup` untimed and `iterations` timed collectives
    # back to back on the last payload (the same two buffers, as a bare loop has), its output checked too.
    expected = torch.empty(words, dtype=torch.int64, device=device)
    bad: list[dict[str, Any]] = []
    flagged: set[int] = set()

    def check(k: int) -> None:
        for s in range(world):
            got, sender = chunk(s)
            diff = first_difference(torch, got, pattern(torch, seed(sender, k), words, device, out=expected))
            if diff is not None and sender not in flagged:
                flagged.add(sender)
                bad.append({"sender": sender, "receiver": rank, "iteration": k, "offset": diff[0],
                            "expected": diff[1], "got": diff[2]})

    fill(0)
    phase(P_PREPARED)
    if delay is not None and int(delay.get("rank", 0)) == me:
        time.sleep(float(delay.get("seconds", 30)))
    for k in range(total):
        if kill is not None and int(kill.get("rank", -1)) == me and k == k_fault:
            os._exit(1)
        if k:
            fill(k)
        phase(P_ITER + 2 * k)
        run(collective)
        phase(P_ITER + 2 * k + 1)
        check(k)
    phase(P_ITER + 2 * total)
    for _ in range(warmup):
        run(collective)
    if nccl:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(cfg["iterations"]):
        run(collective)
    if nccl:
        torch.cuda.synchronize()
    duration = time.perf_counter() - t
    phase(P_ITER + 2 * total + 1)
    check(total - 1)
    phase(p_verify(total))
    bytes_per_iter = words * 8 * world
    conn.send(("result", {"duration_s": duration, "iterations": cfg["iterations"], "bytes": bytes_per_iter,
                          "bad": bad}))
    phase(p_reported(total))
    if test == "all_gather":
        run(dist.barrier)  # the node-0 launcher keeps the store up until every rank is past this
    dist.destroy_process_group()
    phase(p_finished(total))


# --------------------------------------------------------------------------------------------------
# launcher

@dataclass
class Rank:
    index: int  # local rank
    component: str
    proc: subprocess.Popen[bytes] | None = None
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
        for r in self.ranks:
            mine, theirs = socket.socketpair()
            r.proc = subprocess.Popen([sys.executable, "-m", "checks.stoptime.collectives", "--worker-fd",
                                       str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                      stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env, cwd=REPO)
            theirs.close()
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

    def laggards(self, positions: dict[int, int]) -> tuple[set[int], int]:
        if not positions:
            return set(), 0
        top = max(positions.values())
        low = min(positions.values())
        if top == low:
            return set(), top
        return {g for g, p in positions.items() if p == low}, top

    def figures(self, result: dict[str, Any], n: int) -> dict[str, Any]:
        dur = max(result["duration_s"], 1e-9)
        algbw = result["bytes"] * result["iterations"] / dur / 1e9
        busbw = algbw * (n - 1) / n if n > 1 else algbw
        return {"busbw_gbps": round(busbw, 4), "algbw_gbps": round(algbw, 4),
                "duration_s": round(result["duration_s"], 4), "bytes": int(result["bytes"])}


# --------------------------------------------------------------------------------------------------
# all_to_all

def run_all_to_all(spec: dict[str, Any], t0: float) -> int:
    ln = Launcher(spec, t0)
    n = len(ln.ranks)
    words = max(1, int(ln.size_mb * MB) // n // 8)
    noun = "GPU" if ln.gpus else "CPU rank"
    emit_progress(0.0, f"all-to-all: starting {n} {noun}s ({ln.backend}, {words * 8 * n / MB:.1f} MiB per rank, "
                       f"{ln.iterations} iterations)")
    work_dir = bounded_str(spec.get("work_dir"), "work_dir", "", 4096)
    # Absolute, whatever the daemon wrote: the ranks run in another working directory (REPO).
    work = Path(os.path.abspath(work_dir or tempfile.mkdtemp(prefix="robustd-a2a-")))
    work.mkdir(parents=True, exist_ok=True)
    store_file = work / f"a2a-store-{os.getpid()}-{time.time_ns()}"
    # Test-only fault: a FileStore in a directory that does not exist, where every rank waits in vain.
    rank_store = work / "missing-dir" / store_file.name if ln.faults.get("unusable_store") else store_file
    try:
        ln.spawn()
        for r in ln.ranks:
            assert r.conn is not None
            r.conn.send({**ln.base_cfg(r, words), "rank": r.index, "world": n, "file_store": str(rank_store)})
        how = ln.supervise(5.0, 90.0, "all-to-all")
    finally:
        ln.kill_all(at_deadline=False)
        store_file.unlink(missing_ok=True)
        if not work_dir:
            import shutil

            shutil.rmtree(work, ignore_errors=True)

    if all(r.error and r.error[0] == "local" for r in ln.ranks):
        # The same code failed the same way on every rank: the harness (no torch, a bug), not n devices.
        return cannot_run("every rank failed with an error of its own: " +
                          "; ".join(f"rank {r.index} ({describe(r.error[1], ln.total)}): {r.error[2]}"
                                    for r in ln.ranks if r.error))
    if all(r.exit_code not in (0, None) and r.pos == P_SPAWNED and not r.killed_at_deadline for r in ln.ranks):
        return cannot_run("every worker died before starting: exit codes "
                          + ", ".join(str(r.exit_code) for r in ln.ranks) + " (their stderr is above)")
    if (why := rendezvous_failure(ln)) is not None:
        details = {"backend": ln.backend, "ranks": n, "file_store": str(rank_store),
                   **{f"rank{r.index}": describe(r.pos, ln.total) + (f": {r.error[2]}" if r.error else "")
                      for r in ln.ranks}}
        emit_result("host", ERROR, f"ranks could not rendezvous: {why}", {}, details)
        emit_progress(100.0, "all-to-all could not start")
        return 0

    verdicts = judge_all_to_all(ln, how)
    for r, v in zip(ln.ranks, verdicts[:n], strict=True):
        emit_result(r.component, v.status, v.message, v.figures, v.details)
    for comp, v in verdicts[n:]:
        emit_result(comp, v.status, v.message, v.figures, v.details)
    emit_progress(100.0, "all-to-all finished")
    return 0


def rendezvous_failure(ln: Launcher) -> str | None:
    """Why no rank got into the process group, when that says nothing about any one device; else None.

    Only when no rank joined, none crashed and none lagged behind the others: every rank then waited
    at the same rendezvous (or failed in it) — a store path or address that does not work, a harness
    problem. A rank that joined, or one that stayed behind while the others waited, is evidence and is
    judged by `judge_all_to_all`.
    """
    if any(r.pos >= P_READY or r.result is not None or r.crashed for r in ln.ranks):
        return None
    positions = {r.pos for r in ln.ranks}
    if len(positions) != 1:
        return None
    pos = positions.pop()
    errors = [r.error[2] for r in ln.ranks if r.error]
    if errors:
        return (f"{len(errors)} of {len(ln.ranks)} ranks failed while {describe(pos, ln.total)}: "
                f"{errors[0].splitlines()[0] if errors[0] else ''}")
    return (f"none of the {len(ln.ranks)} ranks got past '{describe(pos, ln.total)}' within the "
            f"{ln.timeout:g}s timeout")


def judge_all_to_all(ln: Launcher, how: str) -> list[Any]:
    n = len(ln.ranks)
    suspects: dict[int, str] = {}
    for r in ln.ranks:
        if r.crashed:
            code = r.exit_code or 0
            what = (f"error: {r.error[2]}" if r.error else
                    f"exited with code {code}" if code > 0 else f"killed by signal {-code}")
            suspects[r.index] = f"crashed ({what}); its last phase: {describe(r.pos, ln.total)}"
    bad = [b for r in ln.ranks if r.result for b in r.result["bad"]]
    for g, why in ln.bad_data_suspects(bad, list(range(n)), [r.index for r in ln.ranks if r.result]).items():
        suspects.setdefault(g, why)
    host: list[tuple[str, Verdict]] = []
    stop_reason = ""
    if how == "deadline" and not any(r.crashed for r in ln.ranks):
        stuck = {r.index: r.pos for r in ln.ranks}
        lag, top = ln.laggards(stuck)
        for g in lag:
            suspects.setdefault(g, f"hung: its last phase was '{describe(stuck[g], ln.total)}' at the "
                                   f"{ln.timeout:g}s timeout while other ranks got to '{describe(top, ln.total)}'")
        if not lag and not suspects:
            host.append(("host", Verdict(FAIL, f"every rank hung {describe(top, ln.total)} past the "
                                               f"{ln.timeout:g}s timeout: no single rank to blame")))
        stop_reason = "the test hit its timeout"
    elif how == "crash":
        stop_reason = "a rank crashed"
    if suspects and not stop_reason and any(r.result is None for r in ln.ranks):
        stop_reason = "another rank failed"
    if not suspects and not host and any(r.result is None for r in ln.ranks):
        # Nothing explains why some rank has no result: name the ones that failed in a collective.
        for r in ln.ranks:
            if r.result is None:
                text = r.error[2] if r.error else f"exit code {r.exit_code}"
                suspects[r.index] = f"failed {describe(r.pos, ln.total)}: {text}"

    results = [r.result for r in ln.ranks if r.result]
    floor = float(ln.spec.get("min_busbw_gbps") or 0.0)
    figs = {r.index: ln.figures(r.result, n) for r in ln.ranks if r.result}
    agg: dict[str, Any] = {}
    if len(results) == n:
        mean = dict(results[0])
        mean["duration_s"] = sum(x["duration_s"] for x in results) / n
        agg = ln.figures(mean, n)
        if floor > 0 and agg["busbw_gbps"] < floor and not suspects:
            # Ranks below the floor while others are above it are the slow ones; every rank below it
            # is the machine's problem. (Comparing ranks with each other when all are below is noise:
            # a collective runs at its slowest link on every rank, and per-rank timings differ only by
            # scheduling — a 2-core CI machine blamed random ranks that way.)
            slow = [i for i, f in figs.items() if f["busbw_gbps"] < floor]
            if 0 < len(slow) < n:
                for i in slow:
                    suspects[i] = f"bus bandwidth {figs[i]['busbw_gbps']:.3g} GB/s below the floor {floor:g} GB/s"
            else:
                host.append(("host", Verdict(FAIL, f"bus bandwidth {agg['busbw_gbps']:.3g} GB/s below the floor "
                                                   f"{floor:g} GB/s on every rank alike", agg)))
    out: list[Any] = []
    for r in ln.ranks:
        details: dict[str, Any] = {"completed": r.result is not None, "last_phase": describe(r.pos, ln.total),
                                   "exit_code": r.exit_code, "backend": ln.backend, "ranks": n,
                                   "iterations": ln.iterations}
        if agg:
            details["aggregate_busbw_gbps"] = agg["busbw_gbps"]
        if r.error:
            details["error"] = r.error[2]
        fig = figs.get(r.index, {})
        if r.index in suspects:
            out.append(Verdict(FAIL, suspects[r.index], fig, details))
        elif r.result is not None:
            out.append(Verdict(PASS, f"all-to-all verified from {n} ranks over {r.result['iterations']} iterations, "
                                     f"{fig['busbw_gbps']:.3g} GB/s busbw", fig, details))
        else:
            out.append(Verdict(PASS, f"no fault attributed to this rank; the test stopped early ({stop_reason}) "
                                     f"while it was {describe(r.pos, ln.total)}", fig, details))
    return out + host


# --------------------------------------------------------------------------------------------------
# all_gather

CRASH_UNRUNNABLE = 2  # the value of crashed/<g> for a rank that failed in Python before joining (1: crashed)


def node_info(raw: bytes) -> dict[str, Any]:
    """A peer's check-in (its name and local rank count), bounded and checked: it came from another host."""
    try:
        info = json.loads(raw[:4096])
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {"name": "", "local_ranks": -1}
    name, local = info.get("name"), info.get("local_ranks")
    return {"name": name[:256] if isinstance(name, str) else "",
            "local_ranks": local if isinstance(local, int) and not isinstance(local, bool) else -1}


def harness_failure(r: Rank) -> bool:
    """A Python error of the rank's own before it joined the process group: no torch, a bug, a bad spec."""
    return r.crashed and r.error is not None and r.error[0] == "local" and r.error[1] < P_READY


class Rendezvous:
    """The launcher's own view of the store: node check-in, peers' phases, crash flags."""

    def __init__(self, ln: Launcher, rdv: dict[str, Any]):
        """Raises SpecError for impossible values (a port past 65535, a node rank past the world)."""
        self.ln = ln
        self.addr = bounded_str(rdv.get("master_addr") or None, "rendezvous.master_addr", "127.0.0.1", 255)
        self.port = bounded_int(rdv.get("master_port"), "rendezvous.master_port", 0, 1, 65535)
        self.nodes = bounded_int(rdv.get("world_size") or None, "rendezvous.world_size", 1, 1, MAX_NODES)
        self.node_rank = bounded_int(rdv.get("node_rank"), "rendezvous.node_rank", 0, 0, self.nodes - 1)
        # The same prefix on every node: the daemon's own run id differs from node to node.
        run_id = bounded_str(rdv.get("run_id") or None, "rendezvous.run_id", "", 256)
        self.prefix = f"robustd/all_gather/{run_id or f'{self.addr}:{self.port}/{self.nodes}'}"
        self.store: Any = None
        self.connect_error: str | None = None
        self.joined: dict[int, dict[str, Any]] = {}
        self.local = len(ln.ranks)
        self.world = self.nodes * self.local
        if self.world > MAX_GLOBAL_RANKS:
            raise SpecError(f"{self.nodes} nodes x {self.local} ranks is more than {MAX_GLOBAL_RANKS} ranks")
        self.positions: dict[int, int] = {}
        self.crashed: set[int] = set()
        self.unrunnable: set[int] = set()  # ranks whose own launcher saw them fail before joining, in Python
        self.ended: set[int] = set()  # ranks whose worker process is gone, whatever the reason
        self.store_lost: str | None = None
        self.started = False
        self._thread = threading.Thread(target=self._connect, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _connect(self) -> None:
        try:
            import warnings

            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch.distributed as dist

            remaining = max(1.0, self.ln.deadline - time.monotonic())
            store = dist.TCPStore(self.addr, self.port, is_master=self.node_rank == 0,
                                  timeout=timedelta(seconds=remaining), wait_for_workers=False)
            store.set_timeout(timedelta(seconds=5))
            ps = dist.PrefixStore(self.prefix, store)
            ps.set(f"node/{self.node_rank}", json.dumps({"name": self.ln.node,
                                                          "local_ranks": self.local}))
            ps.add(f"joined/{self.node_rank}", 1)
            self._raw = store
            self.store = ps
        except Exception as e:  # noqa: BLE001
            self.connect_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def poll(self) -> None:
        if self.store is None or self.store_lost:
            return
        try:
            for k in range(self.nodes):
                if k not in self.joined and self.store.add(f"joined/{k}", 0) > 0:
                    self.joined[k] = node_info(self.store.get(f"node/{k}"))
            if self.started:
                for g in range(self.world):
                    self.positions[g] = int(self.store.add(f"pos/{g}", 0))
                    if g not in self.crashed and g not in self.unrunnable:
                        flag = self.store.add(f"crashed/{g}", 0)
                        if flag >= CRASH_UNRUNNABLE:
                            self.unrunnable.add(g)
                        elif flag > 0:
                            self.crashed.add(g)
                    if g not in self.ended and self.store.add(f"ended/{g}", 0) > 0:
                        self.ended.add(g)
        except Exception as e:  # noqa: BLE001
            self.store_lost = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def flag(self, what: str, g: int, value: int = 1) -> None:
        if self.store is not None and not self.store_lost:
            with contextlib.suppress(Exception):
                self.store.add(f"{what}/{g}", value)

    def name(self, k: int) -> str:
        info = self.joined.get(k)
        return info["name"] if info and info.get("name") else f"rank{k}"


def run_all_gather(spec: dict[str, Any], t0: float) -> int:
    rdv_spec = spec.get("rendezvous") or {}
    if not isinstance(rdv_spec, dict) or "master_port" not in rdv_spec:
        return cannot_run("all_gather needs spec.rendezvous with master_addr, master_port, world_size, node_rank")
    ln = Launcher(spec, t0)
    rdv = Rendezvous(ln, rdv_spec)
    me = rdv.node_rank
    words = max(1, int(ln.size_mb * MB) // 8)
    emit_progress(0.0, f"all-gather: node rank {me} of {rdv.nodes}, joining {rdv.addr}:{rdv.port}")
    ln.spawn()
    rdv.start()
    waited_join = False
    how = "done"
    try:
        # 1. every node checks in (or the deadline comes)
        while len(rdv.joined) < rdv.nodes:
            if time.monotonic() >= ln.deadline or rdv.connect_error:
                how = "rendezvous"
                break
            ln.pump(0.2)
            rdv.poll()
            if rdv.store_lost:
                how = "rendezvous"
                break
            if not waited_join and rdv.store is not None:
                waited_join = True
                emit_progress(2.0, f"all-gather: joined the rendezvous, waiting for {rdv.nodes} nodes")
        if how == "done":
            sizes = {k: v["local_ranks"] for k, v in rdv.joined.items()}
            if len(set(sizes.values())) > 1:
                return cannot_run(f"nodes have different local rank counts: {sizes}")
            emit_progress(5.0, "all-gather: every node joined: " + ", ".join(rdv.name(k) for k in range(rdv.nodes)))
            rdv.started = True
            for r in ln.ranks:
                if r.conn is None:
                    continue
                g = me * rdv.local + r.index
                r.conn.send({**ln.base_cfg(r, words), "rank": g, "world": rdv.world, "grank": g,
                             "node_rank": me, "master_addr": rdv.addr, "master_port": rdv.port,
                             "prefix": rdv.prefix})

            flagged: set[int] = set()

            def watch() -> None:
                rdv.poll()
                for r in ln.ranks:
                    if r.crashed and r.index not in flagged:
                        flagged.add(r.index)
                        rdv.flag("crashed", me * rdv.local + r.index, CRASH_UNRUNNABLE if harness_failure(r) else 1)

            how = ln.supervise(5.0, 90.0, "all-gather", watch)
            watch()
            for r in ln.ranks:
                rdv.flag("ended", me * rdv.local + r.index)
            rdv.poll()
            if me == 0:  # keep the store up until every rank is through (or the deadline)
                fin = p_finished(ln.total)
                while time.monotonic() < ln.deadline and not rdv.store_lost and not all(
                        rdv.positions.get(g, 0) >= fin or g in rdv.ended for g in range(rdv.world)):
                    time.sleep(0.1)
                    rdv.poll()
    finally:
        ln.kill_all(at_deadline=how == "deadline")

    for comp, v in judge_all_gather(ln, rdv, how):
        emit_result(comp, v.status, v.message, v.figures, v.details)
    emit_progress(100.0, "all-gather finished")
    sys.stdout.flush()
    return 0


def judge_all_gather(ln: Launcher, rdv: Rendezvous, how: str) -> list[tuple[str, Verdict]]:
    """One verdict per peer node, plus `host` for this node's own problems.

    FAIL needs evidence: a node that joined and then crashed, lagged or sent wrong bytes, a node missing
    from a rendezvous the others reached, a master that went away after everybody joined. A
    rendezvous nobody else reached (or that this node could not reach), ranks that could not form the
    process group anywhere, and this node's own ranks failing in Python before joining are ERRORs:
    they say the harness, the addresses or the network setup are wrong, not which hardware is.
    """
    me, L = rdv.node_rank, rdv.local
    peers = [k for k in range(rdv.nodes) if k != me]
    out: list[tuple[str, Verdict]] = []
    base = {"node_ranks": rdv.nodes, "ranks_per_node": L, "backend": ln.backend}
    if not peers:
        return [("host", Verdict(SKIPPED, "no peer nodes (rendezvous world_size is 1)", {}, base))]

    def untested(why: str) -> list[tuple[str, Verdict]]:
        return [(f"node/{rdv.name(k)}", Verdict(SKIPPED, f"not tested: {why}", {}, {**base, "node_rank": k}))
                for k in peers]

    if how == "rendezvous" or len(rdv.joined) < rdv.nodes:
        if rdv.store is None:  # we never got in: nothing is known about any peer
            if me == 0:
                why = f"could not host the rendezvous on {rdv.addr}:{rdv.port}"
            else:
                why = (f"could not reach the rendezvous master {rdv.addr}:{rdv.port} (node rank 0) within the "
                       f"{ln.timeout:g}s timeout")
            why += f": {rdv.connect_error}" if rdv.connect_error else ""
            return untested("this node could not join the rendezvous") + [
                ("host", Verdict(ERROR, f"ranks could not rendezvous: {why}", {}, {**base, "node_rank": me}))]
        missing = [k for k in range(rdv.nodes) if k not in rdv.joined]
        if not any(k in rdv.joined for k in peers):  # nobody else came: a wrong address, port or run id
            why = (f"no other node joined the rendezvous on {rdv.addr}:{rdv.port} within the {ln.timeout:g}s "
                   f"timeout ({rdv.nodes} nodes expected)" + (f"; {rdv.store_lost}" if rdv.store_lost else ""))
            return untested("no other node joined") + [
                ("host", Verdict(ERROR, f"ranks could not rendezvous: {why}", {}, {**base, "node_rank": me}))]
        why = f"never joined the rendezvous within the {ln.timeout:g}s timeout"
        if rdv.store_lost and not missing:  # everybody had joined, then the master went away
            why = f"(the rendezvous master) went away before the exchange: {rdv.store_lost}"
            missing = [0]
        for k in peers:
            comp = f"node/{rdv.name(k)}"
            if k in missing:
                out.append((comp, Verdict(FAIL, f"node rank {k} {why}", {}, {**base, "node_rank": k})))
            else:
                names = ", ".join(f"node rank {m}" for m in missing) or "the rendezvous"
                out.append((comp, Verdict(SKIPPED, f"not tested: the exchange never started ({names} missing)", {},
                                          {**base, "node_rank": k})))
        return out

    def node_of(g: int) -> int:
        return g // L

    # crashes: our own ranks (what we saw) and the peers' (what their launchers flagged)
    suspects: dict[int, str] = {}
    errors: dict[int, str] = {}  # peers that could not run the test at all (no evidence about them)
    own: list[str] = []  # evidence against this node
    own_errors: list[str] = []  # this node could not run the test
    harness = [r for r in ln.ranks if harness_failure(r)]
    for r in ln.ranks:
        if r.crashed and (r not in harness or len(harness) < L):
            own.append(f"{r.component} crashed {describe(r.pos, ln.total)}"
                       + (f": {r.error[2]}" if r.error else f" (exit code {r.exit_code})"))
    if len(harness) == L:  # every rank here failed in Python before joining: the harness, not L devices
        own_errors.append("every rank of this node failed before joining the process group: "
                          + "; ".join(f"{r.component}: {r.error[2] if r.error else r.exit_code}" for r in harness))
    for g in sorted(rdv.crashed):
        if node_of(g) != me:
            suspects.setdefault(node_of(g), f"its rank {g} crashed "
                                            f"{describe(rdv.positions.get(g, 0), ln.total)}")
    for g in sorted(rdv.unrunnable):
        if node_of(g) != me and node_of(g) not in suspects:
            errors.setdefault(node_of(g), f"could not run the test: its rank {g} failed before joining the "
                                          "process group (its own report says why)")
    # wrong data: what our ranks received
    bad = [b for r in ln.ranks if r.result for b in r.result["bad"]]
    for g, why in ln.bad_data_suspects(bad, list(range(rdv.world)), [me * L + r.index for r in ln.ranks]).items():
        k = node_of(g)
        if k == me:
            own.append(f"rank {g} of this node: {why}")
        else:
            suspects.setdefault(k, why.replace("sent wrong bytes", f"sent wrong bytes (global rank {g})"))
    positions = {g: rdv.positions.get(g, 0) for g in range(rdv.world)}
    for r in ln.ranks:  # what our own ranks told us directly is at least as recent
        positions[me * L + r.index] = max(positions[me * L + r.index], r.pos)
    formed = any(p >= P_READY for p in positions.values())
    # lateness: who never reached the phase everybody else waited in
    if how == "deadline" and not suspects and not own and not own_errors and not errors:
        lag, top = ln.laggards(positions)
        for g in sorted(lag):
            k = node_of(g)
            why = (f"late: its rank {g} was still {describe(positions[g], ln.total)} at the "
                   f"{ln.timeout:g}s timeout while others got to '{describe(top, ln.total)}'")
            if k == me:
                own.append(why.replace("its rank", "this node's rank"))
            else:
                suspects.setdefault(k, why)
        if not lag and not formed:
            own_errors.append(f"ranks could not form the process group: every rank was still "
                              f"{describe(top, ln.total)} at the {ln.timeout:g}s timeout")
        elif not lag:
            own.append(f"every rank hung {describe(top, ln.total)} past the {ln.timeout:g}s timeout")
    if not suspects and not own and not own_errors and not errors and any(r.result is None for r in ln.ranks):
        for r in ln.ranks:
            if r.result is None:
                text = (f"{r.component} failed {describe(r.pos, ln.total)}: "
                        + (r.error[2] if r.error else f"exit code {r.exit_code}"))
                (own if formed else own_errors).append(
                    text if formed else f"ranks could not form the process group: {text}")

    results = [r.result for r in ln.ranks if r.result]
    figs: dict[str, Any] = {}
    if len(results) == L:
        mean = dict(results[0])
        mean["duration_s"] = sum(x["duration_s"] for x in results) / L
        figs = ln.figures(mean, rdv.world)
    floor = float(ln.spec.get("min_busbw_gbps") or 0.0)
    if figs and floor > 0 and figs["busbw_gbps"] < floor:
        own.append(f"bus bandwidth {figs['busbw_gbps']:.3g} GB/s below the floor {floor:g} GB/s")
    names_seen: dict[int, str] = {}
    for r in ln.ranks:
        for entry in r.names or []:
            if isinstance(entry, dict) and isinstance(entry.get("node_rank"), int):
                names_seen[entry["node_rank"]] = str(entry.get("node", ""))[:256]
    verified = len(results) == L
    for k in peers:
        comp = f"node/{rdv.name(k)}"
        details = {**base, "node_rank": k, "global_ranks": list(range(k * L, (k + 1) * L)), "completed": verified}
        if k in names_seen and names_seen[k] != rdv.name(k):
            details["name_in_collective"] = names_seen[k]
        if k in suspects:
            out.append((comp, Verdict(FAIL, suspects[k], figs, details)))
        elif k in errors:
            out.append((comp, Verdict(ERROR, f"node {rdv.name(k)} {errors[k]}", figs, details)))
        elif verified:
            out.append((comp, Verdict(PASS, f"all-gather data from node {rdv.name(k)} verified over "
                                            f"{ln.iterations} iterations"
                                            + (f", {figs['busbw_gbps']:.3g} GB/s busbw" if figs else ""),
                                      figs, details)))
        elif suspects or own:
            out.append((comp, Verdict(PASS, "no fault attributed to this node; the exchange stopped early "
                                            "because of another node", figs, details)))
        elif own_errors or errors:
            out.append((comp, Verdict(SKIPPED, "not tested: the exchange could not run", figs, details)))
        else:
            out.append((comp, Verdict(ERROR, "the exchange did not complete and no node could be blamed",
                                      figs, details)))
    if own:
        out.append(("host", Verdict(FAIL, "; ".join(own), figs, base)))
    elif own_errors:
        out.append(("host", Verdict(ERROR, "; ".join(own_errors), figs, base)))
    return out


# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--worker-fd":
        return worker_main(int(argv[1]))
    try:
        spec = load_spec(argv)
        test = spec.get("test")
        if test == "all_to_all":
            return run_all_to_all(spec, t0)
        if test == "all_gather":
            return run_all_gather(spec, t0)
    except SpecError as e:
        return cannot_run(f"bad spec: {e}")
    return cannot_run(f"checks.stoptime.collectives runs all_to_all or all_gather, not {str(test)[:40]!r}")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the workers are gone; skip torch's slow interpreter teardown
