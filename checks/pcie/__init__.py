"""The PCIe check: link width, AER counters and presence of GPUs, NICs and NVSwitches (`check.py`)."""

from checks.pcie.check import PcieCheck

__all__ = ["PcieCheck"]
