"""Replay a step's dependency graph under what-if scenarios, vectorised over scenarios, steps and DP ranks.

A scenario says, per (node, DP rank), whether the op keeps its traced duration ("unfixed") or takes the
ideal value of its category ("fixed"). Rules (paper §3.2): an op launches when its dependencies have
ended (no launch delays), compute ends at launch + duration, and a synchronisation unit's ops end at the
latest launch among its members + their transfer duration. Step time = the latest end of the step; every
worker starts the step at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from robustd.stragglers.graph import Graph

_CHUNK_ELEMENTS = 24_000_000  # floats held per batch of scenarios (~190 MB)


@dataclass
class Timeline:
    """Per-op launch and end times of one scenario: [N, S, D] seconds from each step's start."""

    launch: np.ndarray
    end: np.ndarray
    step_time: np.ndarray  # [S]


def replay(g: Graph, unfixed: np.ndarray) -> np.ndarray:
    """Step times [K, S] for K scenarios. unfixed: bool [K, N, D] (or broadcastable [K, N, 1])."""
    k_total = unfixed.shape[0]
    per_scenario = g.nodes * len(g.steps) * g.dp
    chunk = max(1, _CHUNK_ELEMENTS // max(per_scenario, 1))
    ideal = g.ideal_work()
    out = np.empty((k_total, len(g.steps)))
    for k0 in range(0, k_total, chunk):
        end, _ = _run(g, unfixed[k0:k0 + chunk], ideal, keep_launch=False)
        out[k0:k0 + chunk] = end.max(axis=(0, 3))
    return out


def timeline(g: Graph, fixed: bool) -> Timeline:
    """The full replay of the measured (fixed=False) or ideal (fixed=True) scenario."""
    unfixed = np.full((1, g.nodes, 1), not fixed)
    end, launch = _run(g, unfixed, g.ideal_work(), keep_launch=True)
    assert launch is not None
    return Timeline(launch=launch[:, 0], end=end[:, 0], step_time=end[:, 0].max(axis=(0, 2)))


def _run(g: Graph, unfixed: np.ndarray, ideal: np.ndarray, keep_launch: bool) -> tuple[np.ndarray, np.ndarray | None]:
    k = unfixed.shape[0]
    shape = (k, len(g.steps), g.dp)
    end = np.zeros((g.nodes, *shape))
    launch = np.zeros((g.nodes, *shape)) if keep_launch else None
    zero = np.zeros(shape)
    # Unfixed masks per node: [K, 1, D or 1] so they broadcast over steps.
    mask = np.ascontiguousarray(np.moveaxis(unfixed, 1, 0))[:, :, None, :]
    work, deps = g.work, g.deps
    for members, across in g.units:
        if len(members) == 1 and not across:
            m = members[0]
            lm = _latest(end, deps[m], zero)
            if launch is not None:
                launch[m] = lm
            end[m] = lm + np.where(mask[m], work[m], ideal[m])
            continue
        launches = [_latest(end, deps[m], zero) for m in members]
        latest = launches[0] if len(launches) == 1 else np.maximum.reduce(launches)
        if across:
            latest = latest.max(axis=2, keepdims=True)
        for m, lm in zip(members, launches, strict=True):
            if launch is not None:
                launch[m] = lm
            end[m] = latest + np.where(mask[m], work[m], ideal[m])
    return end, launch


def _latest(end: np.ndarray, deps: list[int], zero: np.ndarray) -> np.ndarray:
    if not deps:
        return zero
    if len(deps) == 1:
        return end[deps[0]]
    return np.maximum.reduce([end[d] for d in deps])
