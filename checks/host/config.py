"""The host check's settings (`checks.host` in robustd.yaml: the disks, memory, EDAC and stuck-task limits) and the
thresholds of its rule file."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from checks.common.thresholds import Level, Strict, load
from robustd.check import CheckConfig
from robustd.durations import Duration, PositiveDuration
from robustd.flags import Flag

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table and its thresholds


class DiskSpaceLevel(Level):
    """One level of DISK_SPACE_LOW: free space below `free_percent` of the disk."""

    free_percent: float = Field(ge=0, le=100)


class DiskSpace(Strict):
    """DISK_SPACE_LOW's levels, the first that holds wins."""

    critical: DiskSpaceLevel  # checks.host.disks[].critical_free_percent overrides its free_percent
    low: DiskSpaceLevel  # checks.host.disks[].min_free_percent overrides its free_percent

    @model_validator(mode="after")
    def _ordered(self) -> DiskSpace:
        if self.critical.free_percent > self.low.free_percent:
            raise ValueError("critical.free_percent must not be above low.free_percent")
        return self


class HostThresholds(Strict):
    """`thresholds:` of checks/host/rules.yaml."""

    disk_space: DiskSpace


def thresholds() -> HostThresholds:
    return load(RULES, HostThresholds)


class DiskConfig(BaseModel):
    """One entry of `checks.host.disks`; a plain string is `{path: <string>}`."""

    model_config = ConfigDict(extra="forbid")
    path: str
    # below: DISK_SPACE_LOW WARNING / CRITICAL; default: the rule file's (thresholds.disk_space)
    min_free_percent: float = Field(default_factory=lambda: thresholds().disk_space.low.free_percent, ge=0, le=100)
    critical_free_percent: float = Field(default_factory=lambda: thresholds().disk_space.critical.free_percent,
                                         ge=0, le=100)
    readonly_is_fault: Flag = True  # false for a mount that is read-only on purpose
    device: str | None = None  # block device for ioerr_cnt (e.g. sda); default: from the mount table

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not os.path.isabs(v):
            raise ValueError("must be an absolute path")
        return os.path.normpath(v)

    @model_validator(mode="after")
    def _ordered(self) -> DiskConfig:
        if self.critical_free_percent > self.min_free_percent:
            raise ValueError("critical_free_percent must not be above min_free_percent")
        return self


class HostConfig(CheckConfig):
    """`checks.host`."""

    disks: list[DiskConfig] = Field(default_factory=lambda: [DiskConfig(path="/")])
    psi_some_avg10: float = Field(default=40.0, ge=0, le=100)  # % of the last 10 s some task stalled on memory
    psi_full_avg10: float = Field(default=10.0, ge=0, le=100)  # % of the last 10 s all tasks stalled on memory
    min_available_percent: float = Field(default=5.0, ge=0, le=100)  # MemAvailable / MemTotal
    edac_ce_count: int = Field(default=10, ge=1)  # corrected memory errors per window → EDAC_CE_RISING
    edac_ce_window: Duration = 3600.0
    # PROCESS_STUCK (checks/host/stuck.py): a task in uninterruptible sleep (D), not run since, this long
    dstate_after: PositiveDuration = 300.0
    dstate_scan_every: PositiveDuration = 10.0  # /proc is walked at most this often; polls between reuse it
    dstate_max_tasks: int = Field(default=8192, ge=1)  # thread stat files a scan reads; the rest: next scans

    @field_validator("disks", mode="before")
    @classmethod
    def _strings(cls, v: object) -> object:
        return [{"path": x} if isinstance(x, str) else x for x in v] if isinstance(v, list) else v
