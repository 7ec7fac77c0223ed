"""The NVIDIA GPUs the PCI bus shows (sysfs), to compare with the GPUs NVML lists.

A GPU the driver failed to bring up (RmInitAdapter failed, a GPU that fell off the bus before the driver
loaded, one excluded by the driver after errors) is on the bus but not in NVML: NVML's count alone cannot
tell it was ever there. A GPU is vendor 0x10de with class 0x0300xx (VGA) or 0x0302xx (3D controller);
NVSwitches (0x0680xx) and NVIDIA's other functions (audio 0x0403, USB) are not. Each device's class is
read once (it never changes for a bus address); a poll lists the directory and reads nothing new.
"""

from __future__ import annotations

import contextlib
import os

from checks.common.sysfs import read_text

NVIDIA = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # class >> 8: VGA compatible, 3D controller


class PciGpus:
    """`<sys>/bus/pci/devices/*` that are NVIDIA GPUs."""

    def __init__(self, devices_dir: str):
        self.devices_dir = devices_dir
        self._is_gpu: dict[str, bool] = {}

    def scan(self) -> list[str]:
        """The GPUs' bus addresses (dddd:bb:dd.f); raises OSError when the directory cannot be listed."""
        found = []
        for bdf in sorted(os.listdir(self.devices_dir)):
            gpu = self._is_gpu.get(bdf)
            if gpu is None:
                gpu = self._is_gpu[bdf] = self._classify(bdf)
            if gpu:
                found.append(bdf)
        return found

    def _classify(self, bdf: str) -> bool:
        try:
            vendor = int(read_text(os.path.join(self.devices_dir, bdf, "vendor")), 16)
            pci_class = int(read_text(os.path.join(self.devices_dir, bdf, "class")), 16)
        except (OSError, ValueError):
            return False
        return vendor == NVIDIA and pci_class >> 8 in GPU_CLASSES

    def driver(self, bdf: str) -> str:
        """The driver bound to the device (`nvidia`, `vfio-pci`, ...), "" when none is."""
        try:
            return os.path.basename(os.readlink(os.path.join(self.devices_dir, bdf, "driver")))
        except OSError:
            return ""

    def ids(self, bdf: str) -> dict[str, str]:
        out = {}
        for name in ("vendor", "device", "class"):
            with contextlib.suppress(OSError):
                out[name] = read_text(os.path.join(self.devices_dir, bdf, name)).strip()
        return out
