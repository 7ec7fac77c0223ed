"""A trace directory written by robustd.stragglers.recorder: the job's metadata YAML and per-rank shards.

Layout (recorder.METADATA, recorder.SHARD_FORMAT): `metadata.yaml` from rank 0, one parquet shard per
(window, DP rank, PP stage) named `w<first step:08d>-dp<DP:04d>-pp<PP:04d>.parquet`, and a `done-dp..-pp..`
marker per rank once its recorder closed. A window is *complete* when every (DP, PP) cell has its shard;
only complete windows are analysed (the newest may still be being written).

Each rank times its ops from its own step start; the shards also carry that start on a clock common to
all ranks (`step_start`), so loading shifts every rank's ops onto the step's earliest start. Cross-rank
quantities the analyser derives (a transfer's duration = earliest end - latest start of its two sides)
then compare like with like.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from robustd.stragglers.optrace import (
    REQUIRED_COLUMNS,
    Meta,
    OpTrace,
    OpTraceError,
    load_metadata,
    op_trace_from_columns,
)
from robustd.stragglers.recorder import METADATA

SHARD_RE = re.compile(r"^w(\d{8})-dp(\d{4})-pp(\d{4})\.parquet$")
DONE_RE = re.compile(r"^done-dp(\d{4})-pp(\d{4})$")
MAX_ENTRIES = 200_000  # directory entries looked at per scan
MAX_SHARD_BYTES = 256 << 20  # one rank's window; a bigger file is not a recorder shard


@dataclass
class Listing:
    """What a scan of the directory found."""

    windows: dict[int, dict[tuple[int, int], Path]]  # first step -> (dp, pp) -> shard
    done: set[tuple[int, int]]  # ranks whose recorder has closed

    def complete(self, meta: Meta) -> list[int]:
        """First steps of the windows that hold a shard of every (DP, PP) cell, oldest first."""
        return sorted(w for w, cells in self.windows.items() if len(cells) == meta.workers)

    def missing(self, meta: Meta, window: int) -> list[tuple[int, int]]:
        have = self.windows.get(window, {})
        return [(d, p) for p in range(meta.pp) for d in range(meta.dp) if (d, p) not in have]


def scan(directory: str | Path, meta: Meta) -> Listing:
    """List shards and done markers. OSError if the directory cannot be read."""
    windows: dict[int, dict[tuple[int, int], Path]] = {}
    done: set[tuple[int, int]] = set()
    directory = Path(directory)
    with os.scandir(directory) as it:
        for i, entry in enumerate(it):
            if i >= MAX_ENTRIES:
                raise OpTraceError(f"trace dir {directory}: more than {MAX_ENTRIES} entries: not a recorder's "
                                   f"trace directory (or one to split up)")
            m = SHARD_RE.match(entry.name)
            if m:
                d, p = int(m.group(2)), int(m.group(3))
                if d < meta.dp and p < meta.pp:
                    windows.setdefault(int(m.group(1)), {})[(d, p)] = directory / entry.name
                continue
            m = DONE_RE.match(entry.name)
            if m:
                done.add((int(m.group(1)), int(m.group(2))))
    return Listing(windows=windows, done=done)


def load_meta(directory: str | Path) -> Meta:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(2, "No such directory", str(directory))
    return load_metadata(directory / METADATA)


def load(directory: str | Path, steps: str | None = None) -> OpTrace:
    """Every complete window of a trace directory as one trace (then `steps` selects among them)."""
    meta = load_meta(directory)
    listing = scan(directory, meta)
    if not listing.windows:
        raise OpTraceError(f"trace dir {directory}: no shards (w<step>-dp<DP>-pp<PP>.parquet): has the job "
                           f"recorded a whole window yet?")
    complete = listing.complete(meta)
    if not complete:
        newest = max(listing.windows)
        gaps = listing.missing(meta, newest)
        raise OpTraceError(f"trace dir {directory}: no complete window: window {newest} lacks the shards of "
                           f"{len(gaps)} worker(s), e.g. DP {gaps[0][0]} PP {gaps[0][1]}")
    return load_windows(directory, meta, listing, complete, steps)


def load_windows(directory: str | Path, meta: Meta, listing: Listing, windows: list[int],
                 steps: str | None = None) -> OpTrace:
    """The named complete windows as one trace."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for w in windows:
        for (d, p), path in sorted(listing.windows[w].items()):
            try:
                if path.stat().st_size > MAX_SHARD_BYTES:
                    raise OpTraceError(f"shard {path}: larger than {MAX_SHARD_BYTES >> 20} MiB")
                t = pq.read_table(path)
            except pa.ArrowException as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise OpTraceError(f"shard {path}: unreadable parquet ({first})") from None
            missing = [c for c in REQUIRED_COLUMNS if c not in t.column_names]
            if missing:
                raise OpTraceError(f"shard {path}: missing columns: {', '.join(missing)}")
            t = t.select([c for c in (*REQUIRED_COLUMNS, "step_start") if c in t.column_names])
            if "step_start" not in t.column_names:
                t = t.append_column("step_start", pa.array(np.full(len(t), np.nan)))
            for col, want in (("dp_rank", d), ("stage", p)):
                v = t.column(col).to_numpy()
                if len(v) and (v.min() != want or v.max() != want):
                    raise OpTraceError(f"shard {path}: holds {col} {int(v.min())}..{int(v.max())}, its name says "
                                       f"{want}")
            tables.append(t)
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise OpTraceError(f"trace dir {directory}: shards have incompatible columns ({e})") from None
    cols: dict[str, object] = {}
    for c in REQUIRED_COLUMNS:
        col = table.column(c)
        if col.null_count:
            raise OpTraceError(f"trace dir {directory}: column {c} has {col.null_count} empty values")
        cols[c] = col if c == "optype" else col.to_numpy()
    cols["start_ts"] = aligned_starts(np.asarray(cols["step"]), np.asarray(cols["start_ts"], dtype=np.float64),
                                      table.column("step_start").to_numpy(zero_copy_only=False))
    return op_trace_from_columns(cols, meta, steps, where=f"trace dir {directory}")


def aligned_starts(step: np.ndarray, start: np.ndarray, step_start: np.ndarray) -> np.ndarray:
    """Shift each rank's start_ts by how much later than the step's earliest rank its step started."""
    step_start = np.asarray(step_start, dtype=np.float64)
    known = np.isfinite(step_start)
    if not known.any():
        return start
    steps, inv = np.unique(step, return_inverse=True)
    base = np.full(len(steps), np.inf)
    np.minimum.at(base, inv[known], step_start[known])
    shift = np.where(known, step_start - base[inv], 0.0)
    return start + np.nan_to_num(shift, posinf=0.0, neginf=0.0)
