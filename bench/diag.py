"""Stop-time diagnostics on CPU: wall time of the `standard` level (all-to-all + MiniGPT, no EUD)
through the daemon's API with 4 gloo ranks, then the harness's all-to-all bandwidth against a
bare torch.distributed loop on the same payload (bench/diag_collectives.py), in the same run.

Targets: `standard` ≤ 60 s on CPU; harness/bare bandwidth ratio ≥ 0.9.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from _harness import BenchDaemon  # noqa: E402

from checks import BUILTIN  # noqa: E402
from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402


def main() -> None:
    checks = {c.name: {"enabled": False} for c in BUILTIN}
    d = BenchDaemon({"checks": checks, "diagnostics": {"collectives": {"cpu_ranks": 4}}})
    try:
        with grpc.insecure_channel(d.target) as ch:
            t0 = time.perf_counter()
            msgs = list(pb_grpc.DiagnosticsStub(ch).Run(pb.RunRequest(level="standard"), timeout=600))
            wall = time.perf_counter() - t0
        report = msgs[-1].report
        print(f"diag standard (all_to_all + minigpt, 4 gloo ranks on CPU): {pb.Outcome.Name(report.outcome)} "
              f"in {wall:.1f} s (target <= 60 s)")
        for test in report.tests:
            rows = [x for x in report.results if x.test == test]
            figs = {k: v for x in rows for k, v in x.figures.items()}
            print(f"  {test}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(figs.items())))
    finally:
        d.close()
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "diag_collectives.py")], check=False)


if __name__ == "__main__":
    main()
