"""GetVerdict latency at 500 requests/s while 100 Watch streams are open. Target p99 ≤ 5 ms.

Open loop: a request is started every 2 ms whatever the previous one did, so a slow server
shows up as latency, not as a lower rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
from _harness import BenchDaemon, kmsg_write, percentile  # noqa: E402

from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--conditions", type=int, default=20, help="standing conditions to serve (needs root)")
    args = ap.parse_args()
    d = BenchDaemon()
    try:
        tag = os.getpid() % 0xff
        for i in range(args.conditions):
            kmsg_write(f"NVRM: Xid (PCI:{tag:04x}:{i:02x}:00): 13, pid={i}, name=bench, Graphics Engine Exception")
        with grpc.insecure_channel(d.target) as ch:
            stub = pb_grpc.NodeHealthStub(ch)
            while len(stub.GetVerdict(pb.GetVerdictRequest()).conditions) < args.conditions:
                time.sleep(0.05)
        lat, errors = asyncio.run(load(d.target, args.rate, args.seconds, args.streams))
        print(f"api_load: GetVerdict at {args.rate:.0f}/s for {args.seconds:.0f}s with {args.streams} open Watch "
              f"streams, {args.conditions} conditions: {len(lat)} ok, {errors} errors")
        print(f"  latency p50 {percentile(lat, 50):.2f} ms  p99 {percentile(lat, 99):.2f} ms  "
              f"max {max(lat):.2f} ms  (target p99 <= 5 ms)")
    finally:
        d.close()


if __name__ == "__main__":
    main()
