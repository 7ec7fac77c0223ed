"""Stack aggregation at scale: 10,000 ranks (tp=8, pp=5, dp=250, 8 ranks per node), two threads per
rank, ~30 frames each, varying line numbers and addresses, one stuck PP group. Prints the wall time
p50 of `aggregate` over a few runs (target ≤ 2 s)."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from robustd.fleet.stacks import Layout, aggregate  # noqa: E402

DEPTH = 30


def rank_stack(rng: random.Random, innermost: str) -> list[Any]:
    addr = f"0x{rng.getrandbits(48):x}"
    main = [{"function": f"ncclKernel_{innermost} (libnccl.so.2 +{addr})", "file": "/usr/lib/libnccl.so.2",
             "line": 0},
            {"function": innermost, "file": "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py",
             "line": rng.randint(1, 3000)}]
    main += [{"function": f"layer_{i}", "file": f"/job/megatron/core/module_{i % 7}.py", "line": rng.randint(1, 900)}
             for i in range(DEPTH - 3)]
    main.append({"function": "<module>", "file": "/job/pretrain_gpt.py", "line": rng.randint(1, 99)})
    ckpt = [{"function": f"save_{i}", "file": "/job/megatron/checkpointing.py", "line": rng.randint(1, 900)}
            for i in range(DEPTH)]
    return [{"name": "MainThread", "frames": main}, {"name": "ckpt-writer", "frames": ckpt}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    layout = Layout(tp=8, pp=5, dp=250, ranks_per_node=8)
    rng = random.Random(0)
    stacks = {r: rank_stack(rng, "allreduce") for r in range(layout.world)}
    t, d = 3, 117
    pipe = [t + 8 * (d + 250 * p) for p in range(5)]
    for p, r in enumerate(pipe):
        stacks[r] = rank_stack(rng, ["irecv", "irecv", "isend", "isend", "all_gather_into_tensor"][p])
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        agg = aggregate(stacks, layout)
        times.append(time.perf_counter() - t0)
    assert agg.suspect_kind == "pp" and agg.suspects[0].ranks == tuple(pipe), agg.suspects
    print(f"ranks={layout.world} threads/rank=2 frames/thread~{DEPTH} runs={args.runs} "
          f"p50={statistics.median(times):.3f}s max={max(times):.3f}s groups={len(agg.groups)} "
          f"suspect={agg.suspect_kind}:{agg.suspects[0].index} machines={','.join(agg.suspect_machines)}")


if __name__ == "__main__":
    main()
