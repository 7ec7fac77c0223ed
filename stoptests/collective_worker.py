"""The rank worker of the stop-time collectives: one process per local rank, joined to its launcher.

    python -m stoptests.collective_worker --worker-fd N     (started by collective_launcher.py)

A worker reads its settings from the socketpair the launcher gave it, joins the process group
(all_to_all: a FileStore in the work directory; all_gather: the rendezvous TCPStore), and reports
every phase change ("entering iteration k", "done iteration k", verification failures, errors) over
that socketpair, so the launcher always knows where each rank is. It dies with its launcher
(PDEATHSIG). Payloads are pure functions of their seeds (the same on CPU and GPU, on every machine):
rank s sends rank r, in iteration k, a chunk whose every byte is a function of (s, r, k) (all-to-all)
or of (s, k) (all-gather), and every receiver checks every byte it got.

This is the only part of the collectives that imports torch (and the all_gather launcher, for the
TCPStore); never the daemon.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import statistics
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

M32 = 0xFFFFFFFF

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

    slow = cfg["faults"].get("slow_start")
    if isinstance(slow, dict) and int(slow.get("rank", 0)) == cfg.get("local_rank", cfg.get("rank")):
        time.sleep(float(slow.get("seconds", 30)))  # test-only: this rank has not begun to run yet
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
    # On a GPU the loop is timed whole (a sync per iteration would time the launches). On CPU (gloo) each
    # iteration is timed too: the ranks share cores with everything on the host, and one descheduled rank
    # adds a scheduler slice (milliseconds) to a collective of about that length; the median iteration
    # is what the link and the machine can do.
    laps: list[float] = []
    t = time.perf_counter()
    for _ in range(cfg["iterations"]):
        lap = time.perf_counter()
        run(collective)
        if not nccl:
            laps.append(time.perf_counter() - lap)
    if nccl:
        torch.cuda.synchronize()
    duration = time.perf_counter() - t
    phase(P_ITER + 2 * total + 1)
    check(total - 1)
    phase(p_verify(total))
    bytes_per_iter = words * 8 * world
    conn.send(("result", {"duration_s": duration, "iterations": cfg["iterations"], "bytes": bytes_per_iter,
                          "bad": bad, **({"median_iteration_s": statistics.median(laps)} if laps else {})}))
    phase(p_reported(total))
    if test == "all_gather":
        run(dist.barrier)  # the node-0 launcher keeps the store up until every rank is past this
    dist.destroy_process_group()
    phase(p_finished(total))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if len(argv) != 2 or argv[0] != "--worker-fd":
        sys.exit("usage: python -m stoptests.collective_worker --worker-fd N")
    code = worker_main(int(argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow interpreter teardown
