"""GetVerdict latency at 500 requests/s while 100 Watch streams are open. Target p99 ≤ 5 ms.

Open loop: a request is started every 2 ms whatever the previous one did, so a slow server
shows up as latency, not as a lower rate.

Then the same load after fault storms (needs root: real /dev/kmsg lines), with the daemon's
memory: `--storm N` kernel lines naming N distinct GPUs with one Xid (folded past
policy.max_conditions_per_code into one `gpu/*` condition), then N lines on N more GPUs naming up
to 9,000 distinct Xid codes with ~950-byte messages (filling policy.max_conditions, the fold-overs
and the catch-all: the largest verdict the default caps allow). `--storm 0` skips them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
from _harness import BenchDaemon, kmsg_write, percentile  # noqa: E402

from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402

STEP = 50  # storm lines per write burst: well inside the kernel's 128 KiB ring even at ~1 KiB a line


async def load(target: str, rate: float, seconds: float, streams: int) -> tuple[list[float], int]:
    # Separate connections (not a shared subchannel): the daemon caps streams per connection
    # (listen.max_concurrent_streams, default 100), as a scheduler's watchers would be spread too.
    own = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options=own) as watch_ch, \
            grpc.aio.insecure_channel(target, options=own) as ch:
        watchers = [pb_grpc.NodeHealthStub(watch_ch).Watch(pb.WatchRequest(from_seq=0)) for _ in range(streams)]
        for w in watchers:
            await w.wait_for_connection()
        stub = pb_grpc.NodeHealthStub(ch)
        await stub.GetVerdict(pb.GetVerdictRequest())
        lat: list[float] = []
        errors = 0

        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                await stub.GetVerdict(pb.GetVerdictRequest(), timeout=5)
                lat.append((time.perf_counter() - t) * 1000)
            except grpc.RpcError:
                errors += 1

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        for w in watchers:
            w.cancel()
        return lat, errors


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak) of the daemon, in MiB."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def verdict(target: str) -> pb.Verdict:
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        return pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=30)


def accounted(v: pb.Verdict, prefix: str) -> int:
    """Storm lines the verdict shows: components with a condition of their own plus what folds counted."""
    own = sum(1 for c in v.conditions if c.component.startswith(prefix))
    return own + sum(int(c.evidence.get("folded", "0")) for c in v.conditions if c.component in ("*", "gpu/*"))


def storm(target: str, lines: list[str], progress: Callable[[pb.Verdict], int]) -> float:
    """Write the lines in bursts, each once the daemon has read the last; seconds it took.

    A burst lost to another writer flooding the kernel ring (the reader skips what was overwritten)
    is written again: folding counts a component once, however often it is seen.
    """
    t0 = time.monotonic()
    for start in range(0, len(lines), STEP):
        goal = min(start + STEP, len(lines))
        for _ in range(3):
            for line in lines[start:start + STEP]:
                kmsg_write(line)
            deadline = time.monotonic() + 10
            while progress(verdict(target)) < goal and time.monotonic() < deadline:
                time.sleep(0.1)
            if progress(verdict(target)) >= goal:
                break
        else:
            raise SystemExit(f"the daemon did not read storm lines {start}..{goal}")
    return time.monotonic() - t0


def one_at_a_time(target: str, n: int) -> list[float]:
    """Closed loop: each GetVerdict after the last returned, so latency is the cost of one call."""
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.NodeHealthStub(ch)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            stub.GetVerdict(pb.GetVerdictRequest(), timeout=30)
            lat.append((time.perf_counter() - t) * 1000)
    return lat


def concurrent(d: BenchDaemon, callers: int) -> tuple[float, float]:
    """`callers` GetVerdicts in flight at once (over 8 connections): (wall seconds, growth of the daemon's
    peak RSS in MiB). The peak is reset first (clear_refs 5), so only these calls count."""
    with open(f"/proc/{d.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    base = memory(d.proc.pid)["VmHWM"]

    async def run() -> None:
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        chans = [grpc.aio.insecure_channel(d.target, options=opts) for _ in range(8)]
        try:
            stubs = [pb_grpc.NodeHealthStub(c) for c in chans]
            await asyncio.gather(*(stubs[i % 8].GetVerdict(pb.GetVerdictRequest(), timeout=120)
                                   for i in range(callers)))
        finally:
            for c in chans:
                await c.close()

    t0 = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - t0, memory(d.proc.pid)["VmHWM"] - base


def report(label: str, args: argparse.Namespace, d: BenchDaemon, rate: float) -> None:
    v = verdict(d.target)
    lat, errors = asyncio.run(load(d.target, rate, args.seconds, args.streams))
    mem = memory(d.proc.pid)
    print(f"api_load [{label}]: GetVerdict at {rate:.0f}/s for {args.seconds:.0f}s with {args.streams} open "
          f"Watch streams, {len(v.conditions)} conditions ({v.ByteSize() / 1024:.0f} KiB verdict): "
          f"{len(lat)} ok, {errors} errors")
    if lat:
        print(f"  latency p50 {percentile(lat, 50):.2f} ms  p99 {percentile(lat, 99):.2f} ms  "
              f"max {max(lat):.2f} ms  (target p99 <= 5 ms)")
    seq = one_at_a_time(d.target, 200)
    print(f"  one at a time: p50 {percentile(seq, 50):.2f} ms  p99 {percentile(seq, 99):.2f} ms")
    print(f"  daemon RSS {mem['VmRSS']:.0f} MiB (peak {mem['VmHWM']:.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--conditions", type=int, default=20, help="standing conditions to serve (needs root)")
    ap.add_argument("--storm", type=int, default=10_000, help="distinct components per storm; 0: no storms")
    ap.add_argument("--full-rate", type=float, default=50, help="GetVerdict rate once the caps are full "
                    "(a ~1.6 MB verdict)")
    ap.add_argument("--callers", type=int, default=200, help="concurrent GetVerdicts of the caps-full verdict")
    args = ap.parse_args()
    # This one client (root) holds all the streams: let it, past the default listen.max_watches_per_uid.
    d = BenchDaemon({"listen": {"max_watches_per_uid": args.streams, "max_watches": max(256, 2 * args.streams)}})
    try:
        tag = os.getpid() % 0xff
        for i in range(args.conditions):
            kmsg_write(f"NVRM: Xid (PCI:{tag:04x}:{i:02x}:00): 13, pid={i}, name=bench, Graphics Engine Exception")
        with grpc.insecure_channel(d.target) as ch:
            stub = pb_grpc.NodeHealthStub(ch)
            while len(stub.GetVerdict(pb.GetVerdictRequest()).conditions) < args.conditions:
                time.sleep(0.05)
        report("baseline", args, d, args.rate)
        if args.storm <= 0:
            return
        dom = f"{0x1000_0000 + uuid.uuid4().int % 0xefff_ffff:08x}"
        n = args.storm
        gpus = [f"NVRM: Xid (PCI:{dom}:{i // 100:02x}:{i % 100:02x}): 79, pid=1, name=bench, GPU has fallen off "
                "the bus." for i in range(n)]
        before = memory(d.proc.pid)["VmRSS"]
        took = storm(d.target, gpus, lambda v: accounted(v, f"gpu/{dom}:"))
        print(f"storm: {n} distinct GPUs with XID_79 read in {took:.1f}s; daemon RSS "
              f"{before:.0f} -> {memory(d.proc.pid)['VmRSS']:.0f} MiB")
        report(f"{n} GPUs, one code", args, d, args.rate)
        dom2 = f"{0x1000_0000 + uuid.uuid4().int % 0xefff_ffff:08x}"
        detail = "Storm detail " + " ".join(f"0x{i:06x}=0x{i * 7:08x}" for i in range(45))  # ~950 bytes a line
        codes = [f"NVRM: Xid (PCI:{dom2}:{i // 100:02x}:{i % 100:02x}): {1000 + i % 9000}, pid=1, name=bench, "
                 f"{detail}" for i in range(n)]  # Xids have at most 4 digits
        before = memory(d.proc.pid)["VmRSS"]
        base = accounted(verdict(d.target), f"gpu/{dom2}:")  # the first storm's fold-over stands (sticky)
        took = storm(d.target, codes, lambda v: accounted(v, f"gpu/{dom2}:") - base)
        print(f"storm: {n} GPUs with up to 9,000 Xid codes, ~950-byte lines, read in {took:.1f}s; daemon RSS "
              f"{before:.0f} -> {memory(d.proc.pid)['VmRSS']:.0f} MiB")
        report(f"{n} lines, the caps full", args, d, args.full_rate)
        wall, grew = concurrent(d, args.callers)
        print(f"  {args.callers} concurrent GetVerdicts of the caps-full verdict: {wall:.1f}s, daemon peak RSS "
              f"+{grew:.0f} MiB")
    finally:
        d.close()


if __name__ == "__main__":
    main()
