"""The thermal check: CPU and board temperature sensors (hwmon) against their own max and crit.

Reads `<sys root>/class/hwmon/hwmon*/`: `name`, and for every `tempN_input` the optional
`tempN_label`, `tempN_max`, `tempN_crit` (all millidegrees Celsius). A sensor at or above its
`max` is TEMP_HIGH WARNING (action NONE); at or above its `crit` TEMP_HIGH CRITICAL (HW_INSPECT:
cooling, fans, heatsink): the levels of `thresholds` in its rules.yaml. Sensors without thresholds
are not judged. GPU temperatures belong to the
gpu check (NVML knows each GPU's slowdown/shutdown points).

hwmon is read here rather than through psutil.sensors_temperatures(): psutil reads the literal
host /sys, so a fixture tree (or a configured sys root) could never feed it.

Components: `host/<chip>/<sensor>`, where <chip> is the hwmon's device (the basename of its
`device` link: `coretemp.0`, `nvme0`, `0000:00:18.3`), else its `name`, with `-hwmonN` added if two
chips would share an id; <sensor> is the label with blanks as `_` (`Package_id_0`, `Core_4`), else
`tempN`. Example: `host/coretemp.1/Package_id_1`.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from typing import NamedTuple

from checks.common.sysfs import read_text
from checks.thermal.config import RULES, ThermalConfig, ThermalThresholds, thresholds
from checks.thermal.parse import parse_millidegrees, sensor_id
from robustd.check import Check, CheckContext
from robustd.model import Finding, FindingKind, Severity

_TEMP_INPUT = re.compile(r"^temp(\d+)_input$")


class Sensor(NamedTuple):
    chip: str  # component chip id (see module doc)
    name: str  # the hwmon driver's name (coretemp, k10temp, nvme, ...)
    sensor: str  # label with blanks as _, or tempN
    celsius: float
    max: float | None
    crit: float | None


def judge(s: Sensor, levels: ThermalThresholds | None = None) -> tuple[Severity, str] | None:
    """(severity, which threshold) for a sensor at or above its crit or max, else None; the severity of
    each is the rule file's (`levels`, default: its `thresholds`)."""
    levels = levels or thresholds()
    if s.crit is not None and s.crit > 0 and s.celsius >= s.crit:
        return levels.crit.severity, "crit"
    if s.max is not None and s.max > 0 and s.celsius >= s.max:
        return levels.max.severity, "max"
    return None


# -- reading --------------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        return read_text(path)
    except OSError:  # ENOENT: no such attribute; EIO/ENODATA: sensor not ready this time
        return None


def read_hwmon(sys_root: str) -> list[Sensor]:
    """Every temperature sensor under <sys_root>/class/hwmon (an empty list if there is none)."""
    base = os.path.join(sys_root, "class", "hwmon")
    try:
        entries = sorted(os.listdir(base), key=lambda n: (len(n), n))
    except FileNotFoundError:
        return []
    chips: list[tuple[str, str, str]] = []  # (hwmonN, name, chip id)
    for entry in entries:
        path = os.path.join(base, entry)
        name = (_read(os.path.join(path, "name")) or entry).strip()
        device = os.path.join(path, "device")
        chip = os.path.basename(os.path.realpath(device)) if os.path.exists(device) else name
        chips.append((entry, name, chip))
    seen: dict[str, int] = {}
    for _, _, chip in chips:
        seen[chip] = seen.get(chip, 0) + 1

    out: list[Sensor] = []
    for entry, name, chip in chips:
        if seen[chip] > 1:
            chip = f"{chip}-{entry}"
        path = os.path.join(base, entry)
        try:
            files = os.listdir(path)
        except OSError:
            continue
        for fname in sorted(files):
            m = _TEMP_INPUT.match(fname)
            if not m:
                continue
            n = m.group(1)
            raw = _read(os.path.join(path, fname))
            celsius = parse_millidegrees(raw) if raw is not None else None
            if celsius is None:
                continue
            thresholds = {}
            for t in ("max", "crit"):
                text = _read(os.path.join(path, f"temp{n}_{t}"))
                thresholds[t] = parse_millidegrees(text) if text is not None else None
            out.append(Sensor(chip=chip, name=name, sensor=sensor_id(_read(os.path.join(path, f"temp{n}_label")), n),
                              celsius=celsius, max=thresholds["max"], crit=thresholds["crit"]))
    return out


class ThermalCheck(Check):
    """hwmon temperature sensors against their own thresholds."""

    name = "thermal"
    mode = "poll"
    Config = ThermalConfig
    rule_file = RULES

    def supported(self, ctx: CheckContext) -> str | None:
        path = ctx.roots.sys_path("class", "hwmon")
        return None if os.path.isdir(path) else f"{path} does not exist (no hwmon sensors)"

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = ctx.config if isinstance(ctx.config, ThermalConfig) else ThermalConfig()
        levels = thresholds()
        findings: list[Finding] = []
        for s in read_hwmon(ctx.roots.sys):
            where = f"{s.chip}/{s.sensor}"
            if any(fnmatch.fnmatchcase(where, p) or fnmatch.fnmatchcase(s.name, p) for p in cfg.exclude):
                continue
            verdict = judge(s, levels)
            if verdict is None:
                continue
            severity, limit = verdict
            action = (levels.crit if limit == "crit" else levels.max).action
            threshold = s.crit if limit == "crit" else s.max
            evidence = {"celsius": f"{s.celsius:g}", "chip": s.name, "threshold": limit}
            evidence.update({k: f"{v:g}" for k, v in (("max", s.max), ("crit", s.crit)) if v is not None})
            findings.append(Finding(
                component=f"host/{where}", code="TEMP_HIGH", kind=FindingKind.STATE,
                severity=severity, action=action,
                message=f"{s.name} {s.sensor} at {s.celsius:g}°C, at or above its {limit} of {threshold:g}°C",
                evidence=evidence))
        return findings
