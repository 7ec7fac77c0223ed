"""Synthetic traces of a Megatron-LM 1F1B job with injected stragglers, for tests, benchmarks and demos.

The job is executed here with blocking semantics, independently of the analyser's replay: each worker
runs its schedule in order (batched send/recv pairs as one blocking call, collectives waiting for every
peer), with small random launch gaps, and every op is written out as the profiler would record it: its
launch time and how long the call took, waiting included. Known causes can be injected: a slow worker, a
heavier last stage, long sequences on one DP rank per step, and unsynchronised GC pauses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from robustd.stragglers.optrace import OP_TYPES, Meta

# Transfer durations (seconds) of the communication ops once every peer has launched.
P2P_TRANSFER = 0.0005
COLLECTIVE = {"params-all-gather": 0.010, "grads-reduce-scatter": 0.020, "layernorm-grads-all-reduce": 0.0001,
              "embedding-grads-all-reduce": 0.005, "optimizer-clip-main-grad": 0.002}
OPTIMIZER = 0.020
LAUNCH_GAP = 0.0002  # up to this much untraced CPU time before each launch


@dataclass
class Job:
    dp: int = 4
    pp: int = 4
    microbatches: int = 8
    steps: int = 6
    forward: float = 0.030  # seconds per microbatch per stage
    backward: float = 0.060
    noise: float = 0.01  # relative std of compute times
    slow_worker: tuple[int, int, float] | None = None  # (dp_rank, pp_rank, factor)
    last_stage_factor: float = 1.0  # extra work on the last stage (the loss layer)
    long_sequences: bool = False  # one DP rank per step gets long, varied sequences
    long_rank: int | None = None  # ... always this DP rank (like examples/pipeline_train.py --long-sequences)
    gc_pause: float = 0.0  # a GC pause this long ...
    gc_rate: float = 0.1  # ... hits each worker in this share of steps, at random (unsynchronised)
    seed: int = 0

    @property
    def meta(self) -> Meta:
        return Meta(dp=self.dp, pp=self.pp, tp=1, dsp=1, vpp=1, world_size=self.dp * self.pp, name="synthetic")

    def meta_dict(self) -> dict:
        return {"trial_name": "synthetic", "run_id": 0, "dp_size": self.dp, "pp_size": self.pp, "tp_size": 1,
                "dsp_size": 1, "vpp_size": 1, "world_size": self.dp * self.pp}


def _schedule(p: int, pp: int, m: int) -> list[list[tuple[str, int]]]:
    """Stage p's launches in one step: slots of (op type, microbatch) launched together."""
    first, last = p == 0, p == pp - 1
    prog: list[list[tuple[str, int]]] = [[("params-all-gather", -1)]]
    warmup = min(pp - p - 1, m)
    fwd_mb = bwd_mb = 0

    def forward() -> None:
        nonlocal fwd_mb
        prog.append([("forward-compute", fwd_mb)])
        fwd_mb += 1

    def backward() -> None:
        nonlocal bwd_mb
        prog.append([("backward-compute", bwd_mb)])
        bwd_mb += 1

    def alone(direction: str, compute: Callable[[], None], receives: bool, sends: bool) -> None:
        """One microbatch outside the steady state: receive its input, compute, send its output."""
        if receives:
            prog.append([(f"{direction}-recv", -1)])
        compute()
        if sends:
            prog.append([(f"{direction}-send", -1)])

    for _ in range(warmup):
        alone("forward", forward, not first, not last)
    remaining = m - warmup
    if remaining and not first:
        prog.append([("forward-recv", -1)])
    for i in range(remaining):
        forward()
        if not last:
            prog.append([("forward-send", -1), ("backward-recv", -1)])
        backward()
        if i == remaining - 1:
            if not first:
                prog.append([("backward-send", -1)])
        elif not first:
            prog.append([("backward-send", -1), ("forward-recv", -1)])
    for _ in range(warmup):
        alone("backward", backward, not last, not first)
    prog += [[("gc", -1)], [("layernorm-grads-all-reduce", -1)]]
    if first or last:
        prog.append([("embedding-grads-all-reduce", -1)])
    prog += [[("grads-reduce-scatter", -1)], [("optimizer-clip-main-grad", -1)], [("optimizer", -1)]]
    return prog


def compute_times(job: Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward and backward compute seconds [S, D, P, M] and GC pauses [S, D, P] with the injected causes."""
    rng = np.random.default_rng(job.seed)
    shape = (job.steps, job.dp, job.pp, job.microbatches)
    work = np.ones(shape)
    if job.long_sequences:
        work = rng.uniform(0.7, 1.3, shape)
        long_rank = rng.integers(0, job.dp, job.steps)
        if job.long_rank is not None:
            long_rank[:] = job.long_rank
        work[np.arange(job.steps), long_rank] = rng.uniform(1.5, 3.0, (job.steps, job.pp, job.microbatches))
        work = work[:, :, :1, :].repeat(job.pp, axis=2)  # a microbatch's sequences cross every stage
    work[:, :, -1, :] *= job.last_stage_factor
    if job.slow_worker is not None:
        d, p, factor = job.slow_worker
        work[:, d, p, :] *= factor
    fwd = job.forward * work * rng.normal(1.0, job.noise, shape).clip(0.5)
    bwd = job.backward * work * rng.normal(1.0, job.noise, shape).clip(0.5)
    gc = np.where(rng.random(shape[:3]) < job.gc_rate, job.gc_pause, 0.0)
    return fwd, bwd, gc


def generate(job: Job) -> dict[str, np.ndarray]:
    """OpTrace columns (as in the parquet files) of the job, executed with blocking semantics."""
    rng = np.random.default_rng(job.seed + 1)
    fwd, bwd, gc = compute_times(job)
    pp, shape = job.pp, (job.steps, job.dp)
    progs = [_schedule(p, pp, job.microbatches) for p in range(pp)]
    # Number each op per type and stage (seq_id), and find each P2P op's peer slot.
    seqs: list[list[list[int]]] = []
    where: dict[tuple[int, str, int], int] = {}
    for p, prog in enumerate(progs):
        count: dict[str, int] = {}
        seqs.append([])
        for i, slot in enumerate(prog):
            row = []
            for t, _ in slot:
                row.append(count.get(t, 0))
                where[(p, t, row[-1])] = i
                count[t] = row[-1] + 1
            seqs[-1].append(row)
    peer_stage = {"forward-send": 1, "forward-recv": -1, "backward-send": -1, "backward-recv": 1}
    peer_type = {"forward-send": "forward-recv", "forward-recv": "forward-send",
                 "backward-send": "backward-recv", "backward-recv": "backward-send"}

    ptr = [0] * pp
    ready = [np.zeros(shape) for _ in range(pp)]  # when each stage's current slot launches
    arrival: dict[tuple[int, int], np.ndarray] = {}
    pairs: dict[tuple[str, int, int], np.ndarray] = {}
    out: list[tuple[int, str, int, int, np.ndarray, np.ndarray]] = []

    def blocked(p: int, i: int) -> bool:
        for (t, _), s in zip(progs[p][i], seqs[p][i], strict=True):
            if t in peer_stage:
                q = p + peer_stage[t]
                if ptr[q] < where[(q, peer_type[t], s)]:
                    return True
            elif t == "optimizer-clip-main-grad":
                if any(ptr[q] < where[(q, t, s)] for q in range(pp)):
                    return True
            elif t == "embedding-grads-all-reduce" and pp > 1:
                q = pp - 1 if p == 0 else 0
                if ptr[q] < where[(q, t, s)]:
                    return True
        return False

    while any(ptr[p] < len(progs[p]) for p in range(pp)):
        moved = False
        for p in range(pp):
            while ptr[p] < len(progs[p]):
                i = ptr[p]
                if (p, i) not in arrival:
                    arrival[(p, i)] = ready[p] + rng.uniform(0, LAUNCH_GAP, shape)
                if blocked(p, i):
                    break
                launch = arrival[(p, i)]
                end = launch.copy()
                for (t, mb), s in zip(progs[p][i], seqs[p][i], strict=True):
                    if t == "forward-compute":
                        e = launch + fwd[:, :, p, mb]
                    elif t == "backward-compute":
                        e = launch + bwd[:, :, p, mb]
                    elif t == "gc":
                        e = launch + gc[:, :, p]
                    elif t == "optimizer":
                        e = launch + OPTIMIZER
                    elif t in peer_stage:
                        q = p + peer_stage[t]
                        sender = p if t.endswith("send") else q
                        key = (t.split("-")[0], sender, s)
                        if key not in pairs:
                            other = arrival[(q, where[(q, peer_type[t], s)])]
                            pairs[key] = np.maximum(launch, other) + P2P_TRANSFER
                        e = pairs[key]
                    elif t == "optimizer-clip-main-grad":
                        latest = np.max([arrival[(q, where[(q, t, s)])] for q in range(pp)], axis=0)
                        e = np.broadcast_to(latest.max(axis=1, keepdims=True) + COLLECTIVE[t], shape)
                    elif t == "embedding-grads-all-reduce" and pp > 1:
                        q = pp - 1 if p == 0 else 0
                        e = np.maximum(launch, arrival[(q, where[(q, t, s)])]) + COLLECTIVE[t]
                    elif t == "layernorm-grads-all-reduce" or t == "embedding-grads-all-reduce":
                        e = launch + COLLECTIVE[t]
                    else:  # DP collectives
                        e = np.broadcast_to(launch.max(axis=1, keepdims=True) + COLLECTIVE[t], shape)
                    end = np.maximum(end, e)
                for (t, mb), s in zip(progs[p][i], seqs[p][i], strict=True):
                    out.append((p, t, s, mb, launch, end - launch))
                ready[p] = end
                ptr[p] += 1
                moved = True
        if not moved:
            raise RuntimeError("synthetic schedule deadlocked")  # a bug in _schedule, never bad input

    n_ops = len(out)
    size = job.steps * job.dp
    step_ids = np.repeat(np.arange(job.steps, dtype=np.int64)[:, None], job.dp, axis=1).ravel()
    dp_ids = np.repeat(np.arange(job.dp, dtype=np.int8)[None, :], job.steps, axis=0).ravel()
    cols = {
        "dp_rank": np.tile(dp_ids, n_ops),
        "stage": np.repeat(np.array([o[0] for o in out], dtype=np.int8), size),
        "step": np.tile(step_ids, n_ops),
        "optype": np.repeat(np.array([OP_TYPES.index(o[1]) for o in out], dtype=np.int8), size),
        "start_ts": np.concatenate([o[4].ravel() for o in out]).astype(np.float32),
        "duration": np.concatenate([o[5].ravel() for o in out]).astype(np.float32),
        "seq_id": np.repeat(np.array([o[2] for o in out], dtype=np.int32), size),
        "mb_id": np.repeat(np.array([o[3] for o in out], dtype=np.int8), size),
    }
    cols["rank"] = (cols["stage"].astype(np.int16) * job.dp + cols["dp_rank"]).astype(np.int16)
    return cols


def write(job: Job, trace_path: str | Path, meta_path: str | Path | None = None,
          cols: dict[str, np.ndarray] | None = None) -> None:
    """Write the job's trace as parquet (op types dictionary-encoded, like the samples) and its metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    cols = generate(job) if cols is None else cols
    arrays = {k: pa.array(v) for k, v in cols.items() if k != "optype"}
    arrays["optype"] = pa.DictionaryArray.from_arrays(pa.array(np.asarray(cols["optype"], dtype=np.int8)),
                                                      pa.array(list(OP_TYPES)))
    pq.write_table(pa.table(arrays), trace_path)
    if meta_path is not None:
        Path(meta_path).write_text(yaml.safe_dump(job.meta_dict()))
