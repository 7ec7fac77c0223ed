"""The PCIe check end to end: a real daemon polls a copy of an 8-GPU node's sysfs while the test breaks it.

Faults are injected the way the kernel shows them: a link width file that reads x8, AER counter
files whose TOTAL_ERR_* lines rise, a device directory removed from bus/pci/devices.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from conftest import Daemon

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

FIXTURE = Path(__file__).parent / "fixtures" / "sys" / "gpu-node"
FAST = {code: {"clear_after": "1s"} for code in
        ("PCIE_WIDTH_DEGRADED", "PCIE_AER_CORRECTABLE_RISING", "PCIE_AER_NONFATAL", "PCIE_AER_FATAL")}


def cond(v: pb.Verdict, code: str, component: str) -> pb.Condition | None:
    return next((c for c in v.conditions if c.code == code and c.component == component), None)


def wait_polled(d: Daemon, name: str, runs: int = 1, timeout: float = 5.0) -> None:
    """Until the check has finished `runs` polls (the first one takes the baselines)."""
    deadline = time.monotonic() + timeout
    while True:
        with d.channel() as ch:
            checks = pb_grpc.NodeHealthStub(ch).ListChecks(pb.ListChecksRequest(), timeout=5).checks
        info = next(c for c in checks if c.name == name)
        assert info.status != pb.CHECK_STATUS_ERROR, info.last_error
        if info.runs >= runs:
            return
        assert time.monotonic() < deadline, f"{name} did not poll: {info}\n{d.log()}"
        time.sleep(0.05)


def aer(total_name: str, **counters: int) -> str:
    return "".join(f"{k} {v}\n" for k, v in counters.items()) + f"{total_name} {sum(counters.values())}\n"


def start(make_daemon: Any, root: Path, **pcie: Any) -> Daemon:
    shutil.copytree(FIXTURE, root / "sys", symlinks=True)
    d = make_daemon({"roots": {"sys": str(root / "sys")}, "policy": {"codes": FAST},
                     "checks": {"kernel": {"enabled": False},
                                "pcie": {"enabled": True, "interval": "200ms", **pcie}}})
    d.start()
    wait_polled(d, "pcie")
    return d


def test_width_aer_and_missing_device_raise_the_right_verdict_then_clear(make_daemon: Any, short_tmp: Path) -> None:
    d = start(make_daemon, short_tmp, aer_correctable_count=5, aer_correctable_window="1s")
    dev = short_tmp / "sys" / "bus" / "pci" / "devices"
    assert not d.verdict().conditions  # a healthy node; the idle GPU's 2.5 GT/s link is no fault

    # A GPU's link retrains at x8.
    (dev / "0000:2a:00.0" / "current_link_width").write_text("8\n")
    v = d.wait_for(lambda v: cond(v, "PCIE_WIDTH_DEGRADED", "pcie/0000:2a:00.0") is not None)
    c = cond(v, "PCIE_WIDTH_DEGRADED", "pcie/0000:2a:00.0")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
    assert c.evidence["current_link_width"] == "8" and c.evidence["max_link_width"] == "16"
    assert c.source == "pcie" and (v.severity, v.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)

    # A NIC logs a non-fatal uncorrectable error; a GPU a burst of corrected ones (above the rate).
    (dev / "0000:1a:00.0" / "aer_dev_nonfatal").write_text(aer("TOTAL_ERR_NONFATAL", CmpltTO=1, UnsupReq=0))
    (dev / "0000:9a:00.0" / "aer_dev_correctable").write_text(aer("TOTAL_ERR_COR", RxErr=8, BadTLP=1))
    v = d.wait_for(lambda v: cond(v, "PCIE_AER_NONFATAL", "pcie/0000:1a:00.0") is not None
                   and cond(v, "PCIE_AER_CORRECTABLE_RISING", "pcie/0000:9a:00.0") is not None)
    c = cond(v, "PCIE_AER_NONFATAL", "pcie/0000:1a:00.0")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
    assert c.evidence["aer_CmpltTO"] == "1"
    c = cond(v, "PCIE_AER_CORRECTABLE_RISING", "pcie/0000:9a:00.0")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_NONE)
    assert c.evidence["recent"] == "6"  # 9 now, 3 at the baseline, within 1s
    assert v.severity == pb.SEVERITY_WARNING  # nothing yet takes the node out of its job

    # A fatal error on another GPU, and an NVSwitch vanishes from the bus.
    (dev / "0000:db:00.0" / "aer_dev_fatal").write_text(aer("TOTAL_ERR_FATAL", DLP=0, SDES=1))
    shutil.rmtree(dev / "0000:05:00.0")
    v = d.wait_for(lambda v: cond(v, "PCIE_AER_FATAL", "pcie/0000:db:00.0") is not None
                   and cond(v, "PCIE_DEVICE_MISSING", "pcie/0000:05:00.0") is not None)
    c = cond(v, "PCIE_AER_FATAL", "pcie/0000:db:00.0")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)
    c = cond(v, "PCIE_DEVICE_MISSING", "pcie/0000:05:00.0")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)
    assert c.sticky and c.evidence["device"] == "0x22a3"
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)

    # Restored: the link is x16 again, no counter moves, the NVSwitch is back. Only the sticky loss stays.
    (dev / "0000:2a:00.0" / "current_link_width").write_text("16\n")
    shutil.copytree(FIXTURE / "bus" / "pci" / "devices" / "0000:05:00.0", dev / "0000:05:00.0")
    v = d.wait_for(lambda v: [c.code for c in v.conditions] == ["PCIE_DEVICE_MISSING"], timeout=8)
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)


def test_counter_reset_is_not_an_error_and_errors_after_it_are(make_daemon: Any, short_tmp: Path) -> None:
    d = start(make_daemon, short_tmp)
    fatal = short_tmp / "sys" / "bus" / "pci" / "devices" / "0000:18:00.0" / "aer_dev_fatal"
    fatal.write_text(aer("TOTAL_ERR_FATAL", SDES=2))
    d.wait_for(lambda v: cond(v, "PCIE_AER_FATAL", "pcie/0000:18:00.0") is not None)
    d.wait_for(lambda v: not v.conditions, timeout=8)  # no further rise: the hold-down clears it
    fatal.write_text(aer("TOTAL_ERR_FATAL", SDES=0))  # the driver reloaded: counters start again at 0
    wait_polled(d, "pcie", runs=_runs(d) + 3)
    assert not d.verdict().conditions
    fatal.write_text(aer("TOTAL_ERR_FATAL", SDES=1))
    v = d.wait_for(lambda v: cond(v, "PCIE_AER_FATAL", "pcie/0000:18:00.0") is not None)
    assert v.severity == pb.SEVERITY_CRITICAL


def _runs(d: Daemon) -> int:
    with d.channel() as ch:
        checks = pb_grpc.NodeHealthStub(ch).ListChecks(pb.ListChecksRequest(), timeout=5).checks
    return next(c.runs for c in checks if c.name == "pcie")
