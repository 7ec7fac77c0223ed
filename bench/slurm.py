"""Fault to drained node: an Xid 79 line written to /dev/kmsg → `sinfo` shows the node drained. Needs root and Slurm.

A private single-node Slurm (munged, slurmctld, slurmd; tests/fixtures/slurm/cluster.py), a real
robustd on the real /dev/kmsg, and robustd-slurm. Each injection names a new GPU; once sinfo shows
the node drained (polled every 5 ms) the condition is acknowledged and robustd-slurm resumes the
node (resume_after 0s), and the next injection waits for it to be idle again. Prints p50/p99/max
over N injections (default 30). Target p99 ≤ 1 s (NHC's default interval is 300 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "fixtures" / "slurm"))

import grpc  # noqa: E402
from _harness import BenchDaemon, kmsg_write, percentile  # noqa: E402
from cluster import AgentProcess, SlurmCluster, missing_programs  # noqa: E402

from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="injections (at least 30 for a p99 worth the name)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/slurm.py needs root (it writes /dev/kmsg and runs slurmctld/slurmd)")
    if missing_programs():
        raise SystemExit(f"Slurm is not installed ({', '.join(missing_programs())}): make deps")
    cluster = SlurmCluster()
    d = None
    agent = None
    try:
        cluster.start()
        d = BenchDaemon({"slurm": {"resume_after": "0s", "max_resumes": 1000}, "log_level": "info"})
        agent = AgentProcess(d.dir / "robustd.yaml", cluster, d.dir / "agent.log")
        agent.start()
        agent.wait_connected()
        stub = pb_grpc.NodeHealthStub(grpc.insecure_channel(d.target))
        latencies = []
        tag = os.getpid() % 32
        for i in range(args.n):
            ready = cluster.wait_for(lambda: cluster.state()[0] == "idle", 30, "idle", fail=False)
            if not ready:
                raise SystemExit(f"the node did not come back to idle: {cluster.state()}\n{agent.log()[-2000:]}")
            where = f"{0x20 + i % 200:02x}:{(tag + i // 200) % 32:02x}"  # a new GPU each time
            sent = time.perf_counter()
            kmsg_write(f"NVRM: Xid (PCI:0000:{where}): 79, pid=1, name=python, GPU has fallen off the bus.")
            while not cluster.state()[0].startswith("drain"):
                if time.perf_counter() - sent > 30:
                    raise SystemExit(f"injection {i}: not drained within 30 s\n{agent.log()[-2000:]}")
                time.sleep(0.005)
            latencies.append(time.perf_counter() - sent)
            for c in stub.GetVerdict(pb.GetVerdictRequest(), timeout=5).conditions:  # ours, and anyone else's
                if c.severity == pb.SEVERITY_CRITICAL:
                    stub.Acknowledge(pb.AcknowledgeRequest(component=c.component, code=c.code, reason="bench"),
                                     timeout=5)
        ms = sorted(x * 1000 for x in latencies)
        print(f"slurm drain (kmsg Xid 79 -> sinfo drained), n={len(ms)}: p50 {percentile(ms, 50):.0f} ms, "
              f"p99 {percentile(ms, 99):.0f} ms, max {ms[-1]:.0f} ms (target p99 <= 1000 ms)")
    finally:
        if agent is not None:
            agent.stop()
        if d is not None:
            d.close()
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    main()
