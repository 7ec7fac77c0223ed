"""Which components are this node's own: the GPUs NVML lists, and the PCI devices, NICs, InfiniBand
devices and block devices sysfs shows.

The policy folds the conditions of a code past its caps into one `<family>/*` condition
(robustd/policy.py). That bound is for names the node does not have — a driver or a flood printing
made-up bus ids — and must never swallow a real device's fault: a scheduler acts on the component
and an operator acknowledges it by name (`robustctl ack gpu/<bus id> XID_79`). So the policy asks
this, and a component the node has keeps a condition of its own however many made-up ones stand.
The node has few components of its own (its hardware), so exempting them keeps conditions bounded.

It is asked only when a finding would fold (the caps are full), so a stat of sysfs per such finding
is all it costs, and sysfs answers from memory. Names come from kernel lines: only a plain device
name (no `/`, not `.` or `..`) is ever looked up, under the configured sysfs root.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,63}")  # a device name sysfs could hold (no path parts)
BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
MAX_GPUS_REMEMBERED = 1024  # GPUs ever listed since start (one node has at most dozens)
PCI_FAMILIES = ("gpu", "nvswitch", "pcie", "nic")  # components named by a PCI address


class Owned:
    """`owned(component)`: whether the node really has `component`.

    `sys_root` gives roots.sys; `gpu_bus_ids` the bus ids NVML lists now (the GPU check's inventory). A
    GPU once listed stays the node's own even after NVML loses it: a GPU that fell off the bus (Xid 79)
    is exactly the one whose fault must stand on its own.
    """

    def __init__(self, sys_root: Callable[[], str], gpu_bus_ids: Callable[[], Iterable[str]]):
        self._sys_root = sys_root  # roots.sys as configured now (a reload may change it)
        self._gpu_bus_ids = gpu_bus_ids
        self._gpus: set[str] = set()

    def __call__(self, component: str) -> bool:
        family, slash, name = component.partition("/")
        if not slash:
            return False
        if family == "gpu" and self._listed(name):
            return True
        device = name.split("/", 1)[0] if family == "ib" else name  # ib/<device>/<port>
        if not NAME.fullmatch(device) or device in (".", ".."):
            return False
        if family in PCI_FAMILIES and BDF.fullmatch(device.lower()):
            return self._exists("bus", "pci", "devices", device.lower())
        if family == "nic":
            return self._exists("class", "net", device)
        if family == "ib":
            return self._exists("class", "infiniband", device)
        if family == "disk":
            return self._exists("block", device)
        return False

    def _listed(self, bus_id: str) -> bool:
        bus_id = bus_id.lower()
        if bus_id not in self._gpus:
            for listed in self._gpu_bus_ids():
                if len(self._gpus) < MAX_GPUS_REMEMBERED:
                    self._gpus.add(listed.lower())
        return bus_id in self._gpus

    def _exists(self, *parts: str) -> bool:
        return os.path.lexists(os.path.join(self._sys_root(), *parts))
