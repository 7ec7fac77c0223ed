#!/usr/bin/env python3
"""Self-check of the straggler op recorder's GPU path (CUDA events), for a machine with one CUDA GPU.

    python3 scripts/recorder-gpu-check.py [--size 4096] [--steps 8]

Needs CUDA torch, numpy, pyarrow and pyyaml (nothing else of robustd's). It records a few steps of CUDA
matmuls — ops of 1, 2 and 4 matmuls on the default stream and one on a side stream — in two windows and
checks that:
  - every op's duration is positive, and an op of 4 matmuls takes longer than one of 1 (GPU time, not the
    microseconds the host spends launching);
  - ops of a stream are ordered and do not overlap (each starts after the previous one ended);
  - the recorder never synchronised per op: at most 2 synchronize calls per window begun (the clock anchor:
    a device synchronize and one event's), whatever the number of ops;
  - the shards load back through the analyser (robustd.stragglers.tracedir) with every step start known.
Prints a table of one step and PASS/FAIL lines; exit 0 when everything passes. Finishes in well under 60 s.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192,
                    help="matrix size, at least 4096 so the GPU, not the host's launches, sets op times "
                         "(default 8192: ~1.5 ms per fp16 matmul on an H100/H200)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if args.size < 4096 or args.steps < 1:
        ap.error("--size must be at least 4096 and --steps at least 1")
    signal.alarm(60)  # the whole check, whatever hangs

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("FAIL: torch.cuda.is_available() is False: run this on a machine with a CUDA GPU")
        return 1
    from robustd.stragglers import tracedir
    from robustd.stragglers.optrace import OP_TYPES
    from robustd.stragglers.recorder import Recorder

    syncs = {"n": 0}

    def counting(fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            syncs["n"] += 1
            return fn(*a, **kw)
        return wrapper

    torch.cuda.synchronize = counting(torch.cuda.synchronize)
    torch.cuda.Event.synchronize = counting(torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = counting(torch.cuda.Stream.synchronize)

    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn_like(a)
    side = torch.cuda.Stream()
    torch.cuda.current_stream().synchronize()  # warm up cuBLAS outside the count
    (a @ b).sum().item()
    syncs["n"] = 0

    failures: list[str] = []
    host_us: list[float] = []
    ops_per_step = (("forward-compute", 1), ("forward-compute", 2), ("backward-compute", 4), ("optimizer", 1))
    with tempfile.TemporaryDirectory(prefix="recorder-gpu-") as tmp:
        # gc_hook off: its gc op is timed on the host clock, and this checks the CUDA-event timeline.
        rec = Recorder(tmp, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=4, window=4, device="cuda",
                       name="gpu-check", gc_hook=False)
        t_start = time.perf_counter()
        for _ in range(args.steps):
            for mb, (name, k) in enumerate(ops_per_step):
                t0 = time.perf_counter()
                with rec.op(name, microbatch=mb):
                    c = a
                    for _ in range(k):
                        c = c @ b
                host_us.append((time.perf_counter() - t0) * 1e6)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), rec.op("grads-reduce-scatter"):
                c = a @ b
            torch.cuda.current_stream().wait_stream(side)
            rec.step_end()
        loop_s = time.perf_counter() - t_start
        during = syncs["n"]
        # Windows begun: every 4 steps, counting the one the last step_end() opened.
        windows = args.steps // 4 + 1
        rec.close()
        t = tracedir.load(tmp)
        table = []
        for step in t.steps:
            sel = np.nonzero(t.step == step)[0]
            order = sel[np.argsort(t.start[sel])]
            if step == t.steps[-1]:
                table = [(OP_TYPES[t.optype[i]], int(t.seq_id[i]), t.start[i] * 1e3, t.duration[i] * 1e3)
                         for i in order]
            if not (t.duration[sel] > 0).all():
                failures.append(f"step {step}: an op has duration <= 0")
            main = [i for i in order if OP_TYPES[t.optype[i]] != "grads-reduce-scatter"]
            ends = t.start[main] + t.duration[main]
            if not (ends[:-1] <= t.start[main][1:] + 5e-6).all():
                failures.append(f"step {step}: ops of the default stream overlap or are out of order")
            d = {(OP_TYPES[t.optype[i]], int(t.seq_id[i])): t.duration[i] for i in sel}
            if not d[("backward-compute", 0)] > d[("forward-compute", 0)]:
                failures.append(f"step {step}: 4 matmuls ({d[('backward-compute', 0)] * 1e3:.3f} ms) not longer "
                                f"than 1 ({d[('forward-compute', 0)] * 1e3:.3f} ms)")
        if sorted(t.steps.tolist()) != list(range(args.steps)):
            failures.append(f"steps recorded {t.steps.tolist()}, expected 0..{args.steps - 1}")
        import pyarrow.parquet as pq

        shards = sorted(Path(tmp).glob("w*.parquet"))
        starts = np.concatenate([pq.read_table(p).column("step_start").to_numpy() for p in shards])
        if not np.isfinite(starts).all():
            failures.append("a shard has a step without a resolved start (step_start NaN)")
    if during > 2 * windows:
        failures.append(f"{during} synchronize calls while recording {args.steps * 5} ops in {windows} windows: "
                        f"expected at most {2 * windows} (one clock anchor per window begun)")

    print(f"{'op':<22}{'seq':>4}{'start ms':>11}{'GPU ms':>10}")
    for name, seq, start, dur in table:
        print(f"{name:<22}{seq:>4}{start:>11.3f}{dur:>10.3f}")
    print(f"host time per op (launch only): median {float(np.median(host_us)):.0f} µs; synchronize calls while "
          f"recording: {during} ({windows} windows); loop {loop_s:.2f} s")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
