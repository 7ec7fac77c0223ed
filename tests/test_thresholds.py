"""Thresholds as data: each check's levels in its rules.yaml (`thresholds:`), validated at load, read in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from checks.common.thresholds import ThresholdError, load
from checks.gpu.config import GpuConfig, GpuThresholds
from checks.gpu.config import thresholds as gpu_thresholds
from checks.host.config import DiskConfig, HostThresholds
from checks.host.config import thresholds as host_thresholds
from checks.thermal.config import ThermalThresholds
from checks.thermal.config import thresholds as thermal_thresholds
from robustd.config import ConfigError
from robustd.model import Action, Severity


def test_the_shipped_thresholds_are_the_levels_the_checks_always_had() -> None:
    gpu = gpu_thresholds()
    assert (gpu.temperature.near_shutdown.margin, gpu.temperature.near_shutdown.severity,
            gpu.temperature.near_shutdown.action) == (3, Severity.CRITICAL, Action.HW_INSPECT)
    assert (gpu.temperature.at_slowdown.margin, gpu.temperature.at_slowdown.severity,
            gpu.temperature.at_slowdown.action) == (0, Severity.WARNING, Action.NONE)
    replay = gpu.pcie_replay
    assert (replay.per_lane_per_min_at_gen4, replay.per_gen, replay.gen_unknown, replay.width_unknown) == (
        0.96, 2.0, 4, 16)
    disk = host_thresholds().disk_space
    assert (disk.critical.free_percent, disk.critical.severity, disk.critical.action) == (
        3.0, Severity.CRITICAL, Action.HW_INSPECT)
    assert (disk.low.free_percent, disk.low.severity, disk.low.action) == (10.0, Severity.WARNING, Action.NONE)
    thermal = thermal_thresholds()
    assert (thermal.crit.severity, thermal.crit.action) == (Severity.CRITICAL, Action.HW_INSPECT)
    assert (thermal.max.severity, thermal.max.action) == (Severity.WARNING, Action.NONE)


def test_config_keys_default_to_the_rule_file_and_win_when_set() -> None:
    cfg = GpuConfig()
    assert (cfg.temp_warn_margin, cfg.temp_critical_margin) == (0, 3)
    assert GpuConfig(temp_critical_margin=5, temp_warn_margin=2).model_dump()["temp_critical_margin"] == 5
    disk = DiskConfig(path="/data")
    assert (disk.min_free_percent, disk.critical_free_percent) == (10.0, 3.0)
    assert DiskConfig(path="/data", min_free_percent=20, critical_free_percent=5).min_free_percent == 20
    # The defaults are values in the config as before (the reload log shows them key by key).
    assert GpuConfig().model_dump()["temp_critical_margin"] == 3


def test_a_bad_thresholds_table_names_the_file_the_line_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("codes: {}\n"
                    "thresholds:\n"
                    "  disk_space:\n"
                    "    critical: {free_percent: 30, severity: CRITICAL, action: HW_INSPECT}\n"
                    "    low: {free_percent: 10, severity: LOUD, action: NONE}\n")
    with pytest.raises(ThresholdError) as e:
        load(str(path), HostThresholds)
    assert isinstance(e.value, ConfigError)
    at = f"{path}:5: thresholds.disk_space.low.severity: must be one of"
    assert any(p.startswith(at) for p in e.value.problems), e.value.problems
    path.write_text("thresholds:\n  crit: {severity: CRITICAL, action: HW_INSPECT}\n  hot: {severity: WARNING}\n")
    with pytest.raises(ThresholdError) as e:
        load(str(path), ThermalThresholds)
    assert sorted(e.value.problems) == [f"{path}:1: thresholds.max: required key is missing",
                                        f"{path}:3: thresholds.hot: unknown key"], e.value.problems
    path.write_text("thresholds:\n  disk_space:\n    critical: {free_percent: 30, severity: CRITICAL, action: NONE}\n"
                    "    low: {free_percent: 10, severity: WARNING, action: NONE}\n")
    with pytest.raises(ThresholdError, match=r"rules.yaml:2: thresholds.disk_space: critical.free_percent must not"):
        load(str(path), HostThresholds)
    path.write_text("thresholds: [\n")
    with pytest.raises(ThresholdError, match="malformed YAML"):
        load(str(path), GpuThresholds)
