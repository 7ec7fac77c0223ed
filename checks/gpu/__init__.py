"""The GPU check: NVML polled every interval and its pushed events watched (`check.py`)."""

from checks.gpu.check import GpuCheck

__all__ = ["GpuCheck"]
