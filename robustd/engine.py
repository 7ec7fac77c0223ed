"""The single writer: findings → policy → commit to the event log → publish to watchers.

Everything here runs on the event loop thread, and nothing awaits between the policy's
decision, the commit and the publish, so a watcher that subscribes and then reads the log
sees every event exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from robustd.model import Condition, Event, Report
from robustd.policy import Policy
from robustd.store import Store

log = logging.getLogger("robustd.engine")


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
        if not events and not cursors:
            return []
        done = self.store.commit(events, cursors)
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

    def snapshot(self) -> tuple[list[Condition], int]:
        """The standing conditions (by seq) and the newest seq, read together."""
        conds = sorted(self.policy.conditions.values(), key=lambda c: c.seq)
        return conds, self.store.head_seq()
