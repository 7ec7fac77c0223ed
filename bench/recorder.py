"""Straggler op recorder overhead (target <= 1 % of step time on CPU).

1. Per-op cost in µs: `with rec.op(...)` in a sampled step (both CPU clocks), outside a sampled step, and the
   window's shard write, each against an empty loop in the same process.
2. Step time of the example job (examples/pipeline_train.py, PP 2 x DP 2, gloo) with and without recording,
   side by side in one run: the recorder samples every other step (every=2, window=1), so recorded and
   unrecorded steps interleave under the same load; p50/p99 of each, their difference, and the overhead
   the per-op cost predicts (ops per step x µs per op / step time), which a shared machine's noise does not
   blur. Also the job's CPU time and the ranks' peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _harness import percentile  # noqa: E402


def per_op_costs(n: int) -> dict[str, float]:
    import contextlib

    from robustd.stragglers.recorder import Recorder

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rdb-rec-") as tmp:
        null = contextlib.nullcontext()
        t0 = time.perf_counter()
        for _ in range(n):
            with null:
                pass
        base = (time.perf_counter() - t0) / n
        for clock in ("monotonic", "thread"):
            rec = Recorder(Path(tmp) / clock, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=1, window=1,
                           cpu_compute_clock=clock, max_ops_per_step=n + 1)
            t0 = time.perf_counter()
            for i in range(n):
                with rec.op("forward-compute", i):
                    pass
            out[f"op, sampled step, {clock} clock"] = ((time.perf_counter() - t0) / n - base) * 1e6
            t0 = time.perf_counter()
            rec.step_end()  # writes the window's shard: n rows
            out[f"shard write per op ({n}-op shard)"] = (time.perf_counter() - t0) / n * 1e6
            rec.close()
        rec = Recorder(Path(tmp) / "small", dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, gc_hook=False)
        ends = []
        for _ in range(50):  # a one-step window of 13 ops (the example job's): step_end writes its shard
            for i in range(13):
                with rec.op("forward-compute", i):
                    pass
            t0 = time.perf_counter()
            rec.step_end()
            ends.append(time.perf_counter() - t0)
        rec.close()
        out["step_end writing a 13-op shard"] = statistics.median(ends) * 1e6
        rec = Recorder(Path(tmp) / "off", dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=1000, window=1,
                       start=1)
        t0 = time.perf_counter()
        for i in range(n):
            with rec.op("forward-compute", i):
                pass
        out["op, step not sampled"] = ((time.perf_counter() - t0) / n - base) * 1e6
        rec.close()
    return out


def job_side_by_side(steps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="rdb-rec-job-") as tmp:
        trace, stats = Path(tmp) / "trace", Path(tmp) / "stats"
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "examples/pipeline_train.py", "--pp", "2", "--dp", "2", "--steps", str(steps),
                        "--trace-dir", str(trace), "--record-every", "2", "--record-window", "1", "--record-start",
                        "2", "--stats-dir", str(stats)], cwd=REPO, check=True, capture_output=True, timeout=900)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        on: list[float] = []
        off: list[float] = []
        for f in sorted(stats.glob("rank*.json")):
            doc = json.loads(f.read_text())
            for s, (t, sampled) in enumerate(zip(doc["step_times"], doc["sampled"], strict=True)):
                if s >= 2:
                    (on if sampled else off).append(t * 1e3)
        from robustd.stragglers import tracedir

        t = tracedir.load(trace)
        ops_per_step = len(t) / (len(t.steps) * 4)
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        print(f"example job PP 2 x DP 2, {steps} steps (every other one recorded), wall {wall:.1f}s, "
              f"CPU {cpu:.1f}s ({100 * cpu / wall:.0f}% of one core), peak RSS of a rank "
              f"{r1.ru_maxrss / 1024:.0f}MB, {ops_per_step:.0f} ops per rank and step", flush=True)
        for label, xs in (("recorded", on), ("not recorded", off)):
            print(f"  step time {label:13s}: p50 {statistics.median(xs):7.1f} ms  p99 {percentile(xs, 99):7.1f} ms  "
                  f"mean {statistics.fmean(xs):7.1f} ms  (n={len(xs)} rank-steps)", flush=True)
        diff = statistics.median(on) / statistics.median(off) - 1
        print(f"  measured difference of medians: {100 * diff:+.2f}% (noise on a shared machine: see the "
              f"prediction below)", flush=True)
    return ops_per_step, statistics.median(off)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    costs = per_op_costs(args.ops)
    for k, v in costs.items():
        print(f"{k}: {v:.2f} µs", flush=True)
    ops, step_ms = job_side_by_side(args.steps)
    per_op = costs["op, sampled step, thread clock"]
    write = costs["step_end writing a 13-op shard"]
    pred = (ops * per_op + write) / (step_ms * 1e3)
    print(f"  predicted overhead of a recorded step (a window of 1 step): ({ops:.0f} ops x {per_op:.2f} µs + "
          f"{write / 1e3:.2f} ms shard write) / {step_ms:.1f} ms = {100 * pred:.2f}% (target <= 1%); over the "
          f"whole run with every=100 window=5: {100 * pred * 5 / 100:.3f}%", flush=True)


if __name__ == "__main__":
    main()
