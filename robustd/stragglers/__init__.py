"""Straggler what-if analysis of sampled training traces (ByteDance, OSDI '25; papers.md Part B).

load → graph.build → sim.replay under what-if scenarios → analysis.Report (slowdown, attribution,
cause hints) → heatmap PNG / timeline JSON. No torch; numpy and pyarrow only (matplotlib for the PNG).
"""

from __future__ import annotations

from pathlib import Path

from robustd.stragglers.analysis import Report, analyze
from robustd.stragglers.graph import Graph, build
from robustd.stragglers.trace import Meta, Trace, TraceError, load_metadata, load_trace

__all__ = ["Graph", "Meta", "Report", "Trace", "TraceError", "analyze", "analyze_files", "build", "load_metadata",
           "load_trace"]


def analyze_files(metadata: str | Path, trace: str | Path, steps: str | None = None) -> tuple[Report, Graph]:
    """Load, validate and analyse one trace. OSError for unreadable files; TraceError for bad content."""
    meta = load_metadata(metadata)
    t = load_trace(trace, meta, steps)
    g = build(t)
    return analyze(t, g), g
