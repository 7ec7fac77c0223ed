"""The GPU check: NVML polled every interval and its pushed events watched (`check.py`).

The class is imported on first use: `checks.gpu.config` and `checks.gpu.parse` need no pynvml.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checks.common.exports import lazy

if TYPE_CHECKING:  # `X as X`: re-exported, as `__all__` says
    from checks.gpu.check import GpuCheck as GpuCheck

__all__ = ["GpuCheck"]
__getattr__ = lazy("checks.gpu", {"GpuCheck": "checks.gpu.check"})
