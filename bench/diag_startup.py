"""Start-up cost of the stop-time collectives: workers forked after the launcher loads torch vs exec'd.

    .venv/bin/python bench/diag_startup.py [--ranks 4] [--rounds 5]

Runs `python -m stoptests.all_to_all` (gloo, CPU ranks, a 64 KiB payload, 1+2 iterations: start-up is
all there is to time) with `worker_start: fork` and `worker_start: exec` alternately, `--rounds` times
each, and prints per mode the p50/p99 of the child's wall time and of the CPU seconds it and its workers
used (getrusage of the children).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._harness import percentile as pct  # noqa: E402


def run_once(mode: str, n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-start-") as d:
        spec = {"test": "all_to_all", "run_id": "bench", "node": "bench", "work_dir": d, "timeout": 120.0,
                "gpus": [], "backend": "gloo", "cpu_ranks": n, "min_busbw_gbps": 0.0, "faults": {},
                "size_mb": 0.0625, "iterations": 2, "warmup": 1, "worker_start": mode}
        path = os.path.join(d, "spec.json")
        Path(path).write_text(json.dumps(spec))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "stoptests.all_to_all", "--spec", path], cwd=REPO,
                              capture_output=True, timeout=300)
        wall = time.monotonic() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    results = [json.loads(ln) for ln in proc.stdout.decode().splitlines() if ln.startswith("{")]
    ranks = [r for r in results if r.get("type") == "result" and r["component"].startswith("rank/")]
    if proc.returncode != 0 or len(ranks) != n or any(r["status"] != "PASS" for r in ranks):
        raise SystemExit(f"{mode}: the harness failed: rc={proc.returncode}\n{proc.stdout.decode()[-2000:]}\n"
                         f"{proc.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in ("fork", "exec")}
    for i in range(a.rounds):
        for mode in ("fork", "exec"):
            wall, cpu = run_once(mode, a.ranks)
            got[mode]["wall"].append(wall)
            got[mode]["cpu"].append(cpu)
            print(f"round {i + 1} {mode}: wall {wall:.2f} s, cpu {cpu:.2f} s", flush=True)
    print(f"all_to_all start-up, {a.ranks} gloo CPU ranks, {os.cpu_count()} CPUs, {a.rounds} rounds per mode")
    for mode, v in got.items():
        print(f"{mode:>5}: wall p50 {pct(v['wall'], 50):.2f} s p99 {pct(v['wall'], 99):.2f} s; "
              f"cpu p50 {pct(v['cpu'], 50):.2f} s p99 {pct(v['cpu'], 99):.2f} s")
    ratio = statistics.median(got["fork"]["cpu"]) / statistics.median(got["exec"]["cpu"])
    print(f"fork/exec CPU (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
