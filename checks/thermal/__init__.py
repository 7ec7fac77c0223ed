"""The thermal check: hwmon temperature sensors against their own max and crit (`check.py`)."""

from checks.thermal.check import ThermalCheck

__all__ = ["ThermalCheck"]
