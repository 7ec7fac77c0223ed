"""Relative checks across a node's GPUs, end to end: a real daemon whose GPU check reads the NVML emulator
through the real pynvml, its GPUs put under load and one held below its peers' SM clock or power draw."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from test_gpu_check import BUS, Node, cond, has, lib, meaning  # noqa: F401 - lib: the emulator, built once

from robustd.api.v1 import robustd_pb2 as pb
from robustd.nvmlemu import state as emu

WINDOW = 1.0  # checks.gpu.outlier_window in these tests (default 60 s)
# Every reason bit nvml.h names but idle, and one it does not (a newer driver's): all must come out by name.
ALL_REASONS = 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x1000
ALL_NAMES = ("applications_clocks_setting,sw_power_cap,hw_slowdown,sync_boost,sw_thermal_slowdown,"
             "hw_thermal_slowdown,hw_power_brake_slowdown,display_clock_setting,unknown_0x1000")


def outliers(v: pb.Verdict) -> set[tuple[str, str]]:
    return {(c.code, c.component) for c in v.conditions if c.code.endswith("_OUTLIER")}


def node(make_daemon: Any, root: Path, lib: str, gpus: int = 4) -> Node:  # noqa: F811
    return Node(make_daemon, root, lib, gpus=gpus, gpu={"outlier_window": f"{WINDOW * 1000:.0f}ms"})


def test_clock_and_power_outliers_under_load_with_reasons_then_clear(make_daemon: Any, short_tmp: Path,
                                                                     lib: str) -> None:  # noqa: F811
    n = node(make_daemon, short_tmp, lib)

    def idle_and_two_loaded(s: emu.EmulatorState) -> None:
        s.gpus[3].sm_clock_mhz, s.gpus[3].power_mw = 210, 30_000  # idle and far below the others: never compared
        emu.under_load(s, 0)
        emu.under_load(s, 1)
        s.gpus[1].sm_clock_mhz = 1200  # below GPU 0, but two loaded GPUs are no median
    n.edit(idle_and_two_loaded)
    time.sleep(WINDOW + 0.8)
    assert not outliers(n.d.verdict())

    def all_loaded(s: emu.EmulatorState) -> None:
        for i in range(4):
            emu.under_load(s, i)
        s.gpus[2].sm_clock_mhz = 1500  # 24 % below the median 1980
        s.gpus[2].clocks_event_reasons = ALL_REASONS
    n.edit(all_loaded)
    edited = time.monotonic()
    v = n.d.wait_for(has("GPU_CLOCK_OUTLIER", f"gpu/{BUS[2]}"), timeout=WINDOW + 4)
    assert time.monotonic() - edited >= WINDOW - 0.05  # sustained over the window, not the first low poll
    c = cond(v, "GPU_CLOCK_OUTLIER", f"gpu/{BUS[2]}")
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT) and c is not None
    assert c.evidence["value"] == "1500 MHz" and c.evidence["median"] == "1980 MHz"
    assert c.evidence["tolerance"] == "10%" and c.evidence["below"] == "24.2%" and c.evidence["loaded_gpus"] == "4"
    assert c.evidence["reasons"] == ALL_NAMES and c.evidence["reasons_mask"] == hex(ALL_REASONS)
    assert "sw_power_cap" in c.message and "below the median 1980 MHz of 4 loaded GPUs" in c.message
    assert outliers(v) == {("GPU_CLOCK_OUTLIER", f"gpu/{BUS[2]}")}  # its power is its peers': no power outlier

    def clock_back_power_low(s: emu.EmulatorState) -> None:
        emu.under_load(s, 2)
        s.gpus[2].clocks_event_reasons, s.gpus[2].power_mw = 0, 400_000
    n.edit(clock_back_power_low)
    v = n.d.wait_for(lambda v: outliers(v) == {("GPU_POWER_OUTLIER", f"gpu/{BUS[2]}")}, timeout=WINDOW + 4)
    c = cond(v, "GPU_POWER_OUTLIER", f"gpu/{BUS[2]}")
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT) and c is not None
    assert c.evidence["value"] == "400 W" and c.evidence["median"] == "650 W" and c.evidence["tolerance"] == "20%"
    assert c.evidence["reasons"] == "none" and "no clock event reason reported" in c.message

    n.set(2, "power_mw", 560_000)  # 14 % below: within the 20 % power tolerance, so it clears (clear_after 1s)
    n.d.wait_for(lambda v: not outliers(v), timeout=5)


def test_a_gpu_that_goes_idle_starts_its_window_again(make_daemon: Any, short_tmp: Path,
                                                      lib: str) -> None:  # noqa: F811
    n = node(make_daemon, short_tmp, lib)

    def loaded_one_slow(s: emu.EmulatorState) -> None:
        for i in range(4):
            emu.under_load(s, i)
        s.gpus[1].sm_clock_mhz = 1400
    n.edit(loaded_one_slow)
    time.sleep(WINDOW * 0.7)
    n.set(1, "utilization_gpu", 0)  # an evaluation step: idle, not compared, its window reset
    time.sleep(0.5)
    assert not outliers(n.d.verdict())
    n.set(1, "utilization_gpu", 95)
    back = time.monotonic()
    n.d.wait_for(has("GPU_CLOCK_OUTLIER", f"gpu/{BUS[1]}"), timeout=WINDOW + 4)
    # A full window after it came back (without the reset it would have raised about now + 0.0-0.2 s).
    assert time.monotonic() - back >= WINDOW - 0.05
