"""Chrome / Perfetto trace JSON of the measured and the ideal replays (open in ui.perfetto.dev).

One process per (replay, DP rank), one thread per (PP rank, stream: compute, pp-comm, dp-comm); steps
are laid end to end. Times are in microseconds; a communication op spans launch to end (waiting
included) and its args give the transfer duration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from robustd.stragglers import graph as graphmod
from robustd.stragglers import whatif
from robustd.stragglers.graph import Graph
from robustd.stragglers.optrace import OP_TYPES

STREAMS = ("compute", "pp-comm", "dp-comm")


def _stream(t: int) -> int:
    if t in graphmod.COMPUTE or t in graphmod.LOCAL_COMPUTE:
        return 0
    if t in graphmod.SENDS or t in graphmod.RECVS:
        return 1
    return 2


def chunks(g: Graph) -> Iterator[str]:
    """The JSON text of the trace, in pieces (events are formatted in bulk: a replay has one per op)."""
    yield '{"displayTimeUnit":"ms","traceEvents":['
    first = True
    ideal_work = g.ideal_work()
    for r, (label, fixed) in enumerate((("measured", False), ("ideal", True))):
        tl = whatif.timeline(g, fixed)
        offsets = np.concatenate([[0.0], np.cumsum(tl.step_time)[:-1]])
        work = ideal_work if fixed else g.work
        meta = []
        for d in range(g.dp):
            pid = r * g.dp + d + 1
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{label} replay, DP {d}"}})
            for p in range(g.pp):
                for s, stream in enumerate(STREAMS):
                    meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": p * len(STREAMS) + s,
                                 "args": {"name": f"PP {p} {stream}"}})
        yield ("" if first else ",") + ",".join(json.dumps(m, separators=(",", ":")) for m in meta)
        first = False
        for n in range(g.nodes):
            t = int(g.optype[n])
            tid = int(g.stage[n]) * len(STREAMS) + _stream(t)
            si, d = np.nonzero(g.present[n])
            if not len(si):
                continue
            ts = ((offsets[si] + tl.launch[n, si, d]) * 1e6).round(3).tolist()
            dur = (np.maximum(tl.end[n, si, d] - tl.launch[n, si, d], 0.0) * 1e6).round(3).tolist()
            wk = (work[n, si, d] * 1e6).round(3).tolist()
            pids = (r * g.dp + d + 1).tolist()
            steps = g.steps[si].tolist()
            head = f',{{"ph":"X","name":"{OP_TYPES[t]}","tid":{tid},"pid":'
            tail = f',"seq":{int(g.seq[n])},"work_us":'
            yield "".join(f'{head}{pid},"ts":{a},"dur":{b},"args":{{"step":{st}{tail}{w}}}}}'
                          for pid, a, b, st, w in zip(pids, ts, dur, steps, wk, strict=True))
    yield "]}"


def write(g: Graph, path: str | Path) -> None:
    with open(path, "w") as f:
        for piece in chunks(g):
            f.write(piece)
