"""The GPU check's settings (`checks.gpu` in robustd.yaml) and the severities its rule file gives temperatures.

Kept apart from checks/gpu/check.py so the config can be read and validated without the check's NVML code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from robustd.check import CheckConfig
from robustd.durations import Duration
from robustd.model import Action, Severity
from robustd.paths import AbsPath

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table and GPU_TEMP_HIGH's levels
TEMPERATURE_LEVELS = ("near_shutdown", "at_slowdown")


class GpuConfig(CheckConfig):
    """`checks.gpu`. backend, expected_gpus and emulator_state are the public contract."""

    backend: Literal["nvml", "emulator"] = "nvml"
    expected_gpus: int | None = Field(default=None, ge=0)
    emulator_state: AbsPath | None = None  # the emulator's state file (required with backend: emulator)
    emulator_library: AbsPath | None = None  # default: built on demand into <state_dir>/nvml-emulator/
    temp_warn_margin: int = Field(default=0, ge=0)  # WARNING at slowdown threshold minus this (°C)
    temp_critical_margin: int = Field(default=3, ge=0)  # CRITICAL at shutdown threshold minus this (°C)
    init_timeout: Duration = 60.0  # a stuck nvmlInit/inventory is NVML_HANG only after this long
    slowdown_window: Duration = 10.0  # HW slowdown reasons must hold this long to raise
    busy_utilization: int = Field(default=50, ge=0, le=100)  # % above which a lower PCIe gen counts
    # NVLink error counters every Nth poll: 4 counters x 18 links is 72 NVML calls a GPU, most of the poll
    # (issue 15's CPU budget); they feed a rising-rate WARNING, for which 10 s is soon enough.
    nvlink_counters_every: int = Field(default=10, ge=1)
    replay_window: Duration = 60.0
    replay_per_lane_per_min: float | None = None  # default: DCGM's 0.96 at Gen4, doubling per gen
    stall_after: Duration = 300.0  # TRAINING_STALLED after this long idle with processes alive
    stall_utilization: int = Field(default=1, ge=0, le=100)  # % at or below which a GPU counts as idle
    stall_traffic_bytes_per_s: float = Field(default=1_000_000.0, ge=0)  # RDMA+NIC below this is ~0

    @model_validator(mode="after")
    def _emulator_needs_state(self) -> GpuConfig:
        if self.backend == "emulator" and not self.emulator_state:
            raise ValueError("backend emulator needs emulator_state (the emulator's state file)")
        return self


def load_temperature_levels(path: str) -> dict[str, tuple[Severity, Action]]:
    """`temperature_levels` of the rule file: GPU_TEMP_HIGH's severity and action at each level."""
    with open(path, encoding="utf-8") as f:
        levels = (yaml.safe_load(f) or {}).get("temperature_levels") or {}
    try:
        return {name: (Severity[levels[name]["severity"]], Action[levels[name]["action"]])
                for name in TEMPERATURE_LEVELS}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: temperature_levels needs {', '.join(TEMPERATURE_LEVELS)}, each with a "
                         f"severity and an action ({e!r})") from None
