"""The GPU check end to end: a real daemon on the NVML emulator, read as a scheduler reads it (GetVerdict)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest
from conftest import Daemon

from checks.gpu import GpuCheck
from checks.gpu.config import RULES
from checks.gpu.device import _Gpu
from checks.gpu.nvml_fields import FieldBatch
from checks.gpu.parse import normalize_bus_id
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import load_codes
from robustd.nvmlemu import build
from robustd.nvmlemu import state as emu
from robustd.traffic import read_traffic

CODES = list(load_codes(RULES))
BUS = [normalize_bus_id(emu.healthy_gpu(i).bus_id) for i in range(8)]  # gpu/0000:1b:00.0, ...


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build.build_emulator(str(tmp_path_factory.mktemp("nvmlemu")))


class Node:
    """A daemon whose GPU check runs on the emulator, and the emulator's state file."""

    def __init__(self, make_daemon: Any, root: Path, lib: str, gpus: int = 8, gpu: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, state: emu.EmulatorState | None = None,
                 env: dict[str, str] | None = None):
        self.state = str(root / f"nvml-{time.monotonic_ns()}.state")
        emu.save(self.state, state or emu.healthy_node(gpus))
        fast = {code: {"clear_after": "1s"} for code in CODES}
        cfg = {"checks": {"gpu": {"enabled": True, "backend": "emulator", "emulator_state": self.state,
                                  "emulator_library": lib, "interval": "200ms", "slowdown_window": "1s",
                                  "replay_window": "2s", "nvlink_counters_every": 1, **(gpu or {})},
                          "kernel": {"enabled": False}},  # other tests write the real /dev/kmsg
               "policy": {"codes": fast}}
        self.d: Daemon = make_daemon({**cfg, **(config or {})}, **({"env": env} if env else {}))
        self.d.start()

    def edit(self, fn: Any) -> None:
        st = emu.load(self.state)
        fn(st)
        emu.save(self.state, st)

    def fault(self, gpu: int, fault: str, **kw: Any) -> None:
        self.edit(lambda s: emu.apply_fault(s, gpu, fault, **kw))

    def clear(self, *gpus: int) -> None:
        self.edit(lambda s: [emu.clear(s, i) for i in gpus])

    def set(self, gpu: int, key: str, value: Any) -> None:
        self.edit(lambda s: emu.set_value(s, gpu, key, str(value)))


def cond(v: pb.Verdict, code: str, component: str | None = None) -> pb.Condition | None:
    return next((c for c in v.conditions if c.code == code and (component is None or c.component == component)), None)


def has(code: str, component: str | None = None) -> Any:
    return lambda v: cond(v, code, component) is not None


def meaning(c: pb.Condition | None) -> tuple[int, int]:
    assert c is not None
    return c.severity, c.action


def test_every_metric_fault_raises_its_condition_and_clearing_clears_them(make_daemon: Any, short_tmp: Path,
                                                                          lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib)
    d = node.d
    time.sleep(0.6)
    assert list(d.verdict().conditions) == []  # a healthy node
    [label] = d.verdict().emulated  # and never mistaken for real hardware
    assert label.startswith("gpu: NVML emulator, 8 GPUs, driver ")
    r = d.robustctl("status")
    assert r.returncode == 0 and "EMULATED: gpu: NVML emulator, 8 GPUs" in r.stdout
    node.set(7, "pcie_gen", 3)  # an idle GPU may drop its link generation: not a fault
    node.fault(0, "ecc-dbe")
    node.fault(1, "remap-pending")
    node.fault(2, "remap-failure")
    node.fault(3, "power-unreadable")
    node.fault(4, "pcie-width")
    node.fault(4, "pcie-replay")
    node.fault(5, "nvlink-down", link=3)
    node.fault(6, "nvlink-errors", link=1)
    expected = {
        ("GPU_ECC_DBE", BUS[0]): (pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU),
        ("GPU_ROW_REMAP_PENDING", BUS[1]): (pb.SEVERITY_WARNING, pb.ACTION_RESET_GPU),
        ("GPU_ROW_REMAP_FAILURE", BUS[2]): (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT),
        ("GPU_POWER_UNREADABLE", BUS[3]): (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        ("GPU_PCIE_WIDTH_DEGRADED", BUS[4]): (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        ("GPU_PCIE_REPLAY_RISING", BUS[4]): (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        ("GPU_NVLINK_DOWN", BUS[5]): (pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU),
        ("GPU_NVLINK_ERRORS", BUS[6]): (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
    }
    # GPU_NVLINK_ERRORS is an increase, seen once; catch it on the way rather than in one final verdict.
    seen: dict[tuple[str, str], pb.Condition] = {}

    def collect(v: pb.Verdict) -> bool:
        for c in v.conditions:
            seen[(c.code, c.component.removeprefix("gpu/"))] = c
        return all(k in seen for k in expected)

    v = d.wait_for(collect, timeout=5)
    for key, want in expected.items():
        assert meaning(seen[key]) == want, key
    assert seen[("GPU_NVLINK_DOWN", BUS[5])].evidence["links"] == "3"
    assert seen[("GPU_ECC_DBE", BUS[0])].evidence["emulated"] == "true"
    assert seen[("GPU_ECC_DBE", BUS[0])].source == "gpu"
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)  # remap failure wins
    assert cond(d.verdict(), "GPU_PCIE_WIDTH_DEGRADED", f"gpu/{BUS[7]}") is None  # idle at Gen3

    node.set(7, "utilization_gpu", 90)  # busy at Gen3 of Gen5: now it counts
    c = cond(d.wait_for(has("GPU_PCIE_WIDTH_DEGRADED", f"gpu/{BUS[7]}")), "GPU_PCIE_WIDTH_DEGRADED", f"gpu/{BUS[7]}")
    assert c is not None and c.evidence["generation"] == "3" and c.evidence["max_generation"] == "5"

    node.clear(*range(8))
    node.set(7, "pcie_gen", 5)
    v = d.wait_for(lambda v: not v.conditions, timeout=6)
    assert (v.severity, v.action) == (pb.SEVERITY_OK, pb.ACTION_NONE)


def test_temperature_against_the_gpus_own_thresholds(make_daemon: Any, short_tmp: Path, lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib, gpus=2)
    comp = f"gpu/{BUS[1]}"
    node.set(1, "temperature", 86)  # below slowdown (87)
    time.sleep(0.6)
    assert cond(node.d.verdict(), "GPU_TEMP_HIGH") is None
    node.set(1, "temperature", 87)
    c = cond(node.d.wait_for(has("GPU_TEMP_HIGH", comp)), "GPU_TEMP_HIGH", comp)
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_NONE) and c is not None and c.evidence["slowdown"] == "87"
    node.set(1, "temperature", 90)  # within 3 °C of shutdown (92)
    v = node.d.wait_for(lambda v: meaning(cond(v, "GPU_TEMP_HIGH", comp))[0] == pb.SEVERITY_CRITICAL)
    assert meaning(cond(v, "GPU_TEMP_HIGH", comp)) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)
    assert v.severity == pb.SEVERITY_CRITICAL
    node.clear(1)
    node.d.wait_for(lambda v: cond(v, "GPU_TEMP_HIGH") is None, timeout=4)


def test_hw_slowdown_sustained_raises_a_blip_does_not(make_daemon: Any, short_tmp: Path, lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib, gpus=2)
    time.sleep(0.5)
    node.fault(0, "hw-slowdown")
    time.sleep(0.4)  # two polls or so, under the 1 s window
    node.clear(0)
    time.sleep(1.5)
    assert not node.d.stub().ListEvents(pb.ListEventsRequest(component=f"gpu/{BUS[0]}"), timeout=5).events
    t0 = time.monotonic()
    node.fault(1, "hw-slowdown")
    v = node.d.wait_for(has("GPU_HW_SLOWDOWN", f"gpu/{BUS[1]}"), timeout=5)
    assert time.monotonic() - t0 >= 0.9  # only once it lasted the window
    c = cond(v, "GPU_HW_SLOWDOWN")
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT) and c is not None
    assert c.evidence["reasons"] == "hw_slowdown"


def test_gpu_lost_mid_run_and_vanished_gpus_are_sticky_critical(make_daemon: Any, short_tmp: Path, lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib, gpu={"expected_gpus": 8})
    time.sleep(0.5)
    assert not node.d.verdict().conditions
    node.fault(2, "lost")
    v = node.d.wait_for(has("GPU_LOST", f"gpu/{BUS[2]}"))
    c = cond(v, "GPU_LOST", f"gpu/{BUS[2]}")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT) and c is not None and c.sticky
    assert c.evidence["reason"] == "NVML_ERROR_GPU_IS_LOST"
    node.fault(6, "vanish")
    v = node.d.wait_for(has("GPU_LOST", "host"))
    assert cond(v, "GPU_LOST", f"gpu/{BUS[6]}") is not None
    assert cond(v, "GPU_LOST", "host").evidence["found"] == "7"  # type: ignore[union-attr]
    node.clear(2, 6)
    time.sleep(1.5)  # past every clear_after: sticky stays until reboot or acknowledgement
    v = node.d.verdict()
    assert {c.component for c in v.conditions if c.code == "GPU_LOST"} == {f"gpu/{BUS[2]}", f"gpu/{BUS[6]}", "host"}
    assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)


def test_fewer_gpus_than_expected_and_no_nvml(make_daemon: Any, short_tmp: Path, lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib, gpus=4, gpu={"expected_gpus": 8})
    c = cond(node.d.wait_for(has("GPU_LOST", "host")), "GPU_LOST", "host")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT) and c is not None
    assert (c.evidence["found"], c.evidence["expected"]) == ("4", "8")

    broken = emu.healthy_node(8)
    broken.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    node2 = Node(make_daemon, short_tmp, lib, gpu={"expected_gpus": 8}, state=broken)
    c = cond(node2.d.wait_for(has("NVML_UNAVAILABLE")), "NVML_UNAVAILABLE")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)


def test_real_nvml_backend_without_a_driver_is_unsupported_not_noise(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"gpu": {"enabled": True, "interval": "200ms"}, "kernel": {"enabled": False}}})
    d.start()
    info = {c.name: c for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks}["gpu"]
    assert info.status == pb.CHECK_STATUS_UNSUPPORTED and "expected_gpus" in info.last_error
    assert not d.verdict().conditions


def test_a_hung_nvml_call_is_nvml_hang_and_the_daemon_stays_responsive(make_daemon: Any, short_tmp: Path,
                                                                       lib: str) -> None:
    node = Node(make_daemon, short_tmp, lib, gpus=4)
    time.sleep(0.5)
    node.fault(3, "hang")
    v = node.d.wait_for(has("NVML_HANG", f"gpu/{BUS[3]}"), timeout=5)
    c = cond(v, "NVML_HANG")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT) and c is not None
    assert c.evidence["call"].startswith("nvmlDevice") and c.evidence["emulated"] == "true"
    for _ in range(5):  # still hung: every GetVerdict answers within a second
        t0 = time.monotonic()
        with node.d.channel() as ch:
            from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

            v = pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        assert cond(v, "NVML_HANG", f"gpu/{BUS[3]}") is not None
        time.sleep(0.2)
    node.clear(3)  # the call returns; the hang clears after its hold-down
    node.d.wait_for(lambda v: cond(v, "NVML_HANG") is None, timeout=5)


def test_training_stalled_needs_processes_idle_gpus_and_quiet_network(make_daemon: Any, short_tmp: Path,
                                                                      lib: str) -> None:
    sysfs = short_tmp / "sys"
    counters = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    (counters / "port_xmit_data").write_text("1000\n")
    (counters / "port_rcv_data").write_text("1000\n")
    stats = sysfs / "class" / "net" / "eth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "rx_bytes").write_text("5000\n")
    (stats / "tx_bytes").write_text("5000\n")
    assert read_traffic(str(sysfs)).total == 4 * 2000 + 10000

    node = Node(make_daemon, short_tmp, lib, gpus=2, gpu={"stall_after": "1s"}, config={"roots": {"sys": str(sysfs)}})
    time.sleep(0.6)
    assert not node.d.verdict().conditions  # idle GPUs without processes: nothing to say
    node.set(0, "utilization_gpu", 95)
    node.set(0, "processes", "4242:1048576")
    node.set(1, "processes", "4243:1048576")
    time.sleep(1.6)
    assert cond(node.d.verdict(), "TRAINING_STALLED") is None  # busy GPU: training

    stop = threading.Event()

    def traffic() -> None:  # 10 MB/s on the IB port: collectives running
        n = 1000
        while not stop.wait(0.05):
            n += 125_000
            (counters / "port_xmit_data").write_text(f"{n}\n")

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        node.set(0, "utilization_gpu", 0)
        time.sleep(1.6)
        assert cond(node.d.verdict(), "TRAINING_STALLED") is None  # idle GPUs but the network is busy
    finally:
        stop.set()
        t.join()
    t0 = time.monotonic()
    c = cond(node.d.wait_for(has("TRAINING_STALLED", "host"), timeout=5), "TRAINING_STALLED", "host")
    assert time.monotonic() - t0 >= 0.9
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_NONE) and c is not None
    assert c.evidence["pids"] == "4242,4243"
    node.set(0, "utilization_gpu", 80)
    node.d.wait_for(lambda v: cond(v, "TRAINING_STALLED") is None, timeout=4)


def test_the_xid_table_is_one_for_the_kernel_and_the_gpu_check() -> None:
    """Both checks raise XID_<n>: the same meanings (checks/kernel/xid.py), and an NVML recovery action means
    what the kernel line that reports the same action means (the rule XID_154's hints)."""
    from checks.gpu.events import RECOVERY_LABELS, recovery_meaning
    from checks.kernel import KernelCheck
    from checks.kernel.rules import shipped_rules

    kernel = {c: r for c, r in KernelCheck().codes().items() if c.startswith("XID_")}
    assert len(kernel) > 50 and dict(GpuCheck().borrowed_codes()) == kernel
    for action, label in RECOVERY_LABELS.items():
        if not action:
            continue
        line = f"NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x{action:x} ({label})"
        [found] = shipped_rules().match([line])
        assert found.code == "XID_154"
        assert recovery_meaning(action) == (f"0x{action:x} ({label})", found.severity, found.action), label


def test_bus_ids_are_normalised_as_the_kernel_writes_them() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("00000001:DF:00.1") == "0001:df:00.1"
    codes = GpuCheck().codes()  # gpu.yaml; the kernel rules' XID_* meanings are borrowed for NVML Xid events
    assert set(codes) == set(CODES) and {"XID_79", "XID_*"} <= set(GpuCheck().borrowed_codes())


@pytest.mark.parametrize("driver", ["fields", "no-fields", "entry-fails"])
def test_nvlink_down_is_seen_with_or_without_the_state_field(monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """Link state is one field-values call per GPU where the driver answers it, else one call per link."""
    down = {2, 7}
    calls: list[str] = []

    def fields(batch: FieldBatch, handle: Any) -> list[tuple[int, int]]:
        calls.append("fields")
        if driver == "no-fields":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [(pynvml.NVML_ERROR_UNKNOWN if driver == "entry-fails" and link == 0 else pynvml.NVML_SUCCESS,
                 pynvml.NVML_NVLINK_STATE_INACTIVE if link in down else pynvml.NVML_NVLINK_STATE_ACTIVE)
                for field_id, link in batch.asked if field_id == pynvml.NVML_FI_DEV_NVLINK_GET_STATE]

    def state(handle: Any, link: int) -> int:
        calls.append("state")
        return pynvml.NVML_FEATURE_DISABLED if link in down else pynvml.NVML_FEATURE_ENABLED

    monkeypatch.setattr(FieldBatch, "nvmlDeviceGetFieldValues", fields)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", state)
    check = GpuCheck()
    g = _Gpu(handle=object(), bus=BUS[0], name="H100", uuid="GPU-0", active_links=list(range(18)))
    for poll in range(2):
        calls.clear()
        assert check._links_down(g, f"gpu/{BUS[0]}") == [2, 7]
        if driver == "fields":
            assert calls == ["fields"]  # one call for 18 links
        elif driver == "no-fields":  # asked once, then link by link
            assert calls == ["fields"] * (poll == 0) + ["state"] * 18
        else:  # a failed entry: the per-link calls answer (and raise) for this poll, the field is asked again next
            assert calls == ["fields"] + ["state"] * 18
    assert g.link_fields is {"fields": True, "no-fields": False, "entry-fails": None}[driver]
