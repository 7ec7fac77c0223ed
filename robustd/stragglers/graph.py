"""The operation dependency graph of one training step (Megatron-LM 1F1B), rebuilt from a trace.

All steps and all DP ranks of a stage run the same schedule, so the graph is a template of nodes, one
per (PP stage, op type, seq_id), and every per-op quantity is a tensor [node, step, DP rank]. A worker
runs:

- one launch chain: compute (forward, backward, gc, optimizer) and the blocking collectives, in the
  order they were launched (Megatron issues them from one thread and waits for each);
- four pipeline streams (forward/backward send/recv), each in launch order; a send depends on the
  compute that produced its tensor (the latest compute of its direction before it), and the next
  compute of a recv's direction depends on the recv.

Synchronisation (a unit of the graph): a P2P pair (send on stage p, recv on stage p±1, matched by their
order within the step), a DP collective (params all-gather, grads reduce-scatter, separate all-reduce:
the stage's DP ranks), the embedding all-reduce (first and last stage, same DP rank), the clip-grad
all-reduce (every worker). A unit's ops start transferring when every member has launched:
end = max(member launches) + transfer duration. The layernorm all-reduce runs in the (untraced) TP
group, so it is a local op.

Transfer duration (what a communication op would take without waiting for peers) = traced end −
latest traced start of the unit's members. A pipeline pair's two sides may each be batched with
another transfer (Megatron's send_forward_recv_backward), so its end is taken as the earlier of the
two sides' ends.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from robustd.stragglers.optrace import OP_TYPES, OpTrace, OpTraceError

T = {name: i for i, name in enumerate(OP_TYPES)}
FWD, BWD = 0, 1
COMPUTE = {T["forward-compute"]: FWD, T["backward-compute"]: BWD}
LOCAL_COMPUTE = {T["gc"], T["optimizer"]}
SENDS = {T["forward-send"]: FWD, T["backward-send"]: BWD}
RECVS = {T["forward-recv"]: FWD, T["backward-recv"]: BWD}
DP_COLLECTIVES = {T["params-all-gather"], T["grads-reduce-scatter"], T["separate-grads-all-reduce"]}

# Op categories for ideal values and the per-op-type slowdown (sends and recvs of a direction together).
CATEGORIES = (
    "forward-compute",
    "backward-compute",
    "forward-pp-comm",
    "backward-pp-comm",
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    "optimizer",
    "gc",
)
_CAT_OF_TYPE = np.array([CATEGORIES.index({"forward-send": "forward-pp-comm", "forward-recv": "forward-pp-comm",
                                           "backward-send": "backward-pp-comm",
                                           "backward-recv": "backward-pp-comm"}.get(n, n)) for n in OP_TYPES])
COMPUTE_CATEGORIES = {CATEGORIES.index(c) for c in ("forward-compute", "backward-compute", "optimizer", "gc")}


@dataclass
class Graph:
    steps: np.ndarray  # [S] step ids
    dp: int
    pp: int
    stage: np.ndarray  # [N] PP rank of each node
    optype: np.ndarray  # [N] index into OP_TYPES
    seq: np.ndarray  # [N] seq_id
    category: np.ndarray  # [N] index into CATEGORIES
    deps: list[list[int]]  # [N] same-worker dependencies
    units: list[tuple[list[int], bool]]  # (member nodes, synchronised across DP ranks), in topological order
    present: np.ndarray  # [N, S, D] bool: the op was traced there
    start: np.ndarray  # [N, S, D] traced start (nan where absent)
    duration: np.ndarray  # [N, S, D] traced duration (0 where absent)
    work: np.ndarray  # [N, S, D] replay duration: compute time or transfer duration (0 where absent)
    ideal: np.ndarray  # [len(CATEGORIES)] ideal value per category (nan if absent from the trace)
    traced_step_time: np.ndarray  # [S] latest traced end per step

    @property
    def nodes(self) -> int:
        return len(self.stage)

    def ideal_work(self) -> np.ndarray:
        """[N, S, D] ideal replay durations (0 where the op is absent)."""
        per_node = np.nan_to_num(self.ideal[self.category])
        return np.where(self.present, per_node[:, None, None], 0.0)


def build(trace: OpTrace) -> Graph:
    meta = trace.meta
    steps = trace.steps
    si = np.searchsorted(steps, trace.step)
    nseq = int(trace.seq_id.max()) + 1
    key = (trace.stage * len(OP_TYPES) + trace.optype) * nseq + trace.seq_id
    keys, node_of_row = np.unique(key, return_inverse=True)
    n_nodes, n_steps, dp = len(keys), len(steps), meta.dp
    stage = keys // (len(OP_TYPES) * nseq)
    optype = (keys // nseq) % len(OP_TYPES)
    seq = keys % nseq

    start = np.full((n_nodes, n_steps, dp), np.nan)
    dur = np.zeros((n_nodes, n_steps, dp))
    start[node_of_row, si, trace.dp_rank] = trace.start
    dur[node_of_row, si, trace.dp_rank] = trace.duration
    present = ~np.isnan(start)
    end = start + dur
    traced_step_time = np.nanmax(end, axis=(0, 2))

    # Launch order per stage: median traced start, ties broken by the canonical op-type order.
    med = np.nanmedian(start.reshape(n_nodes, -1), axis=1)
    order = np.lexsort((seq, optype, med, stage))
    deps: list[list[int]] = [[] for _ in range(n_nodes)]
    for p in range(meta.pp):
        _stage_deps([int(n) for n in order if stage[n] == p], optype, deps)

    units, work = _sync_units(meta.pp, meta.vpp, stage, optype, seq, start, end, dur, present)
    units = _toposort(units, deps, n_nodes)

    category = _CAT_OF_TYPE[optype]
    ideal = np.full(len(CATEGORIES), np.nan)
    for c in range(len(CATEGORIES)):
        vals = work[category == c][present[category == c]]
        if len(vals):
            ideal[c] = vals.mean() if c in COMPUTE_CATEGORIES else np.median(vals)
    return Graph(steps=steps, dp=dp, pp=meta.pp, stage=stage, optype=optype, seq=seq, category=category,
                 deps=deps, units=units, present=present, start=start, duration=dur, work=work, ideal=ideal,
                 traced_step_time=traced_step_time)


def _stage_deps(order: list[int], optype: np.ndarray, deps: list[list[int]]) -> None:
    last_chain: int | None = None
    last_compute: dict[int, int] = {}
    pending: dict[int, list[int]] = {FWD: [], BWD: []}
    last_in_stream: dict[int, int] = {}
    for n in order:
        t = int(optype[n])
        if t in SENDS or t in RECVS:
            if t in last_in_stream:
                deps[n].append(last_in_stream[t])
            last_in_stream[t] = n
            if t in SENDS and SENDS[t] in last_compute:
                deps[n].append(last_compute[SENDS[t]])
            if t in RECVS:
                pending[RECVS[t]].append(n)
            continue
        if last_chain is not None:
            deps[n].append(last_chain)
        last_chain = n
        if t in COMPUTE:
            direction = COMPUTE[t]
            deps[n].extend(pending[direction])
            pending[direction] = []
            last_compute[direction] = n


Units = list[tuple[list[int], bool]]


def _sync_units(pp: int, vpp: int, stage: np.ndarray, optype: np.ndarray, seq: np.ndarray, start: np.ndarray,
                end: np.ndarray, dur: np.ndarray, present: np.ndarray) -> tuple[Units, np.ndarray]:
    """Group nodes into synchronisation units and estimate every op's replay duration."""
    work = dur.copy()
    units: list[tuple[list[int], bool]] = []
    paired: set[int] = set()

    def nodes(p: int, t: str) -> list[int]:
        idx = np.nonzero((stage == p) & (optype == T[t]))[0]
        return [int(i) for i in idx[np.argsort(seq[idx])]]

    for send, recv, step_dir in (("forward-send", "forward-recv", 1), ("backward-send", "backward-recv", -1)):
        for p in range(pp):
            q = p + step_dir
            if not 0 <= q < pp:
                if vpp == 1 or pp == 1:
                    if nodes(p, send):
                        raise OpTraceError(f"PP {p} has {send} ops but no stage {q} to receive them")
                    continue
                q %= pp
            s_nodes, r_nodes = nodes(p, send), nodes(q, recv)
            if len(s_nodes) != len(r_nodes):
                raise OpTraceError(f"pipeline ops do not pair up: PP {p} has {len(s_nodes)} {send} ops per step, "
                                 f"PP {q} has {len(r_nodes)} {recv}")
            for a, b in zip(s_nodes, r_nodes, strict=True):
                tr = np.fmin(end[a], end[b]) - np.fmax(start[a], start[b])
                tr = np.where(present[a] & present[b], tr, np.where(present[a], dur[a], dur[b]))
                work[a] = work[b] = np.clip(np.nan_to_num(tr), 0.0, None)
                units.append(([a, b], False))
                paired.update((a, b))
    for t in np.unique(optype):
        name = OP_TYPES[t]
        if t in SENDS or t in RECVS:
            continue
        for s in np.unique(seq[optype == t]):
            members = [int(i) for i in np.nonzero((optype == t) & (seq == s))[0]]
            if t in DP_COLLECTIVES:
                groups = [([m], True) for m in members]
            elif name == "embedding-grads-all-reduce":
                groups = [(members, False)]
            elif name == "optimizer-clip-main-grad":
                groups = [(members, True)]
            else:  # compute, gc, optimizer, layernorm all-reduce (TP group, untraced): local
                groups = [([m], False) for m in members]
            for g, across in groups:
                if name in ("embedding-grads-all-reduce", "optimizer-clip-main-grad") or t in DP_COLLECTIVES:
                    with warnings.catch_warnings():  # an op absent from every member of a step: nan, ignored
                        warnings.simplefilter("ignore", RuntimeWarning)
                        latest = np.nanmax(start[g], axis=0)  # [S, D]
                        if across:
                            latest = np.nanmax(latest, axis=1, keepdims=True)
                    for m in g:
                        work[m] = np.where(present[m], np.clip(np.nan_to_num(end[m] - latest), 0.0, None), 0.0)
                units.append((g, across))
    work[~present] = 0.0
    return units, work


def _toposort(units: list[tuple[list[int], bool]], deps: list[list[int]], n_nodes: int) -> list[tuple[list[int], bool]]:
    unit_of = np.empty(n_nodes, dtype=np.int64)
    for u, (members, _) in enumerate(units):
        unit_of[members] = u
    succ: list[set[int]] = [set() for _ in units]
    indeg = np.zeros(len(units), dtype=np.int64)
    for u, (members, _) in enumerate(units):
        for m in members:
            for d in deps[m]:
                v = int(unit_of[d])
                if v != u and u not in succ[v]:
                    succ[v].add(u)
                    indeg[u] += 1
    ready = [u for u in range(len(units)) if indeg[u] == 0]
    out = []
    while ready:
        u = ready.pop()
        out.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if len(out) != len(units):
        raise OpTraceError("the operations' dependencies form a cycle: the stages' send/recv order does not match "
                         "a pipeline schedule")
    return [units[u] for u in out]
