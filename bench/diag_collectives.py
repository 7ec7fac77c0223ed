"""The stop-time all-to-all harness against a bare torch.distributed all_to_all loop, same payload, same run.

    .venv/bin/python bench/diag_collectives.py [--ranks 4] [--size-mb 4] [--iterations 40] [--warmup 5] [--rounds 3]

Runs `python -m stoptests.all_to_all` (gloo, CPU ranks) and a bare loop (the same number of
processes, the same FileStore rendezvous, the same two buffers filled with the same payload, the
same warm-up and timed iteration counts) alternately, `--rounds` times each, and prints both bus
bandwidths (nccl-tests definition: busbw = bytes / time * (n-1)/n, time = mean over ranks) with the
ratio of the medians (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def bare_rank(rank: int, n: int, words: int, warmup: int, iterations: int, store: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    from stoptests.collective_worker import a2a_seed, pattern

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    send = torch.empty((n, words), dtype=torch.int64)
    recv = torch.empty((n, words), dtype=torch.int64)
    for j in range(n):
        pattern(torch, a2a_seed(rank, j, 0), words, out=send[j])
    for _ in range(warmup):
        dist.all_to_all_single(recv, send)
    t = time.perf_counter()
    for _ in range(iterations):
        dist.all_to_all_single(recv, send)
    duration = time.perf_counter() - t
    print(json.dumps({"rank": rank, "duration_s": duration}), flush=True)
    dist.destroy_process_group()


def busbw(bytes_per_iter: int, iterations: int, duration: float, n: int) -> float:
    return bytes_per_iter * iterations / duration / 1e9 * (n - 1) / n


def run_bare(n: int, words: int, warmup: int, iterations: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-a2a-") as d:
        store = os.path.join(d, "store")
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs = [subprocess.Popen([sys.executable, __file__, "--bare-rank", str(r), "--ranks", str(n),
                                   "--words", str(words), "--warmup", str(warmup), "--iterations", str(iterations),
                                   "--store", store], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
                 for r in range(n)]
        durations = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            durations += [json.loads(line)["duration_s"] for line in out.decode().splitlines() if line.startswith("{")]
    if len(durations) != n:
        raise SystemExit("the bare loop failed")
    return busbw(words * 8 * n, iterations, statistics.mean(durations), n)


def run_harness(n: int, size_mb: float, warmup: int, iterations: int) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory(prefix="bench-a2a-") as d:
        spec = {"test": "all_to_all", "run_id": "bench", "node": "bench", "work_dir": d, "timeout": 120.0,
                "gpus": [], "backend": "gloo", "cpu_ranks": n, "min_busbw_gbps": 0.0, "faults": {},
                "size_mb": size_mb, "iterations": iterations, "warmup": warmup}
        path = os.path.join(d, "spec.json")
        Path(path).write_text(json.dumps(spec))
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "stoptests.all_to_all", "--spec", path], cwd=REPO,
                              capture_output=True, timeout=300)
        wall = time.monotonic() - t
    results = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    results = [r for r in results if r.get("type") == "result" and r["component"].startswith("rank/")]
    if proc.returncode != 0 or len(results) != n or any(r["status"] != "PASS" for r in results):
        raise SystemExit(f"the harness failed: rc={proc.returncode}\n{proc.stdout.decode()}\n{proc.stderr.decode()}")
    return float(results[0]["details"]["aggregate_busbw_gbps"]), wall, int(results[0]["figures"]["bytes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=float, default=4.0)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bare-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--words", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare_rank is not None:
        bare_rank(a.bare_rank, a.ranks, a.words, a.warmup, a.iterations, a.store)
        return 0

    words = max(1, int(a.size_mb * (1 << 20)) // a.ranks // 8)  # as the harness sizes its chunks
    harness, bare, walls = [], [], []
    for i in range(a.rounds):
        h, wall, nbytes = run_harness(a.ranks, a.size_mb, a.warmup, a.iterations)
        assert nbytes == words * 8 * a.ranks, (nbytes, words)
        b = run_bare(a.ranks, words, a.warmup, a.iterations)
        harness.append(h)
        bare.append(b)
        walls.append(wall)
        print(f"round {i + 1}: harness {h:.3f} GB/s busbw (child wall {wall:.1f}s), bare loop {b:.3f} GB/s busbw",
              flush=True)
    mh, mb = statistics.median(harness), statistics.median(bare)
    print(f"all-to-all, {a.ranks} gloo CPU ranks, {words * 8 * a.ranks / (1 << 20):.1f} MiB per rank, "
          f"{a.warmup}+{a.iterations} iterations")
    print(f"harness busbw (median of {a.rounds}): {mh:.3f} GB/s")
    print(f"bare loop busbw (median of {a.rounds}): {mb:.3f} GB/s")
    print(f"ratio harness/bare: {mh / mb:.3f} (target >= 0.9)")
    print(f"harness child wall time (median): {statistics.median(walls):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
