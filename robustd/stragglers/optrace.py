"""Load and validate a sampled operation trace (NDTimeline-style parquet) and its job metadata (YAML).

Called an *op trace* in code (OpTrace, OpTraceError) because "trace" alone is the stack tracer
(`robustctl trace`, robustd/tracer.py); the CLI keeps its `--trace FILE` option.

One row per operation: dp_rank, stage (PP rank), step, optype, start_ts and duration (seconds, start_ts
relative to the step's start) and seq_id (the op's order among ops of its type, per step and worker).
Other columns (rank, mc, gmc, mb_id) may be present and are ignored. One traced rank per (DP, PP) cell.

Anything malformed raises OpTraceError (a ValueError) with a one-line message that names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

REQUIRED_COLUMNS = ("dp_rank", "stage", "step", "optype", "start_ts", "duration", "seq_id")
META_KEYS = ("dp_size", "pp_size", "tp_size", "dsp_size", "world_size")

# Every op type the analyser understands, in the order used to break ties between ops that start
# at the same instant (the post-backward chain: gc, layernorm, embedding, grad sync, clip, optimizer).
OP_TYPES = (
    "params-all-gather",
    "forward-recv",
    "forward-compute",
    "forward-send",
    "backward-recv",
    "backward-compute",
    "backward-send",
    "gc",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "optimizer-clip-main-grad",
    "optimizer",
)


class OpTraceError(ValueError):
    """A trace or metadata file the analyser refuses; the message says why, in one line."""


@dataclass(frozen=True)
class Meta:
    dp: int
    pp: int
    tp: int
    dsp: int
    vpp: int
    world_size: int
    name: str = ""

    @property
    def workers(self) -> int:
        """Traced workers: one per (DP, PP) cell."""
        return self.dp * self.pp


@dataclass
class OpTrace:
    """Column arrays of one trace, restricted to the selected steps. `optype` indexes OP_TYPES."""

    meta: Meta
    dp_rank: np.ndarray  # int64
    stage: np.ndarray  # int64
    step: np.ndarray  # int64
    optype: np.ndarray  # int64 index into OP_TYPES
    start: np.ndarray  # float64 seconds from the step's start
    duration: np.ndarray  # float64 seconds
    seq_id: np.ndarray  # int64

    @property
    def steps(self) -> np.ndarray:
        return np.unique(self.step)

    def __len__(self) -> int:
        return len(self.step)


def meta_from_dict(d: object, where: str = "metadata") -> Meta:
    if not isinstance(d, dict):
        raise OpTraceError(f"{where}: expected a mapping of keys (dp_size, pp_size, ...), got {type(d).__name__}")
    missing = [k for k in META_KEYS if k not in d]
    if missing:
        raise OpTraceError(f"{where}: missing metadata key(s): {', '.join(missing)}")
    vals: dict[str, int] = {}
    for k in (*META_KEYS, "vpp_size"):
        v = d.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise OpTraceError(f"{where}: {k} must be a whole number of at least 1, not {v!r}")
        vals[k] = v
    prod = vals["dp_size"] * vals["pp_size"] * vals["tp_size"] * vals["dsp_size"]
    if vals["world_size"] != prod:
        raise OpTraceError(f"{where}: world_size {vals['world_size']} != dp_size*pp_size*tp_size*dsp_size = {prod}")
    if vals["vpp_size"] != 1:
        raise OpTraceError(f"{where}: vpp_size {vals['vpp_size']}: interleaved (virtual) pipeline schedules are not "
                         f"supported; only vpp_size 1")
    return Meta(dp=vals["dp_size"], pp=vals["pp_size"], tp=vals["tp_size"], dsp=vals["dsp_size"],
                vpp=vals["vpp_size"], world_size=vals["world_size"], name=str(d.get("trial_name", "")))


def load_metadata(path: str | Path) -> Meta:
    """Parse the job metadata YAML. OSError if it cannot be read; OpTraceError if it is malformed."""
    import yaml  # here, not at the top: the recorder imports this package in training processes

    text = Path(path).read_text()
    try:
        d = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise OpTraceError(f"metadata {path}: not valid YAML{line}") from None
    return meta_from_dict(d, f"metadata {path}")


def parse_steps(spec: str | None) -> tuple[list[int], list[tuple[int, int]]]:
    """'3-40', '5,6,7' or '1-4,9' -> (explicit steps, inclusive ranges). None or '' selects every step."""
    singles: list[int] = []
    ranges: list[tuple[int, int]] = []
    if not spec:
        return singles, ranges
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                i = part.index("-", 1)
                lo, hi = int(part[:i]), int(part[i + 1:])
                if hi < lo:
                    raise OpTraceError(f"--steps: range {part!r} runs backwards")
                ranges.append((lo, hi))
            else:
                singles.append(int(part))
        except ValueError as e:
            if isinstance(e, OpTraceError):
                raise
            raise OpTraceError(f"--steps: {part!r} is not a step number or a range like 3-40") from None
    if not singles and not ranges:
        raise OpTraceError(f"--steps: {spec!r} names no steps")
    return singles, ranges


def load_op_trace(path: str | Path, meta: Meta, steps: str | None = None) -> OpTrace:
    """Read a parquet trace. OSError if the file is missing; OpTraceError if it is unreadable or malformed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OpTraceError(f"trace {path}: unreadable parquet ({first})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise OpTraceError(f"trace {path}: missing columns: {', '.join(missing)}")
    cols = {}
    for c in REQUIRED_COLUMNS:
        col = table.column(c)
        if col.null_count:
            raise OpTraceError(f"trace {path}: column {c} has {col.null_count} empty values")
        if c == "optype":
            cols[c] = col  # coded without going through Python strings, below
        else:
            try:
                cols[c] = col.to_numpy()
            except (pa.ArrowException, TypeError) as e:
                raise OpTraceError(f"trace {path}: column {c} is not numeric ({col.type})") from e
    return op_trace_from_columns(cols, meta, steps, where=f"trace {path}")


def _as(cols: dict, name: str, kind: str, where: str) -> np.ndarray:
    a = np.asarray(cols[name])
    if a.dtype.kind not in kind:
        expected = "integers" if kind == "iu" else "numbers"
        raise OpTraceError(f"{where}: column {name} has type {a.dtype}, expected {expected}")
    return a


def op_trace_from_columns(cols: dict, meta: Meta, steps: str | None = None, where: str = "trace") -> OpTrace:
    """Validate column arrays (as in the parquet file) and select steps."""
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise OpTraceError(f"{where}: missing columns: {', '.join(missing)}")
    n = len(cols["step"])
    if n == 0:
        raise OpTraceError(f"{where}: no operations (0 rows)")
    if any(len(cols[c]) != n for c in REQUIRED_COLUMNS):
        raise OpTraceError(f"{where}: columns have different lengths")
    dp = _as(cols, "dp_rank", "iu", where).astype(np.int64)
    stage = _as(cols, "stage", "iu", where).astype(np.int64)
    step = _as(cols, "step", "iu", where).astype(np.int64)
    seq = _as(cols, "seq_id", "iu", where).astype(np.int64)
    start = _as(cols, "start_ts", "iuf", where).astype(np.float64)
    dur = _as(cols, "duration", "iuf", where).astype(np.float64)
    optype = _optype_codes(cols["optype"], where)
    for name, a in (("start_ts", start), ("duration", dur)):
        if not np.isfinite(a).all():
            raise OpTraceError(f"{where}: column {name} has {int((~np.isfinite(a)).sum())} values that are not finite")
    if (dur < 0).any():
        raise OpTraceError(f"{where}: {int((dur < 0).sum())} operations have a negative duration")
    if (seq < 0).any():
        raise OpTraceError(f"{where}: seq_id must be >= 0 (found {int(seq.min())})")
    for name, a, size, key in (("dp_rank", dp, meta.dp, "dp_size"), ("stage", stage, meta.pp, "pp_size")):
        bad = (a < 0) | (a >= size)
        if bad.any():
            raise OpTraceError(f"{where}: {name} {int(a[bad][0])} is outside 0..{size - 1} ({key} is {size})")

    all_steps = np.unique(step)
    singles, ranges = parse_steps(steps)
    if singles or ranges:
        absent = [s for s in singles if s not in set(all_steps.tolist())]
        if absent:
            raise OpTraceError(f"{where}: empty step {absent[0]}: the trace has no operations for it "
                             f"(steps present: {_span(all_steps)})")
        keep = np.isin(step, singles)
        for lo, hi in ranges:
            keep |= (step >= lo) & (step <= hi)
        if not keep.any():
            raise OpTraceError(f"{where}: no steps selected: --steps {steps} matches none of the trace's "
                             f"{len(all_steps)} steps ({_span(all_steps)})")
        dp, stage, step, optype, start, dur, seq = (a[keep] for a in (dp, stage, step, optype, start, dur, seq))
    # Every selected step must hold operations of every (DP, PP) worker.
    sel = np.unique(step)
    si = np.searchsorted(sel, step)
    seen = np.zeros((len(sel), meta.dp, meta.pp), dtype=bool)
    seen[si, dp, stage] = True
    if not seen.all():
        s, d, p = (int(x[0]) for x in np.nonzero(~seen))
        raise OpTraceError(f"{where}: empty step {int(sel[s])} for worker DP {d} PP {p}: no operations traced "
                         f"(every selected step needs all {meta.dp}x{meta.pp} workers)")
    key = ((si * meta.dp + dp) * meta.pp + stage) * len(OP_TYPES) + optype
    key = key * (int(seq.max()) + 1) + seq
    if len(np.unique(key)) != len(key):
        u, c = np.unique(key, return_counts=True)
        j = int(np.nonzero(key == u[c > 1][0])[0][0])
        raise OpTraceError(f"{where}: duplicate operation: step {int(step[j])} DP {int(dp[j])} PP {int(stage[j])} "
                         f"{OP_TYPES[optype[j]]} seq_id {int(seq[j])} appears more than once")
    return OpTrace(meta=meta, dp_rank=dp, stage=stage, step=step, optype=optype, start=start, duration=dur,
                 seq_id=seq)


def _optype_codes(values: object, where: str) -> np.ndarray:
    """Op type names -> indices into OP_TYPES (a numpy array of str or of indices, or a pyarrow array)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        arr = values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])
        if not pa.types.is_dictionary(arr.type):
            try:
                arr = pc.dictionary_encode(arr.cast(pa.string()))
            except pa.ArrowException as e:
                raise OpTraceError(f"{where}: column optype is not text ({arr.type})") from e
        parts = []
        for chunk in arr.chunks:
            names = [str(x) for x in chunk.dictionary.to_pylist()]
            idx = chunk.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            used = np.unique(idx)  # a pandas category may list values no row uses
            table = np.zeros(max(len(names), 1), dtype=np.int64)
            table[used] = _lookup([names[i] for i in used], where)
            parts.append(table[idx])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":  # already coded as indices into OP_TYPES
        if len(arr) and (arr.min() < 0 or arr.max() >= len(OP_TYPES)):
            raise OpTraceError(f"{where}: op type code {int(arr.max())} is not an index into the known op types")
        return arr.astype(np.int64)
    names_arr = arr.astype(str)
    uniq, inv = np.unique(names_arr, return_inverse=True)
    return _lookup([str(u) for u in uniq], where)[inv]


def _lookup(names: list[str], where: str) -> np.ndarray:
    unknown = sorted({u for u in names if u not in OP_TYPES})
    if unknown:
        raise OpTraceError(f"{where}: unknown op type(s): {', '.join(map(repr, unknown[:5]))} "
                         f"(known: {', '.join(OP_TYPES)})")
    return np.array([OP_TYPES.index(u) for u in names], dtype=np.int64)


def _span(steps: np.ndarray) -> str:
    return f"{int(steps[0])}..{int(steps[-1])}" if len(steps) > 1 else str(int(steps[0]))
