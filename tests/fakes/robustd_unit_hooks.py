"""Test hooks for the packaged robustd under a real systemd (tests/test_systemd_real.py).

A third-party check, loaded through the `robustd.checks` entry points like any plugin, so the
daemon's own code is not touched. The test puts it on the service's PYTHONPATH with a drop-in;
without that drop-in it does not exist. Both hooks are off unless their file is present:

- while `hold_file` exists, `start()` does not return (at most `hold_max`), so READY=1 is held
  back: the test sees the unit stay `activating` until it removes the file.
- when `hang_file` appears, the watcher removes it (so the restarted daemon runs normally) and then
  blocks the event loop itself, as a main loop wedged in a synchronous call would: no WATCHDOG=1
  goes out, and systemd's watchdog must kill and restart the service.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator

from robustd.check import Check, CheckConfig, CheckContext
from robustd.durations import PositiveDuration
from robustd.model import FindingBatch


class UnitHooksConfig(CheckConfig):
    hold_file: str = "/run/robustd-test-hold"  # read only: the service may not write /run outside /run/robustd
    hold_max: PositiveDuration = 20.0  # below the runner's 30 s limit on start()
    hang_file: str = "/var/lib/robustd/hang-main-loop"  # in StateDirectory=, so the check can remove it
    hang_for: PositiveDuration = 600.0  # far beyond any WatchdogSec= the test sets


class UnitHooksCheck(Check):
    name = "unit_hooks"
    mode = "watch"
    Config = UnitHooksConfig

    def __init__(self) -> None:
        self.cfg = UnitHooksConfig()

    async def start(self, ctx: CheckContext) -> None:
        assert isinstance(ctx.config, UnitHooksConfig)
        self.cfg = ctx.config
        deadline = time.monotonic() + self.cfg.hold_max
        if os.path.exists(self.cfg.hold_file):
            ctx.log.info("holding READY=1 while %s exists", self.cfg.hold_file)
        while os.path.exists(self.cfg.hold_file) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def watch(self) -> AsyncIterator[FindingBatch]:
        while True:
            await asyncio.sleep(0.2)
            if os.path.exists(self.cfg.hang_file):
                os.unlink(self.cfg.hang_file)
                time.sleep(self.cfg.hang_for)  # blocks the event loop on purpose: the hung main loop
            if False:  # an async generator that never yields a report
                yield FindingBatch(self.name)
