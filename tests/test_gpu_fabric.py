"""NVLink fabric registration and the GPU count against the PCI bus, end to end: a real daemon whose GPU check
reads the NVML emulator through the real pynvml, and (for the PCI side) a copy of the gpu-node sysfs fixture."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from test_gpu_check import BUS, Node, cond, has, lib, meaning  # noqa: F401 - lib: the emulator, built once

from robustd.api.v1 import robustd_pb2 as pb
from robustd.nvmlemu import state as emu

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "sys" / "gpu-node"
# The fixture's eight GPUs (class 0x030200); 0000:05:00.0 and 0000:06:00.0 are NVSwitches (class 0x068000).
FIXTURE_GPUS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0",
                "0000:ba:00.0", "0000:db:00.0"]


def fabric_conditions(v: pb.Verdict) -> dict[tuple[str, str], pb.Condition]:
    return {(c.code, c.component): c for c in v.conditions if c.code.startswith("GPU_FABRIC")}


def test_fabric_not_ready_after_grace_error_degraded_and_clique_mismatch(make_daemon: Any, short_tmp: Path,
                                                                        lib: str) -> None:  # noqa: F811
    st = emu.healthy_node(4)
    st.gpus[1].fabric_state = emu.FABRIC_NOT_STARTED  # the fabric manager has not registered it yet
    node = Node(make_daemon, short_tmp, lib, gpus=4, state=st, gpu={"fabric_grace": "1500ms"})
    started = time.monotonic()
    time.sleep(0.6)
    assert not node.d.verdict().conditions  # within the grace: registration takes its time at boot
    v = node.d.wait_for(has("GPU_FABRIC_NOT_READY", f"gpu/{BUS[1]}"), timeout=5)
    assert time.monotonic() - started >= 1.4
    c = cond(v, "GPU_FABRIC_NOT_READY")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT) and c is not None
    assert c.evidence["state"] == "NOT_STARTED" and "CUDA cannot use" in c.message

    node.fault(2, "fabric", value="error")  # registration ran and failed
    node.fault(3, "fabric", value="degraded")  # completed, but the health mask says degraded bandwidth
    node.set(0, "fabric_clique", 7)  # GPU 0 joined another NVLink partition than GPUs 2 and 3... (and 1, later)
    want = {("GPU_FABRIC_ERROR", f"gpu/{BUS[2]}"), ("GPU_FABRIC_ERROR", f"gpu/{BUS[3]}")}
    v = node.d.wait_for(lambda v: want <= set(fabric_conditions(v)), timeout=5)
    found = fabric_conditions(v)
    err, degraded = found[("GPU_FABRIC_ERROR", f"gpu/{BUS[2]}")], found[("GPU_FABRIC_ERROR", f"gpu/{BUS[3]}")]
    assert meaning(err) == (pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU)
    assert err.evidence["status"] == "NVML_ERROR_UNKNOWN" and err.evidence["state"] == "COMPLETED"
    assert degraded.evidence["problems"] == "degraded_bandwidth=1" and degraded.evidence["status"] == "NVML_SUCCESS"
    # Only GPU 0 is registered and healthy: one clique, nothing to compare yet.
    assert ("GPU_FABRIC_CLIQUE_MISMATCH", "host") not in found

    node.clear(1, 2, 3)  # a GPU reset: all registered again; GPU 0 alone in clique 7
    v = node.d.wait_for(has("GPU_FABRIC_CLIQUE_MISMATCH", "host"), timeout=5)
    c = cond(v, "GPU_FABRIC_CLIQUE_MISMATCH", "host")
    assert meaning(c) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT) and c is not None
    assert f"clique 7: {BUS[0]}" in c.evidence["cliques"] and f"clique 1: {BUS[1]},{BUS[2]},{BUS[3]}" in c.message

    node.set(0, "fabric_clique", 1)
    node.d.wait_for(lambda v: not v.conditions, timeout=5)
    # A GPU that loses its registration mid-run gets the grace again from when it was first seen so.
    node.fault(2, "fabric", value="in-progress")
    time.sleep(0.8)
    assert not fabric_conditions(node.d.verdict())
    c = cond(node.d.wait_for(has("GPU_FABRIC_NOT_READY", f"gpu/{BUS[2]}"), timeout=5), "GPU_FABRIC_NOT_READY")
    assert c is not None and c.evidence["state"] == "IN_PROGRESS"


def test_gpus_without_a_fabric_are_said_once_and_raise_nothing(make_daemon: Any, short_tmp: Path,
                                                               lib: str) -> None:  # noqa: F811
    st = emu.healthy_node(3, fabric=False)  # PCIe cards: state NOT_SUPPORTED
    st.gpus[2].fabric_state = emu.FABRIC_CALL_UNSUPPORTED  # a pre-Hopper GPU: the call itself is NOT_SUPPORTED
    node = Node(make_daemon, short_tmp, lib, gpus=3, state=st, gpu={"fabric_grace": "0s"})
    time.sleep(0.8)
    assert not node.d.verdict().conditions
    [gpu] = [c for c in node.d.stub().ListChecks(pb.ListChecksRequest()).checks if c.name == "gpu"]
    assert gpu.note == ("NVLink fabric NOT_SUPPORTED on all 3 of 3 GPUs (PCIe cards or no NVSwitch): "
                        "fabric not checked there")
    assert node.d.log().count("NVLink fabric NOT_SUPPORTED") == 3  # once per GPU, not once per poll
    node.set(1, "fabric_state", emu.FABRIC_NOT_STARTED)  # never asked again: it has no fabric
    time.sleep(0.6)
    assert not node.d.verdict().conditions


def pci_tree(root: Path) -> Path:
    """A writable copy of the gpu-node fixture (eight GPUs, two NVSwitches, NICs, bridges)."""
    sys_root = root / "sys"
    shutil.copytree(FIXTURE / "bus", sys_root / "bus", symlinks=True)
    return sys_root


def nvml_for(buses: list[str]) -> emu.EmulatorState:
    st = emu.healthy_node(len(buses))
    for g, bdf in zip(st.gpus, buses, strict=True):
        domain, rest = bdf.split(":", 1)
        g.bus_id = f"{int(domain, 16):08X}:{rest.upper()}"
    return st


def add_gpu(sys_root: Path, bdf: str, driver: str | None) -> None:
    d = sys_root / "bus" / "pci" / "devices" / bdf
    d.mkdir()
    for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
        (d / name).write_text(value + "\n")
    if driver:
        (sys_root / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../drivers/{driver}", d / "driver")


def test_gpu_on_the_pci_bus_that_nvml_does_not_list_is_missing(make_daemon: Any, short_tmp: Path,
                                                               lib: str) -> None:  # noqa: F811
    sys_root = pci_tree(short_tmp)
    # NVML lists seven of the fixture's eight GPUs: the driver did not bring up 0000:db:00.0.
    node = Node(make_daemon, short_tmp, lib, state=nvml_for(FIXTURE_GPUS[:7]), config={"roots": {"sys": str(sys_root)}})
    v = node.d.wait_for(has("GPU_MISSING"), timeout=5)
    missing = {c.component: c for c in v.conditions if c.code == "GPU_MISSING"}
    assert set(missing) == {"gpu/0000:db:00.0"}  # not the NVSwitches, NICs or bridges, not the listed seven
    c = missing["gpu/0000:db:00.0"]
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)
    assert (c.evidence["driver"], c.evidence["class"], c.evidence["nvml_gpus"]) == ("none", "0x030200", "7")
    assert "no driver bound" in c.message

    add_gpu(sys_root, "0000:e1:00.0", "nvidia")  # bound to nvidia yet absent from NVML
    add_gpu(sys_root, "0000:e2:00.0", "vfio-pci")  # passed to a VM: not NVML's by the host's choice
    v = node.d.wait_for(has("GPU_MISSING", "gpu/0000:e1:00.0"), timeout=5)
    time.sleep(0.5)
    v = node.d.verdict()
    assert {c.component for c in v.conditions if c.code == "GPU_MISSING"} == {"gpu/0000:db:00.0",
                                                                               "gpu/0000:e1:00.0"}
    assert cond(v, "GPU_MISSING", "gpu/0000:e1:00.0").evidence["driver"] == "nvidia"  # type: ignore[union-attr]


def test_matching_pci_tree_raises_nothing_and_a_dead_driver_with_gpus_on_the_bus_is_nvml_unavailable(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    sys_root = pci_tree(short_tmp)
    node = Node(make_daemon, short_tmp, lib, state=nvml_for(FIXTURE_GPUS), config={"roots": {"sys": str(sys_root)}})
    time.sleep(0.8)
    assert not node.d.verdict().conditions  # every GPU on the bus is in NVML; NVSwitches are not GPUs

    broken = nvml_for(FIXTURE_GPUS)
    broken.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED, and no expected_gpus: the bus says GPUs are there
    node2 = Node(make_daemon, short_tmp, lib, state=broken, config={"roots": {"sys": str(sys_root)}})
    c = cond(node2.d.wait_for(has("NVML_UNAVAILABLE", "host"), timeout=5), "NVML_UNAVAILABLE")
    assert meaning(c) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT) and c is not None
    assert c.evidence["pci_gpus"] == "8"


def test_a_container_given_some_gpus_does_not_call_the_others_missing(make_daemon: Any, short_tmp: Path,
                                                                      lib: str) -> None:  # noqa: F811
    """NVIDIA's container runtime sets NVIDIA_VISIBLE_DEVICES: NVML then lists only those GPUs, /sys the bus."""
    sys_root = pci_tree(short_tmp)
    node = Node(make_daemon, short_tmp, lib, state=nvml_for(FIXTURE_GPUS[:2]), config={"roots": {"sys": str(sys_root)}},
                env={"NVIDIA_VISIBLE_DEVICES": "0,1"})
    time.sleep(1.0)
    assert not [c for c in node.d.verdict().conditions if c.code == "GPU_MISSING"]
    assert "NVIDIA_VISIBLE_DEVICES=0,1: the GPUs are not compared with the PCI bus" in node.d.log()
