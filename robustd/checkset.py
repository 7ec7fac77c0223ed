"""The checks a daemon runs: which there are, what of the config they read, the codes they raise, and
what they publish.

Built-in checks come in their fixed order, then third-party ones from the `robustd.checks` entry-point
group; the code table layers the daemon's own codes, each running check's rules, the stop-time tests'
codes and `policy.codes` (later layers win). Read by the daemon at start and at every reload.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Mapping, Sequence

from robustd.check import Check
from robustd.codes import CodeRule, CodeTable
from robustd.config import Schema, Settings
from robustd.diagnostics.manager import codes as diag_codes
from robustd.diagnostics.table import NAMES as STOP_TIME_TESTS
from robustd.inventory import NO_GPUS, GpuInventory, GpuInventoryProvider
from robustd.runner import CheckState
from robustd.traffic import TrafficProvider, TrafficSnapshot

log = logging.getLogger("robustd")

# Codes the daemon itself raises about its checks. Rule files and policy.codes may override.
BUILTIN_CODES: dict[str, CodeRule] = {
    "CHECK_TIMEOUT": CodeRule(severity="WARNING", action="NONE", clear_after="10s",
                              description="a check's poll overran its deadline; the check is blind until it returns"),
    "CHECK_ERROR": CodeRule(severity="WARNING", action="NONE", clear_after="10s",
                            description="a check raised or its watcher failed"),
    "STATE_UNWRITABLE": CodeRule(severity="WARNING", action="NONE", clear_after="10s",
                                 description="robustd cannot write its event log (state disk full, read-only or not "
                                             "responding): verdicts are current, changes wait in memory"),
}


def discover_checks() -> dict[str, type[Check]]:
    """Built-in checks in their fixed order, then third-party ones from the `robustd.checks` group."""
    from checks import BUILTIN

    found: dict[str, type[Check]] = {c.name: c for c in BUILTIN}
    for ep in entry_points(group="robustd.checks"):
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the daemon
            log.error("cannot load check plugin %s (%s): %s", ep.name, ep.value, e)
            continue
        name = getattr(cls, "name", "") or ep.name
        if name in found:
            log.error("check plugin %s (%s) ignored: a check named %r already exists", ep.name, ep.value, name)
            continue
        found[name] = cls
    return found


def config_schema(check_types: Mapping[str, type[Check]]) -> Schema:
    """What the daemon validates of robustd.yaml: every core key, each check's section by its registered
    Config, every registered section (robustd/sections.py), and diagnostics.levels against the test table."""
    from robustd.sections import discover_sections

    return Schema(checks={n: c.Config for n, c in check_types.items()}, sections=discover_sections(),
                  stop_time_tests=STOP_TIME_TESTS)


def code_table(states: Sequence[CheckState], settings: Settings) -> CodeTable:
    """Every code's meaning: the daemon's, the codes running checks borrow, the running checks' own, the
    stop-time tests', then the config's (a later layer wins, field by field)."""
    layers: list[Mapping[str, CodeRule]] = [BUILTIN_CODES]
    active = [st for st in states if st.status.active]  # a disabled or unsupported check's codes do not count
    for part in ("borrowed_codes", "codes"):
        for st in active:
            try:
                layers.append(getattr(st.check, part)())
            except Exception as e:  # noqa: BLE001 - e.g. rules failed to load; the check already reported it
                log.warning("check %s has no code table: %s", st.name, e)
    layers.append(diag_codes())
    layers.append(settings.config.policy.codes)
    return CodeTable(layers)


def gpu_inventory(states: Sequence[CheckState]) -> GpuInventory:
    """What the running GPU check published (no GPUs without one)."""
    for st in states:
        if isinstance(st.check, GpuInventoryProvider) and st.status.active:
            return st.check.gpu_inventory()
    return NO_GPUS


def traffic(states: Sequence[CheckState]) -> TrafficSnapshot | None:
    """The running NIC check's last traffic snapshot; None when no check publishes one or its poll is failing
    (the GPU check then reads the counters itself: robustd/traffic.py)."""
    for st in states:
        if isinstance(st.check, TrafficProvider) and st.status.active and not st.status.failing:
            return st.check.traffic_snapshot()
    return None
