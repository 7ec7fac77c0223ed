"""Rate-limited log lines per caller (robustd/ratelog.py): what a flood leaves in the log, and its bound."""

from __future__ import annotations

import asyncio
import logging

import pytest

from robustd.ratelog import RateLimitedLogs

log = logging.getLogger("robustd.test.ratelog")


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_each_caller_first_line_at_once_and_its_flood_summarised_when_the_window_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    async def flood() -> list[str]:
        refusals = RateLimitedLogs(log, "refused calls from further callers", interval=0.3)
        for i in range(1000):
            refusals("uid 65534", "refused calls from uid 65534", "call %d refused: uid 65534", i)
        refusals("uid 60001", "refused calls from uid 60001", "call refused: uid 60001")
        at_once = lines(caplog)
        await asyncio.sleep(0.5)  # the window ends: its timer logs the count
        return at_once

    caplog.set_level(logging.WARNING, log.name)
    at_once = asyncio.run(flood())
    assert at_once == ["call 0 refused: uid 65534", "call refused: uid 60001"]
    assert lines(caplog)[2:] == ["999 more refused calls from uid 65534 in the last 0s (at most one line per 0s)"]


def test_callers_are_bounded_and_the_rest_share_one_window(caplog: pytest.LogCaptureFixture) -> None:
    async def flood() -> None:
        refusals = RateLimitedLogs(log, "refused calls from further callers", interval=0.3, max_keys=2)
        for key in ("uid 1", "uid 2", "uid 3", "uid 4", "uid 3"):
            refusals(key, f"refused calls from {key}", "refused: %s", key)
        assert len(refusals._logs) == 2  # uid 3 and 4 counted in the shared window, not remembered
        await asyncio.sleep(0.5)
        refusals("uid 5", "refused calls from uid 5", "refused: %s", "uid 5")  # uid 1 and 2 are idle: forgotten
        assert set(refusals._logs) == {"uid 5"}
        refusals.flush()

    caplog.set_level(logging.WARNING, log.name)
    asyncio.run(flood())
    assert lines(caplog) == ["refused: uid 1", "refused: uid 2", "refused: uid 3",
                             "2 more refused calls from further callers in the last 0s (at most one line per 0s)",
                             "refused: uid 5"]
