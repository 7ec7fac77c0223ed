"""Triage cost on a large job: 64 rank logs of 50 MB each, a root cause on one rank, noise on all.

Each log is a Megatron-style training log (timestamped iteration lines, NCCL INFO lines, a few
UserWarnings) that ends the way a real cascade does: rank 37 hits an illegal memory access and
every other rank's ProcessGroupNCCL watchdog times out ten minutes later and aborts. The logs are
written once under --dir (3.2 GB; reused while their size matches).

Timed: `robustctl triage --json DIR` in a fresh process, from exec to exit (interpreter start,
imports, the tail reads and the judge, spread over worker processes), --runs times; reported as
p50/p99 wall time, the peak RSS of the largest process (getrusage) and the peak of the whole
process tree's RSS summed (sampled every 5 ms with psutil). Also read + judge on one core, in this
process. Targets (issue 14): ≤ 2 s
and ≤ 200 MB. `--cold` drops the page cache before each run (root only) so the tails come from disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import percentile  # noqa: E402

from robustd.triage import read_log, triage  # noqa: E402

RANKS = 64
ROOT = 37
LINE = ("{ts} [INFO] [training.py:512] iteration {i:>8}/ 1000000 | consumed samples: {s:>12} | elapsed time per "
        "iteration (ms): 812.4 | learning rate: 3.000E-05 | global batch size: 1024 | lm loss: 2.{i:04d}E+00 | "
        "loss scale: 1.0 | grad norm: 0.81 | number of skipped iterations: 0 | number of nan iterations: 0 |\n")
NCCL = "node{n}:{p}:{p} [{d}] NCCL INFO Channel {c:02d}/32 :    0   1   2   3   4   5   6   7\n"
WARN = ("/usr/lib/python3/dist-packages/torch/utils/checkpoint.py:91: UserWarning: None of the inputs have "
        "requires_grad=True. Gradients will be None\n")


def _stamp(sec: int) -> str:
    return f"2024-05-01 {sec // 3600 % 24:02d}:{sec // 60 % 60:02d}:{sec % 60:02d},{sec * 7 % 1000:03d}"


def write_log(path: Path, rank: int, size: int) -> None:
    block = []
    i = 0
    while sum(map(len, block)) < (1 << 20):
        block.append(LINE.format(ts=_stamp(i), i=i, s=i * 1024))
        if i % 50 == 0:
            block.append(NCCL.format(n=rank // 8, p=1000 + rank, d=rank % 8, c=i % 32))
        if i % 400 == 0:
            block.append(WARN)
        i += 1
    chunk = "".join(block).encode()
    end = 36000
    if rank == ROOT:
        tail = (f"{_stamp(end)} [INFO] [training.py:512] iteration step start\n"
                "Traceback (most recent call last):\n  File \"/workspace/pretrain_gpt.py\", line 301, in <module>\n"
                "    main()\n"
                "RuntimeError: CUDA error: an illegal memory access was encountered\n"
                "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                "below might be incorrect.\n")
    else:
        tail = (f"[rank{rank}]:[E501 {_stamp(end + 600)[11:19]}.123456789 ProcessGroupNCCL.cpp:616] [Rank {rank}] "
                "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=901, OpType=ALLREDUCE, NumelIn=1, "
                "NumelOut=1, Timeout(ms)=600000) ran for 600018 milliseconds before timing out.\n"
                f"[rank{rank}]: RuntimeError: NCCL communicator was aborted on rank {rank}.\n")
    with open(path, "wb") as f:
        written = 0
        while written + len(chunk) < size - len(tail):
            f.write(chunk)
            written += len(chunk)
        f.write(tail.encode())


def ensure_logs(d: Path, size: int) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / f"rank{r}.log" for r in range(RANKS)]
    for r, p in enumerate(paths):
        if not p.exists() or abs(p.stat().st_size - size) > (2 << 20):
            write_log(p, r, size)
    return paths


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def tree_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    """Sample the summed RSS of `pid` and its descendants until `stop`; the largest sum goes in peak[0]."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
        except psutil.NoSuchProcess:
            return
        peak[0] = max(peak[0], total)
        stop.wait(0.005)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/robustd-bench-triage")
    ap.add_argument("--size-mb", type=int, default=50)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    args = ap.parse_args()
    t0 = time.monotonic()
    paths = ensure_logs(Path(args.dir), args.size_mb << 20)
    total = sum(p.stat().st_size for p in paths)
    print(f"logs: {len(paths)} x {args.size_mb} MB = {total / 1e9:.2f} GB in {args.dir} "
          f"(ready in {time.monotonic() - t0:.1f} s)")

    walls: list[float] = []
    answer: dict = {}
    peak = [0]
    for _ in range(args.runs):
        if args.cold:
            drop_caches()
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "triage", "--json", args.dir],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stop = threading.Event()
        sampler = threading.Thread(target=tree_rss, args=(proc.pid, stop, peak))
        sampler.start()
        out, err = proc.communicate(timeout=120)
        walls.append(time.perf_counter() - start)
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            sys.exit(f"robustctl triage exited {proc.returncode}: {err.strip()}")
        answer = json.loads(out)
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    judge: list[float] = []
    for _ in range(args.runs):
        start = time.perf_counter()
        logs = [read_log(str(p)) for p in paths]
        triage(logs, exit_code=1)
        judge.append(time.perf_counter() - start)
    print(f"robustctl triage --json ({'cold' if args.cold else 'warm'} cache), {args.runs} runs: "
          f"p50 {percentile(walls, 50):.2f} s, p99 {percentile(walls, 99):.2f} s; peak RSS {rss_mb:.0f} MB "
          f"(largest process), {peak[0] / (1 << 20):.0f} MB (all its processes together); "
          f"{os.cpu_count()} cores (targets: 2 s, 200 MB)")
    print(f"read + judge in this process, one core: p50 {percentile(judge, 50) * 1000:.0f} ms, "
          f"p99 {percentile(judge, 99) * 1000:.0f} ms")
    print(f"answer: class={answer.get('class')} infra={answer.get('infra')} next={answer.get('next')} "
          f"ranks={answer.get('ranks')} (expected cuda on rank {ROOT})")


if __name__ == "__main__":
    main()
