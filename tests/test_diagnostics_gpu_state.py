"""GPUs left changed by a stop-time test (robustd/diagnostics/gpustate.py), through the real daemon on the NVML
emulator: the fake dcgmi changes GPU settings during the run as NVIDIA's EUD has (downclocked, another power
cap, ECC flipped for the next reset); the report says what robustd set back, GPU_STATE_CHANGED names the rest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conftest import Daemon
from test_diagnostics import diag_daemon, run

from checks.gpu.parse import normalize_bus_id
from robustd.api.v1 import robustd_pb2 as pb
from robustd.nvmlemu import state as emu


def gpu_node(make_daemon: Any, short_tmp: Path, changes: str, timeout: str = "20s") -> tuple[Daemon, Path, list[str]]:
    """A daemon on 4 emulated GPUs whose fake dcgmi applies `changes` (FAKE_DCGMI_SET) while it runs."""
    state = short_tmp / "nvml.state"
    node = emu.healthy_node(4)
    emu.save(str(state), node)
    gpu_check = {"enabled": True, "backend": "emulator", "emulator_state": str(state), "interval": "1h"}
    d = diag_daemon(make_daemon, "pass4", diagnostics={"gpu_state_timeout": timeout}, checks={"gpu": gpu_check},
                    env={"FAKE_DCGMI_SET": changes, "FAKE_DCGMI_GPUS": "4"})
    d.wait_for(lambda v: bool(v.emulated), timeout=10)  # the GPU check has listed the GPUs
    return d, state, [f"gpu/{normalize_bus_id(g.bus_id)}" for g in node.gpus]


def by_gpu(report: pb.DiagnosticReport) -> dict[str, pb.TestResult]:
    return {x.component: x for x in report.results if x.test == "gpu_state"}


def test_changed_settings_are_restored_and_what_cannot_be_is_gpu_state_changed(make_daemon: Any,
                                                                               short_tmp: Path) -> None:
    d, state, gpu = gpu_node(make_daemon, short_tmp, ",".join([
        "1:app_clock_graphics=1200", "1:app_clock_mem=1593", "1:power_limit_mw=450000", "1:compute_mode=3",
        "1:persistence_mode=0",  # GPU 1: downclocked and capped, all of it settable
        "2:ecc_pending=0",  # GPU 2: ECC off at the next reset: never set back by robustd
        "3:set_error=4", "3:power_limit_mw=300000",  # GPU 3: capped, and robustd may not set it (not root)
    ]))
    _, report = run(d, tests=["eud"])
    results = by_gpu(report)
    assert set(results) == {gpu[1], gpu[2], gpu[3]}  # GPU 0 was not changed: nothing said about it
    ok = results[gpu[1]]
    assert ok.status == pb.RESULT_PASS
    assert "power_limit 700000 mW → 450000 mW" in ok.message
    assert "compute_mode DEFAULT → EXCLUSIVE_PROCESS" in ok.message
    assert ok.details["app_clock_graphics"] == "1980 MHz → 1200 MHz; restored"
    assert ok.details["persistence_mode"] == "enabled → disabled; restored"
    back = emu.load(str(state)).gpus[1]  # set back through NVML, as the next job finds it
    assert (back.app_clock_graphics, back.app_clock_mem, back.power_limit_mw, back.compute_mode,
            back.persistence_mode) == (1980, 2619, 700000, 0, 1)

    ecc, denied = results[gpu[2]], results[gpu[3]]
    assert ecc.status == pb.RESULT_FAIL
    assert "ecc_mode_pending enabled → disabled (applies at the next GPU reset" in ecc.message
    assert denied.status == pb.RESULT_FAIL
    assert "power_limit 700000 mW → 300000 mW (setting it back failed: Insufficient Permissions)" in denied.message
    assert "enforced_power_limit" in denied.details
    assert emu.load(str(state)).gpus[2].ecc_pending == 0  # not touched

    # The tests passed: a GPU left changed is a WARNING condition to reset it, not a failed test (no drain)
    assert report.outcome == pb.OUTCOME_PASS and not report.suspects
    assert (report.severity, report.action) == (pb.SEVERITY_OK, pb.ACTION_NONE)
    assert f"restored on {gpu[1]}" in report.message
    assert f"left changed (GPU_STATE_CHANGED, reset the GPU) on {gpu[2]}, {gpu[3]}" in report.message
    conds = {c.component: c for c in d.verdict().conditions if c.code == "GPU_STATE_CHANGED"}
    assert set(conds) == {gpu[2], gpu[3]}
    c = conds[gpu[2]]
    assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_RESET_GPU)
    assert c.evidence["ecc_mode_pending"].startswith("enabled → disabled") and c.evidence["report"] == report.id


def test_an_nvml_failure_reading_the_settings_is_an_error_never_a_verdict(make_daemon: Any, short_tmp: Path) -> None:
    d, _, gpu = gpu_node(make_daemon, short_tmp, "1:power_limit_mw=450000,2:fault=lost")
    _, report = run(d, tests=["eud"])
    results = by_gpu(report)
    assert results[gpu[1]].status == pb.RESULT_PASS  # what could be read was still set back
    lost = results[gpu[2]]
    assert lost.status == pb.RESULT_ERROR and "could not read this GPU's settings after the run" in lost.message
    assert "GPU is lost" in lost.message  # the reason NVML gave
    assert report.outcome == pb.OUTCOME_ERROR and not report.suspects
    assert not [c for c in d.verdict().conditions if c.code == "GPU_STATE_CHANGED"]


def test_a_hung_nvml_call_is_killed_at_its_timeout_and_is_an_error(make_daemon: Any, short_tmp: Path) -> None:
    """A GPU whose driver calls block (the emulator's `hang`) must not hold the run: the child reading the
    settings after it is killed at diagnostics.gpu_state_timeout and the report says so."""
    d, _, _ = gpu_node(make_daemon, short_tmp, "2:fault=hang", timeout="1s")
    started = time.monotonic()
    _, report = run(d, tests=["eud"])
    assert time.monotonic() - started < 10
    [hung] = [x for x in report.results if x.test == "gpu_state"]
    assert (hung.component, hung.status) == ("host", pb.RESULT_ERROR)
    assert "NVML did not answer within 1s" in hung.message
    assert report.outcome == pb.OUTCOME_ERROR and not report.suspects
