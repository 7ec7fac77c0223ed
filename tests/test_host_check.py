"""The thermal and host checks end to end: a real daemon on a copied node tree, and on a real tmpfs.

The fixture test changes the files the kernel would change (hwmon temperatures, the mount table,
PSI, EDAC counters, a SCSI ioerr_cnt). The tmpfs test fills and remounts a real file system.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI, Daemon, need_root

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

FIXTURES = Path(__file__).parent / "fixtures"
FAST = {code: {"clear_after": "1s"} for code in
        ("TEMP_HIGH", "DISK_SPACE_LOW", "DISK_READONLY", "DISK_IO_ERRORS_RISING", "MEMORY_PRESSURE", "EDAC_CE_RISING")}
PSI_CALM = "some avg10=0.00 avg60=0.00 avg300=0.00 total=1523\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=822\n"


def cond(v: pb.Verdict, code: str, component: str) -> pb.Condition | None:
    return next((c for c in v.conditions if c.code == code and c.component == component), None)


def sev(v: pb.Verdict, code: str, component: str) -> tuple[int, int] | None:
    c = cond(v, code, component)
    return None if c is None else (c.severity, c.action)


def wait_polled(d: Daemon, *names: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with d.channel() as ch:
            checks = pb_grpc.NodeHealthStub(ch).ListChecks(pb.ListChecksRequest(), timeout=5).checks
        infos = [c for c in checks if c.name in names]
        for info in infos:
            assert info.status != pb.CHECK_STATUS_ERROR, f"{info.name}: {info.last_error}"
        if len(infos) == len(names) and all(c.runs >= 1 for c in infos):
            return
        assert time.monotonic() < deadline, f"{names} did not poll: {infos}\n{d.log()}"
        time.sleep(0.05)


def test_temperature_disk_memory_and_edac_faults_on_a_node_tree(make_daemon: Any, short_tmp: Path) -> None:
    sys_root, proc_root, data = short_tmp / "sys", short_tmp / "proc", short_tmp / "data"
    shutil.copytree(FIXTURES / "sys" / "gpu-node", sys_root, symlinks=True)
    shutil.copytree(FIXTURES / "proc" / "gpu-node", proc_root)
    data.mkdir()
    mounts = proc_root / "mounts"
    healthy_mounts = mounts.read_text() + f"/dev/sda1 {data} xfs rw,noatime 0 0\n"
    mounts.write_text(healthy_mounts)
    d = make_daemon({
        "roots": {"sys": str(sys_root), "proc": str(proc_root)},
        "policy": {"codes": FAST},
        "checks": {"kernel": {"enabled": False},
                   "thermal": {"enabled": True, "interval": "200ms"},
                   # Free space is the real temp file system's: thresholds 0 keep it out of this test.
                   "host": {"enabled": True, "interval": "200ms", "edac_ce_count": 5, "edac_ce_window": "1s",
                            "disks": [{"path": str(data), "min_free_percent": 0, "critical_free_percent": 0}]}},
    })
    d.start()
    wait_polled(d, "thermal", "host")
    assert not d.verdict().conditions

    # A CPU package passes its max (88 °C), then its crit (98 °C): one condition, escalated.
    pkg = sys_root / "class" / "hwmon" / "hwmon1" / "temp1_input"
    temp = "host/coretemp.0/Package_id_0"
    pkg.write_text("90000\n")
    v = d.wait_for(lambda v: cond(v, "TEMP_HIGH", temp) is not None)
    assert sev(v, "TEMP_HIGH", temp) == (pb.SEVERITY_WARNING, pb.ACTION_NONE)
    assert cond(v, "TEMP_HIGH", temp).evidence["max"] == "88"  # type: ignore[union-attr]
    pkg.write_text("99500\n")
    v = d.wait_for(lambda v: sev(v, "TEMP_HIGH", temp) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT))
    assert len(v.conditions) == 1 and v.severity == pb.SEVERITY_CRITICAL

    # The data disk is remounted read-only after SCSI errors; memory stalls; a DIMM fails.
    disk = f"disk{data}"
    mounts.write_text(healthy_mounts.replace(f"{data} xfs rw,", f"{data} xfs ro,"))
    (sys_root / "block" / "sda" / "device" / "ioerr_cnt").write_text("0x3\n")
    (proc_root / "pressure" / "memory").write_text("some avg10=62.50 avg60=20.00 avg300=4.00 total=99999\n"
                                                   "full avg10=12.00 avg60=3.00 avg300=0.50 total=50000\n")
    edac = sys_root / "devices" / "system" / "edac" / "mc"
    (edac / "mc1" / "ce_count").write_text("9\n")
    (edac / "mc0" / "ue_count").write_text("1\n")
    want = {("DISK_READONLY", disk): (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
            ("DISK_IO_ERRORS_RISING", disk): (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
            ("MEMORY_PRESSURE", "host"): (pb.SEVERITY_WARNING, pb.ACTION_NONE),
            ("EDAC_CE_RISING", "memory/mc1"): (pb.SEVERITY_WARNING, pb.ACTION_NONE),
            ("EDAC_UE", "memory/mc0"): (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)}
    v = d.wait_for(lambda v: all(sev(v, *k) == s for k, s in want.items()))
    assert cond(v, "EDAC_UE", "memory/mc0").sticky  # type: ignore[union-attr]
    assert cond(v, "DISK_IO_ERRORS_RISING", disk).evidence["device"] == "sda"  # type: ignore[union-attr]
    assert cond(v, "MEMORY_PRESSURE", "host").evidence["psi_full_avg10"] == "12"  # type: ignore[union-attr]
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)

    # Everything restored: all clear after the hold-down but the uncorrected memory error.
    pkg.write_text("52000\n")
    mounts.write_text(healthy_mounts)
    (proc_root / "pressure" / "memory").write_text(PSI_CALM)
    v = d.wait_for(lambda v: [(c.code, c.component) for c in v.conditions] == [("EDAC_UE", "memory/mc0")],
                   timeout=8)
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)

    # MemAvailable alone can say it, too.
    (proc_root / "meminfo").write_text("MemTotal: 2113362772 kB\nMemAvailable: 21133627 kB\n")
    v = d.wait_for(lambda v: cond(v, "MEMORY_PRESSURE", "host") is not None)
    assert "MemAvailable 1.0%" in cond(v, "MEMORY_PRESSURE", "host").message  # type: ignore[union-attr]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def tmpfs(short_tmp: Path) -> Any:
    """A real 4 MiB tmpfs, unmounted afterwards."""
    need_root("mounting a tmpfs")
    mnt = short_tmp / "mnt"
    mnt.mkdir()
    try:
        _sh("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt))
    except subprocess.CalledProcessError as e:
        (pytest.fail if IN_CI else pytest.skip)(f"cannot mount a tmpfs here: {e.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_a_real_file_system_filling_up_and_turning_read_only(make_daemon: Any, tmpfs: Path) -> None:
    d = make_daemon({
        "policy": {"codes": FAST},
        "checks": {"kernel": {"enabled": False},
                   # The real /proc: the host's own memory is not under test here.
                   "host": {"enabled": True, "interval": "200ms", "psi_some_avg10": 100, "psi_full_avg10": 100,
                            "min_available_percent": 0,
                            "disks": [{"path": str(tmpfs), "min_free_percent": 50, "critical_free_percent": 20}]}},
    })
    d.start()
    wait_polled(d, "host")
    assert not d.verdict().conditions
    disk = f"disk{tmpfs}"
    blob = tmpfs / "blob"

    blob.write_bytes(b"\0" * (5 << 19))  # 2.5 MiB of 4: 37.5% free
    v = d.wait_for(lambda v: cond(v, "DISK_SPACE_LOW", disk) is not None)
    assert sev(v, "DISK_SPACE_LOW", disk) == (pb.SEVERITY_WARNING, pb.ACTION_NONE)
    with open(blob, "ab") as f:
        f.write(b"\0" * (1 << 20))  # 3.5 MiB: 12.5% free
    v = d.wait_for(lambda v: sev(v, "DISK_SPACE_LOW", disk) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT))
    assert float(cond(v, "DISK_SPACE_LOW", disk).evidence["free_percent"]) < 20  # type: ignore[union-attr]
    os.unlink(blob)
    d.wait_for(lambda v: not v.conditions, timeout=8)

    _sh("mount", "-o", "remount,ro", str(tmpfs))
    v = d.wait_for(lambda v: cond(v, "DISK_READONLY", disk) is not None)
    assert sev(v, "DISK_READONLY", disk) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)
    _sh("mount", "-o", "remount,rw", str(tmpfs))
    d.wait_for(lambda v: not v.conditions, timeout=8)
