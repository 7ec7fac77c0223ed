"""Relative checks across one node's GPUs: a loaded GPU whose SM clock or power draw stays below the median of
the node's loaded GPUs by more than a tolerance (GPU_CLOCK_OUTLIER / GPU_POWER_OUTLIER).

Why relative: a fail-slow GPU (a degraded VRM, a clock held down by a board's power brake, a throttled part
the driver reports no fault for) crosses no absolute threshold, yet in synchronous training every step waits
for it. The GPUs of one node run the same job at the same time, so their median is the best reference for
what this node's GPUs should do under that load (DCGM 4.5 added clock and power tolerances for the same
reason). Idle GPUs are never compared: an idle GPU clocks down and draws little by design.

Pure logic (no NVML): the check hands in each GPU's readings of the poll and keeps the windows on `_Gpu`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# nvmlClocksEventReason* bits (nvml.h; the older nvmlClocksThrottleReason* names are the same bits), by the
# names `nvidia-smi -q -d PERFORMANCE` uses, so an operator matches them up.
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_reasons(mask: int | None) -> list[str]:
    """Every reason the driver reports, by name; bits this table does not know as `unknown_0x...`, never
    dropped (a newer driver's reason is still evidence)."""
    if not mask:
        return []
    names = [name for bit, name in CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_REASONS)
    if rest:
        names.append(f"unknown_{rest:#x}")
    return names


@dataclass(frozen=True)
class Outlier:
    """One GPU below the loaded GPUs' median by more than the tolerance, at this poll."""

    value: float
    median: float
    below: float  # percent below the median
    peers: int  # loaded GPUs with a reading, this one included


def below_median(values: Sequence[float], value: float, tolerance: float) -> Outlier | None:
    """`value` against the median of `values` (the loaded GPUs' readings, `value` among them): an Outlier when
    it is more than `tolerance` percent below. Only below: a GPU above its peers is not slow."""
    median = statistics.median(values)
    if median <= 0:
        return None
    below = (median - value) / median * 100.0
    return Outlier(value, median, below, len(values)) if below > tolerance else None
