"""Straggler what-if analysis at scale: wall time and peak RSS of `robustctl stragglers analyze` (load,
validate, build the graph, every what-if replay, cause hints) on the artifact's AR trace (dp4 pp4, 44 steps,
117k ops) and on a synthetic 1F1B job of 1,024 workers (dp 128 x pp 8, 16 microbatches) x 20 steps with one
slow worker. Each case runs in a fresh child process so its peak RSS is its own.
Targets: AR <= 3 s, 1,024 workers <= 60 s, RSS <= 2 GB."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

AR = REPO / "tests" / "fixtures" / "stragglers"


def child(meta: str, trace: str, heatmap: str | None) -> None:
    """Run the analysis in this process and print one JSON line of figures."""
    from robustd.stragglers import analyze_files
    from robustd.stragglers import heatmap as hm

    t0 = time.perf_counter()
    report, graph = analyze_files(meta, trace)
    if heatmap:
        hm.write_png(report.worker_matrix, heatmap)
    wall = time.perf_counter() - t0
    top = report.workers[0]
    print(json.dumps({"wall_s": wall, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "slowdown": report.slowdown, "cause": report.causes[0].kind,
                      "top": f"DP {top.dp_rank} PP {top.pp_rank}", "nodes": graph.nodes,
                      "ops": int(graph.present.sum())}))


def measure(label: str, meta: Path, trace: Path, heatmap: Path | None, target_s: float, runs: int) -> None:
    figures = []
    for _ in range(runs):
        cmd = [sys.executable, __file__, "--child", str(meta), str(trace)] + ([str(heatmap)] if heatmap else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
        figures.append(json.loads(out.strip().splitlines()[-1]))
    best = min(figures, key=lambda f: f["wall_s"])
    rss = max(f["rss_mb"] for f in figures)
    print(f"{label}: ops={best['ops']} nodes/step={best['nodes']} runs={runs} wall={best['wall_s']:.2f}s "
          f"(target <= {target_s:g} s) peak_rss={rss:.0f}MB (target <= 2048 MB) S={best['slowdown']:.3f} "
          f"cause={best['cause']} slowest={best['top']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, *([None] * (3 - len(args.child))))
        return
    with tempfile.TemporaryDirectory(prefix="rdb-stragglers-") as tmp:
        measure("AR (dp4 pp4, 44 steps)", AR / "meta-AR.yaml", AR / "trace-AR.parquet", Path(tmp) / "ar.png", 3,
                args.runs)
        from robustd.stragglers import synth

        job = synth.Job(dp=128, pp=8, microbatches=16, steps=20, slow_worker=(77, 5, 1.3))
        t0 = time.perf_counter()
        synth.write(job, Path(tmp) / "big.parquet", Path(tmp) / "big.yaml")
        print(f"synthetic trace: {job.dp * job.pp} workers x {job.steps} steps, "
              f"{os.path.getsize(Path(tmp) / 'big.parquet') / 1e6:.1f} MB parquet, "
              f"generated in {time.perf_counter() - t0:.1f}s", flush=True)
        measure("synthetic (dp128 pp8 = 1,024 workers, 20 steps)", Path(tmp) / "big.yaml", Path(tmp) / "big.parquet",
                Path(tmp) / "big.png", 60, max(1, args.runs // 3))


if __name__ == "__main__":
    main()
