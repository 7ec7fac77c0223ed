"""Record a sample of a training job's operations in the trace format `robustctl stragglers analyze` reads.

The training loop marks its operations and each step's end:

    rec = Recorder("/shared/trace/job42", dp_rank=d, pp_rank=p, dp_size=D, pp_size=P, every=50, window=5)
    with rec.op("forward-compute", microbatch=i):
        out = stage(x)
    ...
    rec.step_end()
    rec.close()

Why it is built this way:
- It runs inside the training process, so it needs only the standard library, numpy and pyarrow (it never
  imports torch: on a GPU it times ops with the torch the job has loaded). Outside a sampled window an op
  costs one method call.
- On a GPU an op's duration is what its kernels took on the op's stream: CUDA events recorded around it,
  resolved later by polling `Event.query()` at step ends. There is never a synchronize per op; one per
  window anchors the GPU clock to the host's so that ranks' step starts can be aligned. On a CPU it is a
  monotonic clock (`time.perf_counter`).
- A Python `gc.callbacks` hook records collections by itself: one `gc` op per step, like Megatron-LM's
  (the step's collections summed, at the first one's start; 0 s at the step's end if there was none, so
  that the analyser sees a pause against its absence), and takes each pause out of any CPU-timed op it
  interrupted (the replay chains the two, so the pause would otherwise count twice).
- Steps are sampled: `window` steps out of every `every`, from step `start`. Each rank writes one parquet
  shard per window (`w<first step>-dp<DP>-pp<PP>.parquet`, written to a temporary name and renamed, so a
  reader never sees half a file); rank 0 writes the job's metadata YAML. Rows are exactly the analyser's
  columns (optrace.REQUIRED_COLUMNS) plus rank, mb_id and step_start, the step's start on a clock common
  to all ranks (wall-clock seconds), which robustd.stragglers.tracedir uses to align ranks' steps.
- Everything is bounded: ops per step (`max_ops_per_step`; the rest are counted in `dropped`) and GPU
  events awaiting resolution.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from robustd import atomicfile
from robustd.stragglers.optrace import OP_TYPES

METADATA = "metadata.yaml"
SHARD_FORMAT = "w{first:08d}-dp{dp:04d}-pp{pp:04d}.parquet"
DONE_FORMAT = "done-dp{dp:04d}-pp{pp:04d}"  # written by close(): this rank records no more windows
MAX_OPS_PER_STEP = 100_000
MAX_PENDING_EVENTS = 200_000
GC_MIN_PAUSE = 100e-6  # collections shorter than this are not recorded (young-generation sweeps)

_CODE = {name: i for i, name in enumerate(OP_TYPES)}
_COMPUTE = {_CODE[n] for n in ("forward-compute", "backward-compute", "optimizer", "gc")}


class RecorderError(ValueError):
    """The recorder was set up or used wrongly; the message says how, in one line."""


@dataclass
class _Row:
    step: int
    optype: int
    seq: int
    mb: int
    start: float  # seconds from the step's start
    duration: float


class _Noop:
    """The context of an op outside a sampled step: nothing to do."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOOP = _Noop()


class _CpuOp:
    """An op timed on the host: start on the monotonic clock; duration on it too, or, for compute with
    cpu_compute_clock="thread", the CPU time the thread spent (see Recorder)."""

    __slots__ = ("rec", "code", "mb", "t0", "c0", "gc_paused")

    def __init__(self, rec: Recorder, code: int, mb: int) -> None:
        self.rec, self.code, self.mb, self.gc_paused = rec, code, mb, 0.0
        self.c0 = -1.0

    def __enter__(self) -> None:
        self.rec._open.append(self)
        if self.rec._thread_clock and self.code in _COMPUTE:
            self.c0 = time.thread_time()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        t1 = time.perf_counter()
        busy = time.thread_time() - self.c0 if self.c0 >= 0 else t1 - self.t0
        rec = self.rec
        rec._open.remove(self)
        rec._add(self.code, self.mb, self.t0 - rec._step_t0, max(busy - self.gc_paused, 0.0))


class _GpuOp:
    __slots__ = ("rec", "code", "mb", "ev")

    def __init__(self, rec: Recorder, code: int, mb: int) -> None:
        self.rec, self.code, self.mb = rec, code, mb

    def __enter__(self) -> None:
        self.ev = self.rec._gpu.pair()
        self.ev[0].record()

    def __exit__(self, *exc: object) -> None:
        self.ev[1].record()
        self.rec._gpu_pending(self.code, self.mb, self.ev)


class Recorder:
    """Per-rank op recorder. Mark ops from the training thread (ops are not thread-safe); a collection in
    another Python thread is counted as a pause of the training thread too."""

    def __init__(self, trace_dir: str | Path, *, dp_rank: int | None = None, pp_rank: int | None = None,
                 dp_size: int | None = None, pp_size: int | None = None, tp_size: int = 1, tp_rank: int = 0,
                 dsp_size: int = 1, rank: int | None = None, every: int = 1, window: int = 1, start: int = 0,
                 device: str = "auto", name: str = "", gc_hook: bool = True, gc_min_pause: float = GC_MIN_PAUSE,
                 cpu_compute_clock: str = "monotonic", max_ops_per_step: int = MAX_OPS_PER_STEP) -> None:
        if None in (dp_rank, pp_rank, dp_size, pp_size):
            dp_rank, pp_rank, dp_size, pp_size, tp_size, tp_rank, dsp_size = _megatron_state()
        assert dp_rank is not None and pp_rank is not None and dp_size is not None and pp_size is not None
        for key, v in (("dp_size", dp_size), ("pp_size", pp_size), ("tp_size", tp_size), ("dsp_size", dsp_size),
                       ("every", every), ("window", window), ("max_ops_per_step", max_ops_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RecorderError(f"recorder: {key} must be a whole number of at least 1, not {v!r}")
        if not 0 <= dp_rank < dp_size or not 0 <= pp_rank < pp_size:
            raise RecorderError(f"recorder: DP {dp_rank} PP {pp_rank} is outside the job's {dp_size} x {pp_size} "
                                f"layout")
        if window > every:
            raise RecorderError(f"recorder: window {window} is longer than every {every}: a window is the first "
                                f"`window` steps of every `every`")
        if start < 0:
            raise RecorderError(f"recorder: start must be >= 0, not {start}")
        if cpu_compute_clock not in ("thread", "monotonic"):
            raise RecorderError(f"recorder: cpu_compute_clock must be thread or monotonic, not {cpu_compute_clock!r}")
        self.dir = Path(trace_dir)
        self.dp_rank, self.pp_rank, self.dp_size, self.pp_size = dp_rank, pp_rank, dp_size, pp_size
        self.rank = rank if rank is not None else _world_rank(pp_rank * dp_size + dp_rank)
        self.every, self.window, self.start = every, window, start
        self.max_ops_per_step = max_ops_per_step
        self.gc_min_pause = gc_min_pause
        self.dropped = 0  # ops over max_ops_per_step or max pending GPU events, not recorded
        self.shards_written = 0
        # One traced rank per (DP, PP) cell: with tensor parallelism only TP rank 0 records.
        self.enabled = tp_rank == 0
        self._gpu = _Gpu() if self.enabled and _want_gpu(device) else None
        self._thread_clock = self._gpu is None and cpu_compute_clock == "thread"
        self.clock = "cuda-events" if self._gpu else ("monotonic+thread-cpu" if self._thread_clock else "monotonic")
        self._wall_offset = time.time() - time.perf_counter()
        self._step = 0
        self._sampled = self.enabled and self._is_sampled(0)
        self._step_t0: float = time.perf_counter()
        self._first_op_pending = True  # step 0 starts at its first op, not at construction
        self._seq: dict[int, int] = {}
        self._ops_in_step = 0
        self._open: list[_CpuOp] = []
        self._rows: list[_Row] = []
        self._step_starts: dict[int, float] = {}  # step -> wall-clock start (CPU, or resolved on GPU)
        self._ready: set[int] = set()  # windows whose steps have all ended, not yet written
        self._closed = False
        self._gc_t0: float | None = None
        self._gc_c0 = 0.0
        self._gc_hook = self.enabled and gc_hook
        self._gc_start: float | None = None  # the step's first collection, from the step's start
        self._gc_total = 0.0  # the step's collections, seconds
        if self.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                self._write_metadata(name, dp_size * pp_size * tp_size * dsp_size, tp_size, dsp_size)
            if gc_hook:
                gc.callbacks.append(self._on_gc)

    # ------------------------------------------------------------------ the training loop's calls

    def op(self, optype: str, microbatch: int = -1) -> Any:
        """Context manager timing one op. `optype` is one of optrace.OP_TYPES."""
        if not self._sampled:
            if optype not in _CODE:
                raise RecorderError(f"recorder: unknown op type {optype!r} (known: {', '.join(OP_TYPES)})")
            return _NOOP
        code = _CODE.get(optype)
        if code is None:
            raise RecorderError(f"recorder: unknown op type {optype!r} (known: {', '.join(OP_TYPES)})")
        if self._first_op_pending:
            self._first_op_pending = False
            self._step_t0 = time.perf_counter()
            if self._gpu is not None:
                self._gpu.begin_step(self._step, anchor=True)
        if self._gpu is not None and code != _CODE["gc"]:
            return _GpuOp(self, code, microbatch)
        return _CpuOp(self, code, microbatch)

    def step_end(self) -> None:
        """Mark the end of a training step (every rank calls it once per step, sampled or not)."""
        if self._closed:
            raise RecorderError("recorder: step_end() after close()")
        now = time.perf_counter()
        ended, was_sampled = self._step, self._sampled
        if was_sampled and self._gc_hook:
            # One gc op per step, like Megatron-LM's: every collection of the step, at the first one's start;
            # 0 s at the step's end when nothing was collected (so that a pause stands out against its absence).
            host_t0 = self._step_t0 if self._gpu is None else self._gpu.host_step_t0
            start = self._gc_start if self._gc_start is not None else now - host_t0
            self._add(_CODE["gc"], -1, start, self._gc_total)
        self._gc_start, self._gc_total = None, 0.0
        if was_sampled:
            if self._gpu is None:
                self._step_starts[ended] = self._step_t0 + self._wall_offset
            if ended - self._window_of(ended) == self.window - 1:
                self._ready.add(self._window_of(ended))
        self._step += 1
        self._step_t0 = now
        self._first_op_pending = False
        self._seq.clear()
        self._ops_in_step = 0
        self._sampled = self.enabled and self._is_sampled(self._step)
        if self._gpu is not None:
            if self._sampled:
                self._gpu.begin_step(self._step, anchor=self._window_of(self._step) == self._step)
            self._resolve_gpu(block=False)
        if self._ready:
            self._flush()

    def close(self) -> None:
        """Write what was recorded (the step in progress is dropped) and unhook gc. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if not self.enabled:
            return
        self._rows = [r for r in self._rows if r.step < self._step]
        if self._gpu is not None:
            self._gpu.pending = [p for p in self._gpu.pending if p[0] < self._step]
            self._resolve_gpu(block=True)
        self._ready |= {self._window_of(r.step) for r in self._rows}  # a window cut short by the job's end
        self._flush()
        _atomic_write(self.dir / DONE_FORMAT.format(dp=self.dp_rank, pp=self.pp_rank),
                      json.dumps({"steps": self._step, "dropped": self.dropped}).encode())

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def step(self) -> int:
        """The step being recorded now (0-based; step_end() advances it)."""
        return self._step

    def is_sampled(self, step: int) -> bool:
        """Whether `step` falls in a recorded window (recording also needs this rank to be enabled)."""
        return step >= self.start and (step - self.start) % self.every < self.window

    # ------------------------------------------------------------------ internals

    _is_sampled = is_sampled

    def _window_of(self, step: int) -> int:
        return self.start + (step - self.start) // self.every * self.every

    def _next_seq(self, code: int) -> int | None:
        if self._ops_in_step >= self.max_ops_per_step:
            self.dropped += 1
            return None
        self._ops_in_step += 1
        s = self._seq.get(code, 0)
        self._seq[code] = s + 1
        return s

    def _add(self, code: int, mb: int, start: float, duration: float) -> None:
        seq = self._next_seq(code)
        if seq is not None:
            self._rows.append(_Row(self._step, code, seq, mb, start, duration))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_c0 = time.thread_time()
            self._gc_t0 = time.perf_counter()
            return
        t1 = time.perf_counter()
        t0, self._gc_t0 = self._gc_t0, None
        if t0 is None or not self._sampled or self._closed:
            return
        wall = t1 - t0
        cpu = time.thread_time() - self._gc_c0
        if wall < self.gc_min_pause:
            return
        if self._first_op_pending:
            self._first_op_pending = False
            self._step_t0 = t0
        for o in self._open:  # the pause is its own op, not part of the op it interrupted
            o.gc_paused += cpu if o.c0 >= 0 else wall
        if self._gc_start is None:
            self._gc_start = (t0 - self._step_t0) if self._gpu is None else (t0 - self._gpu.host_step_t0)
        self._gc_total += cpu if self._thread_clock else wall

    # GPU: ops wait as (step, code, seq, mb, (start event, end event)) until their end event has completed.
    def _gpu_pending(self, code: int, mb: int, ev: tuple[Any, Any]) -> None:
        assert self._gpu is not None
        seq = self._next_seq(code)
        if seq is None or len(self._gpu.pending) >= MAX_PENDING_EVENTS:
            self.dropped += seq is not None
            self._gpu.release(ev)
            return
        self._gpu.pending.append((self._step, code, seq, mb, ev))

    def _resolve_gpu(self, block: bool) -> None:
        gpu = self._gpu
        assert gpu is not None
        for step, start_wall in gpu.resolve_steps(block):
            self._step_starts[step] = start_wall
        still = []
        for item in gpu.pending:
            step, code, seq, mb, (e0, e1) = item
            ref = gpu.step_event.get(step)
            # Wait for the step's start to be resolved too, so that its window is written with it.
            if ref is None or step not in self._step_starts or not (block or e1.query()):
                still.append(item)
                continue
            if block:
                e1.synchronize()
            self._rows.append(_Row(step, code, seq, mb, ref.elapsed_time(e0) / 1e3, e0.elapsed_time(e1) / 1e3))
            gpu.release((e0, e1))
        gpu.pending = still
        if block:
            gpu.step_event.clear()
        else:
            gpu.forget_steps_before(min((p[0] for p in still), default=self._step))

    def _flush(self) -> None:
        """Write every ended window whose ops are all resolved (on close, every window)."""
        waiting = {self._window_of(p[0]) for p in self._gpu.pending} if self._gpu is not None else set()
        for w in sorted(self._ready - waiting):
            self._ready.discard(w)
            rows = [r for r in self._rows if self._window_of(r.step) == w]
            self._rows = [r for r in self._rows if self._window_of(r.step) != w]
            starts = {st: t for st, t in self._step_starts.items() if self._window_of(st) == w}
            for st in starts:
                del self._step_starts[st]
            if rows:
                self._write_shard(w, rows, starts)

    def _write_shard(self, first: int, rows: list[_Row], starts: dict[int, float]) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows.sort(key=lambda r: (r.step, r.start, r.optype, r.seq))
        n = len(rows)
        step = np.fromiter((r.step for r in rows), np.int64, n)
        cols = {
            "dp_rank": pa.array(np.full(n, self.dp_rank, np.int32)),
            "stage": pa.array(np.full(n, self.pp_rank, np.int32)),
            "rank": pa.array(np.full(n, self.rank, np.int32)),
            "step": pa.array(step),
            "optype": pa.DictionaryArray.from_arrays(pa.array(np.fromiter((r.optype for r in rows), np.int8, n)),
                                                     pa.array(list(OP_TYPES))),
            "start_ts": pa.array(np.fromiter((r.start for r in rows), np.float64, n)),
            "duration": pa.array(np.fromiter((r.duration for r in rows), np.float64, n)),
            "seq_id": pa.array(np.fromiter((r.seq for r in rows), np.int32, n)),
            "mb_id": pa.array(np.fromiter((r.mb for r in rows), np.int32, n)),
            "step_start": pa.array(np.array([starts.get(int(s), np.nan) for s in step], np.float64)),
        }
        with replacing(self.dir / SHARD_FORMAT.format(first=first, dp=self.dp_rank, pp=self.pp_rank)) as tmp:
            pq.write_table(pa.table(cols), tmp)
        self.shards_written += 1

    def _write_metadata(self, name: str, world: int, tp: int, dsp: int) -> None:
        # Written by hand (flat keys, JSON-quoted strings are valid YAML) so the recorder needs no YAML library.
        doc = {"trial_name": name or self.dir.name, "run_id": 0, "dp_size": self.dp_size, "pp_size": self.pp_size,
               "tp_size": tp, "dsp_size": dsp, "vpp_size": 1, "world_size": world,
               "recorder_every": self.every, "recorder_window": self.window, "recorder_start": self.start,
               "recorder_clock": self.clock}
        text = "".join(f"{k}: {json.dumps(v)}\n" for k, v in doc.items())
        _atomic_write(self.dir / METADATA, text.encode())


class _Gpu:
    """CUDA events for one rank: a pool, the ops awaiting their end event, and each step's start event."""

    def __init__(self) -> None:
        # The job's own torch, already loaded with CUDA (`_want_gpu` saw it in sys.modules): the recorder never
        # imports torch itself, so it stays out of every process that did not load it.
        self.torch = sys.modules["torch"]
        self.pool: list[tuple[Any, Any]] = []
        self.pending: list[tuple[int, int, int, int, tuple[Any, Any]]] = []
        self.step_event: dict[int, Any] = {}
        self.host_step_t0 = time.perf_counter()
        self._anchor: tuple[Any, float] | None = None  # (event, wall-clock time it ran)
        self._unresolved: list[tuple[int, Any, tuple[Any, float]]] = []  # (step, start event, anchor)

    def pair(self) -> tuple[Any, Any]:
        if self.pool:
            return self.pool.pop()
        ev = self.torch.cuda.Event
        return ev(enable_timing=True), ev(enable_timing=True)

    def release(self, ev: tuple[Any, Any]) -> None:
        if len(self.pool) < 4096:
            self.pool.append(ev)

    def begin_step(self, step: int, anchor: bool) -> None:
        """Mark a sampled step's start on the current stream. `anchor`: the first step of a window, where
        one synchronize pins the GPU clock to the host's wall clock (once per window, never per op)."""
        self.host_step_t0 = time.perf_counter()
        if anchor or self._anchor is None:
            self.torch.cuda.synchronize()
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            e.synchronize()  # the stream is empty: this returns at once
            self._anchor = (e, time.time())
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        self.step_event[step] = ev
        self._unresolved.append((step, ev, self._anchor))

    def resolve_steps(self, block: bool) -> list[tuple[int, float]]:
        """Wall-clock starts of the steps whose start events have run."""
        out, still = [], []
        for step, ev, (anchor, wall) in self._unresolved:
            if block:
                ev.synchronize()
            elif not ev.query():
                still.append((step, ev, (anchor, wall)))
                continue
            out.append((step, wall + anchor.elapsed_time(ev) / 1e3))
        self._unresolved = still
        return out

    def forget_steps_before(self, step: int) -> None:
        for s in [s for s in self.step_event if s < step]:
            if all(u[0] != s for u in self._unresolved):
                del self.step_event[s]


def _want_gpu(device: str) -> bool:
    if device not in ("auto", "cpu", "cuda"):
        raise RecorderError(f"recorder: device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu":
        return False
    torch = sys.modules.get("torch")  # never import torch for a CPU job that did not
    available = torch is not None and torch.cuda.is_available()
    if device == "cuda" and not available:
        raise RecorderError("recorder: device 'cuda' but torch with CUDA is not available in this process")
    return available


def _world_rank(default: int) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", default))


def _megatron_state() -> tuple[int, int, int, int, int, int, int]:
    """(dp_rank, pp_rank, dp_size, pp_size, tp_size, tp_rank, dsp_size) from Megatron-LM's parallel state."""
    try:
        from megatron.core import parallel_state as ps  # type: ignore[import-not-found]
    except ImportError:
        raise RecorderError("recorder: pass dp_rank, pp_rank, dp_size and pp_size (Megatron-LM's parallel state "
                            "is not importable here)") from None
    if not ps.model_parallel_is_initialized():
        raise RecorderError("recorder: Megatron-LM's parallel state is not initialised yet: create the recorder "
                            "after initialize_model_parallel(), or pass the ranks")
    cp = getattr(ps, "get_context_parallel_world_size", lambda: 1)()
    return (ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), cp)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` to write to, renamed onto `path` when the block ends: a reader (the
    analyser, `watch`) sees the old file or the whole new one, never half of one."""
    with atomicfile.replacing(path) as tmp:
        yield Path(tmp)


def _atomic_write(path: Path, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)
