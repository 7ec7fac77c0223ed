"""The daemon's own cost with its default checks: CPU % of one core and RSS, sampled over 60 s.

Target ≤ 1 % CPU and ≤ 80 MB RSS. Use --seconds to shorten a trial run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
from _harness import BenchDaemon, percentile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    d = BenchDaemon()
    try:
        p = psutil.Process(d.proc.pid)
        time.sleep(2.0)  # let start-up settle
        t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
        rss: list[float] = []
        while time.monotonic() - t0 < args.seconds:
            rss.append(p.memory_info().rss / 2**20)
            time.sleep(1.0)
        cpu = (sum(p.cpu_times()[:2]) - c0) / (time.monotonic() - t0) * 100
        print(f"overhead: {args.seconds:.0f}s idle with default checks (kernel watcher), {p.num_threads()} threads")
        print(f"  CPU {cpu:.2f}% of one core (target <= 1%)")
        print(f"  RSS p50 {percentile(rss, 50):.1f} MB  max {max(rss):.1f} MB (target <= 80 MB)")
    finally:
        d.close()


if __name__ == "__main__":
    main()
