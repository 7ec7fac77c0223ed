"""Straggler what-if analysis of sampled training traces (ByteDance, OSDI '25; papers.md Part B).

load → graph.build → whatif.replay under what-if scenarios → analysis.Report (slowdown, attribution,
cause hints) → heatmap PNG / timeline JSON. No torch; numpy and pyarrow only (matplotlib for the PNG).
"""

from __future__ import annotations

from pathlib import Path

from robustd.stragglers.analysis import Report, analyze
from robustd.stragglers.graph import Graph, build
from robustd.stragglers.optrace import Meta, OpTrace, OpTraceError, load_metadata, load_op_trace

__all__ = ["Graph", "Meta", "Report", "OpTrace", "OpTraceError", "analyze", "analyze_files", "build", "load_metadata",
           "load_op_trace"]


def analyze_files(metadata: str | Path, trace: str | Path, steps: str | None = None) -> tuple[Report, Graph]:
    """Load, validate and analyse one trace. OSError for unreadable files; OpTraceError for bad content."""
    meta = load_metadata(metadata)
    t = load_op_trace(trace, meta, steps)
    g = build(t)
    return analyze(t, g), g
