"""`robustctl stragglers`: what-if straggler analysis of a sampled training trace (needs no daemon).

Malformed traces or metadata raise ValueError (robustd.stragglers.OpTraceError is one); robustctl turns
them into exit 64 with the message on one line of stderr. A missing file is an OSError (exit 1).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from robustd.cli import output, render
from robustd.cli.args import AddGlobals, verbs

if TYPE_CHECKING:
    from robustd.stragglers.analysis import Report


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "stragglers_command", add_globals)
    a = verb("analyze", "replay a sampled op trace with and without stragglers: job slowdown, per-step, "
                        "per-op-type and per-worker slowdowns, M_S / M_W and cause hints")
    a.add_argument("--metadata", required=True, metavar="META.yaml",
                   help="job metadata (dp_size, pp_size, tp_size, dsp_size, world_size)")
    a.add_argument("--trace", required=True, metavar="TRACE.parquet", help="one row per operation")
    a.add_argument("--steps", metavar="SPEC", help="steps to analyse, e.g. 3-40 or 5,6,7 (default: all)")
    a.add_argument("--heatmap", metavar="OUT.png", help="write the DP x PP worker-slowdown heatmap")
    a.add_argument("--timeline", metavar="OUT.json", help="write a Perfetto/Chrome timeline of both replays")


def run(args: argparse.Namespace) -> int:
    from robustd.stragglers import analyze_files, heatmap, timeline

    report, graph = analyze_files(args.metadata, args.trace, args.steps)
    if args.heatmap:
        heatmap.write_png(report.worker_matrix, args.heatmap,
                          title=f"{report.name or 'job'}: S = {report.slowdown:.3f}")
    if args.timeline:
        timeline.write(graph, args.timeline)
    if args.json:
        output.out(json.dumps(report.to_json()), exact=True)
    else:
        output.out(text(report, heatmap_path=args.heatmap, timeline_path=args.timeline))
    return 0


def text(r: Report, heatmap_path: str | None = None, timeline_path: str | None = None, top: int = 5) -> str:
    steps = r.steps
    span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    lines = [f"{r.name or 'job'}: DP {r.dp} x PP {r.pp} = {r.dp * r.pp} workers, {len(steps)} steps ({span})",
             f"slowdown S = {r.slowdown:.3f}: {r.measured_time:.3f} s/step replayed vs {r.ideal_time:.3f} s/step "
             f"ideal; {r.wasted_fraction:.1%} of GPU time wasted",
             f"simulation error {r.simulation_error:+.1%} (traced {r.traced_time:.3f} s/step)",
             f"M_S = {r.m_s:.3f} (fix the last stage)   M_W = {r.m_w:.3f} (fix the slowest {len(r.worst)} "
             f"worker{'s' if len(r.worst) != 1 else ''})",
             "causes:"]
    lines += [f"  {c.kind}: {c.evidence}" for c in r.causes]
    lines.append("slowest workers (min of DP-rank and PP-rank slowdowns):")
    lines += [f"  DP {w.dp_rank} PP {w.pp_rank}: {w.slowdown:.3f}" for w in r.workers[:top]]
    lines.append("op types (S_t, only that type straggling):")
    lines += [f"  {k}: {v:.3f}" for k, v in list(r.op_types.items())[:top]]
    worst_steps = sorted(r.step_slowdown.items(), key=lambda kv: -kv[1])[:top]
    lines.append("slowest steps: " + ", ".join(f"{s} {v:.3f}" for s, v in worst_steps))
    if heatmap_path:
        lines.append(f"heatmap: {heatmap_path}")
    if timeline_path:
        lines.append(f"timeline: {timeline_path}")
    return render.lines(lines)  # job name, op types and cause evidence come from the trace's files
