"""The daemon's own cost: CPU % of one core and RSS, sampled over 60 s.

Two configurations, one after the other in the same run:
- `kernel`: the kernel-log watcher alone (the spine);
- `all`: every check at 1 s on an emulated 8-GPU node (NVML emulator) with 8 InfiniBand
  ports (the ib-8port fixture tree) plus this host's real links, PCIe devices, sensors and disks;
  the GPU check's NVML event watcher is on (one event set over the 8 GPUs, a thread waiting on it
  in bounded waits; the emulator's waiter sleeps on inotify for its state file, as a driver sleeps).
Targets: ≤ 1 % CPU and ≤ 80 MB RSS. Use --seconds to shorten a trial run.

With `all`, Debian's prometheus-node-exporter (when installed: `apt install prometheus-node-exporter`)
runs beside robustd for the same seconds, and both /metrics endpoints are scraped every second, as a
Prometheus would: the reference an operator already pays for on every host, side by side in one run
(issue 15's budget: robustd with every check at 1 s costs no more CPU than node_exporter).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
from _harness import REPO, BenchDaemon, percentile  # noqa: E402

from checks import BUILTIN  # noqa: E402
from robustd.nvmlemu import state as emu  # noqa: E402


def all_checks(tmp: Path) -> dict[str, Any]:
    ib = tmp / "ib"
    shutil.copytree(REPO / "tests" / "fixtures" / "sys" / "ib-8port", ib)
    nvml = tmp / "nvml.state"
    emu.save(str(nvml), emu.healthy_node(8))
    return {"checks": {"kernel": {"lookback": "0s"},
                       "nic": {"interval": "1s", "ib_root": str(ib / "class" / "infiniband")},
                       "gpu": {"interval": "1s", "backend": "emulator", "emulator_state": str(nvml),
                               "expected_gpus": 8},
                       "pcie": {"interval": "1s"}, "thermal": {"interval": "1s"}, "host": {"interval": "1s"}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_every_second(url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                r.read()
        except OSError:
            pass
        stop.wait(1.0)


class Sampled:
    """CPU seconds and RSS of one process over the measured period."""

    def __init__(self, pid: int):
        self.p = psutil.Process(pid)
        self.rss: list[float] = []
        self.c0 = 0.0

    def start(self) -> None:
        self.c0 = sum(self.p.cpu_times()[:2])

    def sample(self) -> None:
        self.rss.append(self.p.memory_info().rss / 2**20)

    def cpu(self, seconds: float) -> float:
        return (sum(self.p.cpu_times()[:2]) - self.c0) / seconds * 100


def node_exporter(port: int) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if exe is None:
        return None
    return subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def measure(name: str, config: dict[str, Any], seconds: float, note: str = "", compare: bool = False) -> None:
    port = free_port()
    config = {**config, "metrics": {"address": f"127.0.0.1:{port}"}} if compare else config
    d = BenchDaemon(config)
    ne_port = free_port()
    ne = node_exporter(ne_port) if compare else None
    stop = threading.Event()
    scrapers = []
    if compare:
        urls = [f"http://127.0.0.1:{port}/metrics"] + ([f"http://127.0.0.1:{ne_port}/metrics"] if ne else [])
        scrapers = [threading.Thread(target=scrape_every_second, args=(u, stop), daemon=True) for u in urls]
    try:
        procs = [Sampled(d.proc.pid)] + ([Sampled(ne.pid)] if ne else [])
        for t in scrapers:
            t.start()
        time.sleep(3.0)  # let start-up (and the emulator build) settle
        t0 = time.monotonic()
        for s in procs:
            s.start()
        while time.monotonic() - t0 < seconds:
            for s in procs:
                s.sample()
            time.sleep(1.0)
        elapsed = time.monotonic() - t0
        cpu = procs[0].cpu(elapsed)
        rss = procs[0].rss
        print(f"overhead [{name}]: {seconds:.0f}s, {procs[0].p.num_threads()} threads{note}"
              f"{', /metrics scraped every 1 s' if compare else ''}")
        print(f"  CPU {cpu:.2f}% of one core (target <= 1%)   "
              f"RSS p50 {percentile(rss, 50):.1f} MB, max {max(rss):.1f} MB (target <= 80 MB)")
        if compare and ne is None:
            print("  node_exporter: not installed (apt install prometheus-node-exporter); no side-by-side figure")
        elif compare:
            ne_cpu = procs[1].cpu(elapsed)
            print(f"  prometheus-node-exporter, same {seconds:.0f}s, scraped every 1 s: CPU {ne_cpu:.2f}% of one core, "
                  f"RSS p50 {percentile(procs[1].rss, 50):.1f} MB; robustd/node_exporter CPU = "
                  f"{cpu / ne_cpu if ne_cpu else float('inf'):.2f}x (target <= 1x)")
    finally:
        stop.set()
        if ne is not None:
            ne.terminate()
            ne.wait(5)
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--only", choices=["kernel", "all"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rdo-"))
    try:
        if args.only in (None, "kernel"):
            measure("kernel", {"checks": {"kernel": {"lookback": "0s"},
                                          **{c.name: {"enabled": False} for c in BUILTIN if c.name != "kernel"}}},
                    args.seconds)
        if args.only in (None, "all"):
            measure("all", all_checks(tmp), args.seconds, note=", NVML event watcher on (8 GPUs)", compare=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
