"""The straggler op recorder (robustd.stragglers.recorder) and its trace directory (tracedir): what a training
job's ranks write, read back through the analyser's own loader and `robustctl stragglers analyze`.

The ranks of a job are simulated by several recorders in one process driven through the 1F1B schedule of
robustd.stragglers.synth; the real multi-process job is tests/test_pipeline_example.py.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import stragglers_cli as robustctl

from robustd.cli import exitcodes
from robustd.stragglers import OpTraceError, load_metadata, load_op_trace, tracedir
from robustd.stragglers.optrace import OP_TYPES
from robustd.stragglers.recorder import Recorder, RecorderError
from robustd.stragglers.synth import _schedule

REPO = Path(__file__).resolve().parent.parent


def busy(n: int = 2000) -> None:
    """A little real CPU work, so compute ops take measurable time on either clock."""
    x = 0
    for i in range(n):
        x += i * i


def drive(recs: dict[tuple[int, int], Recorder], steps: int, pp: int, microbatches: int = 3) -> None:
    """Run every (DP, PP) recorder through `steps` steps of Megatron's 1F1B schedule (every op type)."""
    for _ in range(steps):
        for (_, p), rec in sorted(recs.items()):
            for slot in _schedule(p, pp, microbatches):
                with contextlib.ExitStack() as stack:
                    for name, mb in slot:
                        stack.enter_context(rec.op(name, microbatch=mb))
                    if slot[0][0].endswith("compute"):
                        busy()
                if slot[0][0] == "grads-reduce-scatter":
                    with rec.op("separate-grads-all-reduce"):
                        pass
            rec.step_end()


def job(tmp_path: Path, dp: int = 2, pp: int = 2, **kw: Any) -> dict[tuple[int, int], Recorder]:
    return {(d, p): Recorder(tmp_path, dp_rank=d, pp_rank=p, dp_size=dp, pp_size=pp, rank=p * dp + d, **kw)
            for p in range(pp) for d in range(dp)}


def close_all(recs: dict[tuple[int, int], Recorder]) -> None:
    for r in recs.values():
        r.close()


def test_shards_round_trip_through_the_analysers_loader(tmp_path: Path) -> None:
    recs = job(tmp_path, every=4, window=2, start=1, name="roundtrip")
    drive(recs, steps=9, pp=2)
    close_all(recs)
    names = sorted(os.listdir(tmp_path))
    assert "metadata.yaml" in names
    # Windows start at steps 1 and 5 (2 steps of every 4 from step 1): one shard per window and worker.
    shards = [n for n in names if n.endswith(".parquet")]
    assert shards == sorted(f"w{w:08d}-dp{d:04d}-pp{p:04d}.parquet" for w in (1, 5) for d in (0, 1) for p in (0, 1))
    assert sorted(n for n in names if n.startswith("done-")) == [f"done-dp{d:04d}-pp{p:04d}" for d in (0, 1)
                                                                  for p in (0, 1)]
    meta = load_metadata(tmp_path / "metadata.yaml")
    assert (meta.dp, meta.pp, meta.world_size, meta.name) == (2, 2, 4, "roundtrip")

    t = tracedir.load(tmp_path)
    assert t.steps.tolist() == [1, 2, 5, 6]
    assert {OP_TYPES[c] for c in np.unique(t.optype)} == set(OP_TYPES)  # every op type survives
    # seq_id numbers each op type per step and worker from 0, with no gaps.
    for s in t.steps:
        for d in (0, 1):
            for p in (0, 1):
                for c in np.unique(t.optype):
                    sel = (t.step == s) & (t.dp_rank == d) & (t.stage == p) & (t.optype == c)
                    if sel.any():
                        assert sorted(t.seq_id[sel].tolist()) == list(range(int(sel.sum())))
    fc = OP_TYPES.index("forward-compute")
    sel = (t.step == 1) & (t.dp_rank == 0) & (t.stage == 0) & (t.optype == fc)
    assert sorted(t.seq_id[sel].tolist()) == [0, 1, 2]  # 3 microbatches
    assert (t.duration >= 0).all() and (t.start >= 0).all()

    # Each shard is exactly the analyser's trace format: the raw file's columns and microbatch ids.
    raw = pq.read_table(tmp_path / "w00000001-dp0001-pp0000.parquet")
    assert set(raw.column_names) >= {"dp_rank", "stage", "step", "optype", "start_ts", "duration", "seq_id",
                                     "rank", "mb_id", "step_start"}
    assert set(raw.column("dp_rank").to_pylist()) == {1} and set(raw.column("rank").to_pylist()) == {1}
    mbs = [m for m, o in zip(raw.column("mb_id").to_pylist(), raw.column("optype").to_pylist(), strict=True)
           if o == "backward-compute"]
    assert sorted(mbs) == [0, 0, 1, 1, 2, 2]  # 3 microbatches x 2 steps

    code, out = robustctl("analyze", "--trace-dir", str(tmp_path), "--json")
    got = json.loads(out)
    assert code == 0 and got["trial"] == "roundtrip" and got["layout"] == {"dp": 2, "pp": 2, "workers": 4}
    assert sorted(int(s) for s in got["steps"]) == [1, 2, 5, 6]
    code, out = robustctl("analyze", "--trace-dir", str(tmp_path), "--steps", "5-6", "--json")
    assert sorted(int(s) for s in json.loads(out)["steps"]) == [5, 6]


def test_a_single_rank_shard_is_a_trace_the_existing_loader_reads(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=1, window=1)
    for _ in range(3):
        for mb in range(2):
            with rec.op("forward-compute", mb):
                busy()
        for mb in range(2):
            with rec.op("backward-compute", mb):
                busy()
        with rec.op("optimizer"):
            busy()
        rec.step_end()
    rec.close()
    meta = load_metadata(tmp_path / "metadata.yaml")
    t = load_op_trace(tmp_path / "w00000002-dp0000-pp0000.parquet", meta)
    assert t.steps.tolist() == [2] and len(t) == 6  # 5 ops and the gc hook's one per step
    code, out = robustctl("analyze", "--metadata", str(tmp_path / "metadata.yaml"),
                          "--trace", str(tmp_path / "w00000000-dp0000-pp0000.parquet"), "--json")
    assert code == 0 and json.loads(out)["layout"]["workers"] == 1


def test_ops_of_a_step_are_ordered_and_do_not_overlap(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, cpu_compute_clock="monotonic",
                   gc_hook=False)
    for _ in range(2):
        for name in ("forward-compute", "forward-compute", "backward-compute", "backward-compute", "optimizer"):
            with rec.op(name):
                busy()
        rec.step_end()
    rec.close()
    t = tracedir.load(tmp_path)
    for s in t.steps:
        sel = np.nonzero(t.step == s)[0]
        order = sel[np.argsort(t.start[sel])]
        assert [OP_TYPES[t.optype[i]] for i in order] == ["forward-compute", "forward-compute", "backward-compute",
                                                          "backward-compute", "optimizer"]
        ends = t.start[order] + t.duration[order]
        assert (ends[:-1] <= t.start[order][1:]).all()  # each op ends before the next starts
        assert (t.duration[order] > 0).all()


def test_gc_hook_records_collections_and_takes_them_out_of_the_op(tmp_path: Path) -> None:
    before = list(gc.callbacks)
    heap = [[i] for i in range(300_000)]  # a full collection has this to walk
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, gc_min_pause=0.0,
                   cpu_compute_clock="monotonic")
    assert len(gc.callbacks) == len(before) + 1
    with rec.op("forward-compute", 0):
        gc.collect()  # all this op does is be interrupted by two collections
        gc.collect()
    with rec.op("backward-compute", 0):
        busy()
    rec.step_end()
    gc.disable()  # step 1 collects nothing
    try:
        with rec.op("forward-compute", 0):
            busy()
        rec.step_end()
    finally:
        gc.enable()
    rec.close()
    assert gc.callbacks == before  # unhooked
    del heap
    t = tracedir.load(tmp_path)
    g, fc = OP_TYPES.index("gc"), OP_TYPES.index("forward-compute")
    # One gc op per step, as in Megatron-LM's traces: both collections of step 0, nothing in step 1.
    gc0, gc1 = (np.nonzero((t.step == s) & (t.optype == g))[0] for s in (0, 1))
    assert len(gc0) == 1 and len(gc1) == 1 and t.seq_id[gc0[0]] == 0
    assert t.duration[gc1[0]] == 0.0 and t.duration[gc0[0]] > 0.0
    f0 = np.nonzero((t.step == 0) & (t.optype == fc))[0][0]
    assert t.duration[f0] < t.duration[gc0[0]]  # the compute op is charged only what is not the collections
    assert t.start[f0] <= t.start[gc0[0]] <= t.start[f0] + t.duration[f0] + t.duration[gc0[0]]
    f1 = np.nonzero((t.step == 1) & (t.optype == fc))[0][0]
    assert t.start[gc1[0]] >= t.start[f1] + t.duration[f1]  # no collection: at the step's end


def test_sampling_and_the_window_cut_short_by_the_end(tmp_path: Path) -> None:
    recs = job(tmp_path, dp=1, pp=2, every=5, window=2, start=1)
    drive(recs, steps=12, pp=2)  # steps 1, 2, 6, 7, 11 sampled; the window at 11 ends with the job
    assert recs[(0, 0)].shards_written == 2  # windows 1 and 6 written as soon as they ended
    close_all(recs)
    assert sorted({n[:9] for n in os.listdir(tmp_path) if n.endswith(".parquet")}) == ["w00000001", "w00000006",
                                                                                        "w00000011"]
    assert tracedir.load(tmp_path).steps.tolist() == [1, 2, 6, 7, 11]


def test_step_in_progress_at_close_is_dropped(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=10, window=10)
    with rec.op("forward-compute"):
        busy()
    rec.step_end()
    with rec.op("forward-compute"):  # step 1 never ends
        busy()
    rec.close()
    rec.close()  # idempotent
    assert tracedir.load(tmp_path).steps.tolist() == [0]
    with pytest.raises(RecorderError, match="after close"):
        rec.step_end()


def test_ranks_are_aligned_on_the_common_clock(tmp_path: Path) -> None:
    recs = job(tmp_path, dp=2, pp=1)
    recs[(1, 0)]._wall_offset += 0.25  # DP 1's steps started 250 ms after DP 0's on the job's clock
    for _ in range(2):
        for rec in recs.values():
            with rec.op("forward-compute"):
                busy()
            with rec.op("grads-reduce-scatter"):
                pass
            rec.step_end()
    close_all(recs)
    raw = {d: pq.read_table(tmp_path / f"w00000001-dp{d:04d}-pp0000.parquet").column("start_ts").to_numpy()
           for d in (0, 1)}
    t = tracedir.load(tmp_path, steps="1")
    for d in (0, 1):
        got = np.sort(t.start[t.dp_rank == d])
        shift = got - np.sort(raw[d])
        assert np.allclose(shift, shift[0])
        assert (shift[0] > 0.2) == (d == 1)  # the later rank moved by its lateness, the earliest not at all


def test_tensor_parallel_peers_do_not_record(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "t", dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, tp_size=2, tp_rank=1, rank=1)
    with rec.op("forward-compute"):
        busy()
    rec.step_end()
    rec.close()
    assert not (tmp_path / "t").exists() and not rec.enabled


def test_ops_per_step_are_bounded(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, max_ops_per_step=3, gc_hook=False)
    for _ in range(5):
        with rec.op("forward-compute"):
            pass
    rec.step_end()
    rec.close()
    assert rec.dropped == 2 and len(tracedir.load(tmp_path)) == 3
    assert json.loads((tmp_path / "done-dp0000-pp0000").read_text())["dropped"] == 2


@pytest.mark.parametrize(("kw", "message"), [
    ({"every": 0}, "every must be a whole number of at least 1"),
    ({"every": 2, "window": 3}, "window 3 is longer than every 2"),
    ({"dp_rank": 2}, "DP 2 PP 0 is outside the job's 2 x 1 layout"),
    ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ({"cpu_compute_clock": "tsc"}, "cpu_compute_clock must be thread or monotonic"),
])
def test_bad_setup_is_refused(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    args = {"dp_rank": 0, "pp_rank": 0, "dp_size": 2, "pp_size": 1, **kw}
    with pytest.raises(RecorderError, match=message):
        Recorder(tmp_path, **args)


def test_unknown_op_type_is_refused_in_and_out_of_a_window(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, every=2, window=1)
    with pytest.raises(RecorderError, match="unknown op type 'fwd'"):
        rec.op("fwd")
    rec.step_end()  # step 1 is not sampled
    with pytest.raises(RecorderError, match="unknown op type 'fwd'"):
        rec.op("fwd")
    rec.close()


def test_without_ranks_and_megatron_it_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(RecorderError, match="pass dp_rank, pp_rank, dp_size and pp_size"):
        Recorder(tmp_path)


def test_trace_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tracedir.load(tmp_path / "absent")
    recs = job(tmp_path, dp=2, pp=1)
    with pytest.raises(OpTraceError, match="no shards"):
        tracedir.load(tmp_path)
    drive(recs, steps=2, pp=1)
    close_all(recs)
    for n in os.listdir(tmp_path):  # as if DP 1 had not written its shards yet
        if n.endswith(".parquet") and "-dp0001-" in n:
            os.remove(tmp_path / n)
    with pytest.raises(OpTraceError, match="no complete window: window 1 lacks the shards of 1 worker.*DP 1 PP 0"):
        tracedir.load(tmp_path)
    (tmp_path / "w00000001-dp0001-pp0000.parquet").write_bytes(b"not parquet")
    with pytest.raises(OpTraceError, match="w00000001-dp0001-pp0000.parquet: unreadable parquet"):
        tracedir.load(tmp_path)


def test_robustctl_analyze_trace_dir_exit_codes(tmp_path: Path) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "stragglers", "analyze", *argv],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    r = run("--trace-dir", str(tmp_path / "absent"))
    assert r.returncode == exitcodes.UNREADABLE == 2 and "absent" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "metadata.yaml").write_text("dp_size: 1\npp_size: 1\ntp_size: 1\ndsp_size: 1\nworld_size: 1\n")
    r = run("--trace-dir", str(tmp_path))
    assert r.returncode == 64 and "no shards" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("--trace-dir", str(tmp_path), "--metadata", str(tmp_path / "metadata.yaml"))
    assert r.returncode == 64 and "either --trace-dir or --metadata and --trace" in r.stderr
    r = run("--metadata", str(tmp_path / "metadata.yaml"))
    assert r.returncode == 64 and "give --trace-dir DIR, or --metadata" in r.stderr


def test_recorder_needs_no_torch(tmp_path: Path) -> None:
    """A CPU job's recorder needs only the standard library, numpy and pyarrow: no torch, no matplotlib
    (the analyser's PNG writer), no yaml, nothing of the daemon's."""
    code = ("import sys\n"
            "from robustd.stragglers.recorder import Recorder\n"
            f"r = Recorder({str(tmp_path)!r}, dp_rank=0, pp_rank=0, dp_size=1, pp_size=1, cpu_compute_clock='thread')\n"
            "with r.op('forward-compute'):\n    pass\n"
            "r.step_end(); r.close()\n"
            "assert not {'torch', 'matplotlib', 'yaml', 'grpc', 'pydantic'} & set(sys.modules), sorted(sys.modules)\n"
            "print(r.clock)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "monotonic+thread-cpu"
    assert (tmp_path / "w00000000-dp0000-pp0000.parquet").exists()
