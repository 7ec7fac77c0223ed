"""Hardware fault → Watch event latency, p50/p99 over N injections each (default 50). Needs root.

- NIC carrier down: a veth end in a network namespace loses carrier (netlink push).
  Target p99 ≤ 500 ms; ByteRobust's Monitor: 30 s.
- GPU lost and GPU over-temperature through the NVML emulator and the real pynvml, with the
  GPU check at its default 1 s interval. Target p99 ≤ 2 s; ByteRobust: 10 s.
- NVML-event faults (Xid 79, Xid 48, fatal poison, recovery action, in turn over the 8 GPUs),
  pushed through the emulator's event API to the GPU check's watcher thread, no poll involved.
  Target p99 ≤ 100 ms (the poll path ≈ 1 s; ByteRobust's GPU detection ≈ 10 s).
Each latency runs from the moment the fault is injected (the state file is replaced, the
link is set down) to the RAISED event arriving on a Watch stream.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from _harness import BenchDaemon, percentile  # noqa: E402
from detect_nic import measure_nic  # noqa: E402

from checks import BUILTIN  # noqa: E402
from checks.gpu.parse import normalize_bus_id  # noqa: E402
from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402
from robustd.nvmlemu import state as emu  # noqa: E402

GPUS = 8


class GpuNode:
    """A daemon whose GPU check reads the emulator at 1 s, and a Watch stream on it."""

    def __init__(self, tmp: Path):
        self.state = str(tmp / "nvml.state")
        emu.save(self.state, emu.healthy_node(GPUS))
        checks = {c.name: {"enabled": False} for c in BUILTIN}
        checks["gpu"] = {"enabled": True, "interval": "1s", "backend": "emulator", "emulator_state": self.state,
                         "expected_gpus": GPUS}
        # A short hold-down so each over-temperature clears before the next injection.
        self.d = BenchDaemon({"checks": checks, "policy": {"codes": {"GPU_TEMP_HIGH": {"clear_after": "1s"}}}})
        self.channel = grpc.insecure_channel(self.d.target)
        self.stub = pb_grpc.NodeHealthStub(self.channel)
        self.stream = self.stub.Watch(pb.WatchRequest(from_seq=self.stub.GetVerdict(pb.GetVerdictRequest()).seq))
        self.events: queue.Queue[tuple[pb.Event, float]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.bus = [normalize_bus_id(g.bus_id) for g in emu.load(self.state).gpus]

    def _read(self) -> None:
        try:
            for ev in self.stream:
                self.events.put((ev, time.perf_counter()))
        except grpc.RpcError:
            pass

    def edit(self, fn: Callable[[emu.EmulatorState], None]) -> float:
        st = emu.load(self.state)
        fn(st)
        t0 = time.perf_counter()
        emu.save(self.state, st)
        return t0

    def wait(self, kind: int, code: str, component: str, timeout: float = 10.0) -> float | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev, t = self.events.get(timeout=left)
            except queue.Empty:
                return None
            c = ev.condition
            if ev.kind == kind and c.code == code and c.component == component:
                return t
        return None

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()
        self.d.close()


def measure_gpu(node: GpuNode, n: int, fault: str) -> tuple[list[float], int]:
    lat: list[float] = []
    missed = 0
    rng = random.Random(1)
    for i in range(n):
        g = i % GPUS
        comp = f"gpu/{node.bus[g]}"
        time.sleep(rng.uniform(0.0, 1.0))  # inject at a random phase of the 1 s poll, not right after one
        if fault == "lost":
            t0 = node.edit(lambda s, g=g: emu.apply_fault(s, g, "lost"))
            t = node.wait(pb.EVENT_KIND_RAISED, "GPU_LOST", comp)
            node.edit(lambda s, g=g: emu.clear(s, g))
            if t is not None:  # sticky: an operator's acknowledgement clears it
                node.stub.Acknowledge(pb.AcknowledgeRequest(component=comp, code="GPU_LOST", reason="bench"))
        else:
            t0 = node.edit(lambda s, g=g: emu.set_value(s, g, "temperature", "90"))
            t = node.wait(pb.EVENT_KIND_RAISED, "GPU_TEMP_HIGH", comp)
            node.edit(lambda s, g=g: emu.set_value(s, g, "temperature", str(emu.HEALTHY_TEMPERATURE)))
            if t is not None and node.wait(pb.EVENT_KIND_CLEARED, "GPU_TEMP_HIGH", comp) is None:
                missed += 1
        if t is None:
            missed += 1
        else:
            lat.append((t - t0) * 1000)
    return lat, missed


EVENT_FAULTS = (("xid", "79", "XID_79"), ("xid", "48", "XID_48"), ("poison", None, "GPU_FATAL_POISON"),
                ("recovery-action", "gpu-reset", "XID_154"))


def measure_gpu_events(node: GpuNode, n: int) -> tuple[list[float], int]:
    """Event injected -> RAISED on Watch; then the GPU is cleared and the condition acknowledged."""
    lat: list[float] = []
    missed = 0
    rng = random.Random(2)
    for i in range(n):
        g = i % GPUS
        fault, value, code = EVENT_FAULTS[(i // GPUS) % len(EVENT_FAULTS)]
        comp = f"gpu/{node.bus[g]}"
        time.sleep(rng.uniform(0.05, 0.25))  # events do not wait for a poll: any phase will do
        t0 = node.edit(lambda s, g=g, f=fault, v=value: emu.apply_fault(s, g, f, value=v))
        t = node.wait(pb.EVENT_KIND_RAISED, code, comp, timeout=5.0)
        node.edit(lambda s, g=g: emu.clear(s, g))
        if t is None:
            missed += 1
            continue
        lat.append((t - t0) * 1000)
        node.stub.Acknowledge(pb.AcknowledgeRequest(component=comp, code=code, reason="bench"))
        node.wait(pb.EVENT_KIND_CLEARED, code, comp, timeout=5.0)
    return lat, missed


def report(name: str, lat: list[float], n: int, missed: int, target_ms: float) -> None:
    print(f"{name}: {len(lat)}/{n} seen on Watch ({missed} waits timed out)")
    if lat:
        print(f"  latency p50 {percentile(lat, 50):.1f} ms  p99 {percentile(lat, 99):.1f} ms  "
              f"max {max(lat):.1f} ms  (target p99 <= {target_ms:g} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--only", choices=["nic", "gpu-lost", "gpu-temp", "gpu-events"])
    args = ap.parse_args()
    if args.only in (None, "nic"):
        lat, missed = measure_nic(args.n)
        report("NIC carrier down", lat, args.n, missed, 500)
    if args.only in (None, "gpu-lost", "gpu-temp", "gpu-events"):
        tmp = Path(tempfile.mkdtemp(prefix="rdhw-"))
        node = GpuNode(tmp)
        try:
            time.sleep(2.0)  # the GPU check's first poll inventories the GPUs
            for fault, name in (("lost", "gpu-lost"), ("temp", "gpu-temp")):
                if args.only in (None, name):
                    lat, missed = measure_gpu(node, args.n, fault)
                    report(f"GPU {'lost' if fault == 'lost' else 'over-temperature'} (emulator, 1 s poll)",
                           lat, args.n, missed, 2000)
            if args.only in (None, "gpu-events"):
                lat, missed = measure_gpu_events(node, args.n)
                report("GPU NVML events: Xid 79/48, fatal poison, recovery action (emulator, pushed)",
                       lat, args.n, missed, 100)
        finally:
            node.close()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
