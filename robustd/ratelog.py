"""Log lines for events that can come thousands of times a second: the first at once, the rest counted.

A flood of refused connections, failed accepts or refused calls must not fill the journal or the disk, nor
push the daemon's other lines past journald's rate limit (an unbounded log is itself a denial of service).
`RateLimitedLog` logs the first event of a window and counts the rest, and logs the count when the window
ends; `RateLimitedLogs` keeps one such window per key (a caller), so one caller's flood is summarised
without hiding another caller's first line. Owners flush or cancel them at shutdown (their timers live on
the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

LOG_INTERVAL = 10.0  # at most one line per this many seconds for each flood (and key)
MAX_KEYS = 256  # callers tracked apart; beyond these (all busy in their window) the rest share one window


class RateLimitedLog:
    """One log line per `interval` for an event that can come thousands of times a second.

    The first event in a window is logged, the rest are counted, and the count is logged when the window
    ends (a timer on the running loop; without one, the next logged line reports it).
    """

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL, level: int = logging.WARNING):
        self.logger = logger
        self.interval = interval
        self.level = level
        self.last = -float("inf")
        self.suppressed = 0
        self._what = ""
        self._flush: asyncio.TimerHandle | None = None

    def __call__(self, what: str, msg: str, *args: Any) -> None:
        """Log `msg % args`, or count it as one more `what` (e.g. "refused connections") in this window."""
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.flush()  # a count no timer reported (there was no running loop)
            self.last = now
            self.logger.log(self.level, msg, *args)
            return
        self.suppressed += 1
        self._what = what
        if self._flush is None:
            with contextlib.suppress(RuntimeError):  # no running loop: the next logged line reports the count
                self._flush = asyncio.get_running_loop().call_later(self.last + self.interval - now, self.flush)

    def flush(self) -> None:
        self.cancel()
        if self.suppressed:
            self.logger.log(self.level, "%d more %s in the last %.0fs (at most one line per %.0fs)", self.suppressed,
                            self._what, self.interval, self.interval)
            self.suppressed = 0
            self.last = time.monotonic()

    def cancel(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def idle(self, now: float) -> bool:
        """Nothing counted and its window over: forgetting it loses nothing."""
        return not self.suppressed and now - self.last >= self.interval


class RateLimitedLogs:
    """A `RateLimitedLog` per key: each caller's first event is logged at once, its flood summarised.

    Bounded (design rule 7): at most `max_keys` keys are kept; idle ones are forgotten when that is reached,
    and while all of them are busy, further keys share one window whose summary counts `others`.
    """

    def __init__(self, logger: logging.Logger, others: str, interval: float = LOG_INTERVAL,
                 level: int = logging.WARNING, max_keys: int = MAX_KEYS):
        self.logger = logger
        self.others = others
        self.interval = interval
        self.level = level
        self.max_keys = max_keys
        self._logs: dict[str, RateLimitedLog] = {}
        self._shared = RateLimitedLog(logger, interval, level)

    def __call__(self, key: str, what: str, msg: str, *args: Any) -> None:
        """Log `msg % args`, or count it as one more `what` of `key` in the key's window."""
        one = self._logs.get(key)
        if one is None:
            if len(self._logs) >= self.max_keys:
                now = time.monotonic()
                for k in [k for k, v in self._logs.items() if v.idle(now)]:
                    del self._logs[k]
            if len(self._logs) >= self.max_keys:
                self._shared(self.others, msg, *args)
                return
            one = self._logs[key] = RateLimitedLog(self.logger, self.interval, self.level)
        one(what, msg, *args)

    def flush(self) -> None:
        """Log every pending count now and stop the timers (at shutdown: the counts are not lost)."""
        for one in (*self._logs.values(), self._shared):
            one.flush()
