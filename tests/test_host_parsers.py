"""Pure parsers of the pcie, thermal and host checks on literal kernel text, and the checks on the fixture tree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from checks.common.counters import Counter, counter_delta
from checks.host import HostCheck
from checks.host.config import HostConfig
from checks.host.parse import Mount, mount_for, parse_count, parse_meminfo, parse_mounts, parse_psi
from checks.pcie import PcieCheck
from checks.pcie.config import PcieConfig
from checks.pcie.parse import parse_aer, parse_hex, parse_link_speed
from checks.thermal import ThermalCheck
from checks.thermal.check import Sensor, judge, read_hwmon
from checks.thermal.parse import parse_millidegrees, sensor_id
from robustd.check import CheckConfig, CheckContext
from robustd.model import Severity
from robustd.roots import Roots

FIXTURES = Path(__file__).parent / "fixtures"

AER_COR = """RxErr 3
BadTLP 1
BadDLLP 0
Rollover 0
Timeout 0
NonFatalErr 0
CorrIntErr 0
HeaderOF 0
TOTAL_ERR_COR 4
"""


# -- pcie -----------------------------------------------------------------------------------------
def test_parse_aer_reads_total_and_named_counters() -> None:
    aer = parse_aer(AER_COR)
    assert aer.total == 4
    assert aer.counters["RxErr"] == 3 and aer.counters["BadTLP"] == 1 and "TOTAL_ERR_COR" not in aer.counters


def test_parse_aer_without_total_line_sums_the_counters() -> None:
    assert parse_aer("DLP 1\nSDES 0\nTLP 2\n").total == 3
    assert parse_aer("").total == 0


def test_parse_aer_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_aer("RxErr three\n")
    with pytest.raises(ValueError):
        parse_aer("not an aer file at all\n")


@pytest.mark.parametrize(("text", "want"), [("32.0 GT/s PCIe\n", 32.0), ("8 GT/s\n", 8.0),
                                            ("2.5 GT/s PCIe", 2.5), ("Unknown\n", None), ("", None)])
def test_parse_link_speed(text: str, want: float | None) -> None:
    assert parse_link_speed(text) == want


def test_parse_hex() -> None:
    assert parse_hex("0x030200\n") == "030200"
    assert parse_hex("0x10DE") == "10de"
    with pytest.raises(ValueError):
        parse_hex("GPU")


def test_counter_reset_counts_from_zero() -> None:
    assert counter_delta(5, 7) == 2
    assert counter_delta(7, 7) == 0
    assert counter_delta(7, 2) == 2  # reset (driver reload): the 2 since the reset are new
    c = Counter(10)
    assert c.update(13, now=100.0) == 3
    assert c.update(1, now=101.0) == 1
    assert c.increase_within(60.0, now=130.0) == 4
    assert c.increase_within(60.0, now=160.5) == 1  # the first rise left the window


def test_pcie_config_classes_accept_strings_and_vendor_mappings() -> None:
    cfg = PcieConfig.model_validate({"classes": ["0x0302", {"class": "0x0680", "vendor": "0x10de"}]})
    m = cfg.matchers()
    assert m[0].matches("030200", "10de") and m[0].matches("030200", "1002")
    assert m[1].matches("068000", "10de") and not m[1].matches("068000", "8086")
    with pytest.raises(ValidationError):
        PcieConfig.model_validate({"classes": ["GPU"]})
    with pytest.raises(ValidationError):
        PcieConfig.model_validate({"thresholds": 1})


# -- thermal --------------------------------------------------------------------------------------
def test_millidegrees_and_judgement() -> None:
    assert parse_millidegrees("52000\n") == 52.0
    assert parse_millidegrees("-273150") == -273.15
    assert parse_millidegrees("N/A") is None
    s = Sensor("coretemp.0", "coretemp", "Package_id_0", 52.0, 88.0, 98.0)
    assert judge(s) is None
    assert judge(s._replace(celsius=88.0)) == (Severity.WARNING, "max")
    assert judge(s._replace(celsius=99.0)) == (Severity.CRITICAL, "crit")
    assert judge(s._replace(celsius=99.0, max=None, crit=None)) is None
    assert judge(s._replace(celsius=30.0, crit=-273.15, max=0.0)) is None  # unset thresholds


def test_sensor_id() -> None:
    assert sensor_id("Package id 0\n", "1") == "Package_id_0"
    assert sensor_id(None, "3") == "temp3"
    assert sensor_id("  ", "3") == "temp3"


def test_read_hwmon_on_the_fixture_tree() -> None:
    sensors = {f"{s.chip}/{s.sensor}": s for s in read_hwmon(str(FIXTURES / "sys" / "gpu-node"))}
    assert sensors["coretemp.0/Package_id_0"].celsius == 52.0
    assert sensors["coretemp.1/Core_0"].max == 88.0 and sensors["coretemp.1/Core_0"].crit == 98.0
    assert sensors["acpitz/temp1"].max is None
    assert sensors["nvme/Composite"].crit == 84.85
    assert read_hwmon("/nonexistent-root") == []


# -- host -----------------------------------------------------------------------------------------
MOUNTS = r"""sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
/dev/nvme0n1p1 / ext4 rw,relatime,errors=remount-ro 0 0
/dev/sda1 /data xfs ro,noatime,attr2 0 0
/dev/sdb1 /mnt/my\040disk ext4 rw 0 0
/dev/sdc1 /data/scratch ext4 rw 0 0
overlay /data/scratch ext4 ro 0 0
garbage
"""


def test_parse_mounts_decodes_escapes_and_options() -> None:
    mounts = parse_mounts(MOUNTS)
    assert len(mounts) == 6
    assert mounts[1] == Mount("/dev/nvme0n1p1", "/", "ext4", ("rw", "relatime", "errors=remount-ro"))
    assert mounts[2].readonly and not mounts[1].readonly
    assert mounts[3].point == "/mnt/my disk"


def test_mount_for_picks_the_longest_point_and_the_top_of_a_stack() -> None:
    mounts = parse_mounts(MOUNTS)
    assert mount_for("/data/ckpt", mounts).source == "/dev/sda1"  # type: ignore[union-attr]
    assert mount_for("/database", mounts).point == "/"  # type: ignore[union-attr]
    assert mount_for("/data/scratch/x", mounts).source == "overlay"  # type: ignore[union-attr]
    assert mount_for("/mnt/my disk", mounts).source == "/dev/sdb1"  # type: ignore[union-attr]
    assert mount_for("/x", []) is None


def test_parse_psi() -> None:
    psi = parse_psi("some avg10=12.50 avg60=3.00 avg300=0.40 total=123456\n"
                    "full avg10=1.25 avg60=0.00 avg300=0.00 total=789\n")
    assert psi["some"].avg10 == 12.5 and psi["some"].total == 123456
    assert psi["full"].avg10 == 1.25
    with pytest.raises(ValueError):
        parse_psi("some avg10=x\n")


def test_parse_meminfo_and_counts() -> None:
    info = parse_meminfo("MemTotal:       2113362772 kB\nMemAvailable:   1998765432 kB\nHugePages_Total:       0\n")
    assert info == {"MemTotal": 2113362772, "MemAvailable": 1998765432, "HugePages_Total": 0}
    assert parse_count("0x1f\n") == 31
    assert parse_count("17\n") == 17


def test_host_config_disks_accept_paths_and_mappings() -> None:
    cfg = HostConfig.model_validate({"disks": ["/", {"path": "/data/", "min_free_percent": 20}]})
    assert [d.path for d in cfg.disks] == ["/", "/data"]
    assert cfg.disks[1].min_free_percent == 20
    assert HostConfig().disks[0].path == "/"
    for bad in ({"disks": ["data"]}, {"disks": [{"path": "/", "critical_free_percent": 50}]},
                {"disks": [{"path": "/", "size": 1}]}):
        with pytest.raises(ValidationError):
            HostConfig.model_validate(bad)


# -- the checks on the fixture tree, polled directly ----------------------------------------------
def _ctx(tmp: Path, cfg: CheckConfig, now: list[float]) -> CheckContext:
    return CheckContext(name="t", node_name="n", roots=Roots(sys=str(tmp / "sys"), proc=str(tmp / "proc")),
                        config=cfg, state_dir=str(tmp), clock=lambda: now[0])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "sys" / "gpu-node", tmp_path / "sys", symlinks=True)
    shutil.copytree(FIXTURES / "proc" / "gpu-node", tmp_path / "proc")
    return tmp_path


def test_pcie_on_the_fixture_is_quiet_then_sees_width_aer_and_loss(tree: Path) -> None:
    now = [1000.0]
    check, ctx = PcieCheck(), _ctx(tree, PcieConfig(aer_correctable_count=5), now)
    assert check.supported(ctx) is None
    assert check.poll(ctx) == []  # the idle GPU's low speed, the NVMe's and Intel bridge's narrow links: no finding
    assert sorted(check._devices or {}) == sorted(  # 8 GPUs, 4 NICs, 2 NVSwitches
        p.name for p in (tree / "sys/bus/pci/devices").iterdir()
        if p.name not in ("0000:17:01.0", "0000:c1:00.0", "0000:00:1f.4"))
    dev = tree / "sys/bus/pci/devices"
    (dev / "0000:2a:00.0/current_link_width").write_text("8\n")
    (dev / "0000:9a:00.0/aer_dev_correctable").write_text(AER_COR.replace("RxErr 3", "RxErr 9")
                                                           .replace("TOTAL_ERR_COR 4", "TOTAL_ERR_COR 10"))
    (dev / "0000:3c:00.0/aer_dev_fatal").write_text("DLP 0\nSDES 1\nTOTAL_ERR_FATAL 1\n")
    shutil.rmtree(dev / "0000:06:00.0")
    now[0] += 1
    got = {(f.component, f.code): f for f in check.poll(ctx)}
    assert set(got) == {("pcie/0000:2a:00.0", "PCIE_WIDTH_DEGRADED"),
                        ("pcie/0000:9a:00.0", "PCIE_AER_CORRECTABLE_RISING"),
                        ("pcie/0000:3c:00.0", "PCIE_AER_FATAL"), ("pcie/0000:06:00.0", "PCIE_DEVICE_MISSING")}
    assert got[("pcie/0000:2a:00.0", "PCIE_WIDTH_DEGRADED")].evidence["max_link_width"] == "16"
    assert got[("pcie/0000:9a:00.0", "PCIE_AER_CORRECTABLE_RISING")].evidence["recent"] == "7"
    assert got[("pcie/0000:3c:00.0", "PCIE_AER_FATAL")].evidence["aer_SDES"] == "1"
    now[0] += 1
    codes = {f.code for f in check.poll(ctx)}  # the fatal error was counted once; the rest are levels
    assert codes == {"PCIE_WIDTH_DEGRADED", "PCIE_AER_CORRECTABLE_RISING", "PCIE_DEVICE_MISSING"}
    now[0] += 120  # the corrected errors left the window
    assert {f.code for f in check.poll(ctx)} == {"PCIE_WIDTH_DEGRADED", "PCIE_DEVICE_MISSING"}


def test_thermal_on_the_fixture(tree: Path) -> None:
    now = [0.0]
    check, ctx = ThermalCheck(), _ctx(tree, ThermalCheck.Config(), now)
    assert check.poll(ctx) == []
    (tree / "sys/class/hwmon/hwmon2/temp3_input").write_text("99000\n")
    (tree / "sys/class/hwmon/hwmon1/temp1_input").write_text("90000\n")
    got = {f.component: f for f in check.poll(ctx)}
    assert got["host/coretemp.1/Core_1"].severity == Severity.CRITICAL
    assert got["host/coretemp.0/Package_id_0"].severity == Severity.WARNING
    assert len(got) == 2
    ctx = _ctx(tree, ThermalCheck.Config(exclude=["coretemp.1/*"]), now)
    assert [f.component for f in check.poll(ctx)] == ["host/coretemp.0/Package_id_0"]


def test_host_on_the_fixture(tree: Path) -> None:
    now = [0.0]
    cfg = HostConfig(disks=[str(tree)], edac_ce_count=3, edac_ce_window="60s")
    (tree / "proc/mounts").write_text(f"/dev/sda1 {tree} xfs rw,noatime 0 0\n")
    check, ctx = HostCheck(), _ctx(tree, cfg, now)
    assert check.poll(ctx) == []
    (tree / "proc/mounts").write_text(f"/dev/sda1 {tree} xfs ro,noatime 0 0\n")
    (tree / "sys/block/sda/device/ioerr_cnt").write_text("0x2\n")
    (tree / "proc/pressure/memory").write_text("some avg10=55.00 avg60=3.00 avg300=0.40 total=1\n"
                                                "full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n")
    (tree / "sys/devices/system/edac/mc/mc1/ce_count").write_text("6\n")
    (tree / "sys/devices/system/edac/mc/mc0/ue_count").write_text("1\n")
    now[0] += 1
    got = {(f.component, f.code): f for f in check.poll(ctx)}
    disk = f"disk{tree}"
    assert set(got) == {(disk, "DISK_READONLY"), (disk, "DISK_IO_ERRORS_RISING"), ("host", "MEMORY_PRESSURE"),
                        ("memory/mc1", "EDAC_CE_RISING"), ("memory/mc0", "EDAC_UE")}
    assert got[(disk, "DISK_IO_ERRORS_RISING")].evidence["device"] == "sda"
    assert "PSI some" in got[("host", "MEMORY_PRESSURE")].message
    (tree / "proc/meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 10 kB\n")
    now[0] += 1
    codes = {f.code for f in check.poll(ctx)}
    assert codes == {"DISK_READONLY", "MEMORY_PRESSURE", "EDAC_CE_RISING"}
