"""The daemon's own cost: CPU % of one core and RSS, sampled over 60 s.

Two configurations, one after the other in the same run:
- `kernel`: the kernel-log watcher alone (the spine);
- `all`: every check at 1 s on an emulated 8-GPU node (NVML emulator) with 8 InfiniBand
  ports (the ib-8port fixture tree) plus this host's real links, PCIe devices, sensors and disks;
  the GPU check's NVML event watcher is on (one event set over the 8 GPUs, a thread waiting on it
  in bounded waits; the emulator's waiter sleeps on inotify for its state file, as a driver sleeps).
Targets: ≤ 1 % CPU and ≤ 80 MB RSS. Use --seconds to shorten a trial run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
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


def measure(name: str, config: dict[str, Any], seconds: float, note: str = "") -> None:
    d = BenchDaemon(config)
    try:
        p = psutil.Process(d.proc.pid)
        time.sleep(3.0)  # let start-up (and the emulator build) settle
        t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
        rss: list[float] = []
        while time.monotonic() - t0 < seconds:
            rss.append(p.memory_info().rss / 2**20)
            time.sleep(1.0)
        cpu = (sum(p.cpu_times()[:2]) - c0) / (time.monotonic() - t0) * 100
        print(f"overhead [{name}]: {seconds:.0f}s, {p.num_threads()} threads{note}")
        print(f"  CPU {cpu:.2f}% of one core (target <= 1%)   "
              f"RSS p50 {percentile(rss, 50):.1f} MB, max {max(rss):.1f} MB (target <= 80 MB)")
    finally:
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
            measure("all", all_checks(tmp), args.seconds, note=", NVML event watcher on (8 GPUs)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
