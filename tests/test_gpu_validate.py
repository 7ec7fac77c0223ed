"""The real-GPU validation script's CPU-side parts: the wheelhouse set-up, the run without a driver, and
its GPU path against the NVML emulator standing in for the host's libnvidia-ml.so.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from test_nvml_emulator import lib  # noqa: F401 - the emulator, built once per module

from robustd.nvmlemu import state as emu

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-validate.sh"


def test_wheelhouse_then_an_offline_venv_and_a_run_without_a_driver_say_what_they_would_check(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    r = subprocess.run([str(SCRIPT), "wheelhouse", str(wheelhouse)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    size = sum(p.stat().st_size for p in wheelhouse.iterdir())
    assert size < 50 * 2**20 and (wheelhouse / "requirements.txt").exists()  # with the checkout, under ~60 MiB
    out = tmp_path / "summary.json"
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    r = subprocess.run([str(SCRIPT), "--wheelhouse", str(wheelhouse), "--venv", str(tmp_path / "venv"),
                        "--out", str(out), "--skip", "diag,tracer"], capture_output=True, text=True, timeout=120,
                       env={**env, "PATH": "/usr/bin:/bin"}, cwd=tmp_path)  # the system Python, no make, no gcc
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - started < 60
    summary = json.loads(out.read_text())
    assert summary["ok"] and not summary["gpu"]
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == ["nvml", "daemon", "diag", "tracer", "dcgmi"]
    assert all(s["status"] == "SKIP" and "would" in s["detail"] for s in steps.values())
    assert "no NVIDIA driver" in steps["daemon"]["detail"]  # the daemon started from the venv and answered
    assert "STEP" in r.stdout and "OK in" in r.stdout  # the table, printed


def test_the_gpu_path_runs_against_a_driver_stand_in(tmp_path: Path, lib: str) -> None:  # noqa: F811
    state = emu.healthy_node(4)
    state.gpus[1].event_types = 0
    state.gpus[1].sm_clock_mhz = -1  # a driver that does not give the SM clock
    state.gpus[2].power_mw = -1
    state.gpus[3].fabric_state = emu.FABRIC_NOT_SUPPORTED  # a PCIe card among them
    state.gpus[3].mig_mode = -1  # ... without MIG
    path = tmp_path / "nvml.state"
    emu.save(str(path), state)
    out = tmp_path / "summary.json"
    env = {**os.environ, "LD_LIBRARY_PATH": os.path.dirname(lib), emu.ENV_VAR: str(path)}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_validate.py"), "--out", str(out),
                        "--skip", "diag,tracer,dcgmi"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(out.read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert summary["gpu"] and steps["nvml"]["status"] == "PASS" and steps["daemon"]["status"] == "PASS"
    gpus = steps["nvml"]["data"]["gpus"]
    assert len(gpus) == 4 and gpus[0]["fields"]["temperature"] == 35 and gpus[0]["events_watched"]
    assert gpus[1]["event_types"] == [] and not gpus[1]["events_watched"]
    assert gpus[2]["fields"]["power_mw"].startswith("error: ")
    assert gpus[0]["fields"]["sm_clock_mhz"] == emu.IDLE_SM_CLOCK_MHZ and gpus[0]["clock_event_reasons"] == ["gpu_idle"]
    assert steps["nvml"]["data"]["not_supported"]["sm_clock_mhz"] == ["1"]
    assert gpus[0]["fabric"]["state"] == "COMPLETED" and gpus[0]["fabric"]["problems"] == []
    assert gpus[3]["fabric"]["state"] == "NOT_SUPPORTED"
    assert steps["nvml"]["data"]["not_supported"]["fabric"] == ["3"] and "fabric (GPU 3)" in steps["nvml"]["detail"]
    assert gpus[0]["settings"]["power_limit"] == 700000 and gpus[0]["settings"]["ecc_mode_pending"] == 1
    assert gpus[3]["settings"]["mig_mode"] == "NOT_SUPPORTED" and "mig_mode (GPU 3)" in steps["nvml"]["detail"]
    daemon = steps["daemon"]["data"]
    assert daemon["gpu_check"]["note"].startswith("NVML events NOT_SUPPORTED on 1 of 4 GPUs")
    assert any("GPU_POWER_UNREADABLE" in c for c in daemon["conditions"])
