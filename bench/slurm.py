"""Fault to drained node: an Xid 79 line written to /dev/kmsg → `sinfo` shows the node drained. Needs root and Slurm.

`--ctld`: a failed 3-node job → its culprit drained and the other nodes released, by the controller's
EpilogSlurmctld (`robustctl slurm epilog-ctld`) on the three-node Slurm of tests/fixtures/slurm/multi.py
(each slurmd and robustd in its own network namespace, mutual TLS), one node's link behind an 8 mbit token
bucket. Timed from the first time `scontrol show job` shows the job no longer RUNNING (its end) until the
culprit is drained with the diagnosis's reason and the two others are idle; p50/max over `--runs` (5).

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

NCCL = ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
        "error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library call "
        "failed or device error.\n")


def ctld(runs: int) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from multi import MultiCluster

    cluster = MultiCluster(3)
    cluster.node_config = {"slurm": {"ctld": {"epilog": True}}}
    try:
        cluster.start()
        cluster.enable_ctld_hook("epilog-ctld", cluster.ctld_command("epilog-ctld", cluster.ctld_config()))
        cluster.enable_node_hook("epilog")
        text = cluster.root / "jobs" / "nccl.txt"
        text.write_text(NCCL)
        took, culprit = [], "n2"
        for i in range(runs):
            cluster.slow(culprit)
            job = cluster.submit(f"cat {text} >&2; exit 1", nodes=3)
            cluster.wait_job(job, 60, states=("COMPLETING", "FAILED", "COMPLETED"))
            ended = time.perf_counter()

            def settled(job: str = job) -> bool:
                st = cluster.states()
                return (st[culprit][1].startswith(f"robustd: job {job} diagnosis FAIL")
                        and all(st[n] == ("idle", "") for n in cluster.nodes if n != culprit))

            if not cluster.wait_for(settled, 240, "settled", fail=False, interval=0.1):
                raise SystemExit(f"run {i}: not settled: {cluster.states()}\n{cluster.hook_log('epilog-ctld')[-3000:]}")
            took.append(time.perf_counter() - ended)
            cluster.wait_job(job, 60)
            cluster.clear_faults()
            cluster.resume(culprit)
            cluster.wait_idle()
            print(f"run {i + 1}: job {job}: {took[-1]:.1f} s", flush=True)
        s = sorted(took)
        print(f"slurm epilog-ctld (failed 3-node job end -> culprit drained, others released), n={len(s)}: "
              f"p50 {percentile(s, 50):.1f} s, max {s[-1]:.1f} s")
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="injections (at least 30 for a p99 worth the name)")
    ap.add_argument("--ctld", action="store_true", help="time the controller hook after a failed 3-node job")
    ap.add_argument("--runs", type=int, default=5, help="with --ctld: failed jobs (default 5)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/slurm.py needs root (it writes /dev/kmsg and runs slurmctld/slurmd)")
    if missing_programs():
        raise SystemExit(f"Slurm is not installed ({', '.join(missing_programs())}): make deps")
    if args.ctld:
        ctld(args.runs)
        return
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
