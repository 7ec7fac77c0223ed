"""`robustctl stragglers analyze`: what-if straggler analysis, checked against the OSDI '25 artifact's own results
on its two sample traces and against synthetic 1F1B jobs with injected causes.

Everything runs through the sub-command (parser + run), as a user calls it; assertions are on what the user
sees: the --json object, the printed report, the heatmap PNG and timeline JSON, and error messages.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from robustd.cli import stragglers as cli
from robustd.stragglers import OpTraceError, analyze_files, heatmap, synth

DATA = Path(__file__).resolve().parent / "fixtures" / "stragglers"


def robustctl(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="robustctl stragglers")
    cli.add_parser(p, lambda v, top: v.add_argument("--json", action="store_true"))
    return cli.run(p.parse_args(list(argv)))


def analyze_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert robustctl("analyze", *argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def artifact(name: str) -> dict[str, Any]:
    res = json.loads((DATA / f"result-{name}.json").read_text())
    return {"S": res["blocking_slowdown"], "steps": res["blocking_step_slowdown"],
            "simerr": res["launch_slowdown"] - 1.0, "op_types": res["blocking_decompose_by_optype"],
            "m_s": json.loads((DATA / f"ms-{name}.json").read_text())["Ms"],
            "m_w": json.loads((DATA / f"mw-{name}.json").read_text())["Mw"],
            "T": json.loads((DATA / f"ms-{name}.json").read_text())["tori"],
            "T_ideal": json.loads((DATA / f"ms-{name}.json").read_text())["tideal"]}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """The analyser's --json output on ST and AR, with the heatmap each run wrote."""
    out: dict[str, tuple[dict[str, Any], Path]] = {}
    for name in ("ST", "AR"):
        png = tmp_path_factory.mktemp(name) / "heatmap.png"
        p = argparse.ArgumentParser()
        cli.add_parser(p, lambda v, top: v.add_argument("--json", action="store_true"))
        args = p.parse_args(["analyze", "--metadata", str(DATA / f"meta-{name}.yaml"),
                             "--trace", str(DATA / f"trace-{name}.parquet"), "--heatmap", str(png), "--json"])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.run(args) == 0
        out[name] = (json.loads(buf.getvalue()), png)
    return out


# ------------------------------------------------------------------ the artifact's sample traces


@pytest.mark.parametrize("name", ["ST", "AR"])
def test_sample_trace_matches_artifact(sample: dict, name: str) -> None:
    got, _ = sample[name]
    ref = artifact(name)
    assert got["slowdown"] == pytest.approx(ref["S"], rel=0.03)
    assert got["measured_time"] == pytest.approx(ref["T"], rel=0.03)
    assert got["ideal_time"] == pytest.approx(ref["T_ideal"], rel=0.03)
    assert got["wasted_fraction"] == pytest.approx(1 - 1 / got["slowdown"], abs=1e-6)
    assert abs(got["m_s"] - ref["m_s"]) <= 0.1
    assert abs(got["m_w"] - ref["m_w"]) <= 0.1
    assert abs(got["simulation_error"] - ref["simerr"]) <= 0.01
    assert set(got["steps"]) == set(ref["steps"])
    assert max(abs(got["steps"][s] - v) for s, v in ref["steps"].items()) < 0.01
    assert set(got["op_types"]) >= set(ref["op_types"])
    assert max(abs(got["op_types"][t] - v) for t, v in ref["op_types"].items()) < 0.01


def test_st_is_last_stage_imbalance(sample: dict) -> None:
    got, png = sample["ST"]
    assert got["slowdown"] == pytest.approx(1.179, rel=0.03)
    assert got["causes"][0]["kind"] == "stage_imbalance"
    assert [c["kind"] for c in got["causes"]] == ["stage_imbalance"]
    assert "PP 3" in got["causes"][0]["evidence"] and "M_S = 1.2" in got["causes"][0]["evidence"]
    # Hot last-stage row: the last stage's workers are the slowest, every other cell is ~1.
    assert {(w["dp_rank"], w["pp_rank"]) for w in got["workers"][:2]} == {(0, 3), (1, 3)}
    assert all(w["slowdown"] < 1.01 for w in got["workers"][2:])
    assert got["workers"][0]["slowdown"] >= got["workers"][1]["slowdown"]
    assert png.stat().st_size > 0


def test_ar_names_the_slow_worker(sample: dict) -> None:
    got, png = sample["AR"]
    assert got["slowdown"] == pytest.approx(1.973, rel=0.03)
    assert [c["kind"] for c in got["causes"]] == ["slow_worker"]
    cause = got["causes"][0]
    assert "DP 0 PP 0" in cause["evidence"]
    assert cause["workers"] == [{"dp_rank": 0, "pp_rank": 0, "slowdown": got["workers"][0]["slowdown"]}]
    assert got["workers"][0]["dp_rank"] == 0 and got["workers"][0]["pp_rank"] == 0
    assert got["workers"][0]["slowdown"] == pytest.approx(1.973, rel=0.03)
    assert all(w["slowdown"] < 1.05 for w in got["workers"][1:])
    assert [w["slowdown"] for w in got["workers"]] == sorted((w["slowdown"] for w in got["workers"]), reverse=True)


def test_ar_heatmap_hottest_cell_is_the_slow_worker(sample: dict) -> None:
    report, _ = analyze_files(DATA / "meta-AR.yaml", DATA / "trace-AR.parquet")
    assert report.worker_matrix.shape == (4, 4)  # [PP, DP]
    assert heatmap.hottest(report.worker_matrix) == (0, 0)
    _, png = sample["AR"]
    from matplotlib import image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rgb = (image.imread(png)[:, :, :3] * 255).astype(int)  # decodes, or raises
    assert rgb.shape[0] > 100 and rgb.shape[1] > 100
    # The hottest cell is drawn in the darkest red of the fixed 1.0-1.5 scale.
    dark = (rgb[:, :, 0] > 90) & (rgb[:, :, 0] < 140) & (rgb[:, :, 1] < 30) & (rgb[:, :, 2] < 40)
    assert dark.sum() > 500


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    st = ("--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(DATA / "trace-ST.parquet"))
    assert robustctl("analyze", *st) == 0
    out = capsys.readouterr().out
    assert "DP 2 x PP 4 = 8 workers, 32 steps (23..1048)" in out
    assert "slowdown S = 1.17" in out or "slowdown S = 1.18" in out
    assert "stage_imbalance: fixing the last stage (PP 3)" in out
    assert "M_S = 1.2" in out


def test_steps_selection(capsys: pytest.CaptureFixture[str]) -> None:
    got = analyze_json(capsys, "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(DATA / "trace-ST.parquet"),
                       "--steps", "259-288,1010")
    assert sorted(map(int, got["steps"])) == [259, 261, 263, 264, 266, 273, 276, 278, 288, 1010]
    ref = artifact("ST")["steps"]
    # Per-op ideal values come from the selected steps only, so the numbers move a little.
    assert all(abs(v - ref[s]) < 0.05 for s, v in got["steps"].items())
    got = analyze_json(capsys, "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(DATA / "trace-ST.parquet"),
                       "--steps", "23,25")
    assert sorted(got["steps"]) == ["23", "25"]


def test_timeline_has_both_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "timeline.json"
    got = analyze_json(capsys, "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(DATA / "trace-ST.parquet"),
                       "--steps", "259-266", "--timeline", str(out))
    ev = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"{r} replay, DP {d}" for r in ("measured", "ideal") for d in (0, 1)}
    ops = [e for e in ev if e["ph"] == "X"]
    table = pq.read_table(DATA / "trace-ST.parquet").to_pydict()
    rows = sum(1 for s in table["step"] if 259 <= s <= 266)
    assert len(ops) == 2 * rows
    measured_end = max(e["ts"] + e["dur"] for e in ops if e["pid"] <= 2) / 1e6
    ideal_end = max(e["ts"] + e["dur"] for e in ops if e["pid"] > 2) / 1e6
    n = len(got["steps"])
    assert measured_end == pytest.approx(got["measured_time"] * n, rel=1e-3)
    assert ideal_end == pytest.approx(got["ideal_time"] * n, rel=1e-3)


# ------------------------------------------------------------------ synthetic jobs with known causes


def synthetic(tmp_path: Path, capsys: pytest.CaptureFixture[str], job: synth.Job,
              heatmap_png: Path | None = None) -> dict[str, Any]:
    synth.write(job, tmp_path / "trace.parquet", tmp_path / "meta.yaml")
    extra = ["--heatmap", str(heatmap_png)] if heatmap_png else []
    return analyze_json(capsys, "--metadata", str(tmp_path / "meta.yaml"), "--trace", str(tmp_path / "trace.parquet"),
                        *extra)


def test_balanced_job_has_no_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job())
    assert got["slowdown"] == pytest.approx(1.0, abs=0.02)
    assert [c["kind"] for c in got["causes"]] == ["none"]
    assert "does not straggle" in got["causes"][0]["evidence"]
    assert abs(got["simulation_error"]) < 0.02
    assert all(v == pytest.approx(1.0, abs=0.02) for v in got["steps"].values())


def test_slow_worker_is_named_and_hottest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "hm.png"
    got = synthetic(tmp_path, capsys, synth.Job(slow_worker=(1, 2, 1.6)), heatmap_png=png)
    assert got["slowdown"] > 1.2
    assert got["causes"][0]["kind"] == "slow_worker"
    assert "DP 1 PP 2" in got["causes"][0]["evidence"]
    assert got["causes"][0]["workers"][0]["dp_rank"] == 1 and got["causes"][0]["workers"][0]["pp_rank"] == 2
    assert got["m_w"] > 0.8
    assert (got["workers"][0]["dp_rank"], got["workers"][0]["pp_rank"]) == (1, 2)
    assert got["workers"][0]["slowdown"] > got["workers"][1]["slowdown"] + 0.1
    report, _ = analyze_files(tmp_path / "meta.yaml", tmp_path / "trace.parquet")
    assert heatmap.hottest(report.worker_matrix) == (1, 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heavier_last_stage_is_stage_imbalance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job(last_stage_factor=1.6))
    assert got["slowdown"] > 1.15
    assert [c["kind"] for c in got["causes"]] == ["stage_imbalance"]
    assert got["m_s"] > 0.8 and got["m_w"] < 0.2
    assert {w["pp_rank"] for w in got["workers"][:4]} == {3}


def test_long_sequences_on_one_dp_rank_is_sequence_imbalance(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job(long_sequences=True))
    assert got["slowdown"] > 1.2
    assert got["causes"][0]["kind"] == "sequence_imbalance"
    assert "correlated" in got["causes"][0]["evidence"]
    assert {c["kind"] for c in got["causes"]} <= {"sequence_imbalance"}


def test_unsynchronised_gc_pauses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job(gc_pause=0.5, gc_rate=0.1, steps=10, seed=3))
    assert got["slowdown"] > 1.1
    assert got["causes"][0]["kind"] == "gc"
    assert "garbage-collection pauses" in got["causes"][0]["evidence"]
    assert got["op_types"]["gc"] > 1.1


def test_no_pipeline_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job(dp=4, pp=1, microbatches=4, slow_worker=(2, 0, 1.5)))
    assert got["m_s"] == 0.0
    assert got["causes"][0]["kind"] == "slow_worker" and "DP 2 PP 0" in got["causes"][0]["evidence"]


# ------------------------------------------------------------------ malformed input


def write_trace(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def write_meta(path: Path, **over: Any) -> Path:
    meta = yaml.safe_load((DATA / "meta-ST.yaml").read_text())
    meta.update(over)
    for k in [k for k, v in over.items() if v is None]:
        del meta[k]
    path.write_text(yaml.safe_dump(meta))
    return path


def st_table() -> pa.Table:
    return pq.read_table(DATA / "trace-ST.parquet")


def _drop_worker_step(t: pa.Table) -> pa.Table:
    d = t.to_pydict()
    rows = zip(d["step"], d["dp_rank"], d["stage"], strict=True)
    keep = [not (s == 263 and dp == 1 and st == 2) for s, dp, st in rows]
    return t.filter(pa.array(keep))


def _set(t: pa.Table, col: str, i: int, value: Any) -> pa.Table:
    vals = t.column(col).to_pylist()
    vals[i] = value
    return t.set_column(t.column_names.index(col), col, pa.array(vals, type=t.column(col).type))


BAD_TRACES = {
    "missing columns": (lambda t: t.drop_columns(["seq_id", "duration"]), "missing columns: duration, seq_id"),
    "empty worker-step": (_drop_worker_step, "empty step 263 for worker DP 1 PP 2"),
    "unknown op type": (lambda t: t.set_column(t.column_names.index("optype"), "optype",
                                               pa.array(["forward-compute"] * (t.num_rows - 1) + ["warp-drive"])),
                        "unknown op type(s): 'warp-drive'"),
    "negative duration": (lambda t: _set(t, "duration", 5, -1.0), "1 operations have a negative duration"),
    "dp rank out of range": (lambda t: _set(t, "dp_rank", 0, 7), "dp_rank 7 is outside 0..1 (dp_size is 2)"),
    "duplicate op": (lambda t: pa.concat_tables([t, t.slice(0, 1)]), "duplicate operation: step"),
    "empty trace": (lambda t: t.slice(0, 0), "no operations (0 rows)"),
    "null values": (lambda t: _set(t, "start_ts", 3, None), "column start_ts has 1 empty values"),
}


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_malformed_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    mutate, message = BAD_TRACES[case]
    trace = write_trace(tmp_path / "bad.parquet", mutate(st_table()))
    with pytest.raises(OpTraceError) as e:
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(trace), "--json")
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)
    assert capsys.readouterr().out == ""


BAD_META = {
    "world size": ({"world_size": 63}, "world_size 63 != dp_size*pp_size*tp_size*dsp_size = 8"),
    "missing key": ({"pp_size": None, "tp_size": None}, "missing metadata key(s): pp_size, tp_size"),
    "not a number": ({"dp_size": "two"}, "dp_size must be a whole number of at least 1, not 'two'"),
    "interleaved": ({"vpp_size": 2}, "vpp_size 2: interleaved (virtual) pipeline schedules are not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_malformed_metadata(tmp_path: Path, case: str) -> None:
    over, message = BAD_META[case]
    meta = write_meta(tmp_path / "meta.yaml", **over)
    with pytest.raises(ValueError, match="metadata .*meta.yaml: ") as e:
        robustctl("analyze", "--metadata", str(meta), "--trace", str(DATA / "trace-ST.parquet"))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_world_size_mismatch_64(tmp_path: Path) -> None:
    meta = tmp_path / "meta.yaml"
    meta.write_text((DATA / "meta-AR.yaml").read_text().replace("world_size: 64", "world_size: 63"))
    with pytest.raises(ValueError, match=r"world_size 63 != dp_size\*pp_size\*tp_size\*dsp_size = 64$"):
        robustctl("analyze", "--metadata", str(meta), "--trace", str(DATA / "trace-AR.parquet"))


@pytest.mark.parametrize(("steps", "message"), [
    ("5000-6000", "no steps selected: --steps 5000-6000 matches none of the trace's 32 steps (23..1048)"),
    ("23,24", "empty step 24: the trace has no operations for it"),
    ("abc", "--steps: 'abc' is not a step number or a range like 3-40"),
    ("40-3", "--steps: range '40-3' runs backwards"),
])
def test_bad_step_selection(steps: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(DATA / "trace-ST.parquet"),
                  "--steps", steps)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unreadable_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not a parquet file at all" * 10)
    with pytest.raises(OpTraceError, match=r"unreadable parquet") as e:
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(garbage))
    assert "\n" not in str(e.value)
    bad_yaml = tmp_path / "meta.yaml"
    bad_yaml.write_text("dp_size: [2\n")
    with pytest.raises(OpTraceError, match=r"not valid YAML"):
        robustctl("analyze", "--metadata", str(bad_yaml), "--trace", str(DATA / "trace-ST.parquet"))
    with pytest.raises(OSError):
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(tmp_path / "absent.parquet"))
    with pytest.raises(OSError):
        robustctl("analyze", "--metadata", str(tmp_path / "absent.yaml"), "--trace", str(DATA / "trace-ST.parquet"))


def test_mismatched_pipeline_ops(tmp_path: Path) -> None:
    t = st_table()
    d = t.to_pydict()
    keep = [not (ot == "forward-recv" and st == 2 and seq == 3) for ot, st, seq in
            zip(d["optype"], d["stage"], d["seq_id"], strict=True)]
    trace = write_trace(tmp_path / "bad.parquet", t.filter(pa.array(keep)))
    with pytest.raises(OpTraceError, match=r"pipeline ops do not pair up: PP 1 has 4 forward-send ops per step, "
                                         r"PP 2 has 3 forward-recv"):
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(trace))


def test_m_values_are_finite_on_a_perfect_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = synthetic(tmp_path, capsys, synth.Job(noise=0.0, dp=2, pp=2, microbatches=2, steps=2))
    assert got["slowdown"] == pytest.approx(1.0, abs=0.01)
    assert all(math.isfinite(got[k]) for k in ("m_s", "m_w", "simulation_error", "wasted_fraction"))


def test_ops_missing_from_some_steps_are_tolerated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker-step without its gc op, a step without the clip all-reduce: the rest still analyses."""
    t = st_table()
    d = t.to_pydict()
    rows = zip(d["optype"], d["step"], d["dp_rank"], d["stage"], strict=True)
    keep = [not ((ot == "gc" and s == 25 and dp == 0 and st == 1) or (ot == "optimizer-clip-main-grad" and s == 263))
            for ot, s, dp, st in rows]
    trace = write_trace(tmp_path / "ragged.parquet", t.filter(pa.array(keep)))
    got = analyze_json(capsys, "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(trace))
    assert got["slowdown"] == pytest.approx(1.179, rel=0.03)
    assert got["causes"][0]["kind"] == "stage_imbalance"


def test_trace_of_zero_durations(tmp_path: Path) -> None:
    t = st_table()
    zeros = pa.array(np.zeros(t.num_rows, dtype=np.float32))
    t = t.set_column(t.column_names.index("duration"), "duration", zeros)
    t = t.set_column(t.column_names.index("start_ts"), "start_ts", zeros)
    trace = write_trace(tmp_path / "zero.parquet", t)
    with pytest.raises(OpTraceError, match="every operation in the selected steps takes no time"):
        robustctl("analyze", "--metadata", str(DATA / "meta-ST.yaml"), "--trace", str(trace))


def test_analysis_never_imports_torch(tmp_path: Path) -> None:
    """robustctl and the daemon's process must not pull torch in (design rule 1)."""
    import subprocess
    import sys

    code = ("import sys, argparse\n"
            "from robustd.cli import stragglers as cli\n"
            "p = argparse.ArgumentParser(); cli.add_parser(p, lambda v, top: v.add_argument('--json', "
            "action='store_true'))\n"
            f"cli.run(p.parse_args(['analyze', '--metadata', {str(DATA / 'meta-ST.yaml')!r}, '--trace', "
            f"{str(DATA / 'trace-ST.parquet')!r}, '--heatmap', {str(tmp_path / 'h.png')!r}, '--json']))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["causes"][0]["kind"] == "stage_imbalance"


def _robustctl_process(*argv: str, env: dict[str, str] | None = None) -> Any:
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "stragglers", "analyze", *argv],
                          capture_output=True, text=True, timeout=120, cwd=root, env={**os.environ, **(env or {})})


def test_robustctl_end_to_end_exit_codes(tmp_path: Path) -> None:
    meta, trace = str(DATA / "meta-ST.yaml"), str(DATA / "trace-ST.parquet")
    r = _robustctl_process("--metadata", meta, "--trace", trace, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert abs(doc["slowdown"] - 1.179) < 0.03 * 1.179 and doc["causes"][0]["kind"] == "stage_imbalance"
    r = _robustctl_process("--metadata", meta, "--trace", str(tmp_path / "missing.parquet"))
    # 2: unreadable (exitcodes.UNREADABLE, issue 32), no longer watch's ALERT 1
    assert (r.returncode, r.stdout) == (2, "") and "missing.parquet: No such file or directory" in r.stderr
    r = _robustctl_process("--metadata", meta, "--trace", str(DATA / "trace-AR.parquet"))
    assert r.returncode == 64 and r.stderr.startswith("robustctl: stragglers: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

    # A node install without the analysis extras says what to install, not a traceback.
    shim = tmp_path / "shim" / "pyarrow"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pyarrow'\", name='pyarrow')\n")
    r = _robustctl_process("--metadata", meta, "--trace", trace, env={"PYTHONPATH": str(shim.parent)})
    assert r.returncode == 5 and "needs pyarrow" in r.stderr and "requirements-analysis.txt" in r.stderr
    assert "Traceback" not in r.stderr


def test_one_dp_rank_always_carrying_long_sequences_is_not_a_slow_worker(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without pipeline parallelism the slowest worker is the whole long-sequence DP rank, so fixing it removes
    # all of the slowdown (M_W >= 1), yet its microbatch work varies with sequence length: a data cause.
    got = synthetic(tmp_path, capsys, synth.Job(dp=4, pp=1, long_sequences=True, long_rank=1))
    assert got["m_w"] >= 0.99
    assert [c["kind"] for c in got["causes"]] == ["sequence_imbalance"]
    assert "DP rank 1 is the slowest in all 6 steps" in got["causes"][0]["evidence"]


def test_a_fix_beyond_the_ideal_removes_all_of_the_slowdown_not_more(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # T_ideal uses the mean compute time, the slow worker's own included: in a small job fixing that worker
    # leaves the job faster than T_ideal (M_W > 1) and the other workers read below 1. That is the method's
    # definition (the artifact's own M_S for ST is 1.219); the report must not claim more than all of it.
    got = synthetic(tmp_path, capsys, synth.Job(dp=2, pp=2, slow_worker=(1, 0, 2.0)))
    assert got["m_w"] > 1.0
    assert [c["kind"] for c in got["causes"]] == ["slow_worker"]
    assert "removes all of the slowdown" in got["causes"][0]["evidence"]
    assert "%" not in got["causes"][0]["evidence"]


# ------------------------------------------------------------------ when the replay's own error is too large

EXISTING_KEYS = {"trial", "layout", "slowdown", "measured_time", "ideal_time", "traced_time", "wasted_fraction",
                 "m_s", "m_w", "m_w_workers", "simulation_error", "steps", "op_types", "dp_ranks", "pp_ranks",
                 "workers", "causes"}


def test_large_untraced_gaps_make_the_replay_untrusted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The same slow worker as test_slow_worker_is_named_and_hottest, but every launch preceded by up to 0.5 s of
    # untraced CPU time (an overloaded host): most of each traced step is outside the traced ops, so the replay
    # is not trusted and no slow_worker is given as a finding, in the JSON or the text.
    from robustd.stragglers.analysis import SIM_ERROR_CUTOFF

    monkeypatch.setattr(synth, "LAUNCH_GAP", 0.5)
    job = synth.Job(slow_worker=(1, 2, 1.6))
    got = synthetic(tmp_path, capsys, job)
    assert set(got) >= EXISTING_KEYS
    assert got["simulation_error"] > SIM_ERROR_CUTOFF
    assert got["trusted"] is False and got["sim_error_cutoff"] == SIM_ERROR_CUTOFF
    assert "outside the traced ops" in got["trust_reason"] and f"{SIM_ERROR_CUTOFF:.0%} cut-off" in got["trust_reason"]
    kinds = [c["kind"] for c in got["causes"]]
    assert kinds[0] == "untrusted" and "slow_worker" not in kinds and "stage_imbalance" not in kinds
    assert "slow worker" in got["causes"][0]["evidence"] and "is not a finding" in got["causes"][0]["evidence"]
    capsys.readouterr()
    files = ("--metadata", str(tmp_path / "meta.yaml"), "--trace", str(tmp_path / "trace.parquet"))
    assert robustctl("analyze", *files) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("not trusted: simulation error +") for ln in out) == 1
    assert not any(ln.startswith("M_S = ") for ln in out) and not any("slow_worker" in ln for ln in out)


def test_the_sample_traces_are_trusted_and_keep_their_causes(sample: dict) -> None:
    for name, kind in (("AR", "slow_worker"), ("ST", "stage_imbalance")):
        got, _ = sample[name]
        assert set(got) >= EXISTING_KEYS
        assert got["trusted"] is True and got["trust_reason"] == "" and got["simulation_error"] < 0.05
        assert [c["kind"] for c in got["causes"]] == [kind]


def test_negative_m_s_and_workers_below_1_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A slow worker on the first stage of a 2x2 job: the ideal is the mean compute, the slow worker's own
    # included, so the last stage and the other workers replay faster than ideal. The text says what that means.
    synth.write(synth.Job(dp=2, pp=2, slow_worker=(1, 0, 2.0)), tmp_path / "trace.parquet", tmp_path / "meta.yaml")
    capsys.readouterr()
    files = ("--metadata", str(tmp_path / "meta.yaml"), "--trace", str(tmp_path / "trace.parquet"))
    assert robustctl("analyze", *files) == 0
    out = capsys.readouterr().out
    assert "M_S < 0: fixing the last stage to the ideal makes the replay slower" in out
    assert "faster than the ideal, which is the mean over all workers" in out
    assert "not trusted" not in out and "slow_worker: slow worker DP 1 PP 0" in out


def test_a_worker_is_named_only_when_it_alone_would_make_the_job_straggle(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """S just over 1.1 with noisy compute: fixing the slowest worker removes most of the gap (M_W >= 0.5), but that
    worker alone slows the job by under 1.1, the study's bar for a straggling job, so no slow worker is named (a
    healthy example job on a loaded host read that way). A worker 1.3x slow still is."""
    mild = synthetic(tmp_path, capsys, synth.Job(dp=2, pp=2, microbatches=4, steps=18, noise=0.3, seed=1,
                                                 slow_worker=(1, 0, 1.15)))
    assert mild["slowdown"] >= 1.1 and mild["m_w"] >= 0.5 and mild["workers"][0]["slowdown"] < 1.1, mild
    assert "slow_worker" not in [c["kind"] for c in mild["causes"]], mild["causes"]
    slow = synthetic(tmp_path, capsys, synth.Job(dp=2, pp=2, microbatches=4, steps=18, noise=0.3, seed=1,
                                                 slow_worker=(1, 0, 1.4)))
    assert slow["workers"][0]["slowdown"] >= 1.1, slow
    named = [c for c in slow["causes"] if c["kind"] == "slow_worker"]
    assert named and named[0]["workers"][0]["dp_rank"] == 1 and named[0]["workers"][0]["pp_rank"] == 0, slow["causes"]
