"""The thermal check's settings (`checks.thermal` in robustd.yaml) and its rule file."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from robustd.check import CheckConfig

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table


class ThermalConfig(CheckConfig):
    """`checks.thermal`."""

    # Sensors not judged: globs over "<chip>/<sensor>" or the hwmon name, e.g. "acpitz*", "*/temp9".
    exclude: list[str] = Field(default_factory=list)
