"""Third-party checks for the tests, loaded by the daemon through the `robustd.checks` entry points.

They misbehave on purpose: one hangs forever in poll, one raises; `tick` is a healthy poller
whose run count shows that the others do not stall the schedule; `mark` reports one occurrence each time
its file's content changes (a second source for a condition `tick` resolves).
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from robustd.check import Check, CheckConfig, CheckContext
from robustd.model import Finding, FindingKind


class HangCheck(Check):
    name = "hang"

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        threading.Event().wait()  # like an NVML call on a GPU that fell off the bus
        return []


class BoomCheck(Check):
    name = "boom"

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        raise OSError(5, "Input/output error reading the sensor")


class TickConfig(CheckConfig):
    flag_file: str = ""  # while this file exists, report a TICK_FLAG state finding
    emulated_label: str = ""  # pretend to read emulated hardware
    resolve: bool = False  # while the flag file is absent, say TICK_FLAG is resolved (as a healthy port does)


class TickCheck(Check):
    name = "tick"
    Config = TickConfig

    def __init__(self) -> None:
        self.label = ""

    def emulated(self) -> str | None:
        return self.label or None

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = ctx.config
        assert isinstance(cfg, TickConfig)
        self.label = cfg.emulated_label
        if cfg.flag_file and os.path.exists(cfg.flag_file):
            return [Finding(component="host", code="TICK_FLAG", message="flag file present",
                            kind=FindingKind.STATE)]
        if cfg.resolve:
            return [Finding(component="host", code="TICK_FLAG", message="no flag file", kind=FindingKind.RESOLVED)]
        return []


class MarkConfig(CheckConfig):
    mark_file: str = ""


class MarkCheck(Check):
    """One TICK_FLAG occurrence each time the mark file's content changes."""

    name = "mark"
    Config = MarkConfig

    def __init__(self) -> None:
        self.seen = ""

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = ctx.config
        assert isinstance(cfg, MarkConfig)
        try:
            with open(cfg.mark_file) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        if text == self.seen:
            return []
        self.seen = text
        return [Finding(component="host", code="TICK_FLAG", message=f"mark {text.strip()}",
                        kind=FindingKind.OCCURRENCE)]
