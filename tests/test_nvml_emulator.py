"""The NVML emulator under the real pynvml, each run in a child process so this one never loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from robustd.nvmlemu import build
from robustd.nvmlemu import state as emu

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import ctypes, json, os, sys, threading, time
ctypes.CDLL(os.environ["EMU_LIB"], mode=ctypes.RTLD_GLOBAL)
import pynvml as n
from robustd.nvmlemu import state as emu
PATH = os.environ["ROBUSTD_NVML_EMULATOR_STATE"]
def code(fn, *a):
    try:
        fn(*a)
        return 0
    except n.NVMLError as e:
        return e.value
def edit(f):
    s = emu.load(PATH); f(s); emu.save(PATH, s)
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build.build_emulator(str(tmp_path_factory.mktemp("nvmlemu")))


def run(lib: str, state: Path | None, body: str, timeout: float = 30) -> Any:
    env = {**os.environ, "EMU_LIB": lib, "ROBUSTD_NVML_EMULATOR_STATE": str(state) if state else ""}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def node(tmp_path: Path) -> Path:
    path = tmp_path / "nvml.state"
    emu.save(str(path), emu.healthy_node(8))
    return path


def test_library_has_the_nvml_soname_and_rebuilds_only_when_stale(lib: str) -> None:
    with open(lib, "rb") as f:
        assert b"libnvidia-ml.so.1" in f.read()  # the DT_SONAME string
    before = os.stat(lib).st_mtime_ns
    assert build.build_emulator(os.path.dirname(lib)) == lib
    assert os.stat(lib).st_mtime_ns == before
    stubs = build.stub_source("nvmlReturn_t DECLDIR nvmlDeviceGetFanSpeed(nvmlDevice_t d, unsigned int *s);\n"
                              "nvmlReturn_t DECLDIR nvmlDeviceGetName(nvmlDevice_t d, char *n, unsigned int l);",
                              "nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name) {")
    assert "nvmlDeviceGetFanSpeed(void) { return 3; }" in stubs and "nvmlDeviceGetName" not in stubs


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no cc
    with pytest.raises(build.BuildError, match="gcc"):
        build.build_emulator(str(tmp_path / "out"))


def test_inventory_through_pynvml(lib: str, node: Path) -> None:
    got = run(lib, node, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        links = [n.nvmlDeviceGetNvLinkState(h, i) for i in range(18)]
        procs_before = n.nvmlDeviceGetComputeRunningProcesses(h)
        edit(lambda s: setattr(s.gpus[0], "processes", "4242:1048576,777:0"))
        procs = [(p.pid, p.usedGpuMemory) for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
        print(json.dumps({
            "driver": n.nvmlSystemGetDriverVersion(), "nvml": n.nvmlSystemGetNVMLVersion(),
            "count": n.nvmlDeviceGetCount(), "name": n.nvmlDeviceGetName(h), "uuid": n.nvmlDeviceGetUUID(h),
            "bus": n.nvmlDeviceGetPciInfo(h).busId,
            "bus7": n.nvmlDeviceGetPciInfo(n.nvmlDeviceGetHandleByIndex(7)).busId,
            "temp": n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU),
            "temp_legacy": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "slowdown": n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "shutdown": n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            "reasons": n.nvmlDeviceGetCurrentClocksEventReasons(h),
            "dbe": n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
            "rows": n.nvmlDeviceGetRemappedRows(h),
            "pcie": [n.nvmlDeviceGetCurrPcieLinkWidth(h), n.nvmlDeviceGetMaxPcieLinkWidth(h),
                     n.nvmlDeviceGetCurrPcieLinkGeneration(h), n.nvmlDeviceGetMaxPcieLinkGeneration(h),
                     n.nvmlDeviceGetGpuMaxPcieLinkGeneration(h), n.nvmlDeviceGetPcieReplayCounter(h)],
            "links": links, "link18": code(n.nvmlDeviceGetNvLinkState, h, 18),
            "nvlink_err": n.nvmlDeviceGetNvLinkErrorCounter(h, 0, n.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            "power": n.nvmlDeviceGetPowerUsage(h), "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
            "procs_before": len(procs_before), "procs": procs,
            "unimplemented": code(n.nvmlDeviceGetFanSpeed, h),
            "bad_index": code(n.nvmlDeviceGetHandleByIndex, 8),
        }))
        n.nvmlShutdown()
    """)
    assert (got["driver"], got["nvml"], got["count"]) == ("550.54.15", "12.550.54.15", 8)
    assert got["name"] == "NVIDIA H100 80GB HBM3" and got["uuid"].startswith("GPU-")
    assert (got["bus"], got["bus7"]) == ("00000000:1B:00.0", "00000000:DF:00.0")  # as real NVML prints it
    assert (got["temp"], got["temp_legacy"], got["slowdown"], got["shutdown"]) == (35, 35, 87, 92)
    assert got["reasons"] == 0x1 and got["dbe"] == 0 and got["rows"] == [0, 0, 0, 0]
    assert got["pcie"] == [16, 16, 5, 5, 5, 0]
    assert got["links"] == [1] * 18 and got["link18"] == 2  # INVALID_ARGUMENT past the last link
    assert got["nvlink_err"] == 0 and got["power"] == 72000 and got["util"] == 0
    assert got["procs_before"] == 0 and got["procs"] == [[4242, 1048576], [777, 0]]
    assert got["unimplemented"] == 3 and got["bad_index"] == 2  # NOT_SUPPORTED, INVALID_ARGUMENT


def test_each_fault_gives_its_nvml_answer(lib: str, node: Path) -> None:
    got = run(lib, node, """
        n.nvmlInit()
        h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        for i, fault in enumerate(["lost", "ecc-dbe", "remap-pending", "remap-failure", "hw-slowdown",
                                   "nvlink-down", "pcie-width", "power-unreadable"]):
            edit(lambda s: emu.apply_fault(s, i, fault, link=2))
        out = {
            "lost": code(n.nvmlDeviceGetName, h[0]),
            "lost_temp": code(n.nvmlDeviceGetTemperatureV, h[0], 0),
            "dbe": n.nvmlDeviceGetTotalEccErrors(h[1], 1, n.NVML_VOLATILE_ECC),
            "pending": n.nvmlDeviceGetRemappedRows(h[2]),
            "failure": n.nvmlDeviceGetRemappedRows(h[3]),
            "reasons": n.nvmlDeviceGetCurrentClocksEventReasons(h[4]),
            "link2": n.nvmlDeviceGetNvLinkState(h[5], 2), "link1": n.nvmlDeviceGetNvLinkState(h[5], 1),
            "link_fields": [(v.nvmlReturn, v.valueType, v.value.uiVal) for v in n.nvmlDeviceGetFieldValues(
                h[5], [(n.NVML_FI_DEV_NVLINK_GET_STATE, 1), (n.NVML_FI_DEV_NVLINK_GET_STATE, 2),
                       (n.NVML_FI_DEV_NVLINK_GET_STATE, 99)])],
            "width": n.nvmlDeviceGetCurrPcieLinkWidth(h[6]),
            "power": code(n.nvmlDeviceGetPowerUsage, h[7]),
        }
        edit(lambda s: emu.apply_fault(s, 3, "vanish"))
        out["count_after_vanish"] = n.nvmlDeviceGetCount()
        out["vanished_handle"] = code(n.nvmlDeviceGetName, h[3])
        out["index3_now"] = n.nvmlDeviceGetPciInfo(n.nvmlDeviceGetHandleByIndex(3)).busId
        edit(lambda s: [emu.clear(s, i) for i in range(8)])
        out["cleared"] = [code(n.nvmlDeviceGetName, x) for x in h]
        out["count_cleared"] = n.nvmlDeviceGetCount()
        out["dbe_cleared"] = n.nvmlDeviceGetTotalEccErrors(h[1], 1, n.NVML_VOLATILE_ECC)
        out["dbe_aggregate"] = n.nvmlDeviceGetTotalEccErrors(h[1], 1, n.NVML_AGGREGATE_ECC)
        print(json.dumps(out))
    """)
    assert got["lost"] == got["lost_temp"] == 15  # NVML_ERROR_GPU_IS_LOST
    assert got["dbe"] == 1
    assert got["pending"] == [0, 1, 1, 0] and got["failure"] == [0, 0, 0, 1]
    assert got["reasons"] & 0x8
    assert (got["link2"], got["link1"]) == (0, 1)
    # NVML_FI_DEV_NVLINK_GET_STATE: link 1 ACTIVE, link 2 INACTIVE, link 99 INVALID_ARGUMENT in its own entry
    assert got["link_fields"][:2] == [[0, 1, 1], [0, 1, 0]] and got["link_fields"][2][0] == 2
    assert got["width"] == 8 and got["power"] == 999  # NVML_ERROR_UNKNOWN
    assert got["count_after_vanish"] == 7 and got["vanished_handle"] == 15
    assert got["index3_now"] == "00000000:9D:00.0"  # the GPUs after it move up
    assert got["cleared"] == [0] * 8 and got["count_cleared"] == 8
    assert (got["dbe_cleared"], got["dbe_aggregate"]) == (0, 1)


def test_hang_blocks_only_that_gpu_until_cleared(lib: str, node: Path) -> None:
    got = run(lib, node, """
        n.nvmlInit()
        h0, h1 = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
        edit(lambda s: emu.apply_fault(s, 0, "hang"))
        result = {}
        t0 = time.monotonic()
        def call():
            result["temp"] = n.nvmlDeviceGetTemperatureV(h0, 0)
            result["returned_after"] = time.monotonic() - t0
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(1.0)
        blocked = t.is_alive()
        other = n.nvmlDeviceGetName(h1)  # the other GPUs still answer
        count = n.nvmlDeviceGetCount()
        edit(lambda s: emu.clear(s, 0))
        t.join(3.0)
        print(json.dumps({"blocked": blocked, "other": other, "count": count, "alive": t.is_alive(), **result}))
    """)
    assert got["blocked"] and got["other"] == "NVIDIA H100 80GB HBM3" and got["count"] == 8
    assert not got["alive"] and got["temp"] == 35 and got["returned_after"] >= 1.0


def test_init_without_state_or_with_a_driver_error(lib: str, node: Path) -> None:
    got = run(lib, None, """
        print(json.dumps({"no_state": code(n.nvmlInit), "before_init": code(n.nvmlDeviceGetCount)}))
    """)
    assert got == {"no_state": 9, "before_init": 1}  # DRIVER_NOT_LOADED; UNINITIALIZED
    st = emu.load(str(node))
    st.init_error = 18  # LIB_RM_VERSION_MISMATCH
    emu.save(str(node), st)
    assert run(lib, node, "print(json.dumps(code(n.nvmlInit)))") == 18


def test_fabric_info_through_pynvml_in_both_struct_versions(lib: str, node: Path) -> None:
    got = run(lib, node, """
        edit(lambda s: [emu.apply_fault(s, 1, "fabric", value="not-started"), emu.apply_fault(s, 2, "fabric",
             value="error"), emu.apply_fault(s, 3, "fabric", value="degraded"), emu.set_value(s, 4, "fabric_state",
             "0"), emu.set_value(s, 5, "fabric_state", "-1"), emu.set_value(s, 6, "fabric_clique", "9")])
        n.nvmlInit()
        out = []
        for i in range(8):
            h = n.nvmlDeviceGetHandleByIndex(i)
            v2, v3 = n.c_nvmlGpuFabricInfoV_t(), n.c_nvmlGpuFabricInfo_v3_t()
            r = code(n.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(v2))
            r3 = code(n.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(v3))
            out.append([r, v2.state, v2.status, v2.cliqueId, v2.healthMask, bytes(v2.clusterUuid).hex(),
                        r3, v3.healthSummary])
        bad = n.c_nvmlGpuFabricInfoV_t()
        bad.version = 0x01000010
        out.append(code(n.nvmlDeviceGetGpuFabricInfoV, n.nvmlDeviceGetHandleByIndex(0), ctypes.byref(bad)))
        print(json.dumps(out))
    """)
    uuid = "5ef1a7c00b3e4f6d9a217c0de0000001"
    assert got[0] == [0, 3, 0, 1, 0xAA, uuid, 0, 1]  # completed, success, healthy summary
    assert got[1][:3] == [0, 1, 0]  # NOT_STARTED
    assert got[2][:3] == [0, 3, 999]  # completed with NVML_ERROR_UNKNOWN
    assert got[3][1] == 3 and got[3][4] == 0xA9 and got[3][7] == 3  # degraded bandwidth: limited capacity
    assert got[4][:2] == [0, 0] and got[4][7] == 0  # state NOT_SUPPORTED (a PCIe card)
    assert got[5][0] == 3 and got[5][6] == 3  # the call NOT_SUPPORTED (pre-Hopper)
    assert got[6][3] == 9
    assert got[8] == 25  # another struct version: NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_load_clocks_power_and_reasons_through_pynvml(lib: str, node: Path) -> None:
    """What the GPU check's relative checks read: utilization, SM clock, power draw, clock event reasons."""
    got = run(lib, node, """
        edit(lambda s: [emu.under_load(s, 1), emu.set_value(s, 2, "sm_clock_mhz", "-1"),
             emu.set_value(s, 1, "clocks_event_reasons", "0x24")])
        n.nvmlInit()
        out = []
        for i in range(3):
            h = n.nvmlDeviceGetHandleByIndex(i)
            sm = (code(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM) if i == 2
                  else n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            out.append([sm,
                        code(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM),
                        n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_GRAPHICS) if i != 2 else None,
                        n.nvmlDeviceGetUtilizationRates(h).gpu, n.nvmlDeviceGetPowerUsage(h),
                        n.nvmlDeviceGetCurrentClocksEventReasons(h), n.nvmlDeviceGetCurrentClocksThrottleReasons(h)])
        print(json.dumps(out))
    """)
    assert got[0] == [emu.IDLE_SM_CLOCK_MHZ, 3, emu.IDLE_SM_CLOCK_MHZ, 0, emu.IDLE_POWER_MW, 0x1, 0x1]  # idle
    assert got[1] == [emu.BOOST_SM_CLOCK_MHZ, 3, emu.BOOST_SM_CLOCK_MHZ, 95, emu.LOADED_POWER_MW, 0x24, 0x24]
    assert got[2][0] == 3  # sm_clock_mhz -1: NOT_SUPPORTED, as a driver that hides clocks


def test_settings_getters_and_setters_write_back_to_the_state_file(lib: str, node: Path) -> None:
    """What a stop-time test may change reads back through pynvml; the setters robustd restores with write
    the state file, so another process (the daemon, a fake dcgmi) sees the change."""
    out = run(lib, node, """
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(1)
    g = lambda: [n.nvmlDeviceGetApplicationsClock(h, n.NVML_CLOCK_GRAPHICS),
                 n.nvmlDeviceGetClock(h, n.NVML_CLOCK_MEM, n.NVML_CLOCK_ID_APP_CLOCK_TARGET),
                 n.nvmlDeviceGetPowerManagementLimit(h), n.nvmlDeviceGetEnforcedPowerLimit(h),
                 n.nvmlDeviceGetPersistenceMode(h), n.nvmlDeviceGetComputeMode(h),
                 list(n.nvmlDeviceGetEccMode(h)), list(n.nvmlDeviceGetMigMode(h))]
    before = g()
    edit(lambda s: [emu.set_value(s, 1, "app_clock_graphics", "1200"), emu.set_value(s, 1, "ecc_pending", "0")])
    changed = g()
    n.nvmlDeviceResetApplicationsClocks(h)
    n.nvmlDeviceSetPowerManagementLimit(h, 500000)
    n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    n.nvmlDeviceSetPersistenceMode(h, 0)
    after = g()
    edit(lambda s: emu.set_value(s, 1, "set_error", "4"))
    denied = code(n.nvmlDeviceSetPowerManagementLimit, h, 700000)
    edit(lambda s: emu.set_value(s, 1, "mig_mode", "-1"))
    mig = code(n.nvmlDeviceGetMigMode, h)
    boost = code(n.nvmlDeviceGetClock, h, n.NVML_CLOCK_SM, n.NVML_CLOCK_ID_CUSTOMER_BOOST_MAX)
    print(json.dumps([before, changed, after, denied, mig, boost]))
    """)
    before, changed, after, denied, mig, boost = out
    assert before == [1980, 2619, 700000, 700000, 1, 0, [1, 1], [0, 0]]
    assert changed[0] == 1200 and changed[6] == [1, 0]
    assert after == [1980, 2619, 500000, 500000, 0, 3, [1, 0], [0, 0]]
    saved = emu.load(str(node)).gpus[1]  # written back: what the next process reads
    assert (saved.power_limit_mw, saved.compute_mode, saved.persistence_mode) == (500000, 3, 0)
    assert emu.load(str(node)).gpus[0].power_limit_mw == 700000  # only that GPU's section
    assert denied == 4 and mig == 3 and boost == 3  # NO_PERMISSION; NOT_SUPPORTED
