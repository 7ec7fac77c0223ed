"""Fleet tools at scale, two figures.

1. Stack aggregation: 10,000 ranks (tp=8, pp=5, dp=250, 8 ranks per node), two threads per rank,
   ~30 frames each, varying line numbers and addresses, one stuck PP group. Wall time p50 and max of
   `aggregate` over a few runs (target <= 2 s).
2. `robustctl fleet status` over 50 real daemons on this machine (each its own socket and state): wall
   time of the whole command (interpreter start included) and of the concurrent GetVerdict fan-out
   alone (p50/p99), then again with 10 of the daemons stopped (unreachable).
3. Tracer.CaptureStacks of 8 real Python "training" processes (root: py-spy attaches with ptrace):
   wall time p50/p99 of the whole RPC, Python-only and with native frames.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._harness import REPO, BenchDaemon, percentile  # noqa: E402
from checks import BUILTIN  # noqa: E402
from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.cli import remote  # noqa: E402
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
    ap.add_argument("--daemons", type=int, default=50)
    args = ap.parse_args()
    bench_aggregate(args)
    if args.daemons:
        bench_status(args.daemons)
    bench_capture()


JOB = "import threading, time\ndef loader():\n    while True: time.sleep(0.05)\n" \
      "def step():\n    while True: time.sleep(0.05)\n" \
      "threading.Thread(target=loader, daemon=True).start()\nstep()\n"


def bench_capture(n: int = 8, runs: int = 20) -> None:
    if os.geteuid() != 0:
        print("capture: skipped (py-spy needs root to attach to other processes)")
        return
    tag = f"bench-train-{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, "-c", JOB, tag], env={**os.environ, "RANK": str(r)})
             for r in range(n)]
    off = {c.name: {"enabled": False} for c in BUILTIN}
    d = BenchDaemon({"checks": off, "tracer": {"process_patterns": [tag]}})
    try:
        import grpc

        from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

        time.sleep(0.5)
        with grpc.insecure_channel(d.target) as ch:
            stub = pb_grpc.TracerStub(ch)
            for native in (False, True):
                walls = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    resp = stub.CaptureStacks(pb.CaptureRequest(native=native), timeout=60)
                    walls.append(time.perf_counter() - t0)
                    assert len(resp.processes) == n and not any(p.error for p in resp.processes), resp
                print(f"CaptureStacks of {n} processes{' (native)' if native else ''}: "
                      f"p50={percentile(walls, 50) * 1000:.0f}ms p99={percentile(walls, 99) * 1000:.0f}ms "
                      f"({runs} runs)")
    finally:
        d.close()
        for p in procs:
            p.kill()
            p.wait()


def bench_status(n: int) -> None:
    off = {c.name: {"enabled": False} for c in BUILTIN}
    daemons = [BenchDaemon({"node_name": f"node{i:03d}", "checks": off}, wait=False) for i in range(n)]
    try:
        t0 = time.perf_counter()
        for d in daemons:
            d.wait_ready(120)
        print(f"{n} daemons up in {time.perf_counter() - t0:.1f}s")
        hosts = [f"unix:{d.socket}" for d in daemons]
        report("all up", hosts, n, n)
        for d in daemons[:10]:
            d.proc.terminate()
            d.proc.wait(15)
        report("10 stopped", hosts, n, n - 10)
    finally:
        for d in daemons:
            d.close()


def report(label: str, hosts: list[str], n: int, answering: int) -> None:
    fan = []
    for _ in range(20):
        t0 = time.perf_counter()
        out = remote.fan_out(hosts, lambda c: c.call("GetVerdict", pb.GetVerdictRequest()), 5.0)
        fan.append(time.perf_counter() - t0)
        assert sum(o.value is not None for o in out) == answering, [o.error for o in out if o.error][:3]
    cli = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "fleet", "status", *hosts],
                           capture_output=True, text=True, cwd=REPO)
        cli.append(time.perf_counter() - t0)
        assert r.returncode == (0 if answering == n else 3), r.stderr
    print(f"fleet status, {n} daemons ({label}): robustctl wall p50={statistics.median(cli):.3f}s "
          f"max={max(cli):.3f}s; fan-out alone p50={percentile(fan, 50) * 1000:.1f}ms "
          f"p99={percentile(fan, 99) * 1000:.1f}ms")


def bench_aggregate(args: argparse.Namespace) -> None:
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
