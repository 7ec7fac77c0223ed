"""Detection latency: NIC carrier down → the NIC_DOWN event on a Watch stream. Needs root.

A veth pair is made with the watched end in a fresh network namespace; the peer in our
namespace is taken down (the watched end loses carrier) and up again, N times (default 100).
Prints p50/p99/max of down → RAISED. Target p99 ≤ 500 ms (ByteRobust: 30 s).
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from _harness import BenchDaemon, percentile  # noqa: E402
from pyroute2 import IPRoute  # noqa: E402

from checks import BUILTIN  # noqa: E402
from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def measure_nic(n: int, gap: float = 0.05) -> tuple[list[float], int]:
    """Carrier-down → NIC_DOWN RAISED latencies in ms, and how many waits timed out."""
    if os.geteuid() != 0:
        raise SystemExit("detect_nic needs root (network namespaces, veth)")
    tag = uuid.uuid4().hex[:6]
    ns, watched, peer = f"rdbench-{tag}", f"rdw{tag}", f"rdp{tag}"
    ip("netns", "add", ns)
    d = None
    try:
        ip("link", "add", watched, "type", "veth", "peer", "name", peer)
        ip("link", "set", watched, "netns", ns)
        ip("link", "set", peer, "up")
        ip("-n", ns, "link", "set", watched, "up")
        checks = {c.name: {"enabled": False} for c in BUILTIN}
        checks["nic"] = {"enabled": True, "interval": "1s", "interfaces": [watched], "netns": ns}
        d = BenchDaemon({"checks": checks})
        channel = grpc.insecure_channel(d.target)
        stream = pb_grpc.NodeHealthStub(channel).Watch(pb.WatchRequest(from_seq=0))
        events: queue.Queue[tuple[int, float]] = queue.Queue()

        def read() -> None:
            try:
                for ev in stream:
                    if ev.condition.code == "NIC_DOWN" and ev.condition.component == f"nic/{watched}":
                        events.put((ev.kind, time.perf_counter()))
            except grpc.RpcError:
                pass

        threading.Thread(target=read, daemon=True).start()
        time.sleep(0.5)
        lat: list[float] = []
        missed = 0
        with IPRoute() as ipr:
            index = ipr.link_lookup(ifname=peer)[0]
            for _ in range(n):
                t0 = time.perf_counter()
                ipr.link("set", index=index, state="down")
                try:
                    kind, t = events.get(timeout=5)
                    while kind != pb.EVENT_KIND_RAISED:
                        kind, t = events.get(timeout=5)
                    lat.append((t - t0) * 1000)
                except queue.Empty:
                    missed += 1
                ipr.link("set", index=index, state="up")
                try:  # wait for the clear, so each down is a fresh RAISED
                    while events.get(timeout=5)[0] != pb.EVENT_KIND_CLEARED:
                        pass
                except queue.Empty:
                    missed += 1
                time.sleep(gap)
        stream.cancel()
        return lat, missed
    finally:
        if d is not None:
            d.close()
        subprocess.run(["ip", "link", "del", peer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between an up and the next down")
    args = ap.parse_args()
    lat, missed = measure_nic(args.n, args.gap)
    print(f"detect_nic: {len(lat)}/{args.n} carrier losses seen on Watch ({missed} waits timed out)")
    if lat:
        print(f"  latency p50 {percentile(lat, 50):.2f} ms  p99 {percentile(lat, 99):.2f} ms  "
              f"max {max(lat):.2f} ms  (target p99 <= 500 ms)")


if __name__ == "__main__":
    main()
