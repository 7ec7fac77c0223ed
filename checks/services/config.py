"""The services check's settings (`checks.services` in robustd.yaml) and the per-unit levels of its rule file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from checks.common.thresholds import Level, Strict, load
from robustd.check import CheckConfig
from robustd.durations import PositiveDuration
from robustd.paths import AbsPath

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table and the units' levels

# `auto`: watch the unit where the node needs it (module doc of check.py); `always`: wherever it is
# installed; `never`: not at all. A unit that is not installed raises nothing in any mode.
When = Literal["auto", "always", "never"]


class UnitLevels(Strict):
    """`thresholds:` of checks/services/rules.yaml: what NVIDIA_SERVICE_DOWN means for each unit."""

    fabricmanager: Level
    persistenced: Level
    imex: Level


def levels() -> UnitLevels:
    return load(RULES, UnitLevels)


class ServicesConfig(CheckConfig):
    """`checks.services`."""

    # The poll only re-reports what the D-Bus signals last said (no D-Bus call): it keeps a standing
    # condition from its hold-down. Changes are pushed and seen within milliseconds.
    interval: PositiveDuration = 10.0
    fabricmanager: When = "auto"  # auto: where an NVIDIA NVSwitch (PCI class 0x0680) is on the PCI bus
    persistenced: When = "auto"  # auto: where the unit is enabled
    imex: When = "auto"  # auto: where imex_nodes_config lists at least one node (an IMEX domain)
    imex_nodes_config: AbsPath = "/etc/nvidia-imex/nodes_config.cfg"
    # The system bus; default $DBUS_SYSTEM_BUS_ADDRESS, else unix:path=/var/run/dbus/system_bus_socket.
    bus: str = Field(default="SYSTEM", min_length=1)

    @field_validator("bus")
    @classmethod
    def _address(cls, v: str) -> str:
        """SYSTEM, SESSION, or a D-Bus unix address (`unix:path=...` / `unix:abstract=...`), the only transport
        the bus library speaks; checked here so a typo is a config error with its line, not a watch that fails."""
        if v in ("SYSTEM", "SESSION"):
            return v
        for addr in v.split(";"):
            transport, _, info = addr.partition(":")
            keys = {kv.partition("=")[0] for kv in info.split(",")}
            if transport == "unix" and keys & {"path", "abstract"}:
                return v
        raise ValueError("must be SYSTEM, SESSION or a unix D-Bus address (unix:path=/run/dbus/system_bus_socket)")
