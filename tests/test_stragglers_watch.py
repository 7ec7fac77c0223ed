"""`robustctl stragglers watch DIR`: online monitoring of a trace directory that fills while the job runs.

Two sources of shards: a synthetic 1F1B job (robustd.stragglers.synth, known causes) written window by window
by a thread, in the recorder's directory layout; and the real example job (examples/pipeline_train.py), four
processes with a worker slowed from mid-run, watched by robustctl in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import stragglers_cli as robustctl

from robustd.cli import exitcodes
from robustd.cli import stragglers as cli
from robustd.stragglers import synth
from robustd.stragglers.optrace import OP_TYPES
from robustd.stragglers.recorder import DONE_FORMAT, SHARD_FORMAT

REPO = Path(__file__).resolve().parent.parent
WINDOW = 3  # steps per window


def synthetic_windows(windows: int, fault_from: int) -> dict[int, dict[str, np.ndarray]]:
    """Columns per window of a dp2 x pp2 job; DP 1 PP 0 is 2x slower from window `fault_from` on."""
    steps = windows * WINDOW
    healthy = synth.generate(synth.Job(dp=2, pp=2, microbatches=4, steps=steps, seed=1))
    slow = synth.generate(synth.Job(dp=2, pp=2, microbatches=4, steps=steps, seed=1, slow_worker=(1, 0, 2.0)))
    out = {}
    for w in range(windows):
        src = slow if w >= fault_from else healthy
        keep = (src["step"] >= w * WINDOW) & (src["step"] < (w + 1) * WINDOW)
        out[w * WINDOW] = {k: v[keep] for k, v in src.items()}
    return out


def write_window(directory: Path, first: int, cols: dict[str, np.ndarray], done: bool = False) -> None:
    """One shard per worker, as the recorder names and writes them (temporary name, then rename)."""
    for d in (0, 1):
        for p in (0, 1):
            sel = (cols["dp_rank"] == d) & (cols["stage"] == p)
            t = pa.table({k: (pa.DictionaryArray.from_arrays(pa.array(v[sel].astype(np.int8)), pa.array(OP_TYPES))
                              if k == "optype" else pa.array(v[sel])) for k, v in cols.items()})
            path = directory / SHARD_FORMAT.format(first=first, dp=d, pp=p)
            pq.write_table(t, directory / f".{path.name}.tmp")
            os.replace(directory / f".{path.name}.tmp", path)
    if done:
        for d in (0, 1):
            for p in (0, 1):
                (directory / DONE_FORMAT.format(dp=d, pp=p)).write_text("{}")


def write_meta(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metadata.yaml").write_text(yaml.safe_dump(synth.Job(dp=2, pp=2).meta_dict()))


def test_watch_reports_each_window_and_alerts_once_the_fault_persists(tmp_path: Path) -> None:
    windows = synthetic_windows(6, fault_from=2)
    stop = threading.Event()

    def job() -> None:  # the directory fills while the watch runs
        write_meta(tmp_path)
        for first, cols in windows.items():
            if stop.wait(0.15):
                return
            write_window(tmp_path, first, cols)

    writer = threading.Thread(target=job)
    writer.start()
    try:
        code, out = robustctl("watch", str(tmp_path), "--poll", "50ms", "--idle-timeout", "60s")
    finally:
        stop.set()
        writer.join(timeout=30)
    lines = out.splitlines()
    assert code == 1
    reports = [ln for ln in lines if not ln.startswith("ALERT")]
    # One line per window, oldest first: two healthy windows, then three straggling ones and the alert.
    assert [ln.split(":")[0] for ln in reports] == ["steps 0-2", "steps 3-5", "steps 6-8", "steps 9-11",
                                                    "steps 12-14"]
    s = [float(re.search(r"S = ([0-9.]+)", ln).group(1)) for ln in reports]
    assert max(s[:2]) < 1.1 < min(s[2:])
    assert all("cause none" in ln for ln in reports[:2])
    assert all("cause slow_worker" in ln and "slowest DP 1 PP 0" in ln for ln in reports[2:])
    assert lines[-1].startswith("ALERT: S > 1.1 for 3 consecutive windows (steps 6-14): slow_worker: ")
    assert "DP 1 PP 0" in lines[-1]
    png = tmp_path / "heatmap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # rewritten per window


def test_watch_ends_quietly_when_every_recorder_has_closed(tmp_path: Path) -> None:
    write_meta(tmp_path)
    windows = synthetic_windows(3, fault_from=99)
    for i, (first, cols) in enumerate(windows.items()):
        write_window(tmp_path, first, cols, done=i == len(windows) - 1)
    code, out = robustctl("watch", str(tmp_path), "--poll", "10ms", "--heatmap", str(tmp_path / "h.png"))
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4
    assert lines[-1] == "watch: the job's recorders have all closed: 3 window(s), no alert"
    assert (tmp_path / "h.png").exists() and not (tmp_path / "heatmap.png").exists()


def test_watch_once_json_and_a_stricter_alert(tmp_path: Path) -> None:
    write_meta(tmp_path)
    for first, cols in synthetic_windows(4, fault_from=2).items():
        write_window(tmp_path, first, cols)
    code, out = robustctl("watch", str(tmp_path), "--once", "--alert-windows", "5", "--json")
    docs = [json.loads(ln) for ln in out.splitlines()]
    assert code == 0 and [d["window"] for d in docs] == [0, 3, 6, 9]
    assert [d["cause"] for d in docs] == ["none", "none", "slow_worker", "slow_worker"]
    assert docs[2]["slowest"][0]["dp_rank"] == 1 and docs[2]["slowest"][0]["pp_rank"] == 0
    code, out = robustctl("watch", str(tmp_path), "--once", "--alert-windows", "2", "--alert-slowdown", "1.2")
    assert code == 1 and out.splitlines()[-1].startswith("ALERT: S > 1.2 for 2 consecutive windows (steps 6-11)")


def test_watch_skips_a_broken_window_and_gives_up_when_idle(tmp_path: Path) -> None:
    write_meta(tmp_path)
    windows = synthetic_windows(2, fault_from=99)
    for first, cols in windows.items():
        write_window(tmp_path, first, cols)
    (tmp_path / SHARD_FORMAT.format(first=0, dp=1, pp=0)).write_bytes(b"garbage")
    code, out = robustctl("watch", str(tmp_path), "--poll", "10ms", "--idle-timeout", "200ms")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("window 0: error: shard ") and "unreadable parquet" in lines[0]
    assert lines[1].startswith("steps 3-5: S = ")
    assert lines[2] == "watch: no new window for 0.2 s: stopped, 2 window(s)"


@pytest.mark.parametrize(("argv", "message"), [
    (["--alert-slowdown", "0.9"], "at least 1.0"),
    (["--alert-windows", "0"], "must be at least 1"),
    (["--poll", "0s"], "must be more than zero"),
])
def test_watch_bad_options(tmp_path: Path, argv: list[str], message: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="robustctl stragglers")
    cli.add_parser(p, lambda v, top: v.add_argument("--json", action="store_true"))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["watch", str(tmp_path), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_watch_the_real_job_as_the_fault_starts_mid_run(tmp_path: Path) -> None:
    """The example job, 4 processes, DP 1 PP 0 slowed 5x from step 12; robustctl watches in its own process."""
    trace = tmp_path / "trace"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    watch = subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "stragglers", "watch", str(trace),
                              "--poll", "200ms", "--idle-timeout", "240s", "--alert-windows", "2",
                              "--alert-slowdown", "1.3"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        job = subprocess.run([sys.executable, "examples/pipeline_train.py", "--pp", "2", "--dp", "2", "--steps",
                              "24", "--trace-dir", str(trace), "--slow-worker", "1,0", "--slow-factor", "4",
                              "--fault-after", "12", "--record-start", "0", "--record-every", "4",
                              "--record-window", "4", "--timeout", "240"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        out, err = watch.communicate(timeout=120)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(timeout=10)
    assert job.returncode == 0, job.stderr[-2000:]
    lines = out.splitlines()
    assert watch.returncode == 1, (out, err)
    reports = [ln for ln in lines if ln.startswith("steps ")]
    firsts = [int(ln.split()[1].split("-")[0]) for ln in reports]
    assert firsts == sorted(firsts) and len(firsts) >= 4 and firsts[0] == 0  # successive windows, from the start
    alert = lines[-1]
    m = re.match(r"ALERT: S > 1.3 for 2 consecutive windows \(steps (\d+)-(\d+)\): slow_worker: ", alert)
    assert m, lines
    assert int(m.group(1)) >= 12  # not before the fault began
    assert "DP 1 PP 0" in alert


def test_watch_waits_for_a_metadata_file_still_being_written(tmp_path: Path) -> None:
    """A launcher that writes metadata.yaml in place (not atomically, as the recorder does): the watch reads
    an empty, then a half file, and keeps following until it parses, then reports the windows as usual."""
    from robustd.stragglers import watch

    meta = tmp_path / "metadata.yaml"
    full = yaml.safe_dump(synth.Job(dp=2, pp=2).meta_dict())
    for first, cols in synthetic_windows(2, fault_from=99).items():
        write_window(tmp_path, first, cols, done=first == WINDOW)
    meta.write_text("")
    clock = [0.0]
    stages = iter(["", full[: len(full) // 2].rsplit("\n", 1)[0] + "\n  - [", full])

    def sleep(s: float) -> None:
        clock[0] += s
        meta.write_text(next(stages, full))

    seen: list[str] = []
    w = watch.Watch(directory=tmp_path, heatmap_path=tmp_path / "h.png")
    code, closing = watch.follow(w, lambda win, alert: seen.append(win.line()), poll_s=0.5, idle_timeout=60,
                                 sleep=sleep, clock=lambda: clock[0])
    assert code == 0 and [ln.split(":")[0] for ln in seen] == ["steps 0-2", "steps 3-5"], seen
    assert closing.startswith("watch: the job's recorders have all closed: 2 window(s)")


def test_watch_fails_on_metadata_that_stays_malformed(tmp_path: Path) -> None:
    from robustd.stragglers import watch
    from robustd.stragglers.optrace import OpTraceError

    (tmp_path / "metadata.yaml").write_text("dp_size: [\n")
    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s

    w = watch.Watch(directory=tmp_path)
    with pytest.raises(OpTraceError, match=r"not valid YAML \(line 2\)"):
        watch.follow(w, lambda win, alert: None, poll_s=1.0, idle_timeout=600, sleep=sleep, clock=lambda: clock[0])
    assert watch.META_GRACE_S <= clock[0] < watch.META_GRACE_S + 2  # waited the grace, then gave up
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "stragglers", "watch", str(tmp_path), "--once"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)  # --once: no grace
    assert r.returncode == exitcodes.USAGE and "not valid YAML (line 2)" in r.stderr and "Traceback" not in r.stderr, r


def test_watch_of_an_untrusted_replay_alerts_on_s_without_claiming_a_slow_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DP 1 PP 0 slow in every window, but each launch preceded by up to 0.5 s of untraced CPU time (an
    # overloaded host): the alert still comes on S, and its cause says the replay is not trusted.
    monkeypatch.setattr(synth, "LAUNCH_GAP", 0.5)
    write_meta(tmp_path)
    for first, cols in synthetic_windows(3, fault_from=0).items():
        write_window(tmp_path, first, cols)
    code, out = robustctl("watch", str(tmp_path), "--once")
    lines = out.splitlines()
    assert code == 1, lines
    assert all("cause untrusted" in ln for ln in lines[:-1]) and not any("slow_worker" in ln for ln in lines)
    assert lines[-1].startswith("ALERT: S > 1.1 for 3 consecutive windows (steps 0-8): untrusted: ")
    assert "simulation error" in lines[-1] and "not trusted" in lines[-1]
    code, out = robustctl("watch", str(tmp_path), "--once", "--json")
    first = json.loads(out.splitlines()[0])
    assert first["trusted"] is False and first["cause"] == "untrusted"
