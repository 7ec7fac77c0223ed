"""Fault to node condition: an Xid 79 line written to /dev/kmsg → `RobustdGPUProblem` True on the API server.

A real robustd on the real /dev/kmsg, robustd-k8s as a child process with the official kubernetes
client, and the API-server stand-in (tests/fakes/kube_apiserver.py) in this process, whose stored Node
is polled every 2 ms. Each injection names a new GPU; once the condition is True it is acknowledged and
the next injection waits for False. Prints p50/p99/max over N injections (default 30; target p99 ≤ 1 s),
robustd-k8s's CPU and RSS while idle, and the writes per node per hour at steady state (a simulated
hour of the reconciler at the default 5 min heartbeat, through the real client and HTTP). Needs root.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import grpc  # noqa: E402
import psutil  # noqa: E402
from _harness import REPO, BenchDaemon, kmsg_write, percentile  # noqa: E402
from fakes.kube_apiserver import KubeAPIServer  # noqa: E402

from robustd.adapters.common.model import Cond, Table  # noqa: E402
from robustd.adapters.k8s.config import K8sConfig  # noqa: E402
from robustd.adapters.k8s.kube import Kube, api_client  # noqa: E402
from robustd.adapters.k8s.reconciler import Reconciler  # noqa: E402
from robustd.adapters.k8s.state import K8sState, K8sStateFile  # noqa: E402
from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402
from robustd.model import Action, Severity  # noqa: E402

NODE = "bench-gpu-1"


def status(server: KubeAPIServer) -> dict[str, str]:
    c = server.condition(NODE, "RobustdGPUProblem")
    return c or {}


def writes_per_hour(server: KubeAPIServer, tmp: Path) -> int:
    """A simulated hour with nothing changing, a step each second, the default config."""
    t = [1_800_000_000.0]
    server.add_node("quiet-node")
    kube = Kube(api_client(str(server.kubeconfig(tmp / "quiet.kubeconfig"))), 5.0)
    r = Reconciler(K8sConfig(), kube, "quiet-node", K8sStateFile(str(tmp / "quiet.json")), K8sState(),
                   clock=lambda: t[0], rng=random.Random())
    link = Cond("nic/eth0", "NIC_LINK_DOWN", Severity.WARNING, Action.NONE, 1)
    table = Table(seq=1, conditions={link.key: link})
    r.step(table)  # the write at start
    before = len(server.requests("PATCH", "/nodes/quiet-node/status"))
    for _ in range(3600):
        t[0] += 1
        r.step(table)
    return len(server.requests("PATCH", "/nodes/quiet-node/status")) - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="injections (at least 30 for a p99 worth the name)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle to measure CPU and RSS over")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/k8s.py needs root (it writes /dev/kmsg)")
    tmp = Path(tempfile.mkdtemp(prefix="rdk-", dir="/tmp"))
    server = KubeAPIServer().start()
    server.add_node(NODE)
    d = BenchDaemon({"k8s": {"node_name": NODE}, "log_level": "info"})
    kubeconfig = server.kubeconfig(tmp / "kubeconfig")
    log = open(tmp / "agent.log", "wb")  # noqa: SIM115 - held for the child's lifetime
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    agent = subprocess.Popen([sys.executable, "-m", "robustd.adapters.k8s.agent", "--config",
                              str(d.dir / "robustd.yaml"), "--kubeconfig", str(kubeconfig)],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 30
        while status(server).get("status") != "False":
            if time.monotonic() > deadline or agent.poll() is not None:
                raise SystemExit(f"robustd-k8s did not write the node:\n{(tmp / 'agent.log').read_text()[-2000:]}")
            time.sleep(0.05)
        stub = pb_grpc.NodeHealthStub(grpc.insecure_channel(d.target))
        latencies = []
        tag = os.getpid() % 32
        for i in range(args.n):
            where = f"{0x20 + i % 200:02x}:{(tag + i // 200) % 32:02x}"  # a new GPU each time
            comp = f"gpu/0000:{where}.0"
            sent = time.perf_counter()
            kmsg_write(f"NVRM: Xid (PCI:0000:{where}): 79, pid=1, name=python, GPU has fallen off the bus.")
            while not (status(server).get("status") == "True" and comp in status(server).get("message", "")):
                if time.perf_counter() - sent > 30:
                    raise SystemExit(f"injection {i}: no condition within 30 s\n"
                                     f"{(tmp / 'agent.log').read_text()[-2000:]}")
                time.sleep(0.002)
            latencies.append(time.perf_counter() - sent)
            for c in stub.GetVerdict(pb.GetVerdictRequest(), timeout=5).conditions:  # ours, and anyone else's
                stub.Acknowledge(pb.AcknowledgeRequest(component=c.component, code=c.code, reason="bench"),
                                 timeout=5)
            deadline = time.monotonic() + 30
            while status(server).get("status") != "False" and time.monotonic() < deadline:
                time.sleep(0.01)
        ms = sorted(x * 1000 for x in latencies)
        print(f"k8s condition (kmsg Xid 79 -> RobustdGPUProblem True on the API server), n={len(ms)}: "
              f"p50 {percentile(ms, 50):.0f} ms, p99 {percentile(ms, 99):.0f} ms, max {ms[-1]:.0f} ms "
              "(target p99 <= 1000 ms)")
        p = psutil.Process(agent.pid)
        p.cpu_percent()
        time.sleep(args.idle)
        print(f"robustd-k8s idle over {args.idle:g} s: CPU {p.cpu_percent():.2f} %, "
              f"RSS {p.memory_info().rss / 2**20:.1f} MiB")
        n = writes_per_hour(server, tmp)
        print(f"writes per node per hour at steady state (heartbeat 5m + up to 10% jitter, simulated hour): {n} "
              f"(bound 3600/300 = 12); 10,000 nodes: {n * 10000 / 3600:.1f} writes/s")
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
        log.close()
        d.close()
        server.stop()


if __name__ == "__main__":
    main()
