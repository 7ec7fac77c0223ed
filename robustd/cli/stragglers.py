"""`robustctl stragglers`: what-if straggler analysis of a sampled training trace (needs no daemon).

`analyze` reads one trace (--metadata/--trace) or a recorder's trace directory (--trace-dir); `watch`
follows a trace directory while the job runs (robustd.stragglers.watch) and exits 1 on an alert.
Malformed traces or metadata raise ValueError (robustd.stragglers.OpTraceError is one); robustctl turns
them into exit 64 with the message on one line of stderr. A missing file is an OSError (exit 2, exitcodes.UNREADABLE).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from robustd.cli import output, render
from robustd.cli.args import AddGlobals, argument_type, positive, verbs, whole_number

if TYPE_CHECKING:
    from robustd.stragglers.analysis import Report


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "stragglers_command", add_globals)
    a = verb("analyze", "replay a sampled op trace with and without stragglers: job slowdown, per-step, "
                        "per-op-type and per-worker slowdowns, M_S / M_W and cause hints")
    a.add_argument("--metadata", metavar="META.yaml",
                   help="job metadata (dp_size, pp_size, tp_size, dsp_size, world_size)")
    a.add_argument("--trace", metavar="TRACE.parquet", help="one row per operation")
    a.add_argument("--trace-dir", metavar="DIR", help="a recorder's directory: metadata.yaml and per-rank shards "
                                                     "(instead of --metadata/--trace; complete windows only)")
    a.add_argument("--steps", metavar="SPEC", help="steps to analyse, e.g. 3-40 or 5,6,7 (default: all)")
    a.add_argument("--heatmap", metavar="OUT.png", help="write the DP x PP worker-slowdown heatmap")
    a.add_argument("--timeline", metavar="OUT.json", help="write a Perfetto/Chrome timeline of both replays")
    w = verb("watch", "follow a recorder's trace directory while the job runs: one line per window (S, wasted GPU "
                      "time, first cause, slowest workers), the heatmap rewritten; exit 1 on an alert")
    w.add_argument("dir", metavar="DIR", help="the trace directory the job's recorders write")
    w.add_argument("--alert-windows", type=whole_number(1), default=3, metavar="N",
                   help="alert when S stays above --alert-slowdown for N consecutive windows (default 3)")
    w.add_argument("--alert-slowdown", type=_slowdown, default=1.1, metavar="S",
                   help="the slowdown above which a window straggles (default 1.1, the study's line)")
    w.add_argument("--heatmap", metavar="OUT.png", help="rewrite this heatmap per window (default DIR/heatmap.png)")
    w.add_argument("--poll", type=positive("--poll"), default=1.0, metavar="DURATION",
                   help="how often to look for new shards (default 1s)")
    w.add_argument("--idle-timeout", type=positive("--idle-timeout"), default=600.0, metavar="DURATION",
                   help="stop when no new window appears for this long (default 10m)")
    w.add_argument("--once", action="store_true", help="report the windows already there and exit")


def _parse_slowdown(text: str) -> float:
    v = float(text)
    if not v >= 1.0 or v == float("inf"):
        raise ValueError(f"{text!r} must be a slowdown of at least 1.0 (S = T / T_ideal)")
    return v


_slowdown = argument_type(_parse_slowdown, "slowdown")




def run(args: argparse.Namespace) -> int:
    if args.stragglers_command == "watch":
        return run_watch(args)
    from robustd.stragglers import analyze_files, heatmap, timeline

    if args.trace_dir:
        if args.metadata or args.trace:
            raise ValueError("analyze: give either --trace-dir or --metadata and --trace, not both")
        from robustd.stragglers import analyze, build, tracedir

        t = tracedir.load(args.trace_dir, args.steps)
        graph = build(t)
        report = analyze(t, graph)
    elif args.metadata and args.trace:
        report, graph = analyze_files(args.metadata, args.trace, args.steps)
    else:
        raise ValueError("analyze: give --trace-dir DIR, or --metadata META.yaml and --trace TRACE.parquet")
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


def run_watch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from robustd.stragglers import watch

    directory = Path(args.dir)
    w = watch.Watch(directory=directory, alert_windows=args.alert_windows, alert_slowdown=args.alert_slowdown,
                    heatmap_path=Path(args.heatmap) if args.heatmap else directory / "heatmap.png")

    def emit(win: watch.Window, alert: str | None) -> None:
        if args.json:
            ok = output.out(json.dumps({**win.to_json(), **({"alert": alert} if alert else {})}), exact=True)
        else:
            ok = output.out(render.lines([win.line()] + ([alert] if alert else [])))
        if not ok:
            raise BrokenPipeError("stdout's reader is gone")  # nobody reads the watch: stop it

    code, closing = watch.follow(w, emit, poll_s=args.poll, idle_timeout=args.idle_timeout, once=args.once)
    if closing and not args.json:
        output.out(closing)
    return code


def text(r: Report, heatmap_path: str | None = None, timeline_path: str | None = None, top: int = 5) -> str:
    from robustd.stragglers.analysis import SIM_ERROR_CUTOFF, STUDY_DISCARD

    steps = r.steps
    span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    lines = [f"{r.name or 'job'}: DP {r.dp} x PP {r.pp} = {r.dp * r.pp} workers, {len(steps)} steps ({span})",
             f"slowdown S = {r.slowdown:.3f}: {r.measured_time:.3f} s/step replayed vs {r.ideal_time:.3f} s/step "
             f"ideal; {r.wasted_fraction:.1%} of GPU time wasted",
             f"simulation error {r.simulation_error:+.1%} (traced {r.traced_time:.3f} s/step)"]
    if r.trusted and r.simulation_error > STUDY_DISCARD:
        lines.append(f"  above the study's {STUDY_DISCARD:.0%} bar but under the {SIM_ERROR_CUTOFF:.0%} cut-off: "
                     f"time outside the traced ops (launch delays; on a CPU job timed by thread CPU time, waiting "
                     f"for a core), which the replay leaves out of T and T_ideal alike")
    if r.trusted:
        lines.append(f"M_S = {r.m_s:.3f} (fix the last stage)   M_W = {r.m_w:.3f} (fix the slowest {len(r.worst)} "
                     f"worker{'s' if len(r.worst) != 1 else ''})")
        if r.m_s < 0:
            lines.append("  M_S < 0: fixing the last stage to the ideal makes the replay slower: the last stage is "
                         "faster than the ideal (the mean over all workers, the slow ones included)")
        if r.m_w < 0:
            lines.append("  M_W < 0: fixing the slowest workers to the ideal makes the replay slower: they are not "
                         "what holds the job back")
    else:
        lines.append(f"not trusted: {r.trust_reason}")
    lines.append("causes:")
    lines += [f"  {c.kind}: {c.evidence}" for c in r.causes]
    lines.append("slowest workers (min of DP-rank and PP-rank slowdowns):")
    lines += [f"  DP {w.dp_rank} PP {w.pp_rank}: {w.slowdown:.3f}" for w in r.workers[:top]]
    if r.workers and r.workers[-1].slowdown < 1.0:
        fast = ", ".join(f"DP {w.dp_rank} PP {w.pp_rank} {w.slowdown:.2f}" for w in r.workers if w.slowdown < 1.0)
        lines.append(f"  below 1 ({fast}): faster than the ideal, which is the mean over all workers, the slow "
                     f"ones included")
    lines.append("op types (S_t, only that type straggling):")
    lines += [f"  {k}: {v:.3f}" for k, v in list(r.op_types.items())[:top]]
    worst_steps = sorted(r.step_slowdown.items(), key=lambda kv: -kv[1])[:top]
    lines.append("slowest steps: " + ", ".join(f"{s} {v:.3f}" for s, v in worst_steps))
    if heatmap_path:
        lines.append(f"heatmap: {heatmap_path}")
    if timeline_path:
        lines.append(f"timeline: {timeline_path}")
    return render.lines(lines)  # job name, op types and cause evidence come from the trace's files
