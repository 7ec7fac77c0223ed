"""What the GPU check knows of one GPU between polls (`_Gpu`) and which NVML call its poll thread is in
(`_Current`, read from the event loop when a call hangs).

Kept apart from `checks/gpu/check.py`, which reads NVML and judges.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from checks.gpu.nvml_fields import FieldBatch


@dataclass
class _Gpu:
    handle: Any
    bus: str  # normalised dddd:bb:dd.f
    name: str
    uuid: str
    active_links: list[int] = field(default_factory=list)
    slowdown: int | None = None  # threshold °C
    shutdown: int | None = None
    max_width: int | None = None
    max_gen: int | None = None
    slowdown_since: float | None = None
    replays: deque[tuple[float, int]] = field(default_factory=deque)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    lost: bool = False
    link_fields: bool | None = None  # the driver answers NVML_FI_DEV_NVLINK_GET_STATE (None: not asked yet)
    link_batch: FieldBatch | None = None  # that field for each active link, asked in one call
    has_fabric: bool | None = None  # NVLink fabric info answered with a state (None: not asked yet)
    fabric_since: float | None = None  # first poll (monotonic) that saw its registration not completed
    # This poll's readings for the relative checks (checks/gpu/outliers.py); None: not read or unreadable.
    util: int | None = None  # utilization.gpu, %
    sm_clock: int | None = None  # MHz, read only while the GPU is loaded
    power_mw: int | None = None
    reasons: int | None = None  # the clock event (throttle) reasons mask
    clock_low_since: float | None = None  # first poll (monotonic) of its current run below the median clock
    power_low_since: float | None = None  # the same for power
    readings: dict[str, float] = field(default_factory=dict)  # this poll's other readings, published for evidence


class _Current:
    """Which GPU and NVML call the poll thread is in; read by timeout_findings from the event loop.

    One tuple assigned at a time: the read is atomic in CPython, so no lock (this runs per call).
    """

    def __init__(self) -> None:
        self._value: tuple[str, str, float] | None = None

    def set(self, component: str, call: str) -> None:
        self._value = (component, call, time.monotonic())

    def clear(self) -> None:
        self._value = None

    def get(self) -> tuple[str, str, float] | None:
        return self._value
