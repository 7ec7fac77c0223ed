"""The thermal check's settings (`checks.thermal` in robustd.yaml) and the thresholds of its rule file."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from checks.common.thresholds import Level, Strict, load
from robustd.check import CheckConfig

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table and its thresholds


class ThermalThresholds(Strict):
    """`thresholds:` of checks/thermal/rules.yaml: TEMP_HIGH at each of a sensor's own thresholds."""

    crit: Level  # at or above tempN_crit (judged first)
    max: Level  # at or above tempN_max


def thresholds() -> ThermalThresholds:
    return load(RULES, ThermalThresholds)


class ThermalConfig(CheckConfig):
    """`checks.thermal`."""

    # Sensors not judged: globs over "<chip>/<sensor>" or the hwmon name, e.g. "acpitz*", "*/temp9".
    exclude: list[str] = Field(default_factory=list)
