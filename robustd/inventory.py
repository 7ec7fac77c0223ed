"""The GPU inventory: which GPUs this node has, its driver, and who computes on them.

The GPU check publishes it (one immutable snapshot, replaced whole after each poll, so a reader on
another thread never sees half of one); the diagnostics (a busy node refuses a Run, the tests are
told which GPUs to use) and the tracer (GPU processes are training processes) read it through
`GpuInventoryProvider`, never by poking at the check's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class GpuDevice:
    index: int  # NVML's index at enumeration
    bus_id: str  # dddd:bb:dd.f as the kernel writes it (indexN for a GPU lost before it could be read)
    uuid: str
    name: str
    # NVML's readings at the last poll (temperature_c, utilization_pct, power_w, ...): what an evidence bundle
    # shows of the GPUs a decision is about; a reading that failed or is not supported is absent.
    readings: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuInventory:
    devices: tuple[GpuDevice, ...] = ()
    driver: str = ""
    compute_pids: frozenset[int] = frozenset()  # processes holding compute contexts at the last poll
    emulated: bool = False  # the GPUs are the NVML emulator's
    polled_at: float = 0.0  # time.time() of the poll that read compute_pids (0: never polled)
    nvml_library: str = ""  # the libnvidia-ml the check loaded ahead of pynvml's own ("": pynvml's default)


NO_GPUS = GpuInventory()


@runtime_checkable
class GpuInventoryProvider(Protocol):
    """A check that publishes the GPU inventory (checks/gpu/)."""

    def gpu_inventory(self) -> GpuInventory:
        """The last published snapshot (NO_GPUS before the first)."""
        ...
