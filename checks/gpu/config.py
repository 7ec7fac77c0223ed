"""The GPU check's settings (`checks.gpu` in robustd.yaml) and the thresholds of its rule file.

Kept apart from checks/gpu/check.py so the config can be read and validated without the check's NVML code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from checks.common.thresholds import Level, Strict, load
from robustd.check import CheckConfig
from robustd.durations import Duration
from robustd.paths import AbsPath

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table and its thresholds


class TemperatureLevel(Level):
    """One level of GPU_TEMP_HIGH: it starts `margin` °C below one of the GPU's own thresholds."""

    margin: int = Field(ge=0)


class Temperature(Strict):
    """GPU_TEMP_HIGH's levels, the first that holds wins."""

    near_shutdown: TemperatureLevel  # against the GPU's shutdown threshold (checks.gpu.temp_critical_margin)
    at_slowdown: TemperatureLevel  # against its slowdown threshold (checks.gpu.temp_warn_margin)


class PcieReplay(Strict):
    """GPU_PCIE_REPLAY_RISING's limit where checks.gpu.replay_per_lane_per_min is not set: DCGM's, derived
    from the link's bit error rate, per lane and minute at Gen4 and times `per_gen` for each generation."""

    per_lane_per_min_at_gen4: float = Field(gt=0)
    per_gen: float = Field(gt=0)
    gen_unknown: int = Field(ge=1)  # the generation and width assumed when NVML does not give the maximum
    width_unknown: int = Field(ge=1)


class GpuThresholds(Strict):
    """`thresholds:` of checks/gpu/rules.yaml."""

    temperature: Temperature
    pcie_replay: PcieReplay


def thresholds() -> GpuThresholds:
    return load(RULES, GpuThresholds)


class GpuConfig(CheckConfig):
    """`checks.gpu`. backend, expected_gpus and emulator_state are the public contract."""

    backend: Literal["nvml", "emulator"] = "nvml"
    expected_gpus: int | None = Field(default=None, ge=0)
    emulator_state: AbsPath | None = None  # the emulator's state file (required with backend: emulator)
    emulator_library: AbsPath | None = None  # default: built on demand into <state_dir>/nvml-emulator/
    # GPU_TEMP_HIGH's levels at the slowdown / shutdown threshold minus this (°C); default: the rule file's
    temp_warn_margin: int = Field(default_factory=lambda: thresholds().temperature.at_slowdown.margin, ge=0)
    temp_critical_margin: int = Field(default_factory=lambda: thresholds().temperature.near_shutdown.margin, ge=0)
    init_timeout: Duration = 60.0  # a stuck nvmlInit/inventory is NVML_HANG only after this long
    # GPU_FABRIC_NOT_READY once a GPU's NVLink fabric registration has not completed this long after robustd
    # started (or the GPU was first seen not registered): the fabric manager takes tens of seconds at boot.
    fabric_grace: Duration = 60.0
    slowdown_window: Duration = 10.0  # HW slowdown reasons must hold this long to raise
    busy_utilization: int = Field(default=50, ge=0, le=100)  # % above which a lower PCIe gen counts
    # NVLink error counters every Nth poll: 4 counters x 18 links is 72 NVML calls a GPU, most of the poll
    # (issue 15's CPU budget); they feed a rising-rate WARNING, for which 10 s is soon enough.
    nvlink_counters_every: int = Field(default=10, ge=1)
    replay_window: Duration = 60.0
    replay_per_lane_per_min: float | None = None  # default: DCGM's, from the rule file (thresholds.pcie_replay)
    # GPU_CLOCK_OUTLIER / GPU_POWER_OUTLIER (checks/gpu/outliers.py): a GPU at or above outlier_utilization %
    # is loaded; with at least outlier_min_gpus loaded (a median of two is their mean, and cannot say which is
    # slow), one whose SM clock / power draw stays more than clock_tolerance / power_tolerance % below their
    # median for outlier_window is the outlier. Under load SM clocks sit at boost unless something holds them
    # down, so 10 % below its peers is already held down. Power follows the work each
    # GPU is given as much as its health (uneven pipeline stages and shards, per-chip leakage and temperature
    # move it by 5-15 % on healthy nodes), so its default is twice as wide: 20 %.
    outlier_utilization: int = Field(default=50, ge=1, le=100)
    outlier_min_gpus: int = Field(default=3, ge=2)
    clock_tolerance: float = Field(default=10.0, gt=0, lt=100)
    power_tolerance: float = Field(default=20.0, gt=0, lt=100)
    outlier_window: Duration = 60.0
    stall_after: Duration = 300.0  # TRAINING_STALLED after this long idle with processes alive
    stall_utilization: int = Field(default=1, ge=0, le=100)  # % at or below which a GPU counts as idle
    stall_traffic_bytes_per_s: float = Field(default=1_000_000.0, ge=0)  # RDMA+NIC below this is ~0

    @model_validator(mode="after")
    def _emulator_needs_state(self) -> GpuConfig:
        if self.backend == "emulator" and not self.emulator_state:
            raise ValueError("backend emulator needs emulator_state (the emulator's state file)")
        return self
