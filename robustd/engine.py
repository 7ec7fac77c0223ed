"""The single writer: findings → policy → commit to the event log → publish to watchers.

Everything here runs on the event loop thread, and nothing awaits between the policy's
decision, the commit and the publish, so a watcher that subscribes and then reads the log
sees every event exactly once.

When the event log cannot be written (disk full, read-only or failing state disk) nothing is
dropped: the events and cursors wait in memory, in order, and every later commit (at least the
1 s tick) retries them first. Meanwhile the policy's conditions — what GetVerdict reports — stay
current, `store_error` says why the log lags, and Watch streams get the events once they are on disk.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from robustd.model import Condition, Event, EventKind, Report
from robustd.policy import Policy
from robustd.store import Store

log = logging.getLogger("robustd.engine")
ERROR_LOG_EVERY = 60.0
COMPACT_AT = 1000  # held events beyond this are compacted (see compact)


def compact(events: list[Event]) -> list[Event]:
    """Drop each UPDATED that a later UPDATED of the same condition supersedes before any RAISED or CLEARED
    of it, so a long outage holds O(conditions x transitions) events, not one per repeat per second.

    What is kept still replays to the same conditions: every RAISED and CLEARED, and each condition's
    newest state between them.
    """
    superseded: set[int] = set()
    last_update: dict[tuple[str, str], int] = {}
    for i, ev in enumerate(events):
        key = ev.condition.key
        if ev.kind is EventKind.UPDATED:
            if key in last_update:
                superseded.add(last_update[key])
            last_update[key] = i
        else:
            last_update.pop(key, None)
    return [ev for i, ev in enumerate(events) if i not in superseded]


@dataclass(eq=False)
class Subscriber:
    """One Watch stream's mailbox. On overflow it is marked lagged and re-reads the log."""

    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(maxsize=1024))
    lagged: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Hub:
    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()

    def subscribe(self) -> Subscriber:
        s = Subscriber()
        self.subscribers.add(s)
        return s

    def unsubscribe(self, s: Subscriber) -> None:
        self.subscribers.discard(s)

    def publish(self, events: list[Event]) -> None:
        for s in self.subscribers:
            for ev in events:
                if s.lagged:
                    break
                try:
                    s.queue.put_nowait(ev)
                except asyncio.QueueFull:
                    s.lagged = True
            s.wake.set()


class Engine:
    def __init__(self, policy: Policy, store: Store, clock: Callable[[], float] = time.time):
        self.policy = policy
        self.store = store
        self.clock = clock
        self.hub = Hub()
        self.events_total = 0
        self.listeners: list[Callable[[list[Event]], None]] = []  # e.g. the health service
        self.backlog: list[Event] = []  # decided, not yet on disk (the log could not be written)
        self._backlog_cursors: dict[str, Mapping[str, str]] = {}
        self.store_error = ""  # why the backlog is not empty; "" while the log is written normally
        self.store_error_since: float | None = None
        self._last_error_log = 0.0

    def submit(self, report: Report) -> list[Event]:
        events = self.policy.apply(report.findings, report.check, self.clock())
        cursors = {report.check: report.cursor} if report.cursor is not None else None
        if not events and cursors is None:
            return []
        return self._commit(events, cursors)

    def tick(self) -> list[Event]:
        return self._commit(self.policy.tick(self.clock()))

    def acknowledge(self, component: str, code: str, reason: str) -> Event:
        ev = self.policy.acknowledge(component, code, reason, self.clock())
        return self._commit([ev])[0]

    def commit_events(self, events: list[Event]) -> list[Event]:
        return self._commit(events)

    def _commit(self, events: list[Event], cursors: Mapping[str, Mapping[str, str]] | None = None) -> list[Event]:
        if not events and not cursors and not self.backlog and not self._backlog_cursors:
            return []
        events = self.backlog + events
        merged = {**self._backlog_cursors, **(cursors or {})}
        try:
            done = self.store.commit(events, merged)
        except (sqlite3.Error, OSError) as e:
            self._held(events, merged, e)
            for listener in self.listeners:
                listener([])  # the conditions changed even though the log did not
            return []
        if self.store_error:
            log.warning("event log writable again: committed %d held events (held for %.0fs)", len(events),
                        self.clock() - (self.store_error_since or self.clock()))
        self.backlog, self._backlog_cursors = [], {}
        self.store_error, self.store_error_since = "", None
        self.policy.committed(done)
        if done:
            self.events_total += len(done)
            self.hub.publish(done)
            for listener in self.listeners:
                listener(done)
            for ev in done:
                c = ev.condition
                log.info("%s %s %s %s seq=%d: %s", ev.kind.name, c.severity.name, c.component, c.code, ev.seq,
                         c.message)
        return done

    def _held(self, events: list[Event], cursors: dict[str, Mapping[str, str]], err: Exception) -> None:
        """Keep what could not be written; say so at once, then once a minute while it lasts."""
        self.backlog = compact(events) if len(events) > COMPACT_AT else events
        self._backlog_cursors = cursors
        now = self.clock()
        if not self.store_error:
            self.store_error_since = now
            self._last_error_log = 0.0
        self.store_error = f"{type(err).__name__}: {err}"
        if now - self._last_error_log >= ERROR_LOG_EVERY:
            log.error("cannot write the event log (%s): %d events held in memory, retried every second; "
                      "GetVerdict stays current, Watch streams wait", self.store_error, len(self.backlog))
            self._last_error_log = now

    def snapshot(self) -> tuple[list[Condition], int]:
        """The standing conditions (by seq) and the newest seq, read together."""
        conds = sorted(self.policy.conditions.values(), key=lambda c: c.seq)
        return conds, self.store.head_seq()
