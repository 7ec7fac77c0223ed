"""Built-in checks, in the order the runner starts them. Nothing registers itself at import."""

from __future__ import annotations

from checks.gpu import GpuCheck
from checks.host import HostCheck
from checks.kernel import KernelCheck
from checks.nic import NicCheck
from checks.pcie import PcieCheck
from checks.thermal import ThermalCheck
from robustd.check import Check

BUILTIN: list[type[Check]] = [KernelCheck, NicCheck, GpuCheck, PcieCheck, ThermalCheck, HostCheck]

__all__ = ["BUILTIN", "KernelCheck", "NicCheck", "GpuCheck", "PcieCheck", "ThermalCheck", "HostCheck"]
